"""W4A16 GEMM in Gluon (`triton.experimental.gluon`) for Hopper: ``Y = X W^T``, decode and prefill.

Why Gluon: Triton waits for each register-operand wgmma before its registers are rewritten (so dequantization
and multiply never overlap) and pipelines loads only a few tiles deep (bench/archive/NOTES_w4a16.md). Gluon places both.

* Paired nibbles (``w4a16_weights._paired_nibble_index``): a packed word shifted right by 4j has codes j and
  j + 4 at bits 0 and 16; one ``lop3`` makes them a pair of 16-bit floats ``MAGIC + code``, one packed
  subtraction and one packed multiply dequantize both, and that register *is* a tensor-core A-operand register.
  A 128-code K tile is four dots of K = 32; the activations are gathered into the matching column order.
* The words are read in the 32-bit A-operand layout (``k_width=1``): thread (g, t) holds words t, t + 4, t + 8,
  t + 12 of rows g and g + 8 of each 16-row block, which is where their pairs sit in the 16-bit A operand of a
  K = 32 dot (``k_width=2``): the conversion is register renaming.
* Ring kernel (:func:`_w4a16_gluon_kernel`): a producer warp (``gl.warp_specialize``) TMAs the weight words
  (64-byte swizzle: conflict-free reads) and activation tiles through NUM_BUF shared-memory stages, each with a
  "ready" and an "empty" mbarrier; the dequantizing warps never load or wait on a CTA-wide barrier. It runs
  under programmatic dependent launch behind ``w4a16_triton._gather_columns`` (gather, workspace zeroing,
  K-tile activation sums) and requests weights before that kernel ends.
* Decode (``WGMMA=False``; M <= 16, a candidate up to 64): ``mma.sync`` m16n8k16, weights as A. Its register
  operands have plain scoreboard dependencies, so dequantizing one dot overlaps the previous MMA with no wait;
  the activation rows are the n = 8 side (M <= 8 wastes nothing). Stream-K: units are (output tile, K tile);
  each of ``num_SMs * CTAS_PER_SM`` programs takes an equal contiguous run (no tail wave); partial tiles meet
  in a float32 workspace (:func:`_flush`). With one group per K tile, zero point and scale go onto each K
  tile's float32 sums instead of every code pair (:func:`_magic_pairs`).
* Prefill (``WGMMA=True``): async wgmma, dequantized A from registers (two warpgroups of 64 or 128 rows),
  activations as B from shared memory; dot j + 1 is dequantized while dot j runs (``warpgroup_mma_wait(1)``).
  One output tile per program (grouped order for L2 reuse), stored once.
* Direct decode (``DIRECT`` configs, M <= 8, one group per K tile; :func:`_w4a16_direct_kernel`): no ring;
  every warp loads its own operands, one unit ahead, from the caller's activations: one launch, no gather
  (act-order weights and ``GATHER_X`` read gathered ones). Partial tiles meet in the layer's
  ``W4A16Weights.partial_sums`` / ``tile_counters``. Faster than the ring up to ~60 M weights.

Scope: 4-bit, K a multiple of 128 (``pair_index`` set), contiguous groups of a multiple of 8 (per channel too),
sym or asym, act-order through ``pair_index``, fp16/bf16, sm_90; GPU only (Gluon has no interpreter path).

Modules: this one holds the launchers (:func:`w4a16_gluon_matmul`, :func:`launch`); the ring kernel is in
:mod:`quantkit.kernels.w4a16_gluon_ring`, the direct decode kernel in :mod:`quantkit.kernels.w4a16_gluon_direct`,
the device helpers both share (constants, dequantization, mma.sync unit, flush) in
:mod:`quantkit.kernels.w4a16_gluon_common`.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from quantkit.kernels.device_info import gpu_arch, num_sms
from quantkit.kernels.w4a16_configs import DIRECT_MAX_M, PAIR_TILE_K, GluonConfig
from quantkit.kernels.w4a16_gluon_common import _WORDS
from quantkit.kernels.w4a16_gluon_direct import _w4a16_direct_kernel
from quantkit.kernels.w4a16_gluon_ring import _w4a16_gluon_kernel
from quantkit.kernels.w4a16_select import _gluon_supports
from quantkit.kernels.w4a16_triton import _gather_columns
from quantkit.kernels.w4a16_weights import W4A16Weights

__all__ = ["w4a16_gluon_matmul"]


def w4a16_gluon_matmul(x: torch.Tensor, w: W4A16Weights, config: GluonConfig) -> torch.Tensor:
    """``x [M, K]`` -> ``x @ W^T`` through the Gluon kernel ``config`` selects (see the module docstring)."""
    if not (x.is_cuda and _gluon_supports(w.facts(), gpu_arch(x.device)) and w.pair_index is not None
            and x.dtype in (torch.float16, torch.bfloat16)):
        raise ValueError("the Gluon W4A16 kernel needs a Hopper GPU, fp16/bf16 activations and 4-bit weights "
                         f"with K a multiple of {PAIR_TILE_K} and groups of a multiple of 8")
    if not config.fits(x.shape[0], w.group_size):
        raise ValueError(f"{config} does not fit M = {x.shape[0]}, group {w.group_size} "
                         "(shared memory, registers or tile)")
    return launch(x, w, config)


def launch(x: torch.Tensor, w: W4A16Weights, config: GluonConfig) -> torch.Tensor:
    """The launch itself, for inputs and a config already checked (by :func:`w4a16_gluon_matmul`, or at load by
    the selection that bound it: :func:`quantkit.kernels.w4a16.bind_launcher`)."""
    if config.DIRECT:
        return _launch_direct(x, w, config)
    m, k = x.shape
    n = w.out_features
    block_m = config.block_m(m)
    k_tiles = k // PAIR_TILE_K
    tiles_n, tiles_m = triton.cdiv(n, config.BLOCK_N), triton.cdiv(m, block_m)
    stream_k = config.STREAM_K and tiles_m == 1
    persistent = config.PERSISTENT and not stream_k
    # the gather also zeroes, for stream-K, the float32 workspace [M, N] and the tile counters behind it
    ws = torch.empty(m * n + tiles_n if stream_k else 0, device=x.device, dtype=torch.float32)
    # and, for the mma.sync path with one group per K tile, each K tile's activation sums (_magic_pairs)
    xsum = None
    if not config.WGMMA and w.group_size % PAIR_TILE_K == 0:
        xsum = torch.empty((m, k_tiles), device=x.device, dtype=torch.float32)
    xp = _gather_columns(x, w.pair_index, ws, xsum)
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if stream_k:
        tile_units = ws[m * n:].view(torch.int32)  # zero bits are int32 zeros
        grid = (min(tiles_n * k_tiles, num_sms(x.device) * config.CTAS_PER_SM),)
    else:
        ws, tile_units = out, out  # unused
        grid = (tiles_n * tiles_m,)
        if persistent:
            grid = (min(tiles_n * tiles_m, num_sms(x.device) * config.CTAS_PER_SM),)
    zeros = w.zeros if w.zeros is not None else w.scales  # dummy pointer when symmetric
    desc_w = TensorDescriptor(w.qweight, [n, k // 8], [w.qweight.stride(0), 1], [config.BLOCK_N, int(_WORDS)],
                              _swizzled_layout(64, 32))
    desc_x = TensorDescriptor(xp, [m, k], [xp.stride(0), 1], [block_m, config.X_BOX_K],
                              _swizzled_layout(2 * config.X_BOX_K, 16))
    _w4a16_gluon_kernel[grid](desc_w, desc_x, w.scales, zeros, xsum if xsum is not None else ws, out, ws, tile_units,
                              m, n, k_tiles, tiles_n,
                              tiles_m, w.scales.stride(0), zeros.stride(0),
                              GROUP_SIZE=w.group_size, HAS_ZEROS=w.zeros is not None, BLOCK_N=config.BLOCK_N,
                              BLOCK_M=block_m, GROUP_N=config.GROUP_N, NUM_BUF=config.NUM_BUF,
                              WGMMA=config.WGMMA, ATOMIC_OUT=stream_k, PERSISTENT=persistent,
                              num_warps=config.num_warps,
                              maxnreg=config.maxnreg(), launch_pdl=True)
    return out


def _launch_direct(x: torch.Tensor, w: W4A16Weights, config: GluonConfig) -> torch.Tensor:
    """:func:`_w4a16_direct_kernel`, behind the column gather for act-order weights or GATHER_X."""
    m, k = x.shape
    n = w.out_features
    if w.tile_counters is None or w.partial_sums is None or w.partial_sums.numel() < m * n:
        raise ValueError("the direct W4A16 kernel needs the layer's zeroed stream-K workspace (M <= "
                         f"{DIRECT_MAX_M}): prepare the weights with prepare_w4a16_weights")
    block_m = config.block_m(m)
    k_tiles = k // PAIR_TILE_K
    tiles_n = triton.cdiv(n, config.BLOCK_N)
    gathered = w.perm is not None or config.GATHER_X
    if gathered:
        xsum = torch.empty((m, k_tiles), device=x.device, dtype=torch.float32)
        x = _gather_columns(x, w.pair_index, None, xsum)
    else:
        x = x if x.stride(1) == 1 else x.contiguous()
        xsum = w.partial_sums  # unused
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    zeros = w.zeros if w.zeros is not None else w.scales  # dummy pointer when symmetric
    grid = (min(tiles_n * k_tiles, num_sms(x.device) * config.CTAS_PER_SM),)
    _w4a16_direct_kernel[grid](w.qweight, x, w.scales, zeros, xsum, out, w.partial_sums, w.tile_counters, m, n,
                               k_tiles, tiles_n, w.qweight.stride(0), x.stride(0), w.scales.stride(0),
                               zeros.stride(0), GROUP_SIZE=w.group_size, HAS_ZEROS=w.zeros is not None,
                               BLOCK_N=config.BLOCK_N, BLOCK_M=block_m, GATHERED=gathered, UNROLL=config.UNROLL,
                               num_warps=config.num_warps, maxnreg=config.maxnreg(), launch_pdl=True)
    return out


@functools.cache
def _swizzled_layout(swizzle_bytes: int, bits: int) -> gl.NVMMASharedLayout:
    """A 2-D TMA/MMA shared layout, cached: building one validates, costing host time on every decode call."""
    return gl.NVMMASharedLayout(swizzle_byte_width=swizzle_bytes, element_bitwidth=bits, rank=2)
