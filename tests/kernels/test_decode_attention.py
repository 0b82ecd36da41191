"""Tests for kernels/decode_attention.py (flash-decoding with a split-K reduce).

Without CUDA the kernels run under TRITON_INTERPRET=1, set before the kernel module is
imported because `triton.jit` reads it at decoration time.
"""

import pytest
import torch

# tests/kernels/conftest.py sets TRITON_INTERPRET=1 without CUDA (before this import) and patches
# the interpreter for NumPy >= 2.4.
from quantkit.kernels.decode_attention import decode_attention, decode_attention_ref  # noqa: E402
from tests.conftest import rel_err  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _make(b, sq, hq, hkv, d, s_max, lengths, dtype, gen=None):
    q = torch.randn(b, sq, hq, d, generator=gen).to(DEV, dtype)
    k = torch.randn(b, s_max, hkv, d, generator=gen).to(DEV, dtype)
    v = torch.randn(b, s_max, hkv, d, generator=gen).to(DEV, dtype)
    # poison the unused tail of the cache: a kernel that reads past cache_seqlens shows NaN
    for i, length in enumerate(lengths):
        k[i, length:] = float("nan")
        v[i, length:] = float("nan")
    return q, k, v, torch.tensor(lengths, dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("sq,hq,hkv,d,lengths,num_splits", [
    (1, 4, 4, 64, [37, 100], 3),        # MHA, ragged lengths, more splits than some need
    (1, 8, 2, 64, [70], 4),             # GQA group 4
    (3, 4, 1, 128, [50, 9], 2),         # MQA, 3 new tokens (causal among them), head dim 128
    (2, 2, 2, 64, [33], 1),             # a single split (no real reduction)
    (1, 4, 2, 64, [5, 80], 8),          # splits that are entirely past a short sequence
])
def test_decode_matches_reference(sq, hq, hkv, d, lengths, num_splits):
    gen = torch.Generator().manual_seed(sum(lengths) + 7 * sq + hq)
    dtype = torch.float16 if CUDA else torch.float32
    q, k, v, seqlens = _make(len(lengths), sq, hq, hkv, d, 100, lengths, dtype, gen)
    out = decode_attention(q, k, v, seqlens, num_splits=num_splits)
    ref = decode_attention_ref(q, k, v, seqlens)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < (2e-3 if CUDA else 1e-5)


def test_split_count_does_not_change_result():
    gen = torch.Generator().manual_seed(11)
    q, k, v, seqlens = _make(1, 1, 2, 2, 64, 96, [96], torch.float32, gen)
    a = decode_attention(q, k, v, seqlens, num_splits=1)
    b = decode_attention(q, k, v, seqlens, num_splits=5)
    assert rel_err(a, b) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sq,hq,hkv,d", [(1, 32, 8, 128), (4, 16, 16, 64), (1, 8, 1, 256)])
def test_gpu_decode_vs_sdpa(dtype, sq, hq, hkv, d):
    b, s_max = 4, 3000
    lengths = [3000, 1, 1777, 2049]
    q, k, v, seqlens = _make(b, sq, hq, hkv, d, s_max, [max(x, sq) for x in lengths], dtype)
    out = decode_attention(q, k, v, seqlens)
    ref = decode_attention_ref(q.double(), k.double(), v.double(), seqlens)
    naive = decode_attention_ref(q, k, v, seqlens).to(dtype)  # float32 math on rounded inputs
    assert torch.isfinite(out).all()
    # bf16 output rounding dominates: allow twice what rounding the exact result gives
    assert rel_err(out, ref) <= 2 * rel_err(ref.to(dtype), ref) + 2 * rel_err(naive, ref) + 1e-4


@pytest.mark.parametrize("window_left,softcap", [(-1, 0.0), (7, 0.0), (-1, 5.0), (20, 3.0)])
def test_cache_slots_window_and_softcap_match_reference(window_left, softcap):
    """Rows read the cache rows their slots name (continuous batching), with Gemma's sliding window and soft-cap."""
    gen = torch.Generator().manual_seed(5 + window_left)
    q, k, v, _ = _make(4, 2, 4, 2, 64, 80, [80, 80, 80, 80], torch.float32, gen)
    q = q[:3]
    slots = torch.tensor([3, 0, 2], dtype=torch.int32, device=DEV)
    seqlens = torch.tensor([9, 77, 40], dtype=torch.int32, device=DEV)
    out = decode_attention(q, k, v, seqlens, num_splits=3, cache_slots=slots, window_left=window_left,
                           softcap=softcap)
    ref = decode_attention_ref(q, k, v, seqlens, cache_slots=slots, window_left=window_left, softcap=softcap)
    assert rel_err(out, ref) < 1e-5
    # the reference itself: row 0 on slot 3 equals a plain call on that cache row alone
    alone = decode_attention_ref(q[:1], k[3:4], v[3:4], seqlens[:1], window_left=window_left, softcap=softcap)
    assert torch.equal(ref[:1], alone)
    if window_left >= 0:  # the window hides keys: differs from the full causal result
        full = decode_attention_ref(q, k, v, seqlens, cache_slots=slots, softcap=softcap)
        assert rel_err(full, ref) > 1e-3
