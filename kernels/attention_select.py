"""Which attention kernel serves a call: the one capability check of the Gluon kernels and one pure selection.

Kernels: Triton (``attention.py``: sm_80 on and the CPU interpreter; every mask, windows, soft-capping, fp8),
Gluon FA3-ordered (``attention_gluon.py``) and Gluon warp-specialized ping-pong (``attention_gluon_ws.py``). The
Gluon kernels take Hopper, bf16/fp16, head dim 64 or 128, no window or soft-cap, and fp8 only with fp8 P @ V and
key sequences starting on multiples of 32 tokens. The H200 measurements pick the warp-specialized kernel, except
causal rows of at most 256 queries, whose short triangles the FA3-ordered kernel's two 64-row programs per SM
balance better (bench/archive/experimental/attention_backends_short_rows.py).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

BACKENDS = ("triton", "gluon", "gluon_ws")


class AttentionTiles(NamedTuple):
    """Config of the Triton and Gluon FA3-ordered kernels: query and key tile, warps, K/V pipeline depth
    (``num_stages`` for Triton, the ring's NUM_BUF for Gluon). A tuple: ``(128, 128, 8, 3)`` reads the same."""

    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int


class WsConfig(NamedTuple):
    """Config of the warp-specialized Gluon kernel: 128-row query tiles, BLOCK_N keys, a NUM_BUF-deep ring, and
    the flags described in ``attention_gluon_ws``'s docstring. ``WsConfig(*t)`` completes a shorter tuple."""

    BLOCK_N: int
    NUM_BUF: int
    PERSISTENT: bool = True
    PINGPONG: bool = True
    TMA_STORE: bool = False
    STAGE_KS: bool = False
    ROWSUM_MMA: bool = False
    LAZY_RESCALE: bool = False


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """What the selection reads of a call. ``arch``: e.g. "sm90", None off CUDA; ``dtype``, ``k_dtype`` as
    strings (``str(torch dtype)``); ``kv_aligned``: every key sequence starts on a multiple of 32 tokens."""

    arch: str | None
    dtype: str
    k_dtype: str
    head_dim: int
    causal: bool = False
    window_left: int = -1
    softcap: float = 0.0
    fp8: bool = False
    fp8_pv: bool = True
    kv_aligned: bool = True
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0  # 0: as max_seqlen_q
    heads_q: int = 1
    heads_kv: int = 1


# fp8="auto" on 16-bit inputs: FP8 only where its gain pays for quantizing q, k and v first. The gain grows with
# the keys each query attends times the query heads; the quantization pass with the heads it moves (Hq + 2 Hkv). Their
# ratio (fp8_work_ratio) decides. Measured on one H200 (bench/results/attention_fp8_crossover_h200.json,
# 16/16, 32/8 and 16/16/64 heads, 1K-8K tokens): at head dim 128 the call and bf16 cross at ratio ~512 (0.997-1.023x),
# with 0.92x at 341 and >= 1.07x at 683; at head dim 64, whose FP8 kernel gains less, between 683 (0.97-0.99x) and
# 1024 (1.04x). Thresholds sit between the last losing and the first winning point measured.
FP8_AUTO_MIN_RATIO = {128: 600, 64: 900}


def fp8_work_ratio(call: AttentionCall) -> float:
    """Keys a query attends (causal: the mean over a block of queries ending at the last key) times Hq, over the
    heads a token's quantization moves (Hq + 2 Hkv). Uses the longest sequences: a batch of mixed lengths reads
    higher than its mean."""
    keys = call.max_seqlen_k or call.max_seqlen_q
    if call.causal:
        keys -= min(call.max_seqlen_q, keys) / 2
    return keys * call.heads_q / (call.heads_q + 2 * call.heads_kv)


def select_fp8(call: AttentionCall) -> tuple[bool, str]:
    """Whether ``fp8="auto"`` quantizes a 16-bit call to FP8: ``(use_fp8, reason)``."""
    ok, reason = gluon_attention_supports(dataclasses.replace(call, fp8=True))
    if not ok:
        return False, f"16-bit: FP8 is measured only in the warp-specialized kernel ({reason})"
    need = FP8_AUTO_MIN_RATIO.get(call.head_dim)
    if need is None:
        return False, f"16-bit: FP8's crossover is not measured at head dim {call.head_dim}"
    ratio = fp8_work_ratio(call)
    if ratio < need:
        return False, f"16-bit: attention work per quantized value {ratio:.0f} < {need}, the measured crossover"
    return True, f"fp8: attention work per quantized value {ratio:.0f} >= {need}, FP8 pays for its quantization"


def gluon_attention_supports(call: AttentionCall) -> tuple[bool, str]:
    """Whether the Gluon attention kernels take the call: ``(True, "")`` or ``(False, reason)``."""
    if call.arch != "sm90":
        return False, f"the Gluon kernels need a Hopper GPU (sm90), this is {call.arch or 'not a CUDA device'}"
    if call.dtype not in ("torch.bfloat16", "torch.float16") or call.k_dtype != call.dtype:
        return False, f"q and k must both be bf16 or fp16, got {call.dtype} / {call.k_dtype}"
    if call.head_dim not in (64, 128):
        return False, f"head dim {call.head_dim} (the Gluon kernels take 64 or 128)"
    if call.window_left >= 0 or call.softcap > 0:
        return False, "sliding windows and soft-capping run in the Triton kernel"
    if call.fp8 and not call.fp8_pv:
        return False, "fp8 Q K^T with 16-bit P @ V runs in the Triton kernel"
    if call.fp8 and not call.kv_aligned:
        return False, "fp8 needs key sequences starting on multiples of 32 tokens (V^T TMA boxes)"
    return True, ""


def select_attention(call: AttentionCall) -> tuple[str, str]:
    """``(backend, reason)``: the kernel the H200 measurements pick for the call, where it applies."""
    ok, reason = gluon_attention_supports(call)
    if not ok:
        return "triton", reason
    if call.fp8:
        return "gluon_ws", "fp8: the warp-specialized kernel (1.14-1.34x its bf16 at hd128, S >= 2048)"
    if call.causal and call.max_seqlen_q <= 256:
        return "gluon", "causal rows up to 256 queries: two 64-row programs per SM balance them better"
    return "gluon_ws", "FA3's warp-specialized ping-pong"
