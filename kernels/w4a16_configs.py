"""Launch configurations of the W4A16 kernels: one frozen dataclass per kernel family.

No Triton here, so the selection table, ``explain`` and the CPU tests read configs without a compiler. Field
names are the kernels' constexpr names, except grid-only ones (``PROGS_PER_SM``, ``SPLIT_K``, ``CTAS_PER_SM``).
Families: ``gemv`` (CUDA-core GEMV, 1-2 rows), ``pairs`` (paired-nibble tensor-core, 4-bit, K a multiple of 128),
``tc`` (general tensor-core), ``gluon`` (Hopper; ``DIRECT``: the ring-less decode kernel), ``cuda`` (the CUDA C++
decode GEMM of ``w4a16_cuda.py``, built with nvcc on first use), ``dequant`` (prefill: the weights dequantized to 16
bits by one Triton kernel, then cuBLAS; ``w4a16_dequant.py``), ``cutlass`` (prefill on Hopper: CUTLASS's
mixed-input GEMM, ``w4a16_cutlass.py``, built with nvcc on first use; no table entry yet).
"""

from __future__ import annotations

import dataclasses

# The paired-nibble kernels' K tile: 16 words of 8 codes.
PAIR_TILE_K = 128
# The direct decode kernel's activation rows at most (its stream-K workspace holds this many).
DIRECT_MAX_M = 8
# Per-channel groups (``-1`` in a checkpoint) as the kernels see them: larger than any K, so every K tile lies
# inside one group. The only spelling past :func:`kernel_group_size`.
PER_CHANNEL_GROUP = 1 << 30

_WORDS = PAIR_TILE_K // 8  # int32 words of one K tile
_DOT_K = 32  # K of one mma / wgmma step


def kernel_group_size(group_size: int, in_features: int) -> int:
    """The group length the kernels index with: ``group_size``, or PER_CHANNEL_GROUP for ``-1`` / ``>= K``."""
    return PER_CHANNEL_GROUP if group_size == -1 or group_size >= in_features else group_size


def codes_per_scale(group_size: int, in_features: int) -> int:
    """The codes one scale covers, for a kernel that takes the group as a length (CUTLASS's): ``group_size``, or
    ``in_features`` where it is PER_CHANNEL_GROUP (:func:`kernel_group_size`'s per-channel spelling)."""
    return in_features if group_size == PER_CHANNEL_GROUP else group_size


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """The W4A16 GEMV (the 16-bit GEMV's is ``gemv.DenseGemvConfig``): BLOCK_N output rows x BLOCK_K codes per
    step, PIPE loads in flight; PROGS_PER_SM sizes the K split (SPLIT_K fixes it; 1: no split, direct store)."""

    BLOCK_N: int
    BLOCK_K: int
    num_warps: int = 4
    PIPE: int = 1
    PROGS_PER_SM: int = 8
    SPLIT_K: int | None = None

    def __post_init__(self):
        if self.BLOCK_N < 1 or self.BLOCK_K < 8 or self.PIPE < 1:
            raise ValueError(f"bad GEMV config {self}")

    def fits(self, m: int, group_size: int) -> bool:
        """BLOCK_K divides the group or covers whole groups, and the tile fits a thread's registers: at most 256
        codes a thread (128 from two rows on: the tile spills otherwise) and 2048 products."""
        block_m = _next_pow2(m)
        codes = self.BLOCK_N * self.BLOCK_K // (32 * self.num_warps)
        block_k_ok = group_size % self.BLOCK_K == 0 or self.BLOCK_K % group_size == 0
        return block_k_ok and codes <= (256 if block_m == 1 else 128) and block_m * codes <= 2048


@dataclasses.dataclass(frozen=True)
class PairsConfig:
    """Paired-nibble tensor-core kernel: BLOCK_N weight rows x BLOCK_M activation rows per tile."""

    BLOCK_N: int
    BLOCK_M: int
    num_warps: int = 4
    num_stages: int = 3
    PROGS_PER_SM: int = 4
    GROUP_N: int = 8
    SPLIT_K: int | None = None

    def __post_init__(self):
        if self.BLOCK_M < 16 or self.BLOCK_N < 16:
            raise ValueError(f"tensor-core tiles are at least 16 x 16, got {self}")


@dataclasses.dataclass(frozen=True)
class TcConfig:
    """General tensor-core kernel. W_IS_A: the dequantized weight tile is wgmma's A operand (``W X^T``), else B."""

    BLOCK_N: int
    BLOCK_M: int
    BLOCK_K: int
    num_warps: int = 4
    num_stages: int = 2
    GROUP_N: int = 8
    W_IS_A: bool = True
    SPLIT_K: int | None = None

    def __post_init__(self):
        if self.BLOCK_M < 16 or self.BLOCK_N < 16 or self.BLOCK_K < 16:
            raise ValueError(f"tensor-core tiles are at least 16 x 16 x 16, got {self}")


@dataclasses.dataclass(frozen=True)
class GluonConfig:
    """A launch configuration of the Hopper Gluon kernels (:mod:`quantkit.kernels.w4a16_gluon`).

    * BLOCK_N weight rows x BLOCK_M activation rows per tile, NUM_BUF ring stages, num_warps consumer warps
      (the producer warp adds a mostly idle warpgroup).
    * WGMMA: wgmma (prefill) instead of mma.sync (decode: BLOCK_M 16, 8 whenever M <= 8, 16 weight rows a
      warp); wgmma takes 64 weight rows per warpgroup.
    * STREAM_K: one activation tile's units split evenly over ``num_SMs * CTAS_PER_SM`` programs; all must be
      resident at once, so CTAS_PER_SM sets the register cap (:meth:`maxnreg`). PERSISTENT: as many
      programs, each taking every n-th tile whole. Neither: one program per tile.
    * X_BOX_K: activation columns per TMA box, 32 (64-byte swizzle) or 64 (128-byte swizzle).
    * DIRECT: the ring-less mma.sync stream-K kernel. GATHER_X (DIRECT only): read column-gathered activations,
      as the ring kernel and act-order weights always do. UNROLL (DIRECT only): 2 units a loop iteration.
    """

    BLOCK_N: int
    BLOCK_M: int
    NUM_BUF: int
    num_warps: int = 4
    CTAS_PER_SM: int = 1
    WGMMA: bool = False
    STREAM_K: bool = True
    GROUP_N: int = 8
    PERSISTENT: bool = False
    X_BOX_K: int = 32
    DIRECT: bool = False
    GATHER_X: bool = False
    UNROLL: int = 1

    def __post_init__(self):
        if self.X_BOX_K not in (32, 64):  # the swizzle is 2 * X_BOX_K bytes: 64 or 128
            raise ValueError(f"X_BOX_K must be 32 or 64, got {self.X_BOX_K}")
        if self.DIRECT and (self.WGMMA or not self.STREAM_K or self.PERSISTENT or self.BLOCK_N < 16 * self.num_warps):
            raise ValueError("DIRECT configs are mma.sync stream-K with at least 16 weight rows a warp")
        if self.GATHER_X and not self.DIRECT:
            raise ValueError("GATHER_X applies to DIRECT configs only (the ring kernel always gathers)")
        if self.UNROLL not in (1, 2) or (self.UNROLL == 2 and not self.DIRECT):
            raise ValueError("UNROLL is 1, or 2 for DIRECT configs")

    def block_m(self, m: int) -> int:
        return 8 if (not self.WGMMA and m <= 8) else self.BLOCK_M

    def _smem_bytes(self, m: int) -> int:
        if self.DIRECT:
            return 1024
        return self.NUM_BUF * (self.BLOCK_N * _WORDS * 4 + 4 * self.block_m(m) * _DOT_K * 2) + 1024

    def maxnreg(self) -> int:
        threads = (self.num_warps + (0 if self.DIRECT else 4)) * 32  # the producer's warpgroup counts whole
        return min(255, 65536 // (self.CTAS_PER_SM * threads) // 8 * 8)  # Hopper: 64 K registers an SM

    def fits(self, m: int, group_size: int) -> bool:
        """Shared memory and registers for CTAS_PER_SM programs per SM, and a tile that suits M."""
        if self.CTAS_PER_SM * self._smem_bytes(m) > 228 * 1024:  # Hopper's shared memory an SM
            return False
        # per-word scales (groups under 128) need more registers: under 80 the decode warps spill
        if self.maxnreg() < (80 if group_size % PAIR_TILE_K else 64):
            return False
        # the direct kernel: one group per K tile and up to 8 activation rows (with 16 its sm_90 compile spills)
        if self.DIRECT and (group_size % PAIR_TILE_K or m > DIRECT_MAX_M):
            return False
        if self.WGMMA:
            return self.BLOCK_M <= max(64, _next_pow2(m)) and (not self.STREAM_K or m <= self.BLOCK_M)
        # mma.sync: one activation tile, not more than twice as tall as M (16 is the smallest)
        return m <= self.BLOCK_M and (self.BLOCK_M <= 16 or 2 * m > self.BLOCK_M)


@dataclasses.dataclass(frozen=True)
class CudaConfig:
    """The CUDA C++ decode GEMM (:mod:`quantkit.kernels.w4a16_cuda`, M <= 16, groups a multiple of 128): R blocks of
    16 output rows a warp, U K tiles of 128 loaded per batch (2 * R * U 16-byte loads of words in flight a thread),
    W warps a CTA splitting K, SPLITS CTAs a row tile (None: enough to fill the SMs once), L2_256: the L2::256B
    prefetch hint on the weight loads."""

    R: int = 2
    U: int = 2
    W: int = 4
    SPLITS: int | None = None
    L2_256: bool = False

    def __post_init__(self):
        if self.R not in (1, 2, 4) or self.U not in (1, 2, 4) or self.W not in (1, 2, 4, 8):
            raise ValueError(f"bad CUDA decode config {self}: R and U in 1, 2, 4; W in 1, 2, 4, 8")
        if self.SPLITS is not None and self.SPLITS < 1:
            raise ValueError(f"SPLITS must be positive or None, got {self.SPLITS}")

    def fits(self, m: int, group_size: int) -> bool:
        """Up to 16 activation rows, one group per K tile (or per channel)."""
        return 1 <= m <= CUDA_MAX_M and group_size % PAIR_TILE_K == 0


# The CUDA decode GEMM's activation rows at most (two n8 tiles of mma.sync).
CUDA_MAX_M = 16


@dataclasses.dataclass(frozen=True)
class DequantConfig:
    """Dequantize-then-cuBLAS (:mod:`quantkit.kernels.w4a16_dequant`): the 16-bit ``[N, K]`` weight written by
    one Triton kernel in tiles of BLOCK_N rows x BLOCK_K codes, then one cuBLAS GEMM. It pays only where the GEMM
    is long enough to hide writing and re-reading the 16-bit weight (large M)."""

    BLOCK_N: int = 64
    BLOCK_K: int = 256
    num_warps: int = 4

    def __post_init__(self):
        if self.BLOCK_N < 1 or self.BLOCK_K < 8 or self.BLOCK_K % 8:
            raise ValueError(f"bad dequantize config {self}: BLOCK_K a multiple of 8")

    def fits(self, m: int, group_size: int) -> bool:
        """Any rows, any contiguous groups."""
        return m >= 1


@dataclasses.dataclass(frozen=True)
class CutlassConfig:
    """The CUTLASS prefill GEMM (:mod:`quantkit.kernels.w4a16_cutlass`, Hopper, built with nvcc on first use):
    TILE_N weight rows x TILE_M activation rows a CTA tile (K tile 64), CLUSTER_N CTAs a cluster along the weight
    rows (they share each activation box by TMA multicast), PINGPONG: two consumer warpgroups on two tiles (else
    both on one, which needs TILE_N >= 128)."""

    TILE_N: int = 128
    TILE_M: int = 128
    CLUSTER_N: int = 1
    PINGPONG: bool = False

    def __post_init__(self):
        if self.TILE_N not in (64, 128, 256) or self.TILE_M not in (64, 128, 256) or self.CLUSTER_N not in (1, 2):
            raise ValueError(f"bad CUTLASS config {self}: tiles of 64, 128 or 256; CLUSTER_N 1 or 2")
        if not self.PINGPONG and self.TILE_N < 128:
            raise ValueError(f"bad CUTLASS config {self}: the cooperative schedule splits TILE_N over two warpgroups")

    def fits(self, m: int, group_size: int) -> bool:
        """Any number of activation rows; groups a multiple of the 64-code K tile (or per channel)."""
        return m >= 1 and group_size % CUTLASS_TILE_K == 0


# The CUTLASS prefill GEMM's K tile (128 bytes of 16-bit activations a row).
CUTLASS_TILE_K = 64

CONFIG_TYPES = {"gemv": GemvConfig, "pairs": PairsConfig, "tc": TcConfig, "gluon": GluonConfig, "cuda": CudaConfig,
                "dequant": DequantConfig, "cutlass": CutlassConfig}


def config_from_dict(kernel: str, fields: dict):
    """The config of ``kernel`` ("gemv", "pairs", "tc", "gluon") with ``fields`` (as the JSON table stores it)."""
    if kernel not in CONFIG_TYPES:
        raise ValueError(f"unknown W4A16 kernel {kernel!r}; known: {', '.join(CONFIG_TYPES)}")
    return CONFIG_TYPES[kernel](**fields)


def config_to_dict(config) -> dict:
    """The fields of ``config`` that differ from their defaults (the JSON table's form)."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.default is dataclasses.MISSING or value != f.default:
            out[f.name] = value
    return out


def config_label(config) -> str:
    """A short readable form, e.g. ``GluonConfig(128x16, NUM_BUF=4, CTAS_PER_SM=4, X_BOX_K=64)``."""
    fields = config_to_dict(config)
    if isinstance(config, CudaConfig):
        fields = dataclasses.asdict(config)
        return f"CudaConfig({', '.join(f'{k}={v}' for k, v in fields.items())})"
    if isinstance(config, CutlassConfig):
        fields = dataclasses.asdict(config)
        head = [f"{fields.pop('TILE_N')}x{fields.pop('TILE_M')}"]
    else:
        # the tile's two sides even where they are the defaults (DequantConfig()), the rest where they differ
        tile = dataclasses.asdict(config)
        second = "BLOCK_M" if "BLOCK_M" in tile else "BLOCK_K"
        head = [f"{tile['BLOCK_N']}x{tile[second]}"]
        fields = {k: v for k, v in fields.items() if k not in ("BLOCK_N", second)}
    return f"{type(config).__name__}({', '.join(head + [f'{k}={v}' for k, v in fields.items()])})"
