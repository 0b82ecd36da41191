"""The routing side of the fused MoE: top-k routing and the pairs' layout by expert, in one Triton program for
decode-sized batches, with the plain-PyTorch code beside it (the reference, and the path for larger batches).

* ``route_ref(logits, top_k, renormalize)``: softmax over the router logits in float32, top-k, optionally
  renormalized over the k (Mixtral's top-k-then-softmax is the same thing).
* ``moe_align(topk_ids, num_experts, block_m)``: the ``T*k`` (token, slot) pairs ``p = t*k + j`` sorted by expert,
  each expert's run padded to a multiple of ``block_m`` with the pair count ``T*k`` (rows the GEMM masks), and the
  expert of every ``block_m`` block. The arrays have their largest size, ``T*k + E*(block_m - 1)`` rounded up to
  ``block_m``, so nothing is read on the host (CUDA-graph safe); blocks past the last run hold padding only.
* ``route_and_align(logits, ...)``: both in one launch.

Why one program: every torch op is a kernel launch on every MoE layer of every decode step (softmax, top-k and
the renormalization 4-5, the align 19), about 2 us each even replayed from a CUDA graph: ~2 ms a step over 48
layers, against the ~0.4 ms the int4 active experts of a 30B-A3B model need at copy speed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # pairs a block of the fused MoE GEMM (its default tile rows)
# One program where its [pairs, experts] matrices are this small (up to 32 tokens of top-8 over 128 experts);
# the torch ops beyond. ``QUANTKIT_MOE_ALIGN=torch`` forces the torch ops (an A/B switch).
ALIGN_ONE_PROGRAM_MAX = 1 << 15  # next_power_of_2(pairs) * next_power_of_2(experts)


def align_in_one_program(pairs: int, num_experts: int, device: torch.device) -> bool:
    """Whether the routing and the align run as one program (the choice, in one place)."""
    from quantkit.kernels.device_info import ab_switch, interpreting

    if ab_switch("QUANTKIT_MOE_ALIGN", ("auto", "torch")) == "torch" or pairs == 0:
        return False
    if device.type != "cuda" and not interpreting():
        return False
    return triton.next_power_of_2(pairs) * triton.next_power_of_2(num_experts) <= ALIGN_ONE_PROGRAM_MAX


def route_ref(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights float32 ``[T, k]`` and expert ids int64 ``[T, k]`` from router logits ``[T, E]``."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def _n_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    return (pairs + num_experts * (block_m - 1) + block_m - 1) // block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_ids, block_expert)``, int32 (module docstring); within an expert's run the pairs keep their order.
    One launch for small routings (``align_in_one_program``), else torch ops: one stable sort gives the order and
    the sorted experts, one binary search each expert's first pair (hence the counts)."""
    flat = topk_ids.reshape(-1)  # [T*k]: pair p = t*k + j routes to expert flat[p]
    pairs, dev = flat.numel(), flat.device
    n_blocks = _n_blocks(pairs, num_experts, block_m)
    if align_in_one_program(pairs, num_experts, dev):
        sorted_ids = torch.empty(n_blocks * block_m, dtype=torch.int32, device=dev)
        block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)
        _moe_align_kernel[(1,)](flat.contiguous(), sorted_ids, block_expert, pairs, num_experts, n_blocks,
                                n_blocks * block_m, BLOCK_M=block_m, PAIRS=triton.next_power_of_2(pairs),
                                EXPERTS=triton.next_power_of_2(num_experts), FILL=FILL,
                                BLOCKS=_blocks_a_step(num_experts), num_warps=_warps(pairs, num_experts))
        return sorted_ids, block_expert
    experts_sorted, order = torch.sort(flat, stable=True)
    first = torch.searchsorted(experts_sorted, torch.arange(num_experts + 1, device=dev, dtype=flat.dtype))
    counts = first[1:] - first[:-1]  # pairs of each expert; its run in `order` starts at first[e]
    padded = (counts + (block_m - 1)).div_(block_m, rounding_mode="floor").mul_(block_m)
    ends = torch.cumsum(padded, 0)  # end of each expert's padded run
    shift = ends - padded - first[:-1]  # padded start minus unpadded start
    sorted_ids = torch.full((n_blocks * block_m,), pairs, dtype=torch.int32, device=dev)
    dest = shift[experts_sorted].add_(torch.arange(pairs, device=dev))
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    blocks = torch.arange(0, n_blocks * block_m, block_m, device=dev, dtype=ends.dtype)
    block_expert = torch.searchsorted(ends, blocks, right=True, out_int32=True).clamp_max_(num_experts - 1)
    return sorted_ids, block_expert


def route_and_align(logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int = BLOCK_M):
    """``route_ref`` and ``moe_align`` in one launch: ``(weights [T, k] float32, ids [T, k] int64, (sorted_ids,
    block_expert))``. Only where ``align_in_one_program(T * top_k, E, device)``; ties between equal probabilities
    go to the lower expert id."""
    tokens, num_experts = logits.shape
    pairs = tokens * top_k
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
    if not align_in_one_program(pairs, num_experts, logits.device):
        raise ValueError(f"{tokens} tokens of top-{top_k} over {num_experts} experts exceed one program")
    dev, logits = logits.device, logits.contiguous()
    n_blocks = _n_blocks(pairs, num_experts, block_m)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=dev)
    sorted_ids = torch.empty(n_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    _route_align_kernel[(1,)](logits, logits.stride(0), weights, ids, sorted_ids, block_expert, tokens, num_experts,
                              n_blocks, n_blocks * block_m, TOP_K=top_k, RENORM=renormalize, BLOCK_M=block_m,
                              TOKENS=triton.next_power_of_2(tokens), PAIRS=triton.next_power_of_2(pairs),
                              EXPERTS=triton.next_power_of_2(num_experts), FILL=FILL,
                              BLOCKS=_blocks_a_step(num_experts), TOP_K_P2=triton.next_power_of_2(top_k),
                              num_warps=_warps(pairs, num_experts))
    return weights, ids, (sorted_ids, block_expert)


FILL = 1024  # padding slots a store step of the align writes


def _warps(pairs: int, num_experts: int) -> int:
    """Warps of the one program: its [pairs, experts] matrices at ~32-64 values a thread (registers, no spills);
    fewer warps where they are small (each reduction across warps goes through shared memory)."""
    cells = triton.next_power_of_2(pairs) * triton.next_power_of_2(num_experts)
    return 4 if cells <= 4096 else 8 if cells <= 16384 else 16


def _blocks_a_step(num_experts: int) -> int:
    """Blocks whose expert one step of the align finds: a [blocks, experts] comparison of ~8K values."""
    return max(16, min(1024, 8192 // triton.next_power_of_2(num_experts)))


@triton.jit
def _align_body(ids_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_experts, n_blocks, n_slots,
                BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, EXPERTS: tl.constexpr, FILL: tl.constexpr,
                BLOCKS: tl.constexpr):
    """The align from the pairs' expert ids in memory. ``hit [PAIRS, EXPERTS]``: pair p routes to expert e; its
    column sums are the counts, its running sums down the pairs each pair's place in its expert's run."""
    offs_p = tl.arange(0, PAIRS)
    p_mask = offs_p < num_pairs
    offs_e = tl.arange(0, EXPERTS)
    ids = tl.load(ids_ptr + offs_p, mask=p_mask, other=EXPERTS)  # lanes past the pairs route nowhere
    hit = (ids[:, None] == offs_e[None, :]).to(tl.int32)
    counts = tl.sum(hit, axis=0)  # [EXPERTS]
    padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # end of each expert's padded run
    place = tl.cumsum(hit, axis=0) - 1 + (ends - padded)[None, :]  # [PAIRS, EXPERTS], read where hit
    dest = tl.sum(tl.where(hit != 0, place, 0), axis=1)  # [PAIRS]
    for s0 in range(0, n_slots, FILL):
        offs_s = s0 + tl.arange(0, FILL)
        tl.store(sorted_ptr + offs_s, num_pairs, mask=offs_s < n_slots)
    tl.debug_barrier()  # the padding fill lands before the pairs are written over it
    tl.store(sorted_ptr + dest, offs_p, mask=p_mask)
    # each block's expert: how many experts' runs end at or before its first row (clamped: trailing padding)
    real_ends = tl.where(offs_e < num_experts, ends, n_slots + 1)
    for b0 in range(0, n_blocks, BLOCKS):
        offs_b = b0 + tl.arange(0, BLOCKS)
        ended = tl.sum((real_ends[None, :] <= offs_b[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + offs_b, tl.minimum(ended, num_experts - 1), mask=offs_b < n_blocks)


@triton.jit
def _moe_align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_experts, n_blocks, n_slots,
                      BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, EXPERTS: tl.constexpr, FILL: tl.constexpr,
                      BLOCKS: tl.constexpr):
    _align_body(ids_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_experts, n_blocks, n_slots,
                BLOCK_M, PAIRS, EXPERTS, FILL, BLOCKS)


@triton.jit
def _pick_keys(probs, offs_e, EXPERTS: tl.constexpr):
    """Each probability and its expert in one int64 that orders as the pick does: the float32's bits (which order
    as the values, all >= 0) above ``EXPERTS - 1 - expert`` (equal probabilities: the lower expert wins), so one
    ``max`` reduction picks what a max and a min over the ids did in two."""
    bits = probs.to(tl.int32, bitcast=True).to(tl.int64)
    return (bits << 32) | (EXPERTS - 1 - offs_e[None, :]).to(tl.int64)


@triton.jit
def _route_body(logits_ptr, stride_lt, weights_ptr, ids_ptr, sorted_ptr, block_expert_ptr, num_tokens, num_experts,
                n_blocks, n_slots, TOP_K: tl.constexpr, RENORM: tl.constexpr, BLOCK_M: tl.constexpr,
                TOKENS: tl.constexpr, PAIRS: tl.constexpr, EXPERTS: tl.constexpr, FILL: tl.constexpr,
                BLOCKS: tl.constexpr, FRESH: tl.constexpr, ALIGN: tl.constexpr, TOP_K_P2: tl.constexpr):
    """Softmax, top-k (renormalized when RENORM) and the align from the router logits in memory. ``FRESH``: the
    logits were written by other programs of this launch, so they are read past L1 (which another replay of the
    step may have left holding this buffer's old lines). ``ALIGN`` False: weights and ids only (the decode GEMV
    reads no layout). The k picks are kept in registers ([TOKENS, TOP_K_P2]) and stored once, one reduction across
    the program's warps each (``_pick_keys``): one pass of picks serves both the renormalization's sum and the
    stores (the first version picked twice when renormalizing, with two reductions a pick: four times as many)."""
    offs_t = tl.arange(0, TOKENS)
    offs_e = tl.arange(0, EXPERTS)
    t_mask = offs_t < num_tokens
    e_mask = offs_e < num_experts
    at = logits_ptr + offs_t[:, None] * stride_lt + offs_e[None, :]
    if FRESH:
        logits = tl.load(at, mask=t_mask[:, None] & e_mask[None, :], other=0.0, cache_modifier=".cg")
    else:
        logits = tl.load(at, mask=t_mask[:, None] & e_mask[None, :], other=0.0)
    logits = tl.where(e_mask[None, :], logits.to(tl.float32), float("-inf"))
    z = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = z / tl.sum(z, axis=1)[:, None]  # [TOKENS, EXPERTS]; 0 past the experts
    offs_j = tl.arange(0, TOP_K_P2)
    picked = tl.zeros((TOKENS, TOP_K_P2), tl.float32)
    chosen = tl.zeros((TOKENS, TOP_K_P2), tl.int32)
    total = tl.zeros((TOKENS,), tl.float32)
    work = _pick_keys(probs, offs_e, EXPERTS)  # [TOKENS, EXPERTS] int64, all distinct in a row
    for j in tl.static_range(TOP_K):
        key = tl.max(work, axis=1)
        best = (key >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        expert = EXPERTS - 1 - (key & 0xFFFFFFFF).to(tl.int32)
        total += best
        picked = tl.where(offs_j[None, :] == j, best[:, None], picked)
        chosen = tl.where(offs_j[None, :] == j, expert[:, None], chosen)
        work = tl.where(work == key[:, None], -1, work)  # taken: below every key left
    if RENORM:
        picked = picked * (1.0 / total)[:, None]
    at_j = offs_t[:, None] * TOP_K + offs_j[None, :]
    tj_mask = t_mask[:, None] & (offs_j[None, :] < TOP_K)
    tl.store(weights_ptr + at_j, picked, mask=tj_mask)
    tl.store(ids_ptr + at_j, chosen.to(tl.int64), mask=tj_mask)
    if ALIGN:
        tl.debug_barrier()  # the ids are in memory before the align reads them back as pairs
        _align_body(ids_ptr, sorted_ptr, block_expert_ptr, num_tokens * TOP_K, num_experts, n_blocks, n_slots,
                    BLOCK_M, PAIRS, EXPERTS, FILL, BLOCKS)


@triton.jit
def _route_align_kernel(logits_ptr, stride_lt, weights_ptr, ids_ptr, sorted_ptr, block_expert_ptr, num_tokens,
                        num_experts, n_blocks, n_slots, TOP_K: tl.constexpr, RENORM: tl.constexpr,
                        BLOCK_M: tl.constexpr, TOKENS: tl.constexpr, PAIRS: tl.constexpr, EXPERTS: tl.constexpr,
                        FILL: tl.constexpr, BLOCKS: tl.constexpr, TOP_K_P2: tl.constexpr):
    _route_body(logits_ptr, stride_lt, weights_ptr, ids_ptr, sorted_ptr, block_expert_ptr, num_tokens, num_experts,
                n_blocks, n_slots, TOP_K, RENORM, BLOCK_M, TOKENS, PAIRS, EXPERTS, FILL, BLOCKS, False, True, TOP_K_P2)
