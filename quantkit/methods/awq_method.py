"""The walker's view of AWQ: capture one decoder layer's inputs, search, fold, clip, round.

Per layer: one forward of the full-precision layer over the calibration batches records, for every
scaling group of the architecture record (``ArchSpec.scaling``), the per-channel mean ``|x|`` of its
input (all tokens), the inputs and outputs of the block its scale search scores (the first
``search_samples`` windows for attention; about ``search_tokens`` strided tokens of every batch for a
token-wise block or the linears themselves), sampled tokens for the clip search, and the layer's output (the next
layer's inputs under ``propagate="fp"``). Every group's scale is searched on that unmodified layer,
then all are folded (the full-precision function is unchanged), the weights are clipped and rounded
with the RTN core or GPTQ.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.arch import ArchSpec, ScalingGroup
from quantkit.calibrate.activations import PhaseClock
from quantkit.calibrate.walker import LayerContext, LayerInputs, LayerResult, capture_calls, first_output
from quantkit.config import QuantScheme
from quantkit.distributed.plan import assign_owners
from quantkit.methods.awq import (
    AWQConfig,
    GroupScale,
    LayerRecord,
    apply_clip,
    clipped_round,
    clipped_rtn,
    fold_into_norm,
    fold_into_rows,
    scale_columns,
    search_clip,
    search_scale,
)
from quantkit.methods.gptq import HessianAccumulator, gptq_quantize
from quantkit.methods.gptq_method import global_hessian
from quantkit.methods.rtn import rtn_quantize
from quantkit.qtensor import QuantizedWeight

log = logging.getLogger(__name__)


@dataclass
class _Site:
    """One input shared by some linears: its statistics and the captures its searches need."""

    linears: tuple[str, ...]  # consumers of this input (all present in the layer)
    group: ScalingGroup | None  # None: no scale for this input (no record, or nothing to fold into)
    block: str  # module whose output scores the scale search ("": the linears themselves)
    tie: tuple[int, int] | None = None  # (n_rep, head_dim): prev's outputs repeated per head (GQA)
    tokenwise: bool = False  # the search scores strided tokens of every batch, not the search windows
    sum_abs: torch.Tensor | None = None  # [in]
    count: int = 0
    clip_x: list[torch.Tensor] = field(default_factory=list)  # [t, in] sampled tokens
    calls: list[tuple[tuple, dict]] = field(default_factory=list)  # block inputs, search batches
    outputs: list[torch.Tensor] = field(default_factory=list)  # fp block outputs, search batches
    hessian: HessianAccumulator | None = None


def _split_for_search(hidden: list[torch.Tensor], n_search: int) -> tuple[list[torch.Tensor], int]:
    """Batches whose first ``k`` hold exactly the first ``n_search`` windows (0: all): (batches, k)."""
    if n_search == 0:
        return list(hidden), len(hidden)
    out, k, left = [], 0, n_search
    for h in hidden:
        if left <= 0:
            out.append(h)
        elif h.shape[0] <= left:
            out.append(h)
            k, left = k + 1, left - h.shape[0]
        else:
            out.extend([h[:left], h[left:]])
            k, left = k + 1, 0
    return out, k


def _local_search_windows(inputs: LayerInputs, n_search: int) -> int:
    """How many of the first ``n_search`` windows of the whole set (0: all) this rank's share holds."""
    if n_search == 0:
        return 0
    local = sum(h.shape[0] for h in inputs.hidden)
    return max(0, min(n_search - inputs.first_window, local))


def _reduce_sites(ctx: LayerContext, sites: list[_Site]) -> None:
    """Turn each site's statistics over this rank's windows into statistics over every rank's:
    summed channel means and counts, the clip tokens of all ranks in window order, summed Hessians."""
    comm = ctx.comm
    if comm.world_size == 1:
        return
    counts = comm.all_reduce_sum(torch.tensor([float(s.count) for s in sites], dtype=torch.float64))
    for site, count in zip(sites, counts.tolist()):
        site.sum_abs = comm.all_reduce_sum(site.sum_abs)
        site.count = int(count)
        site.clip_x = comm.all_gather_rows(torch.cat(site.clip_x))
        if site.hessian is not None:
            site.hessian.H = global_hessian(ctx, site.hessian, set(range(comm.world_size)))


def _mean_square(comm, t: torch.Tensor) -> float:
    """Mean of ``t**2`` over every rank's elements (a rank may hold none)."""
    if comm.world_size == 1:
        return float(t.float().pow(2).mean())
    sq = t.double().pow(2).sum()
    total = comm.all_reduce_sum(torch.stack([sq, sq.new_tensor(float(t.numel()))])).tolist()
    return total[0] / total[1] if total[1] else 0.0


def _module(layer: nn.Module, path: str) -> nn.Module | None:
    try:
        return layer.get_submodule(path)
    except AttributeError:
        return None


def _sites(ctx: LayerContext, notes: list[str], allow_tie: bool) -> list[_Site]:
    """Input sites of the layer: one per scaling group that can be folded, one per other linear."""
    spec: ArchSpec | None = ctx.spec
    sites: list[_Site] = []
    covered: set[str] = set()
    for g in spec.scaling if spec is not None else ():
        consumers = tuple(n for n in g.linears if isinstance(_module(ctx.layer, n), nn.Linear))
        if not any(n in ctx.linears for n in consumers):
            continue
        reason = _fold_problem(ctx.layer, g, consumers)
        tie = _gqa_tie(ctx.layer, g, consumers) if reason and allow_tie else None
        if reason and tie is None:
            notes.append(f"{g.prev} -> {', '.join(consumers)}: scaling skipped ({reason})")
        sites.append(_Site(consumers, g if tie or not reason else None, g.block, tie, not g.block or g.tokenwise))
        covered.update(consumers)
    if spec is None:
        notes.append("no architecture record: AWQ scaling skipped, clip search and rounding only")
    sites += [_Site((n,), None, "") for n in ctx.linears if n not in covered]
    return sites


def _fold_problem(layer: nn.Module, g: ScalingGroup, consumers: tuple[str, ...]) -> str:
    """Why ``1/s`` cannot be folded into ``g.prev`` ("" when it can)."""
    prev = _module(layer, g.prev)
    in_features = {layer.get_submodule(n).in_features for n in consumers}
    if len(in_features) != 1:
        return f"consumers disagree on input size {sorted(in_features)}"
    n_in = in_features.pop()
    if prev is None:
        return f"no module {g.prev}"
    if g.block and _module(layer, g.block) is None:
        return f"no block module {g.block}"
    if g.prev_kind == "linear":
        if not isinstance(prev, nn.Linear):
            return f"{g.prev} is not a linear"
        if prev.out_features != n_in:
            return (f"{g.prev} has {prev.out_features} outputs but the consumers read {n_in} channels "
                    "(grouped-query attention repeats them)")
        return ""
    weight = getattr(prev, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.shape != (n_in,):
        return f"{g.prev} has no per-channel weight of size {n_in}"
    return ""


def _gqa_tie(layer: nn.Module, g: ScalingGroup, consumers: tuple[str, ...]) -> tuple[int, int] | None:
    """(n_rep, head_dim) when ``g.prev`` is an attention projection whose output heads are each read by
    ``n_rep`` consecutive query heads of the consumers (transformers' ``repeat_kv`` order), else None."""
    prev = _module(layer, g.prev)
    parent = _module(layer, g.prev.rsplit(".", 1)[0]) if "." in g.prev else layer
    head_dim = getattr(parent, "head_dim", None)
    if g.prev_kind != "linear" or not isinstance(prev, nn.Linear) or not isinstance(head_dim, int):
        return None
    n_in = layer.get_submodule(consumers[0]).in_features
    if len(consumers) != 1 or n_in % prev.out_features or prev.out_features % head_dim:
        return None
    return (n_in // prev.out_features, head_dim)


def _capture(ctx: LayerContext, sites: list[_Site], config: AWQConfig, with_hessian: bool) -> tuple[
        list[torch.Tensor], list[torch.Tensor]]:
    """One forward over all batches filling every site; returns (batches used, layer outputs).

    Under ``propagate="fp"`` the outputs are the next layer's inputs and nothing reads this layer's
    inputs again, so each input batch is dropped (from the walker's list too) once its output exists:
    inputs and outputs of the whole calibration set never fill memory together."""
    inputs = ctx.inputs
    local_search = _local_search_windows(inputs, config.search_samples)
    if local_search == 0 and config.search_samples:  # this rank holds none of the search windows
        batches, n_search = list(inputs.hidden), 0
    else:
        batches, n_search = _split_for_search(inputs.hidden, local_search)
    consume = config.propagate == "fp"
    if consume:
        inputs.total_tokens = inputs.n_tokens_all  # before the batches go
        inputs.hidden.clear()
    stride = max(1, inputs.n_tokens_all // config.clip_tokens)
    # token-wise searches: about search_tokens tokens of every batch (0: the search windows, as the rest)
    token_stride = max(1, inputs.n_tokens_all // config.search_tokens) if config.search_tokens else 0
    by_linear = {s.linears[0]: s for s in sites}
    by_block = {s.block: s for s in sites if s.group is not None and s.block}
    state = {"batch": 0}
    outputs: list[torch.Tensor] = []

    def on_call(name: str, args: tuple, kwargs: dict, output: Any) -> None:
        searching = state["batch"] < n_search
        if name == "":
            if consume:
                batches[state["batch"]] = None
            state["batch"] += 1
            outputs.append(inputs.keep(first_output(output).detach()))
            return
        if name in by_block:
            site = by_block[name]
            if token_stride and site.tokenwise and len(args) == 1 and not kwargs:
                # [1, t, in] (a block may expect batch and sequence axes) and its outputs [t, out]
                x = args[0].detach()
                site.calls.append(((x.reshape(-1, x.shape[-1])[::token_stride].unsqueeze(0).contiguous(),), {}))
                out = first_output(output).detach()
                site.outputs.append(out.reshape(-1, out.shape[-1])[::token_stride].contiguous())
            elif searching:
                site.calls.append((args, kwargs))
                site.outputs.append(first_output(output).detach())
        if name in by_linear:
            site = by_linear[name]
            x = args[0].detach()
            x2 = x.reshape(-1, x.shape[-1])  # [t, in]
            # abs before the float32 copy (exact either way): one full-size float32 temporary, not two
            site.sum_abs = x2.abs().float().sum(0) + (0 if site.sum_abs is None else site.sum_abs)
            site.count += x2.shape[0]
            site.clip_x.append(x2[::stride].float())
            if with_hessian:
                site.hessian = site.hessian or HessianAccumulator(x2.shape[1], device=x2.device)
                site.hessian.add(x2)
            if site.group is not None and not site.block:
                if token_stride:
                    site.calls.append(((x2[::token_stride].contiguous(),), {}))  # a copy, not a view of the batch
                elif searching:
                    site.calls.append(((x,), {}))

    names = [""] + sorted(by_block) + sorted(by_linear)
    capture_calls(ctx.layer, LayerInputs(batches, inputs.kwargs, device=inputs.device, offload=inputs.offload),
                  names, on_call, stop_early=False)
    if token_stride:
        for site in sites:
            _merge_token_calls(site)
    return batches, outputs


def _merge_token_calls(site: _Site) -> None:
    """One search call of all the strided tokens a token-wise site took from every batch, instead of one a batch:
    a token-wise block maps each token on its own, so the candidates' outputs are the same rows, and each of the
    grid's candidates then costs one call of the block instead of one a batch (an MoE block in "all" mode is
    ~10 launches an expert: 16 batches x 128 experts x 21 candidates were ~430k launches a layer)."""
    if not site.tokenwise or len(site.calls) < 2 or any(len(a) != 1 or k for a, k in site.calls):
        return
    xs = [a[0] for a, _ in site.calls]
    if len({x.dim() for x in xs}) != 1 or len({x.shape[:-2] for x in xs}) != 1:
        return
    site.calls[:] = [((torch.cat(xs, dim=-2),), {})]
    if site.outputs:
        site.outputs[:] = [torch.cat([o.reshape(-1, o.shape[-1]) for o in site.outputs])]


def _block_fn(layer: nn.Module, site: _Site, names: list[str]) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """The callable the scale search scores: the block's output with ``names``' weights replaced."""
    linears = [layer.get_submodule(n) for n in names]
    if not site.calls:  # no search windows on this rank: nothing to score here
        return lambda ws: torch.empty(0)

    if not site.block:
        def linear_fn(ws: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat([torch.cat([F.linear(a[0], w) for w in ws], dim=-1).reshape(-1, sum(
                w.shape[0] for w in ws)) for a, _ in site.calls])

        return linear_fn
    block = layer.get_submodule(site.block)

    def module_fn(ws: list[torch.Tensor]) -> torch.Tensor:
        originals = [lin.weight.data for lin in linears]
        try:
            for lin, w in zip(linears, ws):
                lin.weight.data = w
            outs = [first_output(block(*a, **k)) for a, k in site.calls]
        finally:
            for lin, w in zip(linears, originals):
                lin.weight.data = w
        return torch.cat([o.reshape(-1, o.shape[-1]) for o in outs])

    return module_fn


def _target(site: _Site, names: list[str], layer: nn.Module) -> torch.Tensor:
    if not site.calls:  # no search windows on this rank
        return torch.empty(0)
    if site.block:
        return torch.cat([o.reshape(-1, o.shape[-1]) for o in site.outputs])
    return _block_fn(layer, site, names)([layer.get_submodule(n).weight.data for n in names])


@torch.no_grad()
def apply_group_scale(layer: nn.Module, g: GroupScale, norm_offset: float) -> None:
    """Fold ``1/s`` into ``g.prev`` and ``s`` into the consumers' input columns, in place."""
    s = g.scales.to(next(layer.parameters()).device)
    prev = layer.get_submodule(g.prev)
    if g.prev_kind == "linear":
        s_prev = g.prev_scales().to(s.device)
        w, b = fold_into_rows(prev.weight.data, prev.bias.data if prev.bias is not None else None, s_prev)
        prev.weight.data.copy_(w)
        if b is not None:
            prev.bias.data.copy_(b)
    else:
        prev.weight.data.copy_(fold_into_norm(prev.weight.data, s, norm_offset))
    for name in g.linears + g.passthrough:  # passthrough: 16-bit readers of the same input (an MoE router)
        lin = layer.get_submodule(name)
        lin.weight.data.copy_(scale_columns(lin.weight.data, s))


@torch.no_grad()
def apply_layer_record(layer: nn.Module, record: LayerRecord, norm_offset: float) -> None:
    """Re-apply a saved search to a full-precision layer: fold every scale. Rounding each linear with
    ``clipped_rtn`` on its recorded clip (``rtn_quantize`` where none) reproduces the method's weights."""
    for g in record.scales:
        apply_group_scale(layer, g, norm_offset)


@dataclass(frozen=True)
class AWQMethod:
    """AWQ under the walker. ``records`` collects each layer's re-applicable ``LayerRecord`` by prefix."""

    scheme: QuantScheme = field(default_factory=lambda: QuantScheme(bits=4, group_size=128, sym=False))
    config: AWQConfig = field(default_factory=AWQConfig)
    name: str = "awq"
    needs_calibration: bool = True
    records: dict[str, LayerRecord] = field(default_factory=dict, compare=False, repr=False)

    def checkpoint_extra(self) -> dict:
        """What the checkpoint records about the method (JSON-able)."""
        return {"awq": dataclasses.asdict(self.config)}

    @torch.no_grad()
    def quantize_layer(self, ctx: LayerContext) -> LayerResult:
        if ctx.inputs is None:
            raise ValueError("AWQ needs calibration inputs")
        notes: list[str] = []
        clock = PhaseClock(ctx.device)
        sites = _sites(ctx, notes, self.config.gqa_tied_vo)
        _, outputs = _capture(ctx, sites, self.config, with_hessian=self.config.gptq)
        _reduce_sites(ctx, sites)
        clock.lap("capture")
        stats: dict[str, dict[str, float]] = {n: {} for n in ctx.linears}
        scales = self._search_scales(ctx, sites, stats)
        offset = ctx.spec.norm_offset if ctx.spec is not None else 0.0
        for g in scales:
            apply_group_scale(ctx.layer, g, offset)
        clock.lap("scale_search")
        clips: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        installed: set[str] = set()
        weights = self._clip_and_round(ctx, sites, scales, clips, stats, installed)
        clock.lap("clip_and_round")
        # Kept on the host: a large model's clips would otherwise pile up on the accelerator.
        self.records[ctx.prefix] = LayerRecord(
            tuple(dataclasses.replace(g, scales=g.scales.cpu()) for g in scales),
            {name: (lo.cpu(), hi.cpu()) for name, (lo, hi) in clips.items()},
        )
        if notes and ctx.index == 0:
            for note in notes:
                log.info("%s: %s", ctx.prefix, note)
        next_hidden = outputs if self.config.propagate == "fp" else None
        return LayerResult(weights=weights, stats=stats, notes=notes, next_hidden=next_hidden, phases=clock.phases,
                           installed=frozenset(installed))

    def _search_scales(self, ctx: LayerContext, sites: list[_Site], stats) -> list[GroupScale]:
        found = []
        for site in sites:
            if site.group is None:
                continue
            names = [n for n in site.linears if n in ctx.linears]
            weights = [ctx.layer.get_submodule(n).weight.data for n in names]
            target = _target(site, names, ctx.layer)
            x_mean = site.sum_abs / max(site.count, 1)
            reduce_sums = None if ctx.comm.world_size == 1 else ctx.comm.all_reduce_sum
            res = search_scale(x_mean, weights, _block_fn(ctx.layer, site, names), target, self.scheme, self.config,
                               tie=site.tie, reduce_sums=reduce_sums)
            power = max(_mean_square(ctx.comm, target), 1e-30)
            for n in names:
                stats[n].update(alpha=res.alpha, scale_err_rtn=res.error_rtn / power,
                                scale_err_awq=res.error_best / power)
            found.append(GroupScale(site.group.prev, site.group.prev_kind, site.linears, res.scales, res.alpha,
                                    site.tie, site.group.passthrough))
            site.calls.clear()
            site.outputs.clear()
        return found

    def _site_scale(self, site: _Site, scales: list[GroupScale]) -> torch.Tensor | None:
        for g in scales:
            if g.linears == site.linears:
                return g.scales
        return None

    def _clip_and_round(self, ctx: LayerContext, sites: list[_Site], scales: list[GroupScale], clips, stats,
                        installed: set[str]):
        """Clip search and rounding of every linear, each on its owner rank (greedy bin-packing by size),
        the results broadcast so every rank holds every weight, clip and stat. In one process a clipped
        linear is packed on its device and its layer given the dequantized weights at once (named in
        ``installed``; the walker moves the packed tensors to the host while the next layer is worked on)."""
        comm = ctx.comm
        jobs = [(site, name) for site in sites for name in site.linears if name in ctx.linears]
        owners = assign_owners([float(ctx.linears[n].weight.numel()) for _, n in jobs], comm.world_size)
        clip_inputs: dict[int, torch.Tensor] = {}
        hessians: dict[int, torch.Tensor | None] = {}
        weights: dict[str, QuantizedWeight] = {}
        for (site, name), owner in zip(jobs, owners):
            if owner != comm.rank:
                continue
            s = self._site_scale(site, scales)
            if self.config.clip and not (self.config.clip_skip_qk and _is_qk(name)):
                if id(site) not in clip_inputs:
                    x = torch.cat(site.clip_x)[: self.config.clip_tokens]  # [t, in]
                    clip_inputs[id(site)] = x if s is None else x / s.to(x.device)
                res = search_clip(ctx.linears[name].weight.data, clip_inputs[id(site)], self.scheme, self.config)
                clips[name] = (res.clip_min, res.clip_max)
                stats[name].update(clip_err_before=res.error_before, clip_err_after=res.error_after)
            if id(site) not in hessians:
                hessians[id(site)] = self._site_hessian(site, s)
            if comm.world_size == 1 and hessians[id(site)] is None and name in clips:
                weights[name] = self._round_clipped_here(ctx.linears[name], clips[name], stats[name])
                installed.add(name)
            else:
                weights[name] = self._round_one(name, ctx.linears[name], clips.get(name), hessians[id(site)],
                                                stats[name], "cpu" if comm.world_size > 1 else ctx.device)
        pending = [(st, st["weight_error"]) for st in stats.values() if torch.is_tensor(st.get("weight_error"))]
        if pending:  # one host round trip for the layer's weight errors
            for (st, _), v in zip(pending, torch.stack([e for _, e in pending]).tolist()):
                st["weight_error"] = v
        if comm.world_size > 1:
            for (_, name), owner in zip(jobs, owners):
                weights[name] = _share_linear(comm, owner, name, ctx.linears[name], self.scheme, weights.get(name),
                                              clips, stats)
        return weights

    def _round_clipped_here(self, lin: nn.Linear, clip, stats: dict) -> QuantizedWeight:
        """Round ``lin`` on its clipped grid, pack on its device and install the dequantized weights in it
        (exactly what the packed codes give, so the walker need not unpack them); the weight error stays a
        device tensor for the caller to read with the others."""
        res, dq, err = clipped_round(lin.weight.data, *clip, self.scheme)
        lin.weight.data.copy_(dq.to(lin.weight.dtype))
        stats["weight_error"] = err
        return QuantizedWeight.from_codes(res.codes, res.scales, res.zeros, res.g_idx, self.scheme, bias=lin.bias,
                                          device=lin.weight.device)

    def _site_hessian(self, site: _Site, s: torch.Tensor | None) -> torch.Tensor | None:
        """The Hessian of the site's inputs after the scaling (``x / s``), for GPTQ rounding; else None."""
        if not self.config.gptq:
            return None
        H = site.hessian.H
        if s is not None:
            inv = 1.0 / s.to(H.device).float()
            H = H * inv.view(-1, 1) * inv.view(1, -1)  # inputs x / s
        return H

    def _round_one(
        self, name: str, lin: nn.Linear, clip, H: torch.Tensor | None, stats: dict[str, float],
        device: torch.device | str = "cpu",
    ) -> QuantizedWeight:
        if H is not None:
            if clip is not None:  # GPTQ computes its grid from the weights: clamp them
                lin.weight.data.copy_(apply_clip(lin.weight.data, *clip, self.scheme.group_size))
            res = gptq_quantize(lin.weight.data, H, self.scheme, self.config.gptq_config, name=name)
            stats.update(err_rtn=res.err_rtn, err_gptq=res.err_gptq)
        else:
            res = rtn_quantize(lin.weight.data, self.scheme) if clip is None else clipped_rtn(
                lin.weight.data, *clip, self.scheme)
            stats.update(weight_error=res.weight_error)
        return QuantizedWeight.from_codes(res.codes, res.scales, res.zeros, res.g_idx, self.scheme, bias=lin.bias,
                                          device=device)


def _share_linear(comm, owner: int, name: str, linear: nn.Linear, scheme: QuantScheme, qw: QuantizedWeight | None,
                  clips, stats) -> QuantizedWeight:
    """``name``'s quantized weight, clip and stats, broadcast from ``owner`` (packed tensors as tensors)."""
    mine = comm.rank == owner
    fields = ("qweight", "qzeros", "scales", "g_idx")
    meta = None
    if mine:
        clip = clips.get(name)
        meta = {"stats": stats[name], "clip": None if clip is None else (clip[0].cpu(), clip[1].cpu()),
                "shapes": [(tuple(getattr(qw, f).shape), getattr(qw, f).dtype) for f in fields]}
    meta = comm.broadcast_object(meta, src=owner)
    tensors = [getattr(qw, f) if mine else torch.empty(shape, dtype=dtype)
               for f, (shape, dtype) in zip(fields, meta["shapes"])]
    tensors = [comm.broadcast(t, src=owner) for t in tensors]
    if mine:
        return qw
    stats[name] = meta["stats"]
    if meta["clip"] is not None:
        clips[name] = meta["clip"]
    return QuantizedWeight(*tensors, bits=scheme.bits, group_size=scheme.group_size, sym=scheme.sym,
                           in_features=linear.in_features, out_features=linear.out_features,
                           bias=None if linear.bias is None else linear.bias.detach().cpu())


def _is_qk(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf in ("q_proj", "k_proj")
