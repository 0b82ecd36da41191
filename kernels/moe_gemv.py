"""Decode-sized MoE: every (token, slot) pair's expert as a split-K GEMV, with no sorting or padding.

At decode a MoE block sees a few tokens: 8 (token, expert) pairs at batch 1 for top-8. The tiled kernel
(``moe_w4a16._moe_gemm_kernel``) gives each block of 16 pair rows one expert, so a pair fills one row in
sixteen, and its grid (blocks x N tiles) gives each program the whole of K to walk: on the Qwen3-30B-A3B shape
int4 decode at batch 1 ran at 9 % of its roofline, slower than bf16 (docs/moe.md, H100, 2026-12-06). Here a
program takes one pair, BLOCK_N output columns and one of S slices of K, and multiplies a vector by a weight tile
on the CUDA cores (a one-row product has no tensor-core tile to fill); slices land in float32 partial sums:

1. gate and up: ``p1 [S1, P, 2I] = x[token(p)] . W13[e(p)]`` over slice s;
2. down: each program first forms its slice of ``h = silu(sum_s p1 gate) * sum_s p1 up`` (rounded to the
   activation dtype, as the tiled kernel stores ``h``), then ``p2 [S2, P, H] = w_p * (h . W2[e(p)])``;
3. ``out[t] = sum`` over slices and the token's k pairs (one reduction), rounded once.

Takes 4-bit experts whose groups are contiguous runs (a K tile inside one group: one scale and zero row a tile,
applied once to the tile's sum), 16-bit experts, and FP8 experts (e4m3 codes; the activations rounded per token,
or per token and scale block, before each GEMV as the tiled kernel rounds them, so ``h`` is formed whole by one
more launch between the two); act-order experts stay on the tiled kernel. The reference is
``moe_w4a16.fused_moe_ref``. Which kernel serves a call: ``moe_w4a16.fused_moe``'s selection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from quantkit.kernels.decoder_ops import RowParts, gated_act
from quantkit.kernels.device_info import ab_switch, counts_switch, interpreting, moe_programmatic_launch, pdl_launch
from quantkit.kernels.fp8_quant import quantize_activations

# The most (token, slot) pairs this kernel takes: beyond, a tiled program's 16 rows are mostly full.
MAX_PAIRS = 64
# Programs a launch aims at (a few per SM on an H100/H200's 132); the split of K is sized to reach it.
TARGET_PROGRAMS = 512


@dataclass(frozen=True)
class GemvConfig:
    """A launch's shape: output columns a program, warps a program, programs the split of K aims at."""

    block_n: int = 64
    num_warps: int = 4
    target_programs: int = TARGET_PROGRAMS


# The config by weights (MoEExperts.kind) and (token, slot) pairs: the first row whose weights match and whose
# pairs are at least the call's; anything else takes GemvConfig() (not swept). Chosen in whole decode steps
# (`quantkit bench --shape qwen3-30b-a3b`, H100, one machine a comparison): block-level sweeps mislead here (one
# layer's experts stay in L2 across replays; even replays over 16 routings picked 32/4/2048 at batch 1, which lost
# in the step, 331 against 361 tok/s).
#   4-bit,  8 pairs (batch 1): block_n 32, 2 warps, 512 programs: against GemvConfig() a tie in the step with the
#     tile sums (322 against 321 tok/s, bench/results/bench_qwen3-30b-a3b_h100_{default,cfg64}_0838693.json);
#     with the row sums 361 (bench_qwen3-30b-a3b_h100_rows.json);
#   4-bit, 64 pairs (batch 8): block_n 64, 4 warps, 2048 programs: with the row sums 1,230 tok/s against 1,166 at
#     128/2/1024, the tile sums' pick (1,213 against 1,130 for GemvConfig() then), and 1,188 for the tile sums
#     (bench_qwen3-30b-a3b_h100_rows_cfg64x4x2048.json beside _rows.json and _tile.json).
GEMV_CONFIGS: tuple[tuple[str, int, GemvConfig], ...] = (
    ("4bit", 8, GemvConfig(block_n=32, num_warps=2, target_programs=512)),
    ("4bit", 64, GemvConfig(block_n=64, num_warps=4, target_programs=2048)),
)


def gemv_config(experts, pairs: int) -> GemvConfig:
    """GEMV_CONFIGS' pick for ``pairs`` pairs of ``experts``; ``QUANTKIT_MOE_GEMV_CONFIG=BLOCK_N,WARPS,PROGRAMS``
    puts one config on every call instead (an A/B switch for the benches)."""
    forced = counts_switch("QUANTKIT_MOE_GEMV_CONFIG", "BLOCK_N,WARPS,PROGRAMS")
    if forced:
        return GemvConfig(*forced)
    return next((c for k, most, c in GEMV_CONFIGS if k == experts.kind and pairs <= most), GemvConfig())


@triton.jit
def _gated_input(p1_ptr, p, cols, ok, IN_SPLITS, INTER, stride_ps, stride_pp, UNROLL: tl.constexpr = None,
                 FRESH: tl.constexpr = False):
    """``silu(gate) * up`` in float32 at columns ``cols`` of pair ``p``, from p1's IN_SPLITS partial sums (gate in
    the first INTER columns of a row, up in the next). ``UNROLL``: the loop's unroll factor (None: not unrolled).
    ``FRESH``: other programs of this launch wrote p1, so it is read past L1 (.cg)."""
    g = tl.zeros(cols.shape, dtype=tl.float32)
    u = tl.zeros(cols.shape, dtype=tl.float32)
    for s in tl.range(0, IN_SPLITS, loop_unroll_factor=UNROLL):
        row = p1_ptr + s * stride_ps + p * stride_pp
        if FRESH:
            g += tl.load(row + cols, mask=ok, other=0.0, cache_modifier=".cg")
            u += tl.load(row + INTER + cols, mask=ok, other=0.0, cache_modifier=".cg")
        else:
            g += tl.load(row + cols, mask=ok, other=0.0)
            u += tl.load(row + INTER + cols, mask=ok, other=0.0)
    return gated_act(g, False) * u


@triton.jit
def _nibble_at_16(x, ASM: tl.constexpr):
    """``(x & 0x000F0000) | 0x43000000``: the nibble at bits 16-19 OR-ed into 128.0's bits, the float 128 + code.
    ``ASM``: one ``lop3`` (ptxas keeps a mask and an OR with two immediates as two instructions); the same bits
    from plain operations under the interpreter."""
    if ASM:
        return tl.inline_asm_elementwise("lop3.b32 $0, $1, 983040, 1124073472, 0xea;", "=r,r", [x], dtype=tl.uint32,
                                         is_pure=True, pack=1)
    return (x & 0x000F0000) | 0x43000000


@triton.jit
def _int4_rows_tile(a_row, w_e, s_e, z_e, k0, offs_n, n_mask, K, stride_wk, stride_wn, stride_sg, stride_sn,
                    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, OFFSET: tl.constexpr = False,
                    ASM: tl.constexpr = False):
    """One 4-bit K tile's products, scaled, as [word row, column] sums (the kernel's ``ROWS``): for nibble j of
    each word row w, input column k0 + 8 w + j. Everything stays in the words' layout: the activations come as one
    [W] vector a nibble, so nothing is reduced or moved between threads. ``EVEN_K``: K is whole tiles (no masks
    along K: the slices cover K exactly).

    Each code becomes a float without a conversion. Plain: shifted to bits 0-3 and OR-ed into 2^23's bits (the
    float 2^23 + code), minus 2^23 + zero: code - zero exactly; a shift, a mask (ptxas makes it a bit-field
    extract), an OR, the subtraction and the FMA a code. Masking the codes where they sit and OR-ing each into
    the power of two whose mantissa unit is 1 there saves the shifts but not the instructions: LOP3 takes one
    immediate, so the mask and the OR stay two (sm_90 SASS, 322 integer instructions for two tiles against 339).
    ``OFFSET``: each code shifted to bits 16-19 and OR-ed into 128.0's (the float 128 + code; ``ASM``: mask and OR
    in one lop3), multiplied as it is; the tile then takes (128 + zero) x the sum of its activations off each
    word row once. A shift, one LOP3 and the FMA a code. The 128 rides along in float32: a word row's 8 products
    add up to at most ~1,100 x max|a|, so their rounding (~1e-4 x max|a|) stays far below bf16's on the result."""
    offs_w = tl.arange(0, BLOCK_K // 8)
    rows = k0 // 8 + offs_w
    words = tl.load(w_e + rows[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                    mask=((rows[:, None] < K // 8) | EVEN_K) & n_mask[None, :], other=0)  # [W, BLOCK_N]
    words = words.to(tl.uint32, bitcast=True)  # logical shifts: no sign extension to mask off
    sz = (k0 // GROUP) * stride_sg + offs_n * stride_sn
    inside = n_mask & ((k0 < K) | EVEN_K)
    scale = tl.load(s_e + sz, mask=inside, other=0.0).to(tl.float32)
    zero = tl.load(z_e + sz, mask=inside, other=0.0).to(tl.float32)
    dot = tl.zeros(words.shape, dtype=tl.float32)
    a_sum = tl.zeros(offs_w.shape, dtype=tl.float32)
    for j in tl.static_range(8):
        cols = k0 + offs_w * 8 + j
        a = tl.load(a_row + cols, mask=(cols < K) | EVEN_K, other=0.0).to(tl.float32)
        if OFFSET:  # nibble j (bits 4j..4j+3) moved to bits 16-19
            if j < 4:
                moved = words << (16 - 4 * j)
            elif j > 4:
                moved = words >> (4 * j - 16)
            else:
                moved = words
            dot += a[:, None] * _nibble_at_16(moved, ASM).to(tl.float32, bitcast=True)  # a (128 + code)
            a_sum += a
        else:
            bits = ((words >> (4 * j)) & 0xF) | 0x4B000000  # 2^23 + code
            dot += a[:, None] * (bits.to(tl.float32, bitcast=True) - (zero + 8388608.0)[None, :])
    if OFFSET:
        dot -= (zero + 128.0)[None, :] * a_sum[:, None]
    return scale[None, :] * dot


@triton.jit
def _moe_gemv_kernel(a_ptr, p1_ptr, w_ptr, s_ptr, z_ptr, ids_ptr, topw_ptr, out_ptr, as_ptr,
                     N, K, TOP_K, IN_SPLITS, INTER,
                     stride_am, stride_we, stride_wk, stride_wn, stride_se, stride_sg, stride_sn,
                     stride_ps, stride_pp, stride_os, stride_op, stride_asm,
                     QUANT: tl.constexpr, GROUP: tl.constexpr, GATED_INPUT: tl.constexpr, MUL_ROUTED: tl.constexpr,
                     FP8: tl.constexpr, K_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     NUM_STAGES: tl.constexpr = None, UNROLL: tl.constexpr = None, PDL: tl.constexpr = False,
                     ROWS: tl.constexpr = 0, EVEN_K: tl.constexpr = False, ASM: tl.constexpr = False,
                     cnt_ptr=None, fin_ptr=None, ROW_PAIRS=1, FINISH: tl.constexpr = 0):
    """One pair ``p``, BLOCK_N columns, slice ``s`` of K (K_SPLIT columns). ``GATED_INPUT``: the input row is
    ``silu(gate) * up`` of ``p1``'s IN_SPLITS partial sums (the down GEMV), else ``a[p // TOP_K]`` (gate/up; the
    down GEMV of FP8 experts passes TOP_K 1: its rows are the pairs'). ``FP8``: ``a`` holds e4m3 codes with float32
    scales ``as [rows, K / GROUP]`` and ``w [E, N, K]`` e4m3 codes with scales ``s [E, N, K / GROUP]`` (GROUP: the
    scales' run of input columns, K for one run); each K tile's sum of code products is scaled by both.
    ``NUM_STAGES``: the K loop software-pipelined (Triton's cp.async stages: the next tiles' words requested while
    one is multiplied; in the sm_90 build the 4-bit gate/up loop takes it, the down loop with its gated prologue
    does not), None for none. ``UNROLL``: the K loop's and the gated prologue's unroll factor (the prologue's
    partial-sum loads then go out together), None for none. Neither changes the sums or their order. ``PDL``: let the
    next kernel launch, then wait for the previous one, before any load (device_info.moe_programmatic_launch).
    ``ROWS`` (4-bit): each thread keeps its own sums, one per word row and column, and the program adds them up once
    after the K loop (the plain 4-bit tile sums over K in every tile: shuffles and barriers between the warps, five
    a tile in the sm_90 build); the codes become floats through their bits (no int-to-float conversion, which
    issues at a quarter of the FMA rate). 0: the tile sums; else MATHS' index (:func:`_int4_rows_tile`). The down
    GEMV's gated input is then formed beforehand (``GATED_INPUT`` off). ``ASM``: inline PTX where it saves an
    instruction (not under the interpreter). ``FINISH``: 0, the parts stay for launches of their own; 1 (after
    gate/up) or 2 (after down), the last program to store its part of a group finishes the group (:func:`_finish`)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    sp = tl.program_id(2)
    e = tl.load(ids_ptr + p).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if ROWS:
        tl.static_assert(QUANT and not GATED_INPUT, "row sums: 4-bit weights, the gated input formed beforehand")
        acc_rows = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)  # [word row, column]
    a_row = a_ptr + (p // TOP_K).to(tl.int64) * stride_am  # the input row (unread where GATED_INPUT)
    k_start = sp * K_SPLIT
    for k0 in tl.range(k_start, k_start + K_SPLIT, BLOCK_K, num_stages=NUM_STAGES, loop_unroll_factor=UNROLL):
        if ROWS:
            acc_rows += _int4_rows_tile(a_row, w_ptr + e * stride_we, s_ptr + e * stride_se, z_ptr + e * stride_se,
                                        k0, offs_n, n_mask, K, stride_wk, stride_wn, stride_sg, stride_sn, GROUP,
                                        BLOCK_K, EVEN_K, ROWS == 2, ASM)  # 2: "offset"
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            if GATED_INPUT:
                a = _gated_input(p1_ptr, p, offs_k, k_mask, IN_SPLITS, INTER, stride_ps, stride_pp, UNROLL)
                a = a.to(a_ptr.dtype.element_ty).to(tl.float32)  # as x's dtype
            else:
                a = tl.load(a_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            if QUANT:
                offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
                words = tl.load(w_ptr + e * stride_we + offs_w[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                                mask=(offs_w[:, None] < K // 8) & n_mask[None, :], other=0)  # [BLOCK_K/8, BLOCK_N]
                shifts = tl.arange(0, 8) * 4
                codes = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # word w, nibble j: row 8 w + j
                codes = tl.reshape(codes, [BLOCK_K, BLOCK_N]).to(tl.float32)
                sz = e * stride_se + (k0 // GROUP) * stride_sg + offs_n * stride_sn
                inside = n_mask & (k0 < K)
                scale = tl.load(s_ptr + sz, mask=inside, other=0.0).to(tl.float32)
                zero = tl.load(z_ptr + sz, mask=inside, other=0.0).to(tl.float32)
                # sum_k a_k (c_k - z) s = s (sum_k a_k c_k - z sum_k a_k): the tile lies in one group
                acc += scale * (tl.sum(a[:, None] * codes, axis=0) - zero * tl.sum(a, axis=0))
            elif FP8:  # e4m3 x e4m3 products are exact in float32, as the FP8 GEMM's
                # [BLOCK_N, BLOCK_K]: rows of K-contiguous codes, reduced along K inside a thread's run
                w = tl.load(w_ptr + e * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk,
                            mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
                run = k0 // GROUP
                sa = tl.load(as_ptr + (p // TOP_K).to(tl.int64) * stride_asm + run)
                sw = tl.load(s_ptr + e * stride_se + run * stride_sg + offs_n * stride_sn, mask=n_mask, other=0.0)
                acc += tl.sum(w * a[None, :], axis=1) * (sa * sw)
            else:
                w = tl.load(w_ptr + e * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk,
                            mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
                acc += tl.sum(w * a[None, :], axis=1)
    if ROWS:
        acc = tl.sum(acc_rows, axis=0)
    if MUL_ROUTED:
        acc = acc * tl.load(topw_ptr + p)
    tl.store(out_ptr + sp * stride_os + p * stride_op + offs_n, acc, mask=n_mask)
    if FINISH:
        _finish(out_ptr, cnt_ptr, fin_ptr, p, pid_n, N, INTER, ROW_PAIRS, stride_os, stride_op, BLOCK_N, UNROLL,
                FINISH)


@triton.jit
def _finish(out_ptr, cnt_ptr, fin_ptr, p, pid_n, N, INTER, ROW_PAIRS, stride_os, stride_op, BLOCK_N: tl.constexpr,
            UNROLL: tl.constexpr, FINISH: tl.constexpr):
    """The step after a GEMV, done by the program that stores the last part it needs (an arrival counter a group,
    ``cnt_ptr``, as the fused router's: every program's parts stored before its one count, released with it; the
    last count acquires them all and puts the counter back to zero for the next call or graph replay):

    * FINISH 1, after gate/up: the group is pair ``p``'s gate columns of one BLOCK_N tile and the up columns
      INTER further on, over all slices of K (INTER a multiple of BLOCK_N); the last forms ``h = silu(gate) * up``
      there, rounded to ``fin_ptr``'s dtype: what ``_gated_rows_kernel`` writes.
    * FINISH 2, after down: the group is one token's pairs (ROW_PAIRS of them, consecutive) and slices at one
      column tile; the last adds them pair by pair, slice by slice (``_sum_parts_kernel``'s order over the
      ``[T, ROW_PAIRS, S, N]`` parts) and rounds once into ``fin_ptr [T, N]``: the same bits.

    Its parts are read past L1 (other SMs wrote them)."""
    slices = tl.num_programs(2)
    if FINISH == 1:
        tiles = INTER // BLOCK_N
        tile = pid_n % tiles
        counter = cnt_ptr + p * tiles + tile
        arrivals = 2 * slices
    else:
        t = p // ROW_PAIRS
        counter = cnt_ptr + t * tl.num_programs(1) + pid_n
        arrivals = ROW_PAIRS * slices
    tl.debug_barrier()  # every thread's part stored before the one thread that counts
    arrived = tl.atomic_add(counter, 1, sem="acq_rel")
    if arrived == arrivals - 1:
        tl.atomic_xchg(counter, 0, sem="relaxed")
        if FINISH == 1:
            cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = cols < INTER
            h = _gated_input(out_ptr, p, cols, ok, slices, INTER, stride_os, stride_op, UNROLL, True)
            tl.store(fin_ptr + p * INTER + cols, h.to(fin_ptr.dtype.element_ty), mask=ok)
        else:
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = cols < N
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for j in range(0, ROW_PAIRS):  # pair-major, then slices: _sum_parts_kernel's order over [T, k, S, N]
                row = out_ptr + (t * ROW_PAIRS + j) * stride_op + cols
                for s in tl.range(0, slices, loop_unroll_factor=UNROLL):
                    acc += tl.load(row + s * stride_os, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(fin_ptr + t * N + cols, acc.to(fin_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _sum_parts_kernel(parts_ptr, out_ptr, H, PARTS, BLOCK: tl.constexpr, UNROLL: tl.constexpr = None,
                      PDL: tl.constexpr = False):
    """``out[t] = sum over PARTS rows of parts[:, t]`` (float32), rounded once to out's dtype: the slices of K and
    the token's k pairs in one launch (torch's sum and cast would be two, a few us each at decode). ``UNROLL`` as
    the GEMV's (at batch 1 its 16 dependent loads took 3.6 us, H100 profile, docs/moe.md); ``PDL`` as its."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.range(0, PARTS, loop_unroll_factor=UNROLL):
        acc += tl.load(parts_ptr + (t * PARTS + i) * H + cols, mask=ok, other=0.0)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gated_rows_kernel(p1_ptr, h_ptr, INTER, IN_SPLITS, stride_ps, stride_pp, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = False):
    """``h[p] = silu(sum_s p1 gate) * sum_s p1 up``, rounded to h's dtype: the down GEMV's input where it needs it
    whole (FP8: the activations' per-token e4m3 rounding takes the row's largest value; ``ROWS``). ``PDL`` as the
    GEMV's."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    p = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < INTER
    h = _gated_input(p1_ptr, p, cols, ok, IN_SPLITS, INTER, stride_ps, stride_pp)
    tl.store(h_ptr + p * INTER + cols, h.to(h_ptr.dtype.element_ty), mask=ok)


def block_k_for(experts) -> int:
    """The K tile: 64 for 16-bit experts; for 4-bit ones the largest of 128/64/32 inside both groups, or 0 where
    their groups are not contiguous runs that a tile fits in (act-order: the tiled kernel serves them); for FP8
    ones 64 as for 16-bit, or 32 where the scale blocks are not multiples of 64 (not yet swept on a GPU)."""
    if experts.fp8:
        runs = [g for g in (experts.group13, experts.group2) if g]
        return next((b for b in (64, 32) if all(g % b == 0 for g in runs)), 0)
    if not experts.quantized:
        return 64
    return next((b for b in (128, 64, 32) if experts.group13 and experts.group2
                 and experts.group13 % b == 0 and experts.group2 % b == 0), 0)


def applies(experts, pairs: int) -> bool:
    """Whether this kernel can serve ``pairs`` (token, slot) pairs of these experts (4-bit with contiguous groups,
    FP8 with dynamic activation scales, 16-bit)."""
    return 0 < pairs <= MAX_PAIRS and block_k_for(experts) > 0


def _split(k: int, block_k: int, programs: int, target: int | None = None) -> tuple[int, int]:
    """(slices, columns a slice): enough slices of K for ~``target`` programs (TARGET_PROGRAMS), each a whole
    number of tiles."""
    tiles = triton.cdiv(k, block_k)
    want = max(1, min(tiles, triton.cdiv(TARGET_PROGRAMS if target is None else target, max(programs, 1))))
    per = triton.cdiv(tiles, want)
    return triton.cdiv(tiles, per), per * block_k


def _launch(a, p1, w, s, z, ids, topw, out_parts, n, k, top_k, in_splits, inter, quant, group, gated_input,
            mul_routed, k_split, block_n, block_k, num_warps, a_scales=None, num_stages=None, unroll=None, pdl=False,
            math="tile", finish=None):
    """``finish``: None, or ``(FINISH, counters, fin, row_pairs)`` for the kernel's :func:`_finish`."""
    fp8 = a_scales is not None
    if quant:
        swe, swk, swn = w.stride()  # [E, K/8, N]
        sse, ssg, ssn = s.stride()  # [E, G, N]
    elif fp8:
        swe, swn, swk = w.stride()  # [E, N, K] e4m3
        sse, ssn, ssg = s.stride()  # [E, N, G] float32
        z = w  # unused
        group = group or k
    else:
        swe, swn, swk = w.stride()  # [E, N, K]
        sse = ssg = ssn = 0
        s = z = w  # unused
    slices, pairs = out_parts.shape[0], out_parts.shape[1]
    grid = (pairs, triton.cdiv(n, block_n), slices)
    _moe_gemv_kernel[grid](a, p1, w, s, z, ids, topw, out_parts, a_scales if fp8 else topw, n, k, top_k, in_splits,
                           inter, a.stride(0), swe, swk, swn, sse, ssg, ssn, p1.stride(0), p1.stride(1),
                           out_parts.stride(0), out_parts.stride(1), a_scales.stride(0) if fp8 else 0, QUANT=quant,
                           GROUP=group, GATED_INPUT=gated_input, MUL_ROUTED=mul_routed, FP8=fp8, K_SPLIT=k_split,
                           BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages, UNROLL=unroll, PDL=pdl,
                           ROWS=MATHS.index(math) if quant else 0, EVEN_K=slices * k_split == k,
                           ASM=not interpreting(), **_finish_args(finish),
                           num_warps=num_warps, **pdl_launch(pdl))


def _finish_args(finish) -> dict:
    if finish is None:
        return {}
    code, counters, fin, row_pairs = finish
    return dict(cnt_ptr=counters, fin_ptr=fin, ROW_PAIRS=row_pairs, FINISH=code)


# The K loops' pipelining and unrolling by default (the kernel's NUM_STAGES, UNROLL): two cp.async stages in the
# 4-bit gate/up loop and both loops (and the gated prologue, the final sum) unrolled by two. Measured in whole
# decode steps (Qwen3-30B-A3B shape, H100, 2026-12-06, one machine, bench/results/bench_qwen3-30b-a3b_h100_
# {default,pipelined}_ddd2f8b.json): int4 batch 1 322 against 311 tok/s, FP8 batch 1 279 against 268, FP8 batch 8
# 925 against 819. (An unroll by 4 spills the 4-bit down GEMV in the sm_90 build; by 2 it does not.)
PIPELINING = (2, 2)


def pipelining(num_stages: int | None = None, unroll: int | None = None) -> tuple[int | None, int | None]:
    """(NUM_STAGES, UNROLL) for a launch: the arguments where given, else ``QUANTKIT_MOE_GEMV_STAGES`` /
    ``QUANTKIT_MOE_GEMV_UNROLL`` (A/B switches for the benches), else PIPELINING; 1 means neither (None to the
    kernel: a plain loop)."""
    import os

    def pick(value, name, default):
        if value is None:
            raw = os.environ.get(name, "").strip()
            if not raw:
                value = default
            elif not raw.isdigit() or int(raw) < 1:
                raise ValueError(f"{name} must be a positive integer, got {raw!r}")
            else:
                value = int(raw)
        return None if value == 1 else value  # one stage, or an unroll by one: neither

    return (pick(num_stages, "QUANTKIT_MOE_GEMV_STAGES", PIPELINING[0]),
            pick(unroll, "QUANTKIT_MOE_GEMV_UNROLL", PIPELINING[1]))


# How the 4-bit GEMV sums its products (the kernel's ROWS, _int4_rows_tile): "tile", the K sums of every tile
# (across warps); "rows", per-thread sums added once after the K loop, each code as 2^23 + code less 2^23 + zero;
# "offset", the same sums, each code as 128 + code, the offset taken off once a tile and word row.
MATHS = ("tile", "rows", "offset")


def gemv_math(math: str | None = None) -> str:
    """How 4-bit launches sum their products (MATHS): ``math`` where given, else ``QUANTKIT_MOE_GEMV_MATH`` (an
    A/B switch for the benches), else ``offset``. Each measured faster than the one before it in whole decode steps
    of the 30B-A3B shape, each pair on one H100: "rows" 361 against "tile" 337 tok/s at batch 1
    (bench/results/bench_qwen3-30b-a3b_h100_{rows,tile}.json); "offset" (three instructions a code against five
    in the sm_90 SASS) 387 against "rows" 365 at batch 1 and 1,418 against 1,261 at batch 8, the GEMVs 823 against
    916 us a step (bench/results/bench_qwen3-30b-a3b_h100_{offset,default}_e9cd379.json, 2026-12-06)."""
    return _given_or_switch("math", math, "QUANTKIT_MOE_GEMV_MATH", ("offset", "rows", "tile"))


def _given_or_switch(what: str, value: str | None, variable: str, choices: tuple[str, ...]) -> str:
    """``value`` where given (one of ``choices``), else the A/B switch ``variable`` (``choices[0]`` when unset)."""
    if value is None:
        return ab_switch(variable, choices)
    if value not in choices:
        raise ValueError(f"{what} must be one of {choices}, got {value!r}")
    return value


def moe_gemv(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts, block_n: int | None = None,
             num_warps: int | None = None, target_programs: int | None = None, num_stages: int | None = None,
             unroll: int | None = None, math: str | None = None, counters: torch.Tensor | None = None,
             finish: str | None = None, parts: bool = False) -> torch.Tensor | RowParts:
    """``fused_moe``'s result for a decode-sized ``x [T, H]`` (``applies(experts, T * k)``); module docstring.
    ``block_n``, ``num_warps``, ``target_programs`` (the programs a launch aims at): ``gemv_config``'s where not
    given (bench_moe.py sweeps them). ``num_stages``, ``unroll``: the K loops' pipelining and unrolling
    (``pipelining``). ``math``: how 4-bit launches sum their products (``gemv_math``). ``counters``: int32 zeros
    (``counters_for(experts)`` of them, kept by the caller between calls; the kernels leave them zero) that let
    the GEMVs finish their own parts (``finish``, ``gemv_finish``): two launches instead of four. ``parts``: where
    the sum would be a launch of its own, return the down GEMV's parts as ``RowParts`` for the caller's next norm to
    add up (one launch fewer; the same bits)."""
    num_stages, unroll = pipelining(num_stages, unroll)
    math = gemv_math(math)
    finish = gemv_finish(finish) if counters is not None else "apart"
    t, h = x.shape
    top_k = topk_ids.shape[1]
    pairs = t * top_k
    if not applies(experts, pairs):
        raise ValueError(f"moe_gemv takes 1..{MAX_PAIRS} pairs of 16-bit, FP8 or contiguous-group 4-bit experts")
    config = gemv_config(experts, pairs)
    block_n = config.block_n if block_n is None else block_n
    num_warps = config.num_warps if num_warps is None else num_warps
    target = config.target_programs if target_programs is None else target_programs
    block_k = block_k_for(experts)
    inter = experts.inter
    # FP8 experts: the activations' quantization launches (no PDL) sit between the GEMVs, so none there
    pdl = moe_programmatic_launch(x.device) and not experts.fp8
    x = x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    topw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    q, fp8 = experts.quantized, experts.fp8
    # FP8 experts: the activations rounded to e4m3 per token (or token and scale block), as the FP8 linears and
    # the tiled kernel round them
    a13, as13 = quantize_activations(x, experts.group13) if fp8 else (x, None)
    # silu(gate) * up formed whole before the down GEMV: FP8's rounding needs each row's largest value; the
    # row-sum GEMV reads its input one nibble's column at a time, which would repeat the prologue eight times a
    # tile. Otherwise the down GEMV forms its slices of it from p1 itself (GATED_INPUT).
    gated_whole = fp8 or (q and math != "tile")
    # where the GEMVs finish their parts: the gate/up GEMV forms h (4-bit row sums; its column tiles must not
    # straddle the gate and up halves), the down GEMV adds the parts up
    fused_gate = finish == "fused" and gated_whole and not fp8 and inter % block_n == 0
    fused_sum = finish == "fused"
    tiles_h = triton.cdiv(h, block_n)
    n13 = pairs * (inter // block_n) if fused_gate else 0
    if fused_sum and counters.numel() < n13 + t * tiles_h:
        raise ValueError(f"counters holds {counters.numel()} int32s, the GEMVs need {n13 + t * tiles_h} "
                         f"(counters_for(experts))")
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    hid = torch.empty(pairs, inter, dtype=x.dtype, device=x.device) if gated_whole else None
    s1, k1 = _split(h, block_k, pairs * triton.cdiv(2 * inter, block_n), target)
    p1 = torch.empty(s1, pairs, 2 * inter, dtype=torch.float32, device=x.device)
    _launch(a13, p1, experts.w13, experts.s13, experts.z13, ids, topw, p1, 2 * inter, h, top_k, 1, inter, q,
            experts.group13, False, False, k1, block_n, block_k, num_warps, as13, num_stages, unroll, pdl, math,
            (1, counters, hid, 1) if fused_gate else None)
    s2, k2 = _split(inter, block_k, pairs * tiles_h, target)
    # token-major [T, k, S2, H]: a token's k pairs and S2 slices are one run of rows for the final sum
    p2 = torch.empty(t, top_k, s2, h, dtype=torch.float32, device=x.device)
    parts2 = p2.permute(2, 0, 1, 3).view(s2, pairs, h)
    summed = (2, counters[n13:], out, top_k) if fused_sum else None
    if gated_whole:
        if not fused_gate:
            block = min(1024, triton.next_power_of_2(inter))
            _gated_rows_kernel[(pairs, triton.cdiv(inter, block))](p1, hid, inter, s1, p1.stride(0), p1.stride(1),
                                                                    BLOCK=block, PDL=pdl, num_warps=4,
                                                                    **pdl_launch(pdl))
        a2, as2 = quantize_activations(hid, experts.group2) if fp8 else (hid, None)
        _launch(a2, p1, experts.w2, experts.s2, experts.z2, ids, topw, parts2, h, inter, 1, s1, inter, q,
                experts.group2, False, True, k2, block_n, block_k, num_warps, as2, num_stages, unroll, pdl, math,
                summed)
    else:
        _launch(x, p1, experts.w2, experts.s2, experts.z2, ids, topw, parts2, h, inter, top_k, s1, inter, q,
                experts.group2, True, True, k2, block_n, block_k, num_warps, None, num_stages, unroll, pdl, math,
                summed)
    if not fused_sum and parts:  # the token's k pairs and slices, one run of rows a token: the next norm sums them
        return RowParts(p2.view(t, top_k * s2, h), x.dtype)
    if not fused_sum:  # slices and the token's k pairs summed in float32, rounded once (as the tiled path's sum)
        block = min(1024, triton.next_power_of_2(h))
        _sum_parts_kernel[(t, triton.cdiv(h, block))](p2, out, h, top_k * s2, BLOCK=block, UNROLL=unroll, PDL=pdl,
                                                      num_warps=4, **pdl_launch(pdl))
    return out


# The smallest output tile counters_for sizes the counters for (GemvConfig.block_n of every config and sweep).
_COUNTER_BLOCK_N = 16


def counters_for(experts) -> int:
    """How many int32 counters ``moe_gemv(..., counters=)`` needs for these experts at any decode size: one a
    pair and gate/up column tile, one a token and output column tile."""
    return MAX_PAIRS * (triton.cdiv(experts.inter, _COUNTER_BLOCK_N) + triton.cdiv(experts.hidden, _COUNTER_BLOCK_N))


# Where the parts of the GEMVs' slices are finished (gemv_finish): "apart", a launch each (_gated_rows_kernel
# between 4-bit row-sum GEMVs, _sum_parts_kernel after the down GEMV); "fused", by the GEMVs' last programs
# (_finish), where the caller keeps counters.
FINISHES = ("apart", "fused")


def gemv_finish(finish: str | None = None) -> str:
    """FINISHES' pick: ``finish`` where given, else ``QUANTKIT_MOE_GEMV_FINISH`` (an A/B switch for the benches),
    else "apart": timed slower fused in the Qwen3-30B-A3B int4 step at batch 1 (one H200, 2026-12-06, 2f10422):
    402 and 402 tok/s against 410 and 412 apart, the GEMVs 2.2 us a launch longer eagerly (their last programs'
    counter, reads and stores after the slices) for the 4 us a layer of the two launches they save
    (bench/results/bench_qwen3-30b-a3b_int4_h200_finishfused_2f10422.json beside _default_2f10422.json)."""
    return _given_or_switch("finish", finish, "QUANTKIT_MOE_GEMV_FINISH", FINISHES)
