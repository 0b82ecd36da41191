"""Fused MoE with W4A16 (or FP8, or 16-bit) experts in Triton, and the plain-PyTorch reference beside it.

``fused_moe(x [T, H], topk_weights [T, k], topk_ids [T, k], experts) -> [T, H]`` computes, for every token,
``sum_j w_j * down_e(silu(gate_e(x)) * up_e(x))`` over its k routed experts ``e = topk_ids[t, j]``:

1. ``moe_align`` (``kernels/moe_align.py``, with the routing): the T*k (token, slot) pairs sorted by expert, each
   expert's run padded to a multiple of BLOCK_M (pad rows point past the end and are masked), and the expert of
   every BLOCK_M block;
2. ``_moe_gemm_kernel`` with ``GATED``: each program takes one block of pairs (one expert) and BLOCK_N
   columns of the intermediate, reads the tokens' rows of ``x`` once and accumulates gate and up together
   (one pass over K = H), applies ``silu(gate) * up`` and stores ``[T*k, I]``;
3. ``_moe_gemm_kernel`` again for down (K = I) with each pair's routing weight applied, ``[T*k, H]``;
   the k rows of a token are summed into its row (``view(T, k, H).sum(1)``).

Weights (:class:`MoEExperts`) are the experts' GPTQ tensors stacked: ``qweight [E, K/8, N]`` int32 (4-bit
codes packed along K: row r in word r // 8 at bit 4 (r % 8), ``quantkit.pack``), scales and float zero
points ``[E, G, N]``, ``g_idx [E, K]`` (any grouping, act-order included: scales are gathered per row).
Gate and up are concatenated along N (``[E, K/8, 2I]``: gate columns first). 16-bit experts (the bf16
baseline) go through the same kernel with ``QUANT=False`` (``w [E, N, K]``). FP8 experts (``stack_fp8``) keep
their e4m3 codes ``[E, N, K]`` (half the bytes of 16-bit) with float32 scales per output channel and run of
input columns; their activations are rounded to e4m3 per token (or per token and scale block) as the FP8 linears
round theirs, and each K tile's dot of codes is scaled by both scales (``FP8``). The dot takes the codes
themselves (:func:`fp8_dot`; Hopper's FP8 warpgroup MMA at 64-row tiles, each K tile's products summed there and
scaled into float32), or with ``QUANTKIT_MOE_FP8_DOT=convert`` runs in 16 bits (every e4m3 code, and every product
of two, is exact there; the codes converted in registers each K tile).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quantkit.kernels.decoder_ops import RowParts
from quantkit.kernels.device_info import ab_switch
from quantkit.kernels.fp8_quant import quantize_activations
from quantkit.kernels.moe_align import BLOCK_M, moe_align


@dataclass(frozen=True)
class MoEExperts:
    """Stacked experts (module docstring). ``quantized``: 4-bit GPTQ tensors; ``fp8``: e4m3 ``w13``/``w2`` with
    float32 scales ``s13 [E, 2I, G13]`` / ``s2 [E, H, G2]`` per output channel and run of ``group13``/``group2``
    input columns (block-scaled checkpoints; 0: one run, per-channel or per-tensor scales); else 16-bit."""

    w13: torch.Tensor  # quantized: int32 [E, H/8, 2I]; else [E, 2I, H] (e4m3 for fp8)
    w2: torch.Tensor  # quantized: int32 [E, I/8, H]; else [E, H, I]
    hidden: int
    inter: int
    quantized: bool
    s13: torch.Tensor | None = None  # [E, G13, 2I] scales (activation dtype)
    z13: torch.Tensor | None = None  # [E, G13, 2I] zero points as floats
    g13: torch.Tensor | None = None  # [E, H] int32 groups
    s2: torch.Tensor | None = None  # [E, G2, H]
    z2: torch.Tensor | None = None
    g2: torch.Tensor | None = None  # [E, I]
    # every expert's groups as contiguous runs of this many rows (g_idx = arange(K) // G), found once when the
    # experts are stacked; 0: irregular (act-order) or 16-bit. Read per call, it would sync the host, and a sync
    # breaks CUDA-graph capture (the int4 MoE decode graphs failed so on an H200)
    group13: int = 0
    group2: int = 0
    fp8: bool = False

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def kind(self) -> str:
        """"4bit", "fp8" or "16bit": the weights, as the kernels' config tables name them."""
        return "fp8" if self.fp8 else "4bit" if self.quantized else "16bit"

    def nbytes(self) -> int:
        ts = [self.w13, self.w2, self.s13, self.z13, self.g13, self.s2, self.z2, self.g2]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` (the reference's weights)."""
        if self.fp8:
            return _dequant_fp8(self.w13, self.s13, self.group13), _dequant_fp8(self.w2, self.s2, self.group2)
        if not self.quantized:
            return self.w13.float(), self.w2.float()
        return (_dequant(self.w13, self.s13, self.z13, self.g13, self.hidden),
                _dequant(self.w2, self.s2, self.z2, self.g2, self.inter))


def _dequant(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
             k: int) -> torch.Tensor:
    """``[E, K/8, N]`` packed -> float32 ``[E, N, K]``."""
    rows = torch.arange(k, device=qweight.device)
    codes = (qweight[:, rows // 8, :] >> (4 * (rows % 8))[None, :, None]) & 0xF  # [E, K, N]
    g = g_idx.long()  # [E, K]
    s = torch.gather(scales.float(), 1, g[:, :, None].expand(-1, -1, scales.shape[2]))  # [E, K, N]
    z = torch.gather(zeros.float(), 1, g[:, :, None].expand(-1, -1, zeros.shape[2]))
    return ((codes.float() - z) * s).transpose(1, 2).contiguous()


def _dequant_fp8(codes: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """e4m3 ``[E, N, K]`` with scales ``[E, N, G]`` (runs of ``group`` columns; 0: one) -> float32 ``[E, N, K]``."""
    k = codes.shape[2]
    s = scales.repeat_interleave(group, dim=2)[:, :, :k] if group else scales
    return codes.float() * s


def stack_fp8(experts: list[tuple], device) -> MoEExperts:
    """:class:`MoEExperts` from each expert's ``(gate, up, down)`` ``quantkit.fp8_weight.FP8Weight`` (channel,
    tensor or block scales, all three alike, no static input scales). Block scales become one per output channel
    and run of the block's columns (so gate and up stack whatever the intermediate size)."""

    def column_scales(w) -> tuple[torch.Tensor, int]:  # [N, G] float32, and the run length (0: one run)
        if w.input_scale is not None:
            raise ValueError("static FP8 activation scales on MoE experts are not served by the kernel")
        if w.strategy == "block":
            b0, b1 = w.block
            return w.weight_scale.float().repeat_interleave(b0, dim=0)[: w.out_features], b1
        return w.weight_scale.float().reshape(-1, 1).expand(w.out_features, 1), 0

    strategies = {(w.strategy, w.block) for trio in experts for w in trio}
    if len(strategies) != 1:
        raise ValueError(f"the experts mix FP8 scale layouts {sorted(map(str, strategies))}")
    w13, s13, w2, s2 = [], [], [], []
    for gate, up, down in experts:
        (sg, group13), (su, _), (sd, group2) = column_scales(gate), column_scales(up), column_scales(down)
        w13.append(torch.cat([gate.weight, up.weight]))
        s13.append(torch.cat([sg, su]))
        w2.append(down.weight)
        s2.append(sd)
    gate = experts[0][0]
    return MoEExperts(torch.stack(w13).to(device), torch.stack(w2).to(device), gate.in_features, gate.out_features,
                      False, torch.stack(s13).to(device).contiguous(), s2=torch.stack(s2).to(device).contiguous(),
                      group13=group13, group2=group2, fp8=True)


def stack_quantized(experts: list[tuple], dtype: torch.dtype, device) -> MoEExperts:
    """:class:`MoEExperts` from each expert's ``(gate, up, down)`` ``QuantizedWeight`` (4-bit, GPTQ layout)."""
    from quantkit.pack import unpack_rows

    def zeros_of(qw) -> torch.Tensor:  # [G, N] float zero points (stored minus one, packed along N)
        return (unpack_rows(qw.qzeros.t().contiguous(), qw.bits, qw.out_features).t() + 1).to(dtype)

    for gate, up, down in experts:
        for qw in (gate, up, down):
            if qw.bits != 4:
                raise ValueError(f"the fused MoE kernel takes 4-bit experts, got {qw.bits}-bit")
        if not torch.equal(gate.g_idx, up.g_idx):
            raise ValueError("gate and up of an expert must share g_idx (they are quantized as one stack)")
    w13 = torch.stack([torch.cat([g.qweight, u.qweight], dim=1) for g, u, _ in experts]).to(device)
    s13 = torch.stack([torch.cat([g.scales, u.scales], dim=1) for g, u, _ in experts]).to(device, dtype)
    z13 = torch.stack([torch.cat([zeros_of(g), zeros_of(u)], dim=1) for g, u, _ in experts]).to(device)
    w2 = torch.stack([d.qweight for _, _, d in experts]).to(device)
    s2 = torch.stack([d.scales for _, _, d in experts]).to(device, dtype)
    z2 = torch.stack([zeros_of(d) for _, _, d in experts]).to(device)
    g13 = torch.stack([g.g_idx for g, _, _ in experts]).to(device, torch.int32)
    g2 = torch.stack([d.g_idx for _, _, d in experts]).to(device, torch.int32)
    gate, _, down = experts[0]
    return MoEExperts(w13, w2, gate.in_features, gate.out_features, True, s13, z13, g13, s2, z2, g2,
                      _contiguous_group(g13), _contiguous_group(g2))


def stack_dense(w13: torch.Tensor, w2: torch.Tensor) -> MoEExperts:
    """16-bit experts: ``w13 [E, 2I, H]`` (gate rows first), ``w2 [E, H, I]``."""
    return MoEExperts(w13.contiguous(), w2.contiguous(), w13.shape[2], w2.shape[2], False)


@triton.jit
def _weight_tile(w_ptr, s_ptr, z_ptr, g_ptr, e, k0, offs_k, offs_n, k_mask, n_mask, K,
                 stride_we, stride_wk, stride_wn, stride_se, stride_sg, stride_sn,
                 QUANT: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                 DTYPE: tl.constexpr):
    """Weights ``[BLOCK_K, BLOCK_N]`` of expert ``e`` (W^T tile: rows are K, columns N), in DTYPE.

    Quantized: ``BLOCK_K / 8`` words per column are loaded once and split into their eight codes (word w,
    nibble j is K row 8 w + j). ``GROUP`` > 0: groups are contiguous and a multiple of BLOCK_K, so the tile
    has one row of scales and zeros; 0: each row's group comes from ``g_idx`` (act-order)."""
    mask = k_mask[:, None] & n_mask[None, :]
    if QUANT:
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(w_ptr + e * stride_we + offs_w[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                        mask=(offs_w[:, None] < K // 8) & n_mask[None, :], other=0)  # [BLOCK_K/8, BLOCK_N]
        shifts = tl.arange(0, 8) * 4
        codes = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # [BLOCK_K/8, 8, BLOCK_N]
        codes = tl.reshape(codes, [BLOCK_K, BLOCK_N])
        if GROUP > 0:
            sz = e * stride_se + (k0 // GROUP) * stride_sg + offs_n[None, :] * stride_sn  # [1, BLOCK_N]
            s = tl.load(s_ptr + sz, mask=n_mask[None, :], other=0.0).to(tl.float32)
            z = tl.load(z_ptr + sz, mask=n_mask[None, :], other=0.0).to(tl.float32)
        else:
            g = tl.load(g_ptr + e * K + offs_k, mask=k_mask, other=0)
            sz = e * stride_se + g[:, None] * stride_sg + offs_n[None, :] * stride_sn
            s = tl.load(s_ptr + sz, mask=mask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + sz, mask=mask, other=0.0).to(tl.float32)
        return ((codes.to(tl.float32) - z) * s).to(DTYPE)
    else:
        w = tl.load(w_ptr + e * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                    mask=mask, other=0.0)
        return w.to(DTYPE)


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, s_ptr, z_ptr, g_ptr, out_ptr, sorted_ptr, block_expert_ptr, topw_ptr, as_ptr,
                     num_pairs, N, K, UP_OFFSET, TOP_K, SCALE_K,
                     stride_am, stride_we, stride_wk, stride_wn, stride_se, stride_sg, stride_sn, stride_om, stride_asm,
                     QUANT: tl.constexpr, GROUP: tl.constexpr, GATED: tl.constexpr, A_BY_TOKEN: tl.constexpr,
                     MUL_ROUTED: tl.constexpr, FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, DTYPE: tl.constexpr, OP_DTYPE: tl.constexpr):
    """``FP8``: ``a`` holds e4m3 codes with float32 scales ``as [rows, K / SCALE_K]`` and ``w`` e4m3 codes with
    scales ``s [E, N, K / SCALE_K]``; codes are exact in DTYPE, so each K tile's dot is the FP8 GEMM's exact sum
    of code products, scaled by the row's and the column's scale of its run of SCALE_K columns. ``OP_DTYPE``: the
    dot's operands, DTYPE, or for FP8 the e4m3 codes as loaded (no conversion)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if tl.load(sorted_ptr + pid_m * BLOCK_M) >= num_pairs:
        return  # a block of padding only (past the last expert's run)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + offs_m)  # [BLOCK_M] (token, slot) pair ids; num_pairs marks padding
    valid = pairs < num_pairs
    if A_BY_TOKEN:
        a_rows = pairs // TOP_K  # the token's row of x
    else:
        a_rows = pairs  # the pair's row of the intermediate
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None].to(tl.int64) * stride_am + offs_k[None, :],
                    mask=valid[:, None] & k_mask[None, :], other=0.0).to(OP_DTYPE)  # [BLOCK_M, BLOCK_K]
        w = _weight_tile(w_ptr, s_ptr, z_ptr, g_ptr, e, k0, offs_k, offs_n, k_mask, n_mask, K, stride_we, stride_wk,
                         stride_wn, stride_se, stride_sg, stride_sn, QUANT, GROUP, BLOCK_K, BLOCK_N, OP_DTYPE)
        if FP8:
            run = k0 // SCALE_K
            sa = tl.load(as_ptr + a_rows.to(tl.int64) * stride_asm + run, mask=valid, other=0.0)
            sw = tl.load(s_ptr + e * stride_se + run * stride_sg + offs_n * stride_sn, mask=n_mask, other=0.0)
            acc += tl.dot(a, w) * (sa[:, None] * sw[None, :])
        else:
            acc += tl.dot(a, w)
        if GATED:  # the up half of the same expert, same activations: one pass over K for both
            w_up = _weight_tile(w_ptr, s_ptr, z_ptr, g_ptr, e, k0, offs_k, offs_n + UP_OFFSET, k_mask, n_mask, K,
                                stride_we, stride_wk, stride_wn, stride_se, stride_sg, stride_sn, QUANT, GROUP,
                                BLOCK_K, BLOCK_N, OP_DTYPE)
            if FP8:
                sw_up = tl.load(s_ptr + e * stride_se + run * stride_sg + (offs_n + UP_OFFSET) * stride_sn,
                                mask=n_mask, other=0.0)
                acc_up += tl.dot(a, w_up) * (sa[:, None] * sw_up[None, :])
            else:
                acc_up += tl.dot(a, w_up)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up
    if MUL_ROUTED:
        rw = tl.load(topw_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
        acc = acc * rw[:, None]
    out = out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _contiguous_group(g_idx: torch.Tensor) -> int:
    """``G`` when every expert's ``g_idx [E, K]`` is ``arange(K) // G``, else 0 (the kernel gathers each row's
    group). Reads the tensor on the host: call it once, when the experts are stacked."""
    k = g_idx.shape[1]
    n_groups = int(g_idx[0].max()) + 1
    size = -(-k // n_groups)
    expected = torch.arange(k, device=g_idx.device, dtype=g_idx.dtype) // size
    return size if bool((g_idx == expected).all()) else 0


def _tile_group(group: int, block_k: int) -> int:
    """The kernel's ``GROUP``: the group size where it is a multiple of the K tile (one scale row a tile), else 0."""
    return group if group and group % block_k == 0 else 0


def _launch(a, ex_w, s, z, g, out, sorted_ids, block_expert, topw, pairs, n, k, up_offset, top_k, quant, gated,
            by_token, mul, block_m, block_n, block_k, group, num_warps, num_stages, a_scales=None, fp8_codes=False):
    """One of the two GEMMs. ``a_scales``: FP8 experts, ``a`` their e4m3 activation codes (``group``: the scales'
    run of input columns, 0 for one run; ``fp8_codes``: the dot on the codes as they are); else ``group`` is the
    4-bit experts' contiguous group size."""
    fp8 = a_scales is not None
    scale_k = (group or k) if fp8 else 1
    if quant:
        swe, swk, swn = ex_w.stride()  # [E, K/8, N]
        sse, ssg, ssn = s.stride()
    elif fp8:
        swe, swn, swk = ex_w.stride()  # [E, N, K]
        sse, ssn, ssg = s.stride()  # [E, N, G]
        z = g = ex_w  # unused
    else:
        swe, swn, swk = ex_w.stride()  # [E, N, K]
        sse = ssg = ssn = 0
        s = z = g = ex_w  # unused
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](a, ex_w, s, z, g, out, sorted_ids, block_expert, topw, a_scales if fp8 else topw, pairs, n,
                           k, up_offset, top_k, scale_k, a.stride(0), swe, swk, swn, sse, ssg, ssn, out.stride(0),
                           a_scales.stride(0) if fp8 else 0, QUANT=quant, GROUP=group if quant else 0, GATED=gated,
                           A_BY_TOKEN=by_token, MUL_ROUTED=mul, FP8=fp8, BLOCK_M=block_m,
                           BLOCK_N=block_n, BLOCK_K=block_k, DTYPE=_TL_DTYPE[out.dtype],
                           OP_DTYPE=tl.float8e4nv if fp8 and fp8_codes else _TL_DTYPE[out.dtype],
                           num_warps=num_warps, num_stages=num_stages)


# Which kernel serves a call, by (token, slot) pairs, where ``moe_gemv.applies`` (16-bit, FP8 with dynamic activation
# scales, or contiguous-group 4-bit experts, at most moe_gemv.MAX_PAIRS pairs); the tiled kernel serves everything else.
#   "gemv":  kernels/moe_gemv.py, one program per pair x N tile x slice of K (decode)
#   "tiles": this file's kernel, 16 pairs of one expert a program
# Measured (H100, Qwen3-30B-A3B shape, top-8 of 128; bench/results/bench_moe_kernel_h100_gemv.json and
# bench_qwen3-30b-a3b_h100_{gemv,tiles}.json, whole decode steps under each kernel forced, same machine):
#   4-bit experts, 8 pairs (batch 1): the MoE block 39.1 us against 87.9, the step 292 tok/s against 169;
#     64 pairs (batch 8): with the GEMV's first config the step lost (1,036 against 1,149 tok/s); with
#     moe_gemv.GEMV_CONFIGS' 64-pair row it wins, 1,234 against 1,131 (2026-12-06, one machine,
#     bench/results/bench_qwen3-30b-a3b_h100_{default,gemv}_ddd2f8b.json) -> the GEMV up to GEMV_MAX_PAIRS;
#   FP8 experts with per-channel scales (e4m3 rows read as [N, K]): the step 251 against 151 tok/s at batch 1 and
#     807 against 696 at batch 8 -> the GEMV wherever it applies (up to moe_gemv.MAX_PAIRS), for one-run scales;
#     block-scaled FP8 experts were not timed and stay tiled;
#   16-bit experts lose at both (bf16 steps 218 against 235 tok/s at batch 1, 557 against 717 at batch 8).
# QUANTKIT_MOE_DECODE=gemv|tiles forces one (where the GEMV applies).
DECODE_KERNELS = ("auto", "tiles", "gemv")
GEMV_MAX_PAIRS = 64  # 4-bit experts: batch 8 of top-8


def decode_kernel(experts: MoEExperts, pairs: int) -> str:
    """"gemv" or "tiles" for ``pairs`` (token, slot) pairs of ``experts`` (the table above)."""
    from quantkit.kernels import moe_gemv

    choice = ab_switch("QUANTKIT_MOE_DECODE", DECODE_KERNELS)
    if choice == "tiles" or not moe_gemv.applies(experts, pairs):
        return "tiles"
    if choice == "gemv":
        return "gemv"
    if experts.fp8:
        return "gemv" if experts.group13 == experts.group2 == 0 else "tiles"
    return "gemv" if experts.quantized and pairs <= GEMV_MAX_PAIRS else "tiles"


@dataclass(frozen=True)
class TileConfig:
    """The tiled kernel's tiles (both GEMMs): pair rows and output columns a program, warps, pipeline stages."""

    block_m: int = BLOCK_M
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3


# Tiles by weights and (token, slot) pairs: the first row whose weights match and whose pairs the call reaches;
# anything else takes TileConfig(). From bench_moe.py's kernel section (`prefill_tile_sweep`, CUDA-graph replays of
# fused_moe, Qwen3-30B-A3B shape, top-8 of 128, 4-bit experts, H100, 2026-12-06,
# bench/results/bench_moe_prefill_h100.json): taller tiles unpack each expert's 4-bit weights for more rows at once
#   2048 tokens (16,384 pairs, ~128 rows an expert): block_m 64, block_n 64: 1,015 us against 2,399 for TileConfig()
#   256 tokens (2,048 pairs, ~16 rows an expert): block_m 32, block_n 128: 418 us against 489
#     (at 2048 tokens this row gives 1,519 us, still under TileConfig()'s).
# 16-bit experts and FP8 experts converted to 16 bits were not swept. FP8 experts multiplied as codes (fp8_dot's
# default, "fp8-codes") take 64-row tiles at 2048 tokens, the least that Hopper's FP8 warpgroup MMA takes (below it
# Triton converts the codes for mma.sync): with them a 2048-token prefill of the whole 30B-A3B shape ran 21.8k
# against 13.4k tok/s (one H100, bench/results/bench_qwen3-30b-a3b_h100_{fp8codes,default}_f540fd9.json).
TILE_CONFIGS: tuple[tuple[str, int, TileConfig], ...] = (
    ("4bit", 16384, TileConfig(block_m=64, block_n=64)),
    ("4bit", 2048, TileConfig(block_m=32, block_n=128)),
    ("fp8-codes", 16384, TileConfig(block_m=64, block_n=64)),
)


def fp8_dot() -> str:
    """How the tiled kernel multiplies FP8 experts: "codes" (the e4m3 codes into the dot as they are: FP8 tensor
    cores on Hopper; the default, measured above) or "convert" (each K tile's codes to 16 bits, the 16-bit tensor
    cores: the path before), by the A/B switch ``QUANTKIT_MOE_FP8_DOT``."""
    return ab_switch("QUANTKIT_MOE_FP8_DOT", ("codes", "convert"))


def _dot_on_codes(experts: MoEExperts) -> bool:
    """Whether the tiled kernel's dots take ``experts``' e4m3 codes as they are (FP8 experts, :func:`fp8_dot`)."""
    return experts.fp8 and fp8_dot() == "codes"


def tile_config(experts: MoEExperts, pairs: int, aligned: bool = False) -> TileConfig:
    """TILE_CONFIGS' pick for ``pairs`` (token, slot) pairs of ``experts``; ``QUANTKIT_MOE_TILES=plain`` gives
    TileConfig() to every call (an A/B switch for the benches); FP8 experts multiplied as codes (:func:`fp8_dot`)
    take the "fp8-codes" rows. ``aligned``: the caller laid the pairs out already, at TileConfig()'s rows
    (``moe_align.BLOCK_M``), so those tiles."""
    if aligned or ab_switch("QUANTKIT_MOE_TILES", ("table", "plain")) == "plain":
        return TileConfig()
    kind = "fp8-codes" if _dot_on_codes(experts) else experts.kind
    return next((c for k, least, c in TILE_CONFIGS if k == kind and pairs >= least), TileConfig())


def fused_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts: MoEExperts,
              block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
              aligned: tuple | None = None, num_warps: int | None = None,
              num_stages: int | None = None, counters: torch.Tensor | None = None,
              parts: bool = False) -> torch.Tensor | RowParts:
    """The MoE block's routed output ``[T, H]`` (module docstring); ``x [T, H]`` in 16-bit (or float32).
    ``aligned``: ``moe_align``'s ``(sorted_ids, block_expert)`` for ``topk_ids`` at ``block_m``, where the caller
    made them already (``moe_align.route_and_align``, at ``BLOCK_M`` unless ``block_m`` says otherwise). The tiles,
    warps and pipeline stages apply to both GEMMs: ``tile_config``'s where not given (``bench/bench_moe.py``'s
    kernel section sweeps them). ``block_k`` defaults to 64, or for block-scaled FP8 experts to the largest of 64,
    32, 16 inside one scale block. ``counters``: the decode GEMV's (``moe_gemv.counters_for``), kept by the caller
    between calls. ``parts``: the routed outputs as ``RowParts`` (a token's k weighted expert rows, or the decode
    GEMV's slices), left for the caller's next add + RMSNorm to sum (``decoder_ops.add_rms_norm``: one launch
    fewer)."""
    if decode_kernel(experts, topk_ids.numel()) == "gemv":
        from quantkit.kernels.moe_gemv import moe_gemv

        return moe_gemv(x, topk_weights, topk_ids, experts, counters=counters, parts=parts)
    tiles = tile_config(experts, topk_ids.numel(), aligned=aligned is not None)
    block_m = tiles.block_m if block_m is None else block_m
    block_n = tiles.block_n if block_n is None else block_n
    num_warps = tiles.num_warps if num_warps is None else num_warps
    num_stages = tiles.num_stages if num_stages is None else num_stages
    if block_k is None:
        runs = [g for g in (experts.group13, experts.group2) if experts.fp8 and g]
        block_k = next((b for b in (64, 32, 16) if all(g % b == 0 for g in runs)), 64)
    t, h = x.shape
    k = topk_ids.shape[1]
    if h != experts.hidden:
        raise ValueError(f"x has {h} features, the experts {experts.hidden}")
    if experts.quantized and (experts.hidden % 8 or experts.inter % 8 or block_k % 8):
        raise ValueError("4-bit experts need hidden and intermediate sizes (and block_k) divisible by 8")
    if experts.fp8 and any(g and g % block_k for g in (experts.group13, experts.group2)):
        raise ValueError(f"block_k {block_k} must divide the FP8 scale blocks ({experts.group13}, {experts.group2})")
    x = x.contiguous()
    codes = _dot_on_codes(experts)
    sorted_ids, block_expert = aligned if aligned is not None else moe_align(topk_ids, experts.num_experts, block_m)
    pairs = t * k
    topw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    inter = torch.empty(pairs, experts.inter, dtype=x.dtype, device=x.device)
    q = experts.quantized
    if experts.fp8:  # the activations' e4m3 codes and scales, as the FP8 linears round them
        g13, g2 = experts.group13, experts.group2
        a13, as13 = quantize_activations(x, g13)
    else:
        g13, g2 = _tile_group(experts.group13, block_k), _tile_group(experts.group2, block_k)
        a13, as13 = x, None
    _launch(a13, experts.w13, experts.s13, experts.z13, experts.g13, inter, sorted_ids, block_expert, topw, pairs,
            experts.inter, h, experts.inter, k, q, True, True, False, block_m, block_n, block_k, g13, num_warps,
            num_stages, as13, codes)
    a2, as2 = quantize_activations(inter, g2) if experts.fp8 else (inter, None)
    out = torch.empty(pairs, h, dtype=torch.float32 if x.dtype == torch.float32 else x.dtype, device=x.device)
    _launch(a2, experts.w2, experts.s2, experts.z2, experts.g2, out, sorted_ids, block_expert, topw, pairs,
            h, experts.inter, 0, k, q, False, False, True, block_m, block_n, block_k, g2, num_warps, num_stages, as2,
            codes)
    if parts:  # summed by the next norm, in slot order, in float32, rounded once
        return RowParts(out.view(t, k, h), out.dtype)
    # one launch: a 16-bit sum accumulates in float32 and rounds once, as summing to float32 and casting would
    return out.view(t, k, h).sum(1)


def fused_moe_ref(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  experts: MoEExperts, act_quant=None) -> torch.Tensor:
    """Plain PyTorch: each routed expert in float32 on its tokens, weighted, summed into the token's row.
    ``act_quant``: applied to the inputs of gate/up and of down (FP8 experts: the activations' rounding)."""
    w13, w2 = experts.dequantized()
    inter = experts.inter
    q = act_quant if act_quant is not None else (lambda v: v)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.where(topk_ids == e)
        gu = q(x[tok].float()) @ w13[e].t()  # [t_e, 2I]
        h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        out.index_add_(0, tok, (q(h) @ w2[e].t()) * topk_weights[tok, slot, None].float())
    return out.to(x.dtype)
