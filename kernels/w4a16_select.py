"""Which W4A16 kernel and config serve a layer ("which kernel runs for this shape?"): a pure function of the
layer's :class:`LayerFacts`, the activation-row bucket and the GPU generation (and its name, for the entries
measured on one card), giving a :class:`KernelChoice`.
``prepare_w4a16_weights`` stores the choice for every bucket in a :class:`W4A16Plan`. Nothing is timed at run
time: the opt-in tuner ``bench/tune_w4a16.py`` writes the table read here.

1. :func:`w4a16_supports`: CUDA from sm_80, Triton, fp16/bf16 activations, 4- or 8-bit codes in contiguous
   groups of one length. Otherwise the plain-PyTorch reference.
2. Hopper, 4-bit, K a multiple of 128, groups a multiple of 8: the Gluon kernels (the GEMV for one row on small
   layers, :func:`_small_for_gluon`), config from the H200 table ``w4a16_h200.json``: the nearest measured
   shape (log2 N and log2 K), then nearest M bucket, whose config fits this layer.
   A ``cuda`` entry (the CUDA C++ decode GEMM, built with nvcc on first use), a ``cutlass`` one (prefill:
   CUTLASS's mixed-input GEMM, likewise), a ``dequant`` one (prefill: dequantize-then-cuBLAS) or a ``gluon`` one
   naming a card serves only the exact (N, K, M bucket) it was measured at, and an entry naming a ``card`` only on
   a GPU of that name (``card`` argument: ``device_info.gpu_card``), since a pick measured on one Hopper card need
   not win on another; a ``cuda`` or ``cutlass`` choice keeps the choice above as its ``fallback`` where nvcc or
   the build is missing.
3. Elsewhere, or where no entry fits, :func:`_by_rule`: 1-2 rows the CUDA-core GEMV (direct store up to
   ``GEMV_DIRECT_MAX_WEIGHTS``), more rows the paired-nibble kernel if it applies, else the general one. Their
   configs are H200 autotuning winners (bench/archive/NOTES_w4a16.md); no other GPU has been measured.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
from pathlib import Path

from quantkit.kernels.w4a16_configs import (
    PAIR_TILE_K,
    CudaConfig,
    CutlassConfig,
    DequantConfig,
    GemvConfig,
    GluonConfig,
    PairsConfig,
    TcConfig,
    codes_per_scale,
    config_from_dict,
    config_label,
    kernel_group_size,
)

TABLE_PATH = Path(__file__).with_name("w4a16_h200.json")
# Activation-row buckets: a call with M rows uses the plan of the next power of two (capped).
M_BUCKETS = tuple(2**i for i in range(13))  # 1 .. 4096
# Up to this many weights the GEMV stores its rows directly (one launch); above, it splits K with atomics.
GEMV_DIRECT_MAX_WEIGHTS = 1 << 24
# The paired Triton kernel splits K (float32 atomics) up to this many rows: its configs below carry BLOCK_M = M.
PAIRS_SPLIT_MAX_M = 64


@dataclasses.dataclass(frozen=True)
class LayerFacts:
    """What the selection reads of a layer; ``group_size`` as ``kernel_group_size`` encodes it, None if irregular."""

    n: int
    k: int
    bits: int
    group_size: int | None
    has_zeros: bool
    act_order: bool

    def __post_init__(self):
        if self.n < 1 or self.k < 1:
            raise ValueError(f"a layer has positive N and K, got {self.n} x {self.k}")

    @property
    def paired(self) -> bool:
        """The paired-nibble layout applies: 4-bit codes, K a multiple of the 128-code tile."""
        return self.bits == 4 and self.k % PAIR_TILE_K == 0

    @property
    def direct(self) -> bool:
        """The direct Gluon decode kernel can take it (whole K tiles per group): it gets a workspace."""
        return self.paired and self.group_size is not None and self.group_size % PAIR_TILE_K == 0


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """A kernel family ("gemv", "pairs", "tc", "gluon", "cuda", "dequant" or "reference"), its config (None:
    reference) and why; ``fallback``: what serves where this one cannot be built (a "cuda" choice's Triton
    kernel)."""

    kernel: str
    config: GemvConfig | PairsConfig | TcConfig | GluonConfig | CudaConfig | CutlassConfig | DequantConfig | None
    reason: str
    fallback: KernelChoice | None = None

    def label(self) -> str:
        return self.kernel if self.config is None else f"{self.kernel} {config_label(self.config)}"


@dataclasses.dataclass(frozen=True)
class W4A16Plan:
    """The choice for each M bucket of one layer on one GPU generation (``arch``, e.g. "sm90") and card (its name,
    for the table's card-specific entries; None: none of those)."""

    arch: str
    choices: tuple[tuple[int, KernelChoice], ...]
    card: str | None = None

    def choice(self, m: int) -> KernelChoice:
        bucket = m_bucket(m)
        for b, c in self.choices:
            if b == bucket:
                return c
        raise KeyError(f"no plan for M = {m}")


def m_bucket(m: int) -> int:
    """The next power of two at or above ``m``, capped at the largest bucket."""
    return min(1 << max(m - 1, 0).bit_length(), M_BUCKETS[-1])


def _arch_at_least(arch: str, major: int) -> bool:
    return arch.startswith("sm") and int(arch[2:-1] or 0) >= major


def w4a16_supports(facts: LayerFacts, arch: str | None, dtype=None) -> tuple[bool, str]:
    """Whether a W4A16 kernel can serve ``facts`` on ``arch`` (None: not a CUDA device) with activations of
    ``dtype`` (a torch dtype, or None to leave it out): ``(True, "")`` or ``(False, reason)``."""
    if arch is None:
        return False, "input is not on a CUDA device"
    if not _arch_at_least(arch, 8):
        return False, f"needs an sm_80 or newer GPU, this one is {arch}"
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    if dtype is not None and str(dtype) not in ("torch.float16", "torch.bfloat16"):
        return False, f"activations are {dtype}, the kernels take float16/bfloat16"
    if facts.bits not in (4, 8):
        return False, f"{facts.bits}-bit codes are not supported (4 or 8)"
    if facts.group_size is None:
        return False, "groups are not contiguous runs of one length"
    return True, ""


def _gluon_supports(facts: LayerFacts, arch: str | None) -> bool:
    """Whether the Hopper Gluon kernel can take the layer (sm_90, paired layout, groups a multiple of 8)."""
    return arch == "sm90" and facts.paired and facts.group_size is not None and facts.group_size % 8 == 0


@functools.cache
def load_table() -> tuple[dict, ...]:
    """The entries of the shipped H200 table, each with its config built."""
    with open(TABLE_PATH) as f:
        data = json.load(f)
    return tuple(dict(e, config=config_from_dict(e["kernel"], e["config"])) for e in data["entries"])


def select_w4a16(m: int, facts: LayerFacts, arch: str | None, card: str | None = None) -> KernelChoice:
    """The kernel and config for ``m`` activation rows (its bucket) of the layer ``facts`` on ``arch`` (and the
    GPU named ``card``, which only the table's card-specific entries read)."""
    ok, reason = w4a16_supports(facts, arch)
    if not ok:
        return KernelChoice("reference", None, reason)
    bucket = m_bucket(m)
    choice = None
    if _gluon_supports(facts, arch):
        kernel = "gemv" if _small_for_gluon(bucket, facts) else "gluon"
        choice = _from_table(bucket, facts, load_table(), kernel)
    choice = choice or _by_rule(bucket, facts, arch)
    return _measured_exact(bucket, facts, arch, card, load_table(), choice) or choice


def _measured_exact(bucket: int, facts: LayerFacts, arch: str, card: str | None, table,
                    fallback: KernelChoice) -> KernelChoice | None:
    """A ``cuda``, ``cutlass`` or ``dequant`` entry, or a ``gluon`` one naming a card, measured at exactly this
    layer's (N, K) and bucket on this table's GPU generation, and on this card where the entry names one (a ``cuda``
    or ``cutlass`` one with ``fallback``: what serves where its nvcc build is missing); None where there is none."""
    if arch != "sm90":
        return None
    for e in table:
        if (e["n"], e["k"], e["m"]) != (facts.n, facts.k, bucket) or e.get("card", card) != card:
            continue
        source = f"{e.get('card', 'H200 table')}, measured ({e.get('source', '')})"
        if e["kernel"] == "cuda" and e["config"].fits(bucket, facts.group_size or 1) and facts.bits == 4 \
                and facts.paired:
            return KernelChoice("cuda", e["config"], source, fallback)
        if e["kernel"] == "dequant":
            return KernelChoice("dequant", e["config"], source)
        if e["kernel"] == "cutlass" and facts.bits == 4 and facts.group_size is not None \
                and e["config"].fits(bucket, codes_per_scale(facts.group_size, facts.k)):
            return KernelChoice("cutlass", e["config"], source, fallback)
        if e["kernel"] == "gluon" and "card" in e and _gluon_supports(facts, arch) \
                and _fits("gluon", e["config"], bucket, facts):
            return KernelChoice("gluon", e["config"], source)
    return None


@functools.lru_cache(maxsize=4096)
def plan_w4a16(facts: LayerFacts, arch: str | None, card: str | None = None) -> W4A16Plan | None:
    """The choice for every M bucket (None off CUDA); memoized, so layers of one shape share one plan."""
    if arch is None:
        return None
    return W4A16Plan(arch, tuple((b, select_w4a16(b, facts, arch, card)) for b in M_BUCKETS), card)


def _fits(kernel: str, config, bucket: int, facts: LayerFacts) -> bool:
    """Whether ``config`` serves every M of ``bucket`` on this layer."""
    lo = bucket // 2 + 1 if bucket > 1 else 1
    if kernel == "gluon":
        if config.DIRECT and not facts.direct:
            return False
        return config.fits(lo, facts.group_size) and config.fits(bucket, facts.group_size)
    if kernel == "gemv":
        return bucket <= 2 and _gemv_block_k_ok(config.BLOCK_K, facts.group_size) and (
            (config.SPLIT_K == 1) == (facts.n * facts.k <= GEMV_DIRECT_MAX_WEIGHTS))
    if kernel == "pairs":
        return facts.paired
    return kernel == "tc"


def _from_table(bucket: int, facts: LayerFacts, table, kernel: str) -> KernelChoice | None:
    """The nearest measured entry of ``kernel`` (shape, then M bucket) whose config fits, or None."""

    def distance(e):
        shape = abs(math.log2(e["n"] / facts.n)) + abs(math.log2(e["k"] / facts.k))
        return shape, abs(math.log2(e["m"] / bucket)), e["m"] > bucket

    # an entry naming a card serves that card's exact cell alone (_measured_exact), never as a nearest shape
    for e in sorted((e for e in table if e["kernel"] == kernel and "card" not in e), key=distance):
        if _fits(kernel, e["config"], bucket, facts):
            exact = (e["n"], e["k"], e["m"]) == (facts.n, facts.k, bucket)
            where = "measured" if exact else f"nearest measured: {e['n']}x{e['k']} at M={e['m']}"
            return KernelChoice(e["kernel"], e["config"], f"H200 table, {where} ({e.get('source', '')})")
    return None


def _gemv_block_k_ok(block_k: int, group_size: int) -> bool:
    """A GEMV K tile either lies inside one group or covers whole groups."""
    return group_size % block_k == 0 or block_k % group_size == 0


def _by_rule(bucket: int, facts: LayerFacts, arch: str) -> KernelChoice:
    weights = facts.n * facts.k
    # two rows: the GEMV only where the paired kernel cannot take the layer, or below 32 M weights
    gemv_ok = bucket == 1 or (bucket == 2 and (not facts.paired or weights < 1 << 25))
    if _gluon_supports(facts, arch) and not _small_for_gluon(bucket, facts):
        return KernelChoice("gluon", _gluon_default(bucket, facts), "rule: Hopper, no table entry fits")
    if gemv_ok:
        direct = weights <= GEMV_DIRECT_MAX_WEIGHTS
        for block_k in (512, 256, 128, 64, 32):
            if _gemv_block_k_ok(block_k, facts.group_size):
                if direct:
                    config = GemvConfig(8, block_k, 4, PIPE=3, SPLIT_K=1)
                else:
                    config = GemvConfig(128, min(block_k, 128), 4)  # the split-K winner on every measured shape
                return KernelChoice("gemv", config, f"rule: {bucket} row(s), {'direct' if direct else 'split K'}")
    if facts.paired:
        if bucket <= 16:
            config = PairsConfig(128, 16, 4, 3)  # the measured decode winner
        elif bucket <= PAIRS_SPLIT_MAX_M:
            config = PairsConfig(128, bucket, 4, 3)
        else:
            config = PairsConfig(128, 128, 8, 3)  # the measured prefill winner
        return KernelChoice("pairs", config, "rule: paired-nibble layout")
    if bucket <= 16:
        config = TcConfig(64, 16, 256, 4, 3)
    else:
        config = TcConfig(128, 128, 64, 8, 4, W_IS_A=False)
    return KernelChoice("tc", config, f"rule: {facts.bits}-bit codes, K = {facts.k}")


def _small_for_gluon(bucket: int, facts: LayerFacts) -> bool:
    """One row on a layer where the GEMV beats the Gluon kernels on Hopper: under 4 M weights where the direct
    kernel can take it, else under 32 M (bench/archive/NOTES_w4a16.md)."""
    return bucket == 1 and facts.n * facts.k < (1 << 22 if facts.direct else 1 << 25)


def _gluon_default(bucket: int, facts: LayerFacts) -> GluonConfig:
    if bucket <= 16:
        return GluonConfig(128, 16, 4, 4, 2, X_BOX_K=64)
    if bucket <= 64:
        return GluonConfig(128, 64, 6, 8, WGMMA=True, STREAM_K=True)
    return GluonConfig(256, 128, 4, 8, WGMMA=True, STREAM_K=False)


def facts_of(n: int, k: int, bits: int, group_size: int | None, sym: bool, act_order: bool) -> LayerFacts:
    """LayerFacts from checkpoint-level facts (``group_size`` -1 for per channel, as a checkpoint stores it)."""
    group = None if group_size is None else kernel_group_size(group_size, k)
    return LayerFacts(n, k, bits, group, has_zeros=not sym, act_order=act_order)
