"""Tests for kernels/attention.py.

On a machine without CUDA the Triton kernels run under the interpreter (TRITON_INTERPRET=1).
`triton.jit` reads that variable when the kernel is *decorated*, i.e. when
quantkit.kernels.attention is first imported, so it is set here before that import.
"""

import pytest
import torch

# tests/kernels/conftest.py sets TRITON_INTERPRET=1 without CUDA (before this import) and patches
# the interpreter for NumPy >= 2.4.
from quantkit.kernels.attention import attention, attention_ref, attention_varlen  # noqa: E402
from quantkit.kernels.attention_fp8 import quantize_qkv_fp8  # noqa: E402
from quantkit.kernels.attention_triton import triton_forward as _triton_forward  # noqa: E402
from tests.conftest import rel_err  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _packed(seqlens_q, seqlens_k, hq, hkv, d, dtype, device=DEV, gen=None):
    cu_q = torch.tensor([0] + list(torch.tensor(seqlens_q).cumsum(0)), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + list(torch.tensor(seqlens_k).cumsum(0)), dtype=torch.int32, device=device)
    q = torch.randn(sum(seqlens_q), hq, d, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(sum(seqlens_k), hkv, d, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(sum(seqlens_k), hkv, d, generator=gen).to(device=device, dtype=dtype)
    return q, k, v, cu_q, cu_k


def _triton(q, k, v, cu_q, cu_k, max_q, use_tma, causal=False, window_left=-1, softcap=0.0, fp8=False,
            fp8_pv=True, kv_aligned=None):
    """The Triton kernel with K / V loaded by TMA or by pointers, whatever the device (the public call decides
    by GPU generation): both load paths run on the interpreter and on the GPU."""
    prepared = quantize_qkv_fp8(q, k, v, cu_k, None, False, fp8_pv) if fp8 else None
    return _triton_forward(q, k, v, cu_q, cu_k, max_q, causal, None, window_left, softcap, prepared, None, use_tma,
                           kv_aligned)


# --------------------------------------------------------------------------------------------
# CPU (interpreter) tests: small shapes, fp16/fp32 (the interpreter's bf16 dot is broken,
# triton issue #11584). Lengths deliberately not multiples of the 16-wide CPU blocks.
# --------------------------------------------------------------------------------------------
CASES = [
    # seqlens_q, seqlens_k, hq, hkv, d, causal, window, softcap
    ([37], [37], 2, 2, 64, False, -1, 0.0),
    ([37], [37], 2, 2, 64, True, -1, 0.0),
    ([21, 40, 5], [21, 40, 5], 4, 2, 64, True, -1, 0.0),        # varlen + GQA
    ([19, 33], [19, 33], 4, 1, 128, False, -1, 0.0),            # MQA, head dim 128
    ([45], [45], 2, 1, 64, True, 10, 0.0),                      # sliding window
    ([45, 23], [45, 23], 2, 2, 64, False, 7, 0.0),              # window, non-causal
    ([30], [30], 2, 2, 64, True, -1, 5.0),                      # soft-cap
    ([6, 3], [50, 29], 2, 2, 64, True, -1, 0.0),                # prefill against a cache
    ([40], [17], 2, 2, 64, True, -1, 0.0),                      # more queries than keys
]


@pytest.mark.parametrize("use_tma", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_attention_matches_reference(case, use_tma):
    sq, sk, hq, hkv, d, causal, window, softcap = case
    gen = torch.Generator().manual_seed(hash((tuple(sq), tuple(sk), hq, d, causal, window)) % 2**31)
    dtype = torch.float16 if CUDA else torch.float32
    q, k, v, cu_q, cu_k = _packed(sq, sk, hq, hkv, d, dtype, gen=gen)
    out = _triton(q, k, v, cu_q, cu_k, max(sq), use_tma, causal=causal, window_left=window, softcap=softcap)
    ref = attention_ref(q, k, v, cu_q, cu_k, causal=causal, window_left=window, softcap=softcap)
    assert torch.isfinite(out).all()
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    assert rel_err(out, ref) < tol
    # rows that see no key (more queries than keys, causal) must be exactly zero
    assert (out[ref.abs().sum(-1) == 0] == 0).all()


def test_attention_fp16_interpreter():
    """fp16 inputs through the tensor-core path (dot in fp16, fp32 accumulate)."""
    q, k, v, cu_q, cu_k = _packed([29], [29], 2, 2, 64, torch.float16, gen=torch.Generator().manual_seed(1))
    out = attention_varlen(q, k, v, cu_q, cu_k, 29, causal=True)
    ref = attention_ref(q, k, v, cu_q, cu_k, causal=True)
    assert out.dtype == torch.float16 and rel_err(out, ref) < 2e-3


def test_fixed_batch_wrapper_and_sdpa():
    """`attention` on (B, S, H, D) equals torch SDPA (float32)."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 33, 4, 64, generator=gen).to(DEV)
    k = torch.randn(2, 33, 2, 64, generator=gen).to(DEV)
    v = torch.randn(2, 33, 2, 64, generator=gen).to(DEV)
    out = attention(q, k, v, causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2),
        v.repeat_interleave(2, 2).transpose(1, 2),
        is_causal=True).transpose(1, 2)
    assert rel_err(out, ref) < (1e-5 if not CUDA else 1e-3)


def test_fixed_batch_wrapper_keys_longer_than_queries():
    """`attention` with Sk != Sq (new queries against a longer context, bottom-right causal): its query and key
    offsets are separate tensors then (one tensor serves both when the lengths match)."""
    gen = torch.Generator().manual_seed(4)
    b, sq, sk = 3, 17, 45
    q = torch.randn(b, sq, 4, 64, generator=gen).to(DEV)
    k = torch.randn(b, sk, 2, 64, generator=gen).to(DEV)
    v = torch.randn(b, sk, 2, 64, generator=gen).to(DEV)
    out = attention(q, k, v, causal=True)
    cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=DEV)
    cu_k = torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device=DEV)
    ref = attention_ref(q.reshape(-1, 4, 64), k.reshape(-1, 2, 64), v.reshape(-1, 2, 64), cu_q, cu_k, causal=True)
    assert rel_err(out.reshape(-1, 4, 64), ref) < (1e-5 if not CUDA else 1e-3)


def test_reference_detects_wrong_mask():
    """Guard against a test that cannot fail: causal and non-causal outputs must differ."""
    q, k, v, cu_q, cu_k = _packed([20], [20], 1, 1, 64, torch.float32, device="cpu",
                                  gen=torch.Generator().manual_seed(3))
    a = attention_ref(q, k, v, cu_q, cu_k, causal=True)
    b = attention_ref(q, k, v, cu_q, cu_k, causal=False)
    assert rel_err(a, b) > 0.1


# --------------------------------------------------------------------------------------------
# GPU tests: against SDPA in float32, tolerance relative to naive PyTorch in the same dtype
# (FlashAttention's rule: at most ~2x the error of the naive low-precision computation).
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("use_tma", [False, True])
@pytest.mark.parametrize("backend", ["triton", "gluon", "gluon_ws"])
def test_gpu_vs_sdpa(dtype, d, causal, use_tma, backend):
    if not use_tma and (d != 128 or dtype != torch.bfloat16 or backend != "triton"):
        pytest.skip("pointer path checked at one shape: each variant costs a compile")
    if backend != "triton" and d == 256:
        pytest.skip("the gluon kernels cover head dims 64 and 128")
    b, s, hq, hkv = 2, 1000, 8, 2  # 1000: not a multiple of any block size
    q = torch.randn(b, s, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype)
    if use_tma:
        out = attention(q, k, v, causal=causal, backend=backend)
    else:
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
        out = _triton(*(x.reshape(b * s, -1, d) for x in (q, k, v)), cu, cu, s, False, causal=causal).view(q.shape)

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.repeat_interleave(hq // hkv, 2).transpose(1, 2),
            v.repeat_interleave(hq // hkv, 2).transpose(1, 2), is_causal=causal).transpose(1, 2)

    ref = sdpa(q.float(), k.float(), v.float())
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        naive = sdpa(q, k, v)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= 2 * rel_err(naive, ref) + 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("hadamard,fp8_pv", [(False, True), (True, True), (False, False)])
def test_gpu_fp8(hadamard, fp8_pv):
    b, s, h, d = 2, 1000, 8, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = attention(q, k, v, causal=True, fp8=True, hadamard=hadamard, fp8_pv=fp8_pv)
    ref = attention(q.float(), k.float(), v.float(), causal=True)
    # e4m3 has a 3-bit mantissa: ~2-4% relative error is the expected scale
    assert rel_err(out, ref) < 0.06


@pytest.mark.parametrize("seqlens,use_tma", [([37, 20], False), ([32, 48], True), ([37, 20], True)])
@pytest.mark.parametrize("fp8_pv", [True, False])
def test_fp8_path_interpreter_or_gpu(seqlens, use_tma, fp8_pv):
    """FP8 e4m3 path (per-token q/k scales, per-head v scale) on varlen batches. Sequence starts
    not multiples of 16 must fall back to pointer loads of V^T (TMA alignment)."""
    gen = torch.Generator().manual_seed(5)
    dtype = torch.bfloat16 if CUDA else torch.float32
    q, k, v, cu_q, cu_k = _packed(seqlens, seqlens, 4, 2, 64, dtype, gen=gen)
    out = _triton(q, k, v, cu_q, cu_k, max(seqlens), use_tma, causal=True, fp8=True, fp8_pv=fp8_pv)
    ref = attention_ref(q, k, v, cu_q, cu_k, causal=True)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < (0.07 if fp8_pv else 0.05)


def test_fp8_key_scales_are_block_amax_without_a_host_sync():
    # one scale per KV head and 128-key block of each sequence (blocks restart at every sequence)
    from quantkit.kernels.attention_fp8 import KV_SCALE_BLOCK, _quantize_per_block

    gen = torch.Generator().manual_seed(3)
    lens = [300, 5, 128, 129]
    x = torch.randn(sum(lens), 2, 16, generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    _, scale = _quantize_per_block(x, cu)
    start = 0
    for n in lens:
        for b0 in range(0, n, KV_SCALE_BLOCK):
            rows = slice(start + b0, start + min(n, b0 + KV_SCALE_BLOCK))
            expect = x[rows].abs().amax(dim=(0, 2)) / 448.0
            assert torch.allclose(scale[rows], expect.expand_as(scale[rows]))
        start += n


@pytest.mark.parametrize("kv_aligned", [None, True, False])
def test_kv_aligned_hint_gives_the_same_result(kv_aligned):
    # the caller's alignment hint only saves the device check; False forces pointer loads of V^T
    gen = torch.Generator().manual_seed(9)
    dtype = torch.bfloat16 if CUDA else torch.float32
    q, k, v, cu_q, cu_k = _packed([32, 64], [32, 64], 4, 2, 64, dtype, gen=gen)
    out = _triton(q, k, v, cu_q, cu_k, 64, True, causal=True, fp8=True, kv_aligned=kv_aligned)
    ref = attention_ref(q, k, v, cu_q, cu_k, causal=True)
    assert torch.isfinite(out).all() and rel_err(out, ref) < 0.07
