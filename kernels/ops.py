# ruff: noqa: UP045  (torch.library infers the op schema from typing.Optional annotations)
"""The W4A16 linear and varlen attention as PyTorch custom ops, so that ``torch.compile`` (and transformers'
static-cache ``generate``) sees each kernel call as one opaque node instead of tracing into the launchers.

* ``quantkit::w4a16_linear(x, qweight, scales, zeros, g_idx, perm, pair_index, tile_counters, partial_sums, bits,
  group_size, bias) -> y [..., N]``: the tensors of a ``W4A16Weights`` (``group_size`` in the kernels' encoding),
  run by :func:`quantkit.kernels.dispatch.w4a16_linear`; rebuilding the plan and its launchers is a
  lookup (``dispatch.planned`` is memoized per layer shape). No mutation is declared: every call leaves the
  decode workspace zeroed again.
* ``quantkit::attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, sm_scale, window_left,
  softcap) -> out (total_q, Hq, D)``: :func:`quantkit.kernels.attention.attention_varlen` on CUDA, the reference
  (cast to q's dtype) elsewhere.

Importing this module registers the ops; :func:`w4a16_linear_op` and :func:`attention_varlen_op` are the callables.
"""

from typing import Optional

import torch
from torch import Tensor


@torch.library.custom_op("quantkit::w4a16_linear", mutates_args=())
def w4a16_linear_op(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Optional[Tensor], g_idx: Tensor,
                    perm: Optional[Tensor], pair_index: Optional[Tensor], tile_counters: Optional[Tensor],
                    partial_sums: Optional[Tensor], bits: int, group_size: Optional[int],
                    bias: Optional[Tensor]) -> Tensor:
    from quantkit.kernels.device_info import gpu_arch, gpu_card
    from quantkit.kernels.dispatch import planned, w4a16_linear
    from quantkit.kernels.w4a16_select import LayerFacts
    from quantkit.kernels.w4a16_weights import W4A16Weights

    n, k = qweight.shape[0], qweight.shape[1] * 32 // bits
    facts = LayerFacts(n, k, bits, group_size, has_zeros=zeros is not None, act_order=perm is not None)
    plan, launchers = planned(facts, gpu_arch(qweight.device), gpu_card(qweight.device))
    weights = W4A16Weights(qweight=qweight, scales=scales, zeros=zeros, g_idx=g_idx, perm=perm, bits=bits,
                           group_size=group_size, in_features=k, out_features=n, pair_index=pair_index,
                           tile_counters=tile_counters, partial_sums=partial_sums,
                           plan=plan, launchers=launchers)
    return w4a16_linear(x, weights, bias)


@w4a16_linear_op.register_fake
def _w4a16_linear_fake(x, qweight, scales, zeros, g_idx, perm, pair_index, tile_counters, partial_sums, bits,
                       group_size, bias):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


def w4a16_linear_call(x: Tensor, weights, bias: Optional[Tensor] = None) -> Tensor:
    """``x [..., K] @ W^T (+ bias)`` through the custom op, for a ``W4A16Weights``."""
    return w4a16_linear_op(x, weights.qweight, weights.scales, weights.zeros, weights.g_idx, weights.perm,
                           weights.pair_index, weights.tile_counters, weights.partial_sums, weights.bits,
                           weights.group_size, bias)


@torch.library.custom_op("quantkit::attention_varlen", mutates_args=())
def attention_varlen_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                        max_seqlen_q: int, causal: bool = False, sm_scale: Optional[float] = None,
                        window_left: int = -1, softcap: float = 0.0) -> Tensor:
    from quantkit.kernels import attention

    if q.is_cuda:
        return attention.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal=causal,
                                          sm_scale=sm_scale, window_left=window_left, softcap=softcap)
    out = attention.attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, sm_scale=sm_scale,
                                  window_left=window_left, softcap=softcap)
    return out.to(q.dtype)


@attention_varlen_op.register_fake
def _attention_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal=False, sm_scale=None,
                           window_left=-1, softcap=0.0):
    return torch.empty_like(q)
