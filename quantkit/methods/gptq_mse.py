"""GPTQ's static-group range search, every group of a weight at once (tensors in, ``[G, out]`` out).

``group_qparams`` searches one group ``[out, gs]`` at a time: ``1 + mse_max_shrink * mse_grid``
candidate ranges (21 by default), each scored by some twenty small tensor operations. Static groups
(``static_groups``, the sym default) computed that for every group of a linear in a Python loop: on an
8B layer (qkv, o, gate/up, down; 208 groups at g128) about 90,000 kernel launches, 1.9 s of the 2.5 s
a layer took on the H200. Here the same arithmetic runs on ``W`` viewed as ``[rows, G, gs]``: one pass
per candidate over a chunk of rows and all its groups, so the launches no longer scale with the number
of groups (~20 per candidate and chunk).

Same algorithm, op for op: the same ``qparams_from_range`` per (row, group), the same rounding and
error ``sum_j w_j |w_j - q(w_j)|^norm`` per (row, group) summed over the group's ``gs`` values, the same
strict ``<`` keeping the earlier candidate on ties. Only the reduction runs over a ``[rows, G, gs]``
tensor instead of ``[out, gs]``; tests compare the two bit for bit on synthetic weights.
"""

from __future__ import annotations

import torch

from quantkit.config import QuantScheme
from quantkit.primitives import qparams_from_range

# Weight values scored at a time. On a GPU large (~128 MiB per float32 temporary: few launches); on the host
# small enough that the ~20 temporaries of a candidate stay in cache (1 MiB each). SmolLM2's [1536, 576] on
# one CPU thread: 0.11 s at 2^18 against 0.46 s at 2^20 and 2^25 and 0.15 s for the one-group loop.
CHUNK_ELEMENTS = {"cuda": 1 << 25, "cpu": 1 << 18}


def group_qparams(
    wg: torch.Tensor, scheme: QuantScheme, config, weight: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale float32 ``[out]`` and zero int32 ``[out]`` for the group ``wg [out, k]`` (min/max or mse);
    ``weight`` float32 ``[k]``: the mse search's per-column weights (None: unweighted)."""
    wmin, wmax = wg.amin(dim=1), wg.amax(dim=1)  # [out]
    scale, zero = qparams_from_range(wmin, wmax, scheme.bits, scheme.sym)
    if not config.mse:
        return scale, zero
    best = _shrink_error(wg, scale, zero, scheme.bits, config.search_norm, weight)  # [out]
    for k in range(1, int(config.mse_max_shrink * config.mse_grid) + 1):
        p = 1.0 - k / config.mse_grid
        s, z = qparams_from_range(wmin * p, wmax * p, scheme.bits, scheme.sym)
        err = _shrink_error(wg, s, z, scheme.bits, config.search_norm, weight)
        better = err < best
        best = torch.where(better, err, best)
        scale = torch.where(better, s, scale)
        zero = torch.where(better, z, zero)
    return scale, zero


def _shrink_error(wg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, norm: float,
                  weight: torch.Tensor | None = None) -> torch.Tensor:
    s, z = scale[:, None], zero[:, None].float()  # [out, 1]
    q = torch.clamp(torch.round(wg / s) + z, 0, 2**bits - 1)
    err = ((q - z) * s - wg).abs().pow(norm)  # [out, k]
    if weight is not None:
        err = err * weight  # [k] over the columns
    return err.sum(dim=1)  # [out]


def static_group_qparams(
    W: torch.Tensor, scheme: QuantScheme, config, gs: int, weight: torch.Tensor | None = None,
    chunk_elements: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group scale float32 and zero int32 ``[G, out]`` of ``W [out, in]`` (float32, unpermuted), min/max
    or (``config.mse``) the shrink search; ``weight [in]``: the search's column weights or None;
    ``chunk_elements``: values scored at a time (None: ``CHUNK_ELEMENTS`` for the device).

    The whole groups go through :func:`_search_chunk` a chunk of rows at a time; a partial last group
    (``in % gs``) through ``group_qparams``, as before."""
    out_features, in_features = W.shape
    if chunk_elements is None:
        chunk_elements = CHUNK_ELEMENTS.get(W.device.type, CHUNK_ELEMENTS["cuda"])
    full = in_features // gs
    parts_s, parts_z = [], []
    if full:
        step = max(1, chunk_elements // (full * gs))
        cw = None if weight is None else weight[: full * gs].reshape(full, gs)  # [G, gs]
        chunks = [_search_chunk(W[r : r + step, : full * gs].reshape(-1, full, gs), scheme, config, cw)
                  for r in range(0, out_features, step)]
        parts_s.append(torch.cat([s for s, _ in chunks]).t())  # [G, out]
        parts_z.append(torch.cat([z for _, z in chunks]).t())
    if full * gs < in_features:
        tail_w = None if weight is None else weight[full * gs :]
        s, z = group_qparams(W[:, full * gs :], scheme, config, tail_w)  # [out]
        parts_s.append(s[None])
        parts_z.append(z[None])
    return torch.cat(parts_s).contiguous(), torch.cat(parts_z).contiguous()


def _search_chunk(wg: torch.Tensor, scheme: QuantScheme, config, weight: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``group_qparams`` for ``wg [r, G, gs]``: scale and zero ``[r, G]`` (``weight [G, gs]`` or None)."""
    wmin, wmax = wg.amin(dim=-1), wg.amax(dim=-1)  # [r, G]
    scale, zero = qparams_from_range(wmin, wmax, scheme.bits, scheme.sym)
    if not config.mse:
        return scale, zero
    norm = config.search_norm
    best = _errors(wg, scale, zero, scheme.bits, norm, weight)  # [r, G]
    for k in range(1, int(config.mse_max_shrink * config.mse_grid) + 1):
        p = 1.0 - k / config.mse_grid
        s, z = qparams_from_range(wmin * p, wmax * p, scheme.bits, scheme.sym)
        err = _errors(wg, s, z, scheme.bits, norm, weight)
        better = err < best
        best = torch.where(better, err, best)
        scale = torch.where(better, s, scale)
        zero = torch.where(better, z, zero)
    return scale, zero


def _errors(wg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, norm: float,
            weight: torch.Tensor | None) -> torch.Tensor:
    """``sum_j weight_j |w_j - q(w_j)|^norm`` per (row, group) of ``wg [r, G, gs]``: ``[r, G]``."""
    s, z = scale[..., None], zero[..., None].float()  # [r, G, 1]
    q = torch.clamp(torch.round(wg / s) + z, 0, 2**bits - 1)
    err = ((q - z) * s - wg).abs().pow(norm)  # [r, G, gs]
    if weight is not None:
        err = err * weight  # [G, gs] over the columns
    return err.sum(dim=-1)
