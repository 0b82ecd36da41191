"""The router's GEMM, the top-k routing and the pairs' layout in one launch, for decode batches of a few tokens.

At batch 1 the MoE block spent ~12 us of its ~38 us (Qwen3-30B-A3B shape, H100, docs/moe.md) on two launches
before the experts: the router's ``[T, H] x [H, E]`` GEMM (cuBLAS) and ``moe_align.route_and_align``. Here the
router's rows are split over ``E / BLOCK_E`` programs (each reads ``BLOCK_E`` rows of the 16-bit router: 16 KB a
program at H = 2048, so the 512 KB are read in parallel), each writes its logits and counts itself done on an
atomic counter; the program that arrives last runs ``route_and_align``'s body on all the logits (its picks kept
in registers and stored once) and puts the counter back to zero for the next call (a CUDA-graph
replay sees it zero again). One launch instead of two.

The logits are rounded to the activations' dtype before the softmax, as ``F.linear``'s 16-bit output is, so the
routing is the unfused path's up to the order of the float32 sums (a different last bit of a 16-bit logit can swap
two experts only at a near-tie). The reference is ``route_ref(F.linear(x, router))`` plus ``moe_align``.

The counter is the caller's (one int32 zero, kept with the layer: ``runtime/moe.py``); the kernel reads nothing
on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from quantkit.kernels.device_info import ab_switch, counts_switch, moe_programmatic_launch, pdl_launch
from quantkit.kernels.moe_align import FILL, _blocks_a_step, _n_blocks, _route_body, _warps, align_in_one_program

# Up to this many tokens (a decode batch); more take the router GEMM and route_and_align apart.
ROUTER_FUSED_MAX_TOKENS = 4
BLOCK_E = 4  # router rows a program (E / 4 programs: 32 for 128 experts)


def router_fused_applies(tokens: int, top_k: int, num_experts: int, device: torch.device) -> bool:
    """Whether ``router_route_and_align`` takes this call (decode-sized, one program's routing)."""
    return 0 < tokens <= ROUTER_FUSED_MAX_TOKENS and align_in_one_program(tokens * top_k, num_experts, device)


def router_fused_selected(tokens: int, top_k: int, num_experts: int, device: torch.device) -> bool:
    """Whether the runtime's MoE block routes this call here: wherever it applies. Measured on the
    Qwen3-30B-A3B shape (H100, 2026-12-06, docs/moe.md): the batch-1 block 33.5 us against 38.6 for the router
    GEMM and ``route_and_align`` apart. ``QUANTKIT_MOE_ROUTER=apart`` keeps them apart (an A/B switch for the
    benches)."""
    return (ab_switch("QUANTKIT_MOE_ROUTER", ("fused", "apart")) == "fused"
            and router_fused_applies(tokens, top_k, num_experts, device))


def router_config(pairs: int, num_experts: int) -> tuple[int, int]:
    """(router rows a program, warps) of a launch: ``(BLOCK_E, moe_align._warps(...))``, the routing's warps
    (its reductions cross the warps: fewer where the matrices are small); ``QUANTKIT_MOE_ROUTER_CONFIG=ROWS,WARPS``
    puts one config on every launch instead (an A/B switch for the benches; ROWS and WARPS powers of two)."""
    forced = counts_switch("QUANTKIT_MOE_ROUTER_CONFIG", "ROWS,WARPS", powers_of_two=True)
    return forced or (BLOCK_E, _warps(pairs, num_experts))


def norm_router_selected() -> bool:
    """Whether the runtime's MoE block runs its pre-norm inside the fused router's launch
    (:func:`norm_router_route_and_align`) where the fused router serves: the default; ``QUANTKIT_MOE_NORM_ROUTER=apart``
    keeps the norm a launch of its own (the A/B switch). Measured on the Qwen3-30B-A3B shape's int4 step at batch 1
    (one H100, 2026-12-06, docs/moe.md): 2.413 ms against 2.457 apart, and 2.483 against 2.495 in an earlier run."""
    return ab_switch("QUANTKIT_MOE_NORM_ROUTER", ("fused", "apart")) == "fused"


@triton.jit
def _router_route_kernel(x_ptr, stride_xt, w_ptr, stride_we, logits_ptr, counter_ptr, weights_ptr, ids_ptr,
                         sorted_ptr, block_expert_ptr, num_tokens, num_experts, hidden, n_blocks, n_slots,
                         res_ptr, stride_rt, norm_ptr, xo_ptr, ro_ptr, stride_ot, eps, offset,
                         TOP_K: tl.constexpr, RENORM: tl.constexpr, BLOCK_M: tl.constexpr, TOKENS: tl.constexpr,
                         PAIRS: tl.constexpr, EXPERTS: tl.constexpr, FILL: tl.constexpr, BLOCKS: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, ALIGN: tl.constexpr,
                         TOP_K_P2: tl.constexpr, PDL: tl.constexpr = False, NORM: tl.constexpr = False,
                         HAS_RES: tl.constexpr = False):
    # NORM: x is not the router's input but the MoE block's ``delta`` (and ``res_ptr`` its residual stream): every
    # program forms ``rms_norm(delta + residual)`` itself, element for element as decoder_ops.add_rms_norm does,
    # and the first program stores the normed rows (xo) and the sum (ro) for the experts and the next layer
    # The router's rows are read chunk by chunk after the wait. Reading them in one tile (before the wait, or after
    # it) made this launch faster alone and the 30B-A3B step 4-5 % slower (docs/moe.md; archived as
    # bench/archive/experimental/moe_router_whole_rows.patch).
    if PDL:  # the next kernel may launch; x is the previous one's output
        gdc_launch_dependents()
        gdc_wait()
    pid = tl.program_id(0)
    offs_t = tl.arange(0, TOKENS)
    offs_e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    t_mask = offs_t < num_tokens
    e_mask = offs_e < num_experts
    acc = _chunked_logits(x_ptr, stride_xt, w_ptr, stride_we, res_ptr, stride_rt, norm_ptr, xo_ptr, ro_ptr,
                          stride_ot, eps, offset, hidden, offs_t, offs_e, t_mask, e_mask, pid, TOKENS, BLOCK_E,
                          BLOCK_H, NORM, HAS_RES)
    # rounded to the activations' dtype (the logits buffer's), as F.linear's output is
    tl.store(logits_ptr + offs_t[:, None] * num_experts + offs_e[None, :], acc.to(logits_ptr.dtype.element_ty),
             mask=t_mask[:, None] & e_mask[None, :])
    # every thread's logits stored before the one thread that counts (the barrier), released with its count at
    # GPU scope; the last program's count acquires all of them
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed")  # zero again for the next call
        _route_body(logits_ptr, num_experts, weights_ptr, ids_ptr, sorted_ptr, block_expert_ptr, num_tokens,
                    num_experts, n_blocks, n_slots, TOP_K, RENORM, BLOCK_M, TOKENS, PAIRS, EXPERTS, FILL, BLOCKS,
                    True, ALIGN, TOP_K_P2)


@triton.jit
def _summed_rows(x_ptr, res_ptr, stride_xt, stride_rt, offs_t, offs_h, mask, dtype_ptr, HAS_RES: tl.constexpr):
    """``delta + residual`` of a [TOKENS, BLOCK_H] chunk, rounded to the model's dtype as its add is, in float32."""
    s = tl.load(x_ptr + offs_t[:, None] * stride_xt + offs_h[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + offs_t[:, None] * stride_rt + offs_h[None, :], mask=mask, other=0.0)
        s = (s + r.to(tl.float32)).to(dtype_ptr.dtype.element_ty).to(tl.float32)
    return s


@triton.jit
def _normed_rows(s, rstd, norm_ptr, offset, offs_t, offs_h, h_mask, th_mask, xo_ptr, ro_ptr, stride_ot, pid,
                 HAS_RES: tl.constexpr):
    """``rms_norm`` of a chunk of the summed rows ``s`` as the model's dtype rounds it, returned in float32 (the
    router reads the normed rows as rounded, as F.linear on them would); program 0 stores them (and the sums)."""
    nw = tl.load(norm_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    normed = (s * rstd[:, None] * (nw + offset)[None, :]).to(xo_ptr.dtype.element_ty)
    if pid == 0:
        out = offs_t[:, None] * stride_ot + offs_h[None, :]
        tl.store(xo_ptr + out, normed, mask=th_mask)
        if HAS_RES:
            tl.store(ro_ptr + out, s.to(ro_ptr.dtype.element_ty), mask=th_mask)
    return normed.to(tl.float32)


@triton.jit
def _chunked_logits(x_ptr, stride_xt, w_ptr, stride_we, res_ptr, stride_rt, norm_ptr, xo_ptr, ro_ptr, stride_ot, eps,
                    offset, hidden, offs_t, offs_e, t_mask, e_mask, pid, TOKENS: tl.constexpr,
                    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """The program's [TOKENS, BLOCK_E] logits over the hidden size chunk by chunk (rows wider than one tile); with
    NORM, the rows' sums of squares in a first pass, then the normed values chunk by chunk."""
    acc = tl.zeros((TOKENS, BLOCK_E), dtype=tl.float32)
    if NORM:
        sq = tl.zeros((TOKENS,), dtype=tl.float32)
        for h0 in range(0, hidden, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            th_mask = t_mask[:, None] & (offs_h < hidden)[None, :]
            s = _summed_rows(x_ptr, res_ptr, stride_xt, stride_rt, offs_t, offs_h, th_mask, xo_ptr, HAS_RES)
            sq += tl.sum(s * s, axis=1)
        rstd = 1.0 / tl.sqrt(sq / hidden + eps)
    for h0 in range(0, hidden, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_mask = offs_h < hidden
        th_mask = t_mask[:, None] & h_mask[None, :]
        if NORM:
            s = _summed_rows(x_ptr, res_ptr, stride_xt, stride_rt, offs_t, offs_h, th_mask, xo_ptr, HAS_RES)
            x = _normed_rows(s, rstd, norm_ptr, offset, offs_t, offs_h, h_mask, th_mask, xo_ptr, ro_ptr, stride_ot,
                             pid, HAS_RES)
        else:
            x = tl.load(x_ptr + offs_t[:, None] * stride_xt + offs_h[None, :], mask=th_mask,
                        other=0.0).to(tl.float32)  # [TOKENS, BLOCK_H]
        w = tl.load(w_ptr + offs_e[:, None] * stride_we + offs_h[None, :], mask=e_mask[:, None] & h_mask[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_E, BLOCK_H]
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    return acc


def router_route_and_align(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool,
                           counter: torch.Tensor, block_m: int, align: bool = True):
    """``route_ref(F.linear(x, router), top_k, renormalize)`` and ``moe_align(ids, E, block_m)`` in one launch:
    ``(weights [T, k] float32, ids [T, k] int64, (sorted_ids, block_expert))``. ``x [T, H]`` 16-bit (or float32),
    ``router [E, H]``, ``counter``: an int32 tensor of one zero on x's device, kept by the caller between calls (the
    kernel leaves it zero). ``align`` False: no layout (the third item None; the decode GEMV reads none). Only
    where ``router_fused_applies``."""
    return _launch(x, router, top_k, renormalize, counter, block_m, align, None)


def norm_router_route_and_align(delta: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                                eps: float, offset: float, router: torch.Tensor, top_k: int, renormalize: bool,
                                counter: torch.Tensor, block_m: int, align: bool = True):
    """The MoE block's pre-norm, the router and the routing in one launch: ``decoder_ops.add_rms_norm(delta,
    residual, norm_weight, eps, offset)`` then :func:`router_route_and_align` on its normed rows. Returns ``(x,
    summed, weights, ids, aligned)``: the normed rows and ``delta + residual`` (``delta`` itself where residual is
    None) as add_rms_norm returns them, then the routing. One launch fewer a MoE layer at decode."""
    if residual is not None and residual.shape != delta.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match delta {tuple(delta.shape)}")
    if norm_weight.shape != (delta.shape[1],):
        raise ValueError(f"norm weight {tuple(norm_weight.shape)} does not match {delta.shape[1]} features")
    delta = delta.contiguous()
    residual = None if residual is None else residual.contiguous()
    x = torch.empty_like(delta)
    summed = delta if residual is None else torch.empty_like(delta)
    weights, ids, aligned = _launch(delta, router, top_k, renormalize, counter, block_m, align,
                                    (residual, norm_weight.contiguous(), eps, offset, x, summed))
    return x, summed, weights, ids, aligned


def _launch(x, router, top_k, renormalize, counter, block_m, align, norm):
    tokens, hidden = x.shape
    num_experts = router.shape[0]
    if router.shape[1] != hidden:
        raise ValueError(f"x has {hidden} features, the router {router.shape[1]}")
    if not router_fused_applies(tokens, top_k, num_experts, x.device):
        raise ValueError(f"{tokens} tokens of top-{top_k} over {num_experts} experts: not a fused-router call")
    if counter.dtype != torch.int32 or counter.numel() != 1 or counter.device != x.device:
        raise ValueError("counter must be one int32 on the activations' device")
    x, router = x.contiguous(), router.contiguous()
    dev = x.device
    pairs = tokens * top_k
    n_blocks = _n_blocks(pairs, num_experts, block_m)
    logits = torch.empty(tokens, num_experts, dtype=x.dtype, device=dev)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=dev)
    sorted_ids = torch.empty(n_blocks * block_m if align else 1, dtype=torch.int32, device=dev)
    block_expert = torch.empty(n_blocks if align else 1, dtype=torch.int32, device=dev)
    toks = triton.next_power_of_2(tokens)
    pdl = moe_programmatic_launch(dev)
    block_e, warps = router_config(pairs, num_experts)
    # a [TOKENS, BLOCK_E, BLOCK_H] product of 32 values a thread a step (~4K at 4 warps)
    block_h = max(32, min(triton.next_power_of_2(hidden), 1024 * warps // (toks * block_e)))
    grid = (triton.cdiv(num_experts, block_e),)
    residual, norm_weight, eps, offset, x_out, summed = norm if norm is not None else (None, x, 0.0, 0.0, x, x)
    res = x if residual is None else residual
    _router_route_kernel[grid](x, x.stride(0), router, router.stride(0), logits, counter, weights, ids, sorted_ids,
                               block_expert, tokens, num_experts, hidden, n_blocks, n_blocks * block_m,
                               res, res.stride(0), norm_weight, x_out, summed, x_out.stride(0), eps, offset,
                               TOP_K=top_k, RENORM=renormalize, BLOCK_M=block_m, TOKENS=toks,
                               PAIRS=triton.next_power_of_2(pairs), EXPERTS=triton.next_power_of_2(num_experts),
                               FILL=FILL, BLOCKS=_blocks_a_step(num_experts), BLOCK_E=block_e, BLOCK_H=block_h,
                               ALIGN=align, TOP_K_P2=triton.next_power_of_2(top_k), PDL=pdl,
                               NORM=norm is not None, HAS_RES=residual is not None,
                               num_warps=warps, **pdl_launch(pdl))
    return weights, ids, (sorted_ids, block_expert) if align else None
