"""The walker's view of GPTQ: Hessians of each decoder layer's linears, solved group by group.

Linears that read the same input (q/k/v, gate/up) share one Hessian and are solved as one stacked
weight: GPTQ treats output rows independently, so stacking gives the same codes as solving each
alone, with a third of the Python column loop.

True-sequential (the default) quantizes the groups of ``ctx.groups`` in order, each on inputs that
come through the already quantized groups before it. It runs in one of two ways:

* single pass (the whole calibration set holds at most ``single_pass_max_tokens`` tokens; by default
  on the CPU, where the set lives in host memory anyway, and on a CUDA device whose free memory holds
  the forward's estimated peak, ``single_pass_fits``): one
  forward of the layer on all calibration samples at once; a pre-hook on each group's first linear
  accumulates its Hessian, quantizes the group and installs the result before the forward goes on.
  The forward's output is then the quantized layer's output: capture, every group and propagation
  cost one pass. Should the device run out of memory all the same, the groups not yet solved are
  solved group by group (a warning says so) and later layers go that way from the start.
* group by group: one (early-stopped) pass per group over the calibration batches, each batch's
  inputs folded into the group's Hessian by a forward hook and dropped (device memory does not grow
  with the number of tokens); the walker's forward of the quantized layer then makes the next inputs.

``true_sequential=False`` collects every Hessian in one pass over the unquantized layer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from quantkit.calibrate.walker import LayerContext, LayerResult, capture_linear_inputs, first_output
from quantkit.config import QuantkitError, QuantScheme
from quantkit.distributed.plan import SolveItem, plan_solves
from quantkit.methods.gptq import GPTQConfig, GPTQResult, HessianAccumulator, gptq_quantize, relative_error_tensor
from quantkit.primitives import dequantize, num_groups
from quantkit.qtensor import QuantizedWeight

log = logging.getLogger(__name__)


def _clock(device: torch.device) -> float:
    """Wall time after the compute stream's queued work is done (so GPU timings mean something). Only that
    stream: a device-wide wait also waited for the walker's side-stream copies (the next layer in, the last
    one back to the host), which ``calibrate.pipeline`` overlaps with this work."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return time.perf_counter()


class _Timeline:
    """Points on the compute stream's time line: CUDA events read once, after the layer's last solve (no host
    round trip per point), or the host clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.points: list = []

    def mark(self) -> int:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.points.append(ev)
        else:
            self.points.append(time.perf_counter())
        return len(self.points) - 1

    def wait(self) -> None:
        """Wait for the last point (one host round trip); ``seconds`` reads only points before it."""
        if self.cuda and self.points:
            self.points[-1].synchronize()

    def seconds(self, a: int, b: int) -> float:
        if not self.cuda:
            return self.points[b] - self.points[a]
        return self.points[a].elapsed_time(self.points[b]) / 1e3


class _Stopwatch:
    """Seconds spent inside ``start()``/``stop()`` pairs. On CUDA timed with events and read once at
    the end, so timing a step inside a forward adds no host round trip per batch."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.pairs: list = []
        self.host = 0.0

    def start(self) -> None:
        if self.cuda:
            self.pairs.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self.pairs[-1][0].record()
        else:
            self.host -= time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.pairs[-1][1].record()
        else:
            self.host += time.perf_counter()

    def seconds(self) -> float:
        if not self.cuda:
            return self.host
        if self.pairs:
            self.pairs[-1][1].synchronize()
        return sum(a.elapsed_time(b) for a, b in self.pairs) / 1e3


@dataclass
class _LayerWork:
    """Mutable bookkeeping of one layer's quantization (weights and stats as they are produced)."""

    method: GPTQMethod
    ctx: LayerContext
    weights: dict[str, QuantizedWeight]
    stats: dict[str, dict[str, float]]
    timeline: _Timeline | None = None
    # (linears, Hessian seconds measured before ``solve``, marks: start, Hessians ready, solved) per stack set
    pending: list = field(default_factory=list)
    # (linear, stat name, float64 scalar on the device): the errors, read together by ``finish_errors``
    errors: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.timeline is None:
            self.timeline = _Timeline(self.ctx.device)

    def finish_errors(self) -> None:
        """Each linear's ``err_rtn`` and ``err_gptq``, read in one host round trip for the whole layer."""
        if self.errors:
            values = torch.stack([t for _, _, t in self.errors]).tolist()
            for (name, key, _), value in zip(self.errors, values):
                self.stats[name][key] = value
        self.errors.clear()

    def finish_timings(self) -> None:
        """Each linear's ``seconds`` (solve) and ``hessian_seconds``, its share of its set's by weight size."""
        tl = self.timeline
        tl.wait()
        for names, hessian_seconds, (a, b, c) in self.pending:
            total = sum(self.ctx.linears[n].weight.numel() for n in names) or 1
            hs, seconds = hessian_seconds + tl.seconds(a, b), tl.seconds(b, c)
            for name in names:
                share = self.ctx.linears[name].weight.numel() / total
                self.stats[name]["seconds"] = seconds * share
                self.stats[name]["hessian_seconds"] = hs * share
        self.pending.clear()

    def solve(self, sets: list[tuple[list[str], HessianAccumulator]], hessian_seconds: float) -> None:
        """GPTQ on each stack of linears sharing one Hessian (``members``, their accumulator); installs them.

        One process: each stack solved whole, in order. Several ranks: the Hessians are summed over
        the ranks onto the ranks that need them, the stacks' rows solved by their owners (``plan_solves``:
        greedy bin-packing, huge stacks cut by rows), every part broadcast, and every rank installs the
        same weights.
        """
        ctx, comm, config = self.ctx, self.ctx.comm, self.method.config
        names = [n for members, _ in sets for n in members]
        t0 = self.timeline.mark()
        stacks = [_stacked(ctx, members) for members, _ in sets]  # each [sum out_n, in]
        if ctx.releasable:  # a stack of several linears is a copy: their own float weights are dead until
            for members, _ in sets:  # ``_install`` puts the quantized ones back
                for name in members if len(members) > 1 else ():
                    _release_weight(ctx.linears[name], None, None)
        items = plan_solves([tuple(w.shape) for w in stacks], comm.world_size, config.split_min_rows)
        hessians = [global_hessian(ctx, acc, {it.owner for it in items if it.key == k})
                    for k, (_, acc) in enumerate(sets)]
        t1 = self.timeline.mark()
        parts: dict[tuple[int, int], GPTQResult] = {}
        for it in items:
            if it.owner == comm.rank:
                members = sets[it.key][0]
                parts[it.key, it.row_start] = gptq_quantize(
                    stacks[it.key][it.row_start : it.row_stop], hessians[it.key], self.method.scheme, config,
                    name=f"{ctx.prefix}.{'+'.join(members)}", spill_hessian=ctx.releasable)
        for it in items:
            parts[it.key, it.row_start] = share_solved_rows(ctx, parts.get((it.key, it.row_start)), it,
                                                      stacks[it.key].shape[1], self.method.scheme)
        self.pending.append((names, hessian_seconds, (t0, t1, self.timeline.mark())))
        for k, (members, _) in enumerate(sets):
            res = _join([parts[it.key, it.row_start] for it in items if it.key == k])
            self._install(members, stacks[k], res)

    def _install(self, members: list[str], w: torch.Tensor, res: GPTQResult) -> None:
        scheme, ctx = self.method.scheme, self.ctx
        row = 0
        for name in members:
            linear = ctx.linears[name]
            rows = slice(row, row + linear.out_features)
            # Packed where the codes are (the device): the walker's worker brings them to the host
            # (``calibrate.pipeline``), instead of four blocking copies per linear in this thread.
            qw = QuantizedWeight.from_codes(res.codes[rows], res.scales[:, rows], res.zeros[:, rows], res.g_idx,
                                            scheme, bias=linear.bias, device=res.codes.device)
            # What the packed weights dequantize to, installed from the device copy one linear at a time
            # (the walker does not install ``qw`` again: ``installed``).
            w_hat = dequantize(res.codes[rows], res.scales[:, rows], res.zeros[:, rows], res.g_idx)  # [out_n, in]
            if linear.weight.numel() == 0:  # released while its stack was solved (ctx.releasable)
                linear.weight.data = w_hat.to(linear.weight.dtype)
            else:
                linear.weight.data.copy_(w_hat.to(linear.weight.dtype))
            del w_hat
            self.weights[name] = qw
            self.stats[name] = {"err_rtn": None, "err_gptq": None, "damp": res.damp}  # errors: ``finish_errors``
            self.errors += [(name, "err_rtn", relative_error_tensor(res.row_err_rtn[rows], res.row_energy[rows])),
                            (name, "err_gptq", relative_error_tensor(res.row_err_gptq[rows], res.row_energy[rows]))]
            row = rows.stop
        assert row == w.shape[0], (row, w.shape)


def _stacked(ctx: LayerContext, members: list[str]) -> torch.Tensor:
    ws = [ctx.linears[n].weight.data for n in members]  # each [out_n, in]
    return ws[0] if len(ws) == 1 else torch.cat(ws)


def global_hessian(ctx: LayerContext, acc: HessianAccumulator | None, owners: set[int], total: int | None = None,
                   in_features: int = 0) -> torch.Tensor | None:
    """The Hessian over every rank's tokens, on the ranks in ``owners`` (None elsewhere).

    Each rank's running mean is weighted by its share of the ``total`` tokens it was accumulated over (default:
    every calibration token; an MoE expert's Hessian saw fewer) and summed: reduced onto a single owner,
    all-reduced when several ranks need it. A rank whose ``acc`` is None (it saw none of those tokens) adds zeros
    ``[in_features, in_features]``."""
    comm = ctx.comm
    if comm.world_size == 1:
        return acc.H
    total = ctx.inputs.n_tokens_all if total is None else total
    if acc is None or total == 0:
        H = torch.zeros(in_features, in_features, dtype=torch.float32, device=ctx.device)
    else:
        weight = acc.n / total
        H = acc.H.mul_(weight) if weight != 1.0 else acc.H
    if len(owners) == 1:
        (owner,) = owners
        H = comm.reduce_sum(H, dst=owner)
        return H if owner == comm.rank else None
    H = comm.all_reduce_sum(H)
    return H if comm.rank in owners else None


def share_solved_rows(
    ctx: LayerContext, res: GPTQResult | None, item: SolveItem, in_features: int, scheme: QuantScheme
) -> GPTQResult:
    """The solved rows of ``item`` on every rank, broadcast from their owner (codes travel as bytes); every rank
    calls this for every item in the same order."""
    comm = ctx.comm
    if comm.world_size == 1:
        return res
    rows = item.row_stop - item.row_start
    G = num_groups(in_features, scheme.group_size)
    dev = ctx.device
    mine = item.owner == comm.rank
    if mine:
        codes = res.codes.to(torch.uint8)  # [rows, in]; bits <= 8
        floats = torch.cat([res.scales.double().flatten(), res.row_err_gptq.double(), res.row_err_rtn.double(),
                            res.row_energy.double(), torch.tensor([res.damp], dtype=torch.float64, device=dev)])
        ints = torch.cat([res.zeros.to(torch.int32).flatten(), res.g_idx.to(torch.int32)])
    else:
        codes = torch.empty(rows, in_features, dtype=torch.uint8, device=dev)
        floats = torch.empty(G * rows + 3 * rows + 1, dtype=torch.float64, device=dev)
        ints = torch.empty(G * rows + in_features, dtype=torch.int32, device=dev)
    codes = comm.broadcast(codes, src=item.owner)
    floats = comm.broadcast(floats, src=item.owner)
    ints = comm.broadcast(ints, src=item.owner)
    if mine:
        return res
    f = floats.split([G * rows, rows, rows, rows, 1])
    zeros, g_idx = ints.split([G * rows, in_features])
    return GPTQResult(codes.to(torch.int32), f[0].float().view(G, rows), zeros.view(G, rows), g_idx,
                      float(f[4]), f[1].float(), f[2].float(), f[3].float())


def _join(parts: list[GPTQResult]) -> GPTQResult:
    """One result from parts holding consecutive rows of the same stack (same Hessian, same g_idx)."""
    if len(parts) == 1:
        return parts[0]
    return GPTQResult(
        torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts], dim=1),
        torch.cat([p.zeros for p in parts], dim=1), parts[0].g_idx, max(p.damp for p in parts),
        torch.cat([p.row_err_gptq for p in parts]), torch.cat([p.row_err_rtn for p in parts]),
        torch.cat([p.row_energy for p in parts]))


def collect_hessians(
    layer: torch.nn.Module, ctx: LayerContext, names: list[str]
) -> tuple[dict[str, HessianAccumulator], dict[str, list[str]], float]:
    """One pass over the calibration batches: a Hessian per distinct input of the named linears.

    Returns the accumulators by owner name, the linears each owner's Hessian serves (linears whose
    input is the very same tensor share an owner), and the seconds spent accumulating.
    """
    accs: dict[str, HessianAccumulator] = {}
    owner_of: dict[str, str] = {}
    batch_inputs: dict[tuple, str] = {}
    # The inputs seen in the current batch, held so that a freed one's address cannot be taken by a
    # later input of the same batch and mistaken for it (which would share a Hessian wrongly).
    held: list[torch.Tensor] = []
    seen: set[str] = set()
    timer = _Stopwatch(ctx.device)

    def on_input(name: str, x: torch.Tensor) -> None:
        if name in seen:  # a new batch began
            seen.clear()
            batch_inputs.clear()
            held.clear()
        held.append(x)
        seen.add(name)
        key = (x.data_ptr(), tuple(x.shape), x.dtype)
        owner = owner_of.setdefault(name, batch_inputs.get(key, name))
        batch_inputs.setdefault(key, owner)
        if owner == name:
            timer.start()
            acc = accs.get(name)
            if acc is None:  # not setdefault: that would allocate (and zero) an [in, in] matrix every batch
                acc = accs[name] = HessianAccumulator(x.shape[-1], ctx.device)
            acc.add(x)
            timer.stop()

    capture_linear_inputs(layer, ctx.inputs, names, on_input)
    missing = [n for n in names if n not in owner_of]
    if missing:
        raise QuantkitError(f"{ctx.prefix}: linears {missing} never ran in the calibration forward")
    members: dict[str, list[str]] = {}
    for name in names:
        members.setdefault(owner_of[name], []).append(name)
    return accs, members, timer.seconds()


def single_pass_fits(ctx: LayerContext) -> bool:
    """Whether one forward of the layer over this rank's whole calibration set fits the CUDA device's free
    memory (what the caching allocator holds unused counted as free), with a fifth kept spare.

    The estimate, per token in the activation dtype: six hidden-wide tensors (the inputs, their concatenation,
    the output, an RMS norm's float32 temporaries) and four of the widest linear's width (an MLP's gate, up,
    activation and product), plus the widest Hessian in float32 and its float64 factor. On the Llama-3-8B shape
    at 128 x 2048 tokens: 45 GB estimated, 30.0 GiB measured (an H100, 2026-12-06). Eager attention (a model
    without SDPA support) also holds every window's scores: float32 scores and probabilities and a 16-bit copy,
    ``windows x heads x S^2 x 10`` bytes (an 8B-shaped layer at 128 x 2048: 172 GB more, so group passes there)."""
    device = ctx.device
    if device.type != "cuda" or not ctx.linears:
        return False
    first = ctx.inputs.hidden[0]
    width = max(max(m.in_features, m.out_features) for m in ctx.linears.values())
    need = ctx.inputs.n_tokens * first.element_size() * (6 * first.shape[-1] + 4 * width) + 12 * width * width
    attn_config = getattr(getattr(ctx.layer, "self_attn", None), "config", None)
    if attn_config is not None and getattr(attn_config, "_attn_implementation", None) == "eager":
        seqlen = first.shape[1]
        need += ctx.inputs.n_tokens // seqlen * attn_config.num_attention_heads * seqlen * seqlen * 10
    free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return need <= 0.8 * free


def _single_pass(work: _LayerWork) -> list[torch.Tensor] | None:
    """Quantize every group inside one forward of all calibration samples; returns the layer's output
    split back into the calibration batches.

    Out of device memory in one process (one rank: the collectives of several could not be matched), the
    groups not yet solved are solved group by group instead and None is returned (the walker then runs
    the quantized layer batch by batch); out of memory inside a solve whose linears were already changed
    (released or partly installed) there is nothing sound to go back to, and the error goes on."""
    ctx = work.ctx
    hidden = list(ctx.inputs.batches())
    x = hidden[0] if len(hidden) == 1 else torch.cat(hidden)  # [n_samples, S, hidden]
    del hidden[:]
    group_of = {name: gi for gi, group in enumerate(ctx.groups) for name in group}
    group_input: dict[int, int] = {}  # group -> data_ptr of the input it was solved on
    solved: set[int] = set()

    def pre_hook(name: str) -> Callable:
        def hook(module, args):
            gi = group_of[name]
            inp = args[0]  # [n_samples, S, in]
            if gi in group_input:
                if inp.data_ptr() != group_input[gi]:
                    raise QuantkitError(
                        f"{ctx.prefix}.{name} reads a different input than the rest of its group "
                        f"{ctx.groups[gi]}; run GPTQ with single_pass_max_tokens=0")
                return
            group_input[gi] = inp.data_ptr()
            t0 = _clock(ctx.device)
            acc = HessianAccumulator(inp.shape[-1], ctx.device)
            acc.add(inp)
            work.solve([(list(ctx.groups[gi]), acc)], _clock(ctx.device) - t0)
            solved.add(gi)
            return

        return hook

    handles = [ctx.linears[n].register_forward_pre_hook(pre_hook(n)) for n in group_of]
    if ctx.releasable:  # each linear runs once in this forward: its float weight is dead after that
        handles += [ctx.linears[n].register_forward_hook(_release_weight) for n in group_of]
    try:
        with torch.no_grad():
            out = first_output(ctx.layer(x, **ctx.inputs.kwargs))  # [n_samples, S, hidden]
    except torch.OutOfMemoryError:
        if not _can_fall_back(work, set(group_input) - solved):
            raise
        out = None
    finally:
        for handle in handles:
            handle.remove()
    if out is None:
        del x  # the exception, and with it the forward's intermediates, is gone by now
        torch.cuda.empty_cache()
        work.method.single_pass_memory.refuse(ctx.inputs.n_tokens)
        log.warning("%s: out of device memory in the single calibration pass of %d tokens; solving the "
                    "remaining groups pass by pass (so are the later layers)", ctx.prefix, ctx.inputs.n_tokens)
        for gi, group in enumerate(ctx.groups):
            if gi not in solved:
                GPTQMethod._collect_and_solve(work, list(group))
        return None
    missing = [g for gi, g in enumerate(ctx.groups) if gi not in group_input]
    if missing:
        raise QuantkitError(f"{ctx.prefix}: linears {missing} never ran in the calibration forward")
    return [ctx.inputs.keep(o) for o in out.split([h.shape[0] for h in ctx.inputs.hidden])]


def _can_fall_back(work: _LayerWork, unfinished: set[int]) -> bool:
    """Whether a single pass that ran out of memory can go on group by group: one rank, and the linears of a
    group whose solve was cut short still hold their float weights (none released, none installed)."""
    ctx = work.ctx
    if ctx.comm.world_size != 1:
        return False
    names = [n for gi in unfinished for n in ctx.groups[gi]]
    return all(n not in work.weights and ctx.linears[n].weight.numel() > 0 for n in names)


@dataclass
class SinglePassMemory:
    """The calibration set size (tokens) at which a single pass ran out of device memory in this run, so
    that later layers (the same shapes) go group by group from the start."""

    refused_tokens: int | None = None

    def refuse(self, n_tokens: int) -> None:
        self.refused_tokens = n_tokens if self.refused_tokens is None else min(self.refused_tokens, n_tokens)

    def allows(self, n_tokens: int) -> bool:
        return self.refused_tokens is None or n_tokens < self.refused_tokens


def _release_weight(module: torch.nn.Module, args, output) -> None:
    """Free a linear's float weight after its one forward of a single pass (the packed weight is kept):
    while the MLP's down_proj is solved, the layer's other float weights are no longer resident."""
    module.weight.data = torch.empty(0, dtype=module.weight.dtype, device=module.weight.device)


@dataclass(frozen=True)
class GPTQMethod:
    """GPTQ for the walker: ``quantize_layer`` quantizes one decoder layer's linears."""

    scheme: QuantScheme
    config: GPTQConfig = field(default_factory=GPTQConfig)
    name: str = "gptq"
    needs_calibration: bool = True
    # what this run learned of the device: not part of the method's identity
    single_pass_memory: SinglePassMemory = field(default_factory=SinglePassMemory, compare=False, repr=False)

    def checkpoint_extra(self) -> dict:
        """GPTQ's entries of ``quantization_config`` in config.json."""
        return {
            "desc_act": self.config.desc_act,
            "static_groups": self.config.static_groups,
            "damp_percent": self.config.damp,
            "true_sequential": self.config.true_sequential,
        }

    def quantize_layer(self, ctx: LayerContext) -> LayerResult:
        if ctx.inputs is None:
            raise QuantkitError("GPTQ needs calibration inputs")
        work = _LayerWork(self, ctx, {}, {})
        next_hidden = None
        if not self.config.true_sequential:
            names = [n for group in ctx.groups for n in group]
            self._collect_and_solve(work, names)
        elif self._use_single_pass(ctx):
            next_hidden = _single_pass(work)
        else:
            for group in ctx.groups:
                self._collect_and_solve(work, list(group))
        work.finish_errors()  # one host round trip for the layer's 2 x linears error floats
        work.finish_timings()  # one wait for the last solve's event, not two device-wide syncs per solve
        # Report in the layer's module order.
        stats = {n: work.stats[n] for n in ctx.linears if n in work.stats}
        # ``_install`` already put exactly the packed weights' values into the layer, on the device.
        return LayerResult(weights=work.weights, stats=stats, next_hidden=next_hidden,
                           installed=frozenset(work.weights))

    def _use_single_pass(self, ctx: LayerContext) -> bool:
        """One forward for the whole layer (``_single_pass``) rather than a pass per group?"""
        if not self.single_pass_memory.allows(ctx.inputs.n_tokens):
            return False
        limit = self.config.single_pass_limit(ctx.device)
        return single_pass_fits(ctx) if limit is None else ctx.inputs.n_tokens_all <= limit

    @staticmethod
    def _collect_and_solve(work: _LayerWork, names: list[str]) -> None:
        accs, members, seconds = collect_hessians(work.ctx.layer, work.ctx, names)
        work.solve([(group, accs[owner]) for owner, group in members.items()], seconds)
