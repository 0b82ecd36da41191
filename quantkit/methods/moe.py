"""Calibration that reaches every expert: a method wrapper for layers with MoE blocks.

``MoEMethod(inner, config)`` hands a layer's other linears (attention, shared expert) to ``inner`` and
quantizes the experts itself, in two passes over the calibration batches:

1. the inputs of every expert's gate/up: with ``mode="all"`` every token goes through every expert
   (one Hessian, the MoE block's input, shared by all experts' gate/up, solved as row stacks); with
   ``mode="routed"`` each expert sees only the tokens routed to it (one Hessian per expert);
2. the inputs of every expert's down projection, through the now quantized gate/up (per expert).

Either way the layer's output passed on is the routed sum (``SeparateExperts``). Experts are computed
one at a time, so device memory holds ``[tokens of a batch, 2I]`` of intermediates at most; the gate/up
solves stack ``chunk`` experts sharing the one Hessian.

An expert whose Hessian saw fewer than ``min_tokens`` tokens (only possible in ``routed`` mode: a rarely
chosen expert) is quantized by round-to-nearest instead: with no or few tokens its Hessian is empty or
singular, and GPTQ on it fits noise; RTN needs no data. A warning names each such expert. The tokens
each expert was routed (in both modes) are in every expert linear's stats (``routed_tokens``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from quantkit.calibrate.walker import LayerContext, LayerResult, StopForward, install_weight
from quantkit.config import QuantkitError
from quantkit.distributed.plan import SolveItem, assign_owners, solve_cost
from quantkit.methods.gptq import GPTQResult, HessianAccumulator, gptq_quantize, relative_error_tensor
from quantkit.methods.gptq_method import global_hessian, share_solved_rows
from quantkit.methods.rtn import rtn_quantize
from quantkit.moe.experts import SeparateExperts, find_separate_experts
from quantkit.qtensor import QuantizedWeight

log = logging.getLogger(__name__)

CALIB_MODES = ("all", "routed")


@dataclass(frozen=True)
class MoECalibConfig:
    """``mode``: "all" (every token through every expert, the default: better model on the measured
    tiny MoE, docs/moe.md) or "routed"; ``min_tokens``: below it an expert falls back to RTN;
    ``chunk``: experts whose gate/up GPTQ solves as one stack in "all" mode (they share one Hessian)."""

    mode: str = "all"
    min_tokens: int = 8
    chunk: int = 8

    def __post_init__(self) -> None:
        if self.mode not in CALIB_MODES:
            raise QuantkitError(f"--moe-calib must be one of {', '.join(CALIB_MODES)}, got {self.mode!r}")
        if self.min_tokens < 0 or self.chunk < 1:
            raise QuantkitError("--moe-min-tokens must be >= 0 and the expert chunk >= 1")


@dataclass(frozen=True)
class MoEMethod:
    """Any method, with the experts of MoE layers quantized as the module docstring says (GPTQ needs
    calibration and is run here per expert with the inner method's config; RTN rounds every linear)."""

    inner: Any
    config: MoECalibConfig = MoECalibConfig()

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def needs_calibration(self) -> bool:
        return self.inner.needs_calibration

    @property
    def scheme(self):
        return self.inner.scheme

    def checkpoint_extra(self) -> dict:
        extra = self.inner.checkpoint_extra() if hasattr(self.inner, "checkpoint_extra") else {}
        return {**extra, "moe_calibration": {"mode": self.config.mode, "min_tokens": self.config.min_tokens}}

    def quantize_layer(self, ctx: LayerContext) -> LayerResult:
        blocks = find_separate_experts(ctx.layer)
        if not blocks or not self.inner.needs_calibration:
            return self.inner.quantize_layer(ctx)  # RTN: every expert linear is a linear like any other
        if self.inner.name == "awq":
            return _awq_layer(ctx, blocks, self.inner)
        if self.inner.name != "gptq":
            raise QuantkitError(f"{self.inner.name} on MoE experts is not supported; use gptq, awq or rtn")
        expert_linears = {n for n in ctx.linears if any(n.startswith(p + ".") for p in blocks)}
        rest = {n: m for n, m in ctx.linears.items() if n not in expert_linears}
        groups = [[n for n in g if n in rest] for g in ctx.groups]
        # The expert blocks below run the whole layer again (its attention included): the inner method must not
        # release the float weights of the linears it quantizes (a streamed layer's ``releasable``).
        result = self.inner.quantize_layer(replace(ctx, linears=rest, groups=[g for g in groups if g],
                                                   releasable=False))
        with torch.no_grad():
            for name, qw in result.weights.items():
                if name not in result.installed:
                    install_weight(rest[name], qw)
        weights, stats, notes = dict(result.weights), dict(result.stats), list(result.notes)
        for path, block in blocks.items():
            w, s, n = _quantize_block(ctx, path, block, self.inner, self.config)
            weights.update(w)
            stats.update(s)
            notes.extend(n)
        return LayerResult(weights=weights, stats=stats, notes=notes, installed=frozenset(weights),
                           phases=result.phases)


def _awq_layer(ctx: LayerContext, blocks: dict[str, SeparateExperts], inner: Any) -> LayerResult:
    """AWQ with the layer's scaling groups expanded for its experts (``quantkit.methods.moe_awq``), every expert
    reached by every token while AWQ captures and searches."""
    from quantkit.methods.moe_awq import awq_layer_spec

    for block in blocks.values():
        block.mode = "all"
    try:
        result = inner.quantize_layer(replace(ctx, spec=awq_layer_spec(ctx.spec, blocks)))
    finally:
        for block in blocks.values():
            block.mode = "routed"
    return result


def _run(ctx: LayerContext, block: SeparateExperts, observer) -> None:
    """One pass of the layer over the calibration batches, ending each forward after ``block``."""

    def stop(module, args, output):
        raise StopForward

    handle = block.register_forward_hook(stop)
    block.observer = observer
    try:
        with torch.no_grad():
            for h in ctx.inputs.batches():
                try:
                    ctx.layer(h, **ctx.inputs.kwargs)
                except StopForward:
                    pass
    finally:
        block.observer = None
        handle.remove()


def _quantize_block(ctx: LayerContext, path: str, block: SeparateExperts, inner: Any,
                    config: MoECalibConfig) -> tuple[dict, dict, list[str]]:
    scheme, gcfg = inner.scheme, inner.config
    block.mode = config.mode
    block.routed_tokens.zero_()
    n = block.num_experts
    gate_n, up_n, down_n = block[0].names
    accs: dict[int | None, HessianAccumulator] = {}

    def add(key: int | None, x: torch.Tensor) -> None:
        acc = accs.get(key)
        if acc is None:
            acc = accs[key] = HessianAccumulator(x.shape[-1], ctx.device)
        acc.add(x)

    def on_in(e: int | None, kind: str, x: torch.Tensor) -> None:
        if kind == "in":
            add(e, x)
            if e is None:  # every expert reads this very input: nothing more to see in this pass
                raise StopForward

    try:
        _run(ctx, block, on_in)
    finally:
        block.mode = "routed"
    # Under --gpus each rank saw its own windows: the counts (and so the fallbacks) are those of all ranks.
    routed = _global_counts(ctx, block.routed_tokens.tolist())
    shared = None in accs if ctx.comm.world_size == 1 else config.mode == "all"
    counts = _global_counts(ctx, [accs[None].n if None in accs else 0] if shared else
                            [accs[e].n if e in accs else 0 for e in range(n)])
    seen = counts * n if shared else counts
    weights: dict[str, QuantizedWeight] = {}
    stats: dict[str, dict[str, float]] = {}
    notes: list[str] = []
    fallback = [e for e in range(n) if seen[e] < max(config.min_tokens, 1)]
    for e in fallback:
        msg = (f"{ctx.prefix}.{path}.{e}: {seen[e]} calibration tokens reached it (floor {config.min_tokens}, "
               f"{routed[e]} routed); quantized by round-to-nearest (GPTQ needs a Hessian from enough tokens; "
               "RTN needs none)")
        log.warning(msg)
        notes.append(msg)
        for lname in (gate_n, up_n, down_n):
            name = f"{path}.{e}.{lname}"
            linear = block[e].get_submodule(lname)
            res = rtn_quantize(linear.weight.data, scheme)
            qw = QuantizedWeight.from_codes(res.codes, res.scales, res.zeros, res.g_idx, scheme)
            install_weight(linear, qw)
            weights[name] = qw
            stats[name] = {"weight_error": res.weight_error, "fallback_rtn": 1.0}
    solve = [e for e in range(n) if e not in fallback]
    # gate/up: all experts share one Hessian in "all" mode (solved in stacks of ``chunk`` experts), each has
    # its own in "routed" mode
    if shared:
        jobs = [[(e, ln) for e in solve[i : i + config.chunk] for ln in (gate_n, up_n)]
                for i in range(0, len(solve), config.chunk)]
        H = global_hessian(ctx, accs.get(None), set(range(ctx.comm.world_size)), counts[0],
                           block[0].get_submodule(gate_n).in_features)
        _solve_jobs(ctx, block, path, jobs, [H] * len(jobs), None, scheme, gcfg, weights, stats)
    else:
        jobs = [[(e, gate_n), (e, up_n)] for e in solve]
        _solve_jobs(ctx, block, path, jobs, [accs.get(e) for e in solve], [seen[e] for e in solve], scheme, gcfg,
                    weights, stats)
    # down: each expert's own input, through its quantized gate/up
    accs.clear()
    if solve:
        block.mode = config.mode
        wanted = set(solve)

        def on_down(e: int | None, kind: str, x: torch.Tensor) -> None:
            if kind == "down_in" and e in wanted:
                add(e, x)

        try:
            _run(ctx, block, on_down)
        finally:
            block.mode = "routed"
    down_counts = _global_counts(ctx, [accs[e].n if e in accs else 0 for e in solve])
    _solve_jobs(ctx, block, path, [[(e, down_n)] for e in solve], [accs.get(e) for e in solve], down_counts,
                scheme, gcfg, weights, stats)
    _read_errors(stats)
    for e in range(n):
        for lname in (gate_n, up_n, down_n):
            stats[f"{path}.{e}.{lname}"].update(routed_tokens=float(routed[e]), calib_tokens=float(seen[e]))
    return weights, stats, notes


def _read_errors(stats: dict) -> None:
    """The block's error statistics, float64 scalars on the device until now, read in one host round trip
    (two per expert linear otherwise: hundreds per layer on a 128-expert model)."""
    pending = [(name, key) for name, st in stats.items() for key, v in st.items() if isinstance(v, torch.Tensor)]
    if pending:
        values = torch.stack([stats[name][key] for name, key in pending]).tolist()
        for (name, key), value in zip(pending, values):
            stats[name][key] = value


def _global_counts(ctx: LayerContext, counts: list[int]) -> list[int]:
    """``counts`` summed over the ranks (the same list on every rank; as given in one process)."""
    if ctx.comm.world_size == 1:
        return list(counts)
    t = torch.tensor(counts, dtype=torch.float64, device=ctx.device)
    return [int(round(v)) for v in ctx.comm.all_reduce_sum(t).tolist()]


def _solve_jobs(ctx: LayerContext, block: SeparateExperts, path: str, jobs: list[list[tuple[int, str]]],
                hessians: list, totals: list[int] | None, scheme, gcfg, weights: dict, stats: dict) -> None:
    """GPTQ on each job's stacked weights (expert, linear name), installed and packed on every rank.

    ``hessians``: one per job, a tensor on every rank (``totals`` None), or each rank's accumulator whose
    tokens sum to ``totals[j]`` over the ranks. In one process the jobs run in order. Under --gpus each job
    has an owner (largest first, to the least loaded rank): the Hessians are reduced onto their owners, every
    rank solves its own jobs, then each result is broadcast from its owner; every rank installs every job.
    """
    comm = ctx.comm

    def stack(mats: list[tuple[int, str]]) -> torch.Tensor:  # built when solved: one stack alive at a time
        return torch.cat([block[e].get_submodule(ln).weight.data for e, ln in mats])

    shapes = [(sum(block[e].get_submodule(ln).out_features for e, ln in mats),
               block[mats[0][0]].get_submodule(mats[0][1]).in_features) for mats in jobs]
    owners = assign_owners([solve_cost(rows, in_f) for rows, in_f in shapes], comm.world_size)
    if totals is not None:
        hessians = [global_hessian(ctx, acc, {owner}, total, in_f)
                    for acc, (_, in_f), total, owner in zip(hessians, shapes, totals, owners)]
    results: dict[int, GPTQResult] = {}
    for j, mats in enumerate(jobs):
        if owners[j] == comm.rank:
            label = f"{ctx.prefix}.{path}.{mats[0][0]}..{mats[-1][0]}"
            results[j] = gptq_quantize(stack(mats), hessians[j], scheme, gcfg, name=label)
            if comm.world_size == 1:  # solved and installed in order: the next job reads nothing of this one
                _install(block, path, mats, results.pop(j), scheme, weights, stats)
        hessians[j] = None
    if comm.world_size == 1:
        return
    for j, mats in enumerate(jobs):
        res = share_solved_rows(ctx, results.pop(j, None), SolveItem(j, 0, shapes[j][0], owners[j], 0.0),
                                shapes[j][1], scheme)
        _install(block, path, mats, res, scheme, weights, stats)


def _install(block: SeparateExperts, path: str, mats: list[tuple[int, str]], res: GPTQResult, scheme,
             weights: dict, stats: dict) -> None:
    """The solved stack ``res`` back into its experts' linears (dequantized), packed, with its errors."""
    w_hat = res.dequantize()
    row = 0
    for e, ln in mats:
        lin = block[e].get_submodule(ln)
        rows = slice(row, row + lin.weight.shape[0])
        lin.weight.data.copy_(w_hat[rows].to(lin.weight.dtype))
        name = f"{path}.{e}.{ln}"
        weights[name] = QuantizedWeight.from_codes(res.codes[rows], res.scales[:, rows], res.zeros[:, rows],
                                                   res.g_idx, scheme)
        stats[name] = {"err_rtn": relative_error_tensor(res.row_err_rtn[rows], res.row_energy[rows]),
                       "err_gptq": relative_error_tensor(res.row_err_gptq[rows], res.row_energy[rows]),
                       "damp": res.damp}  # the errors stay on the device until ``_read_errors``
        row = rows.stop
