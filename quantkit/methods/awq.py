"""AWQ's pure core: activation-aware scales, their folding, and the clip search.

AWQ (Lin et al., 2023) keeps every weight at 4 bits but protects the input channels that meet large
activations. For a group of linears reading the same input ``x [n, in]`` it picks a per-channel scale
``s [in]``, rounds ``W * s`` instead of ``W`` and divides the input by ``s`` (folded into the operation
that produces ``x``: an RMSNorm weight or the output rows of a previous linear), so the
full-precision function is unchanged while salient channels get a finer grid.

* Scale search: ``s = mean|x| ** alpha`` (optionally divided by ``mean|w_normalized| ** (1 - alpha)``,
  "duo scaling"), normalized so that ``sqrt(max s * min s) = 1``; ``alpha`` runs over a grid in
  ``[0, 1]`` and the one whose quantized weights ``Q(W s) / s`` give the least mean squared error of
  the block output (a callable: attention, MLP, or the linears themselves) wins. ``alpha = 0`` is
  plain round-to-nearest, so the search never does worse than RTN on its own objective.
* Clip search: per (group, output row) the min/max range is shrunk by ratios in
  ``[1 - max_shrink, 1]``; the ratio whose rounded group gives the least error of the group's
  partial products ``x_g . w_g`` over sampled tokens is kept (ratio 1 is on the grid, so the
  objective never increases).
* Everything here takes tensors and a frozen config and returns records; the walker glue lives in
  ``awq_method.py`` (``AWQMethod``), which imports this module and never the other way round.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

from quantkit.config import QuantkitError, QuantScheme
from quantkit.methods.gptq import GPTQConfig
from quantkit.methods.rtn import RTNResult
from quantkit.primitives import (
    default_g_idx,
    fake_quantize_contiguous,
    num_groups,
    qparams_from_range,
    quantize_contiguous,
)

log = logging.getLogger(__name__)

PROPAGATE = ("fp", "quantized")


@dataclass(frozen=True)
class AWQConfig:
    """AWQ's options.

    ``grid``: alpha steps over [0, 1] (``grid + 1`` candidates). ``clip``: run the clip search;
    ``clip_grid`` shrink ratios evenly over ``[1 - max_shrink, 1]`` on ``clip_tokens`` sampled tokens;
    ``clip_skip_qk``: leave q/k projections unclipped (their error acts through the attention scores,
    which the partial-product objective does not see). ``duo_scaling``: divide by the normalized weight
    magnitude too. ``search_samples``: calibration windows whose block outputs score the scale search
    of blocks that mix tokens (attention; 0: all; the per-channel activation means always use all).
    ``search_tokens``: token-wise blocks (an MLP, the linears themselves) are scored on about this many
    tokens taken at a stride from the whole calibration set instead (0: on the ``search_samples``
    windows too); at 128 x 2048 tokens a quarter of the 8 windows' products, from every window. ``gptq``: GPTQ
    rounding after the scaling (``gptq_config`` its options). ``gqa_tied_vo``: under grouped-query attention still scale
    v -> o, one scale per value channel shared by the query heads that read it (peers skip v -> o
    there). ``propagate``: the next layer's inputs come from the
    full-precision layer (``"fp"``, as AutoAWQ) or from the quantized one (``"quantized"``).
    """

    grid: int = 20
    duo_scaling: bool = True
    clip: bool = True
    clip_grid: int = 20
    max_shrink: float = 0.5
    clip_tokens: int = 512
    clip_skip_qk: bool = True
    search_samples: int = 8
    search_tokens: int = 4096
    gqa_tied_vo: bool = True
    gptq: bool = False
    gptq_config: GPTQConfig = field(default_factory=GPTQConfig)
    propagate: str = "fp"

    def __post_init__(self) -> None:
        if self.grid < 1:
            raise QuantkitError(f"--grid must be at least 1, got {self.grid}")
        if self.clip_grid < 1:
            raise QuantkitError(f"clip_grid must be at least 1, got {self.clip_grid}")
        if not 0.0 <= self.max_shrink < 1.0:
            raise QuantkitError(f"max_shrink must be in [0, 1), got {self.max_shrink}")
        if self.clip_tokens < 1:
            raise QuantkitError(f"clip_tokens must be at least 1, got {self.clip_tokens}")
        if self.search_tokens < 0:
            raise QuantkitError(f"search_tokens must be >= 0 (0: the search windows), got {self.search_tokens}")
        if self.search_samples < 0:
            raise QuantkitError(f"search_samples must be >= 0 (0: all windows), got {self.search_samples}")
        if self.propagate not in PROPAGATE:
            raise QuantkitError(f"propagate must be one of {PROPAGATE}, got {self.propagate!r}")
        if self.gptq and self.gptq_config.desc_act and not self.gptq_config.static_groups:
            raise QuantkitError("AWQ+GPTQ keeps contiguous groups: use desc_act only with static_groups")


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class ScaleSearch:
    """Outcome of one scale search: the chosen ``alpha``, ``scales [in]`` and block MSEs per alpha."""

    alpha: float
    scales: torch.Tensor
    error_rtn: float  # alpha = 0: plain round-to-nearest
    error_best: float
    errors: tuple[float, ...]


@dataclass(frozen=True)
class ClipSearch:
    """Clip range per group: ``clip_min``/``clip_max`` ``[G, out]`` and the summed partial-product MSEs."""

    clip_min: torch.Tensor
    clip_max: torch.Tensor
    error_before: float
    error_after: float


@dataclass(frozen=True)
class GroupScale:
    """A scale folded into ``prev`` (a norm or a linear's output rows) and ``linears``' input columns."""

    prev: str
    prev_kind: str
    linears: tuple[str, ...]
    scales: torch.Tensor  # [in]
    alpha: float
    # (n_rep, head_dim) when ``prev``'s outputs are repeated n_rep times per head for the consumers
    # (grouped-query attention); ``scales`` is then tied across the repeats.
    tie: tuple[int, int] | None = None
    # 16-bit modules reading the same input (an MoE router): ``s`` folded into their columns, exactly
    passthrough: tuple[str, ...] = ()

    def prev_scales(self) -> torch.Tensor:
        """The scale of each output of ``prev``: ``scales`` itself, or one per repeated channel."""
        if self.tie is None:
            return self.scales
        n_rep, head_dim = self.tie
        return self.scales.view(-1, n_rep, head_dim)[:, 0, :].reshape(-1)  # [kv * head_dim]


@dataclass(frozen=True)
class LayerRecord:
    """The re-applicable result of AWQ on one decoder layer: scales per group, clips per linear."""

    scales: tuple[GroupScale, ...] = ()
    clips: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # name -> [G, out] x2

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Tensors (``scale/<prev>``, ``clip_min/<linear>``, ``clip_max/<linear>``) and JSON metadata."""
        tensors: dict[str, torch.Tensor] = {}
        meta: dict[str, Any] = {}
        for g in self.scales:
            tensors[f"scale/{g.prev}"] = g.scales.detach().cpu()
            meta[f"scale/{g.prev}"] = {"prev_kind": g.prev_kind, "linears": list(g.linears), "alpha": g.alpha,
                                       "tie": None if g.tie is None else list(g.tie),
                                       "passthrough": list(g.passthrough)}
        for name, (cmin, cmax) in self.clips.items():
            tensors[f"clip_min/{name}"] = cmin.detach().cpu()
            tensors[f"clip_max/{name}"] = cmax.detach().cpu()
        return tensors, meta

    @classmethod
    def from_state_dict(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> LayerRecord:
        scales = tuple(
            GroupScale(key[len("scale/"):], m["prev_kind"], tuple(m["linears"]), tensors[key], float(m["alpha"]),
                       None if m.get("tie") is None else tuple(m["tie"]), tuple(m.get("passthrough", ())))
            for key, m in meta.items()
        )
        clips = {
            key[len("clip_min/"):]: (t, tensors["clip_max/" + key[len("clip_min/"):]])
            for key, t in tensors.items() if key.startswith("clip_min/")
        }
        return cls(scales, clips)


# --------------------------------------------------------------------------- scale search


def weight_channel_mean(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """Mean over output rows of ``|w|`` normalized by its group's max: ``[in]`` (duo scaling's weight term)."""
    w = torch.cat([x.float() for x in weights], dim=0)  # [sum out, in]
    out_features, in_features = w.shape
    gs = in_features if group_size == -1 else group_size
    pad = num_groups(in_features, group_size) * gs - in_features
    wg = F.pad(w.abs(), (0, pad)).view(out_features, -1, gs)  # [out, G, gs]
    wg = wg / wg.amax(dim=-1, keepdim=True).clamp_min(1e-12)
    return wg.reshape(out_features, -1)[:, :in_features].mean(dim=0)


def tie_repeats(v: torch.Tensor, tie: tuple[int, int] | None) -> torch.Tensor:
    """Average ``v [kv * n_rep * head_dim]`` over the ``n_rep`` heads that share a kv head, expanded back."""
    if tie is None:
        return v
    n_rep, head_dim = tie
    return v.view(-1, n_rep, head_dim).mean(dim=1, keepdim=True).expand(-1, n_rep, -1).reshape(-1)


def awq_scales(x_mean: torch.Tensor, alpha: float, w_mean: torch.Tensor | None = None,
               check: bool = True) -> torch.Tensor:
    """``s [in] = x_mean^alpha (/ w_mean^(1-alpha))``, clamped away from zero, geometric mid-range 1.
    ``check``: raise on non-finite scales here (a host round trip; the search checks once at its end)."""
    s = x_mean.float().clamp_min(1e-4).pow(alpha)
    if w_mean is not None:
        s = s / w_mean.float().clamp_min(1e-4).pow(1.0 - alpha)
    s = s.clamp_min(1e-4)
    s = s / (s.max() * s.min()).sqrt()
    if check and not torch.isfinite(s).all():
        raise FloatingPointError("non-finite AWQ scales")
    return s


def fake_quantize_scaled(w: torch.Tensor, s: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """``Q(w * s) / s`` for ``w [out, in]``, ``s [in]``: what the scaled weight contributes for input ``x``
    (AWQ's groups are contiguous: reductions over a reshaped view, no index gathers). Float32."""
    ws = w.float() * s.view(1, -1)
    return fake_quantize_contiguous(ws, scheme.bits, scheme.group_size, scheme.sym) / s.view(1, -1)


def candidate_weight(w: torch.Tensor, s: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """``fake_quantize_scaled(w, s, scheme)`` in ``w``'s dtype: one fused Triton pass on CUDA (the same
    values bit for bit, kernels/awq_fake_quant.py), the torch ops elsewhere (also under Triton's
    interpreter, which the kernel's own tests use: it would be far slower than torch on the CPU)."""
    if w.is_cuda:
        from quantkit.kernels.awq_fake_quant import fake_quantize_scaled_triton, fused_supported

        if fused_supported(w, scheme.group_size):
            return fake_quantize_scaled_triton(w, s, scheme.bits, scheme.group_size, scheme.sym)
    return fake_quantize_scaled(w, s, scheme).to(w.dtype)


def search_scale(
    x_mean: torch.Tensor,
    weights: list[torch.Tensor],
    block_fn: Callable[[list[torch.Tensor]], torch.Tensor],
    target: torch.Tensor,
    scheme: QuantScheme,
    config: AWQConfig,
    tie: tuple[int, int] | None = None,
    reduce_sums: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> ScaleSearch:
    """Grid-search ``alpha`` for linears ``weights [out_i, in]`` sharing the input with channel means
    ``x_mean [in]``. ``block_fn(candidate weights)`` returns the block output computed with them
    (same shape as ``target``, the full-precision output); the least mean squared error wins.
    ``tie = (n_rep, head_dim)`` makes the scales equal across repeated heads (see ``tie_repeats``).

    ``reduce_sums``: when the search windows are spread over several processes, each computes its
    squared-error sums and element counts ``[grid + 1, 2]`` (float64; a process without search
    windows passes empty outputs) and ``reduce_sums`` returns their sum over the processes; the mean
    errors then come from the totals. None: one process, the errors are local means."""
    w_mean = weight_channel_mean(weights, scheme.group_size) if config.duo_scaling else None
    x_mean = tie_repeats(x_mean.float(), tie)
    w_mean = None if w_mean is None else tie_repeats(w_mean, tie)
    target = target.float()
    # The loop stays on the device: errors and the finiteness of the scales are read back once, after it.
    means: list[torch.Tensor] = []
    sums: list[torch.Tensor] = []
    candidates_s: list[torch.Tensor] = []
    finite = torch.ones((), dtype=torch.bool, device=x_mean.device)
    for i in range(config.grid + 1):
        alpha = i / config.grid
        s = awq_scales(x_mean, alpha, w_mean, check=False) if i else torch.ones_like(x_mean, dtype=torch.float32)
        finite &= torch.isfinite(s).all()
        candidates = [candidate_weight(w, s, scheme) for w in weights]
        diff = block_fn(candidates).float() - target
        del candidates
        if reduce_sums is None:
            means.append(diff.pow(2).mean())
        else:
            sq = diff.double().pow(2).sum()
            sums.append(torch.stack([sq, sq.new_tensor(float(diff.numel()))]))
        candidates_s.append(s)
    if not bool(finite):
        raise FloatingPointError("non-finite AWQ scales")
    if reduce_sums is None:
        errors = torch.stack(means).tolist()
    else:
        totals = reduce_sums(torch.stack(sums)).tolist()  # [grid + 1, 2]
        errors = [a / n if n else math.nan for a, n in totals]
    best = (math.inf, 0.0, torch.ones_like(x_mean, dtype=torch.float32))
    for i, err in enumerate(errors):
        if err < best[0]:  # strict: ties keep the smaller alpha (alpha 0 is RTN)
            best = (err, i / config.grid, candidates_s[i])
    if not math.isfinite(best[0]):
        log.warning("AWQ scale search: every candidate gave a non-finite error; keeping RTN")
        best = (errors[0], 0.0, torch.ones_like(x_mean, dtype=torch.float32))
    return ScaleSearch(alpha=best[1], scales=best[2], error_rtn=errors[0], error_best=best[0], errors=tuple(errors))


# --------------------------------------------------------------------------- folding


def fold_into_norm(weight: torch.Tensor, s: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """Norm weight ``[in]`` whose output is divided by ``s``: ``(offset + w) / s - offset`` (Gemma: 1)."""
    return ((offset + weight.float()) / s.float() - offset).to(weight.dtype)


def fold_into_rows(weight: torch.Tensor, bias: torch.Tensor | None, s: torch.Tensor):
    """A previous linear ``[out, in]`` whose outputs are divided by ``s [out]``: (weight, bias)."""
    w = (weight.float() / s.float().view(-1, 1)).to(weight.dtype)
    b = None if bias is None else (bias.float() / s.float()).to(bias.dtype)
    return w, b


def scale_columns(weight: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """A consumer ``[out, in]`` whose input was divided by ``s [in]``: columns multiplied by ``s``."""
    return (weight.float() * s.float().view(1, -1)).to(weight.dtype)


# --------------------------------------------------------------------------- clip search


def _grouped(t: torch.Tensor, gs: int, n_groups: int) -> torch.Tensor:
    """``t [rows, in]`` zero-padded to ``n_groups * gs`` columns -> ``[rows, G, gs]``."""
    return F.pad(t, (0, n_groups * gs - t.shape[1])).view(t.shape[0], n_groups, gs)


def search_clip(
    w: torch.Tensor, x: torch.Tensor, scheme: QuantScheme, config: AWQConfig, chunk_elements: int = 1 << 25,
    fused: bool = True,
) -> ClipSearch:
    """Best shrink of each (group, output row) range of ``w [out, in]`` for inputs ``x [n, in]``.

    The error of a candidate is the mean over the tokens of the squared partial product
    ``(x_g . (q(w_g) - w_g))^2 = d^T A_g d`` with ``A_g = X_g^T X_g / n`` (``[G, gs, gs]``, computed
    once): every shrink ratio of a block of rows is scored at once by one batched product with
    ``A``, ``gs / n`` of the arithmetic of multiplying by the tokens (and exact differences ``d`` instead
    of the difference of two products). Blocks of rows hold about ``chunk_elements`` candidate values.
    Ties keep the larger ratio (1 first: the objective never increases). Groups are contiguous (a
    partial last group is zero-padded: padded columns add nothing and do not move the min/max, which
    always include zero). ``fused``: on CUDA, one Triton pass instead (kernels/awq_clip.py)."""
    out_features, in_features = w.shape
    gs = in_features if scheme.group_size == -1 else scheme.group_size
    G = num_groups(in_features, scheme.group_size)
    xg = _grouped(x.float(), gs, G).permute(1, 0, 2)  # [n, in] -> [G, n, gs]
    gram = torch.bmm(xg.transpose(1, 2), xg) / max(1, x.shape[0])  # [G, gs, gs]
    ratios = torch.tensor([1.0 - config.max_shrink * i / config.clip_grid for i in range(config.clip_grid)],
                          dtype=torch.float32, device=w.device)  # [R], descending from 1
    R = ratios.numel()
    if fused and w.is_cuda:
        found = _search_clip_fused(w, gram, ratios, scheme)
        if found is not None:
            return found
    rows = max(1, chunk_elements // (R * G * gs))
    cmin_all, cmax_all, before, after = [], [], [], []  # error sums stay on the device until the end
    for start in range(0, out_features, rows):
        wg = _grouped(w[start : start + rows].float(), gs, G)  # [o, G, gs]
        o = wg.shape[0]
        wmin = wg.amin(dim=-1).clamp(max=0).t()  # [G, o]
        wmax = wg.amax(dim=-1).clamp(min=0).t()
        if scheme.sym:  # a symmetric grid clips both sides at the same magnitude
            wmax = torch.maximum(-wmin, wmax)
            wmin = -wmax
        r3 = ratios.view(R, 1, 1)
        scale, zero = qparams_from_range(wmin * r3, wmax * r3, scheme.bits, scheme.sym)  # [R, G, o]
        s4 = scale.permute(0, 2, 1).unsqueeze(-1)  # [R, o, G, 1]
        z4 = zero.permute(0, 2, 1).unsqueeze(-1).float()
        d = (torch.clamp(torch.round(wg / s4) + z4, 0, scheme.maxq) - z4) * s4 - wg  # [R, o, G, gs]
        d = d.permute(2, 0, 1, 3).reshape(G, R * o, gs)
        err = (torch.bmm(d, gram) * d).sum(dim=-1).view(G, R, o)
        del d
        err = torch.nan_to_num(err, nan=math.inf)
        best_err, best = err.min(dim=1)  # [G, o]: the first (largest) ratio among equal errors
        before.append(err[:, 0].sum())
        after.append(best_err.sum())
        best_ratio = ratios[best]
        cmin_all.append(wmin * best_ratio)
        cmax_all.append(wmax * best_ratio)
    # Summed in float64 on the host, block by block.
    before_sum = sum(torch.stack(before).tolist())
    after_sum = sum(torch.stack(after).tolist())
    return ClipSearch(torch.cat(cmin_all, dim=1), torch.cat(cmax_all, dim=1), before_sum, after_sum)


def _search_clip_fused(w: torch.Tensor, gram: torch.Tensor, ratios: torch.Tensor, scheme: QuantScheme
                       ) -> ClipSearch | None:
    """``search_clip`` in one Triton pass (kernels/awq_clip.py; same grid and rounding, the scores summed in
    another order); None where the kernel does not apply or fails to build (the torch search then runs)."""
    from quantkit.kernels.awq_clip import clip_search_triton, clip_supported

    if not clip_supported(w, scheme.group_size):
        return None
    try:
        cmin, cmax, err0, errb = clip_search_triton(w, gram, ratios, scheme.bits, scheme.group_size, scheme.sym)
    except Exception as exc:  # a Triton build problem must not stop a quantization run
        log.warning("AWQ clip search kernel failed (%s: %s); using the torch search", type(exc).__name__, exc)
        return None
    before, after = torch.stack([err0.double().sum(), errb.double().sum()]).tolist()
    return ClipSearch(cmin, cmax, before, after)


def clipped_rtn(w: torch.Tensor, clip_min: torch.Tensor, clip_max: torch.Tensor, scheme: QuantScheme) -> RTNResult:
    """Round ``w [out, in]`` on the grid of its clipped ranges ``[G, out]`` (contiguous groups): exactly
    the rounding the clip search scored. Values outside a range take the grid's extreme codes."""
    res, _, err = clipped_round(w, clip_min, clip_max, scheme)
    return replace(res, weight_error=float(err))


def clipped_round(w: torch.Tensor, clip_min: torch.Tensor, clip_max: torch.Tensor, scheme: QuantScheme
                  ) -> tuple[RTNResult, torch.Tensor, torch.Tensor]:
    """``clipped_rtn`` without a host round trip: (the result with ``weight_error`` NaN, the dequantized
    weights float32 ``[out, in]`` (what the packed codes dequantize to, bit for bit), the relative error as a
    0-d tensor)."""
    scales, zeros = qparams_from_range(clip_min, clip_max, scheme.bits, scheme.sym)  # [G, out]
    g_idx = default_g_idx(w.shape[1], scheme.group_size, device=w.device).to(torch.int32)
    codes = quantize_contiguous(w, scales, zeros, scheme.bits, scheme.group_size)
    w32 = w.float()
    dq = fake_quantize_contiguous(w, scheme.bits, scheme.group_size, scheme.sym, qparams=(scales, zeros))
    err = (dq - w32).norm() / w32.norm().clamp_min(1e-12)
    return RTNResult(codes, scales, zeros, g_idx, math.nan), dq, err


def apply_clip(w: torch.Tensor, clip_min: torch.Tensor, clip_max: torch.Tensor, group_size: int) -> torch.Tensor:
    """Clamp ``w [out, in]`` to its per-group range ``clip_min``/``clip_max [G, out]`` (contiguous groups):
    how a clip reaches GPTQ, which computes its own grid from the weights."""
    in_features = w.shape[1]
    gs = in_features if group_size == -1 else group_size
    gi = torch.arange(in_features, device=w.device) // gs  # [in]
    lo = clip_min.t()[:, gi].to(w.dtype)  # [out, in]
    hi = clip_max.t()[:, gi].to(w.dtype)
    return torch.maximum(torch.minimum(w, hi), lo)
