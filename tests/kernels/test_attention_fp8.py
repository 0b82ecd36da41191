"""Tests for kernels/attention_fp8.py: the fused fp8 quantization of q, k, v against its plain-PyTorch
reference (``attention_fp8.prepare_fp8``), and the pre-quantized fp8 call with descale factors.

Without CUDA the Triton kernels run under the interpreter (tests/kernels/conftest.py), on fp16/fp32 inputs."""

import pytest
import torch

from quantkit.kernels import attention_fp8 as fq  # noqa: E402  (conftest set TRITON_INTERPRET first)
from quantkit.kernels.attention import attention, attention_ref, attention_varlen
from quantkit.kernels.attention_fp8 import _key_perm_positions, prepare_fp8, quantize_fp8_per_token
from tests.conftest import rel_err

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
E4M3_NAN = 0x7F  # the byte of an e4m3fn NaN: poisons storage the kernels must overwrite


def _packed(lens, hq, hkv, d, dtype, seed, device=DEV, outliers=True):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
    q = torch.randn(sum(lens), hq, d, generator=gen)
    k = torch.randn(sum(lens), hkv, d, generator=gen)
    v = torch.randn(sum(lens), hkv, d, generator=gen)
    if outliers:  # scales far from 1, and one block with a far larger amax than the rest
        k, v = k * 3.0, v * 0.5
        k[:7] *= 20.0
    return (*(x.to(device=device, dtype=dtype) for x in (q, k, v)), cu)


@pytest.fixture
def poisoned_v_storage(monkeypatch):
    """V^T storage full of NaN bytes, so that any position the kernels leave unwritten shows."""
    original = fq._v_t_storage

    def poisoned(*args):
        vt, n_pad = original(*args)
        vt.view(torch.uint8).fill_(E4M3_NAN)
        return vt, n_pad

    monkeypatch.setattr(fq, "_v_t_storage", poisoned)


def _storage(v8):
    """The whole (Hkv, D, n_pad) V^T storage behind the (total_k, Hkv, D) view, padding included."""
    hkv, d, n_pad = v8.shape[1], v8.shape[2], v8.stride(2)
    return torch.as_strided(v8, (hkv, d, n_pad), (d * n_pad, n_pad, 1))


def _same_codes(a, b):
    """Equal e4m3 codes: bit for bit on the GPU; by value under the interpreter, whose cast turns -0.0 into
    +0.0 (a NaN left in storage fails either way)."""
    if CUDA:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a.float(), b.float())


def _assert_same_operands(got, ref):
    names = ("q8", "q_scale", "k8", "k_scale", "v8", "v_scale")
    for name, a, b in zip(names, got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert (_same_codes(a, b) if a.dtype == torch.float8_e4m3fn else torch.equal(a, b)), name
    assert got[4].stride() == ref[4].stride()
    assert _same_codes(_storage(got[4]), _storage(ref[4])), "V^T storage and its zero padding"


CPU_CASES = [([37], 2, 2, 32, torch.float32), ([0, 37, 130, 5], 4, 2, 32, torch.float16),
             ([129, 3], 2, 1, 64, torch.float32)]


@pytest.mark.parametrize("lens,hq,hkv,d,dtype", CPU_CASES)
def test_fused_quantization_is_prepare_fp8_bit_for_bit(lens, hq, hkv, d, dtype, poisoned_v_storage):
    # per-token q, per-(sequence, 128-key block) k, per-head v scales; codes rounded to nearest even; the V^T
    # storage in the permuted key order with zeros after the last token; an empty first sequence included
    q, k, v, cu = _packed(lens, hq, hkv, d, dtype, seed=1)
    got = fq.quantize_qkv_fp8(q, k, v, cu, max(lens))
    _assert_same_operands(got, prepare_fp8(q, k, v, cu_seqlens_k=cu))


def test_fused_quantization_without_max_seqlen_k_bounds_the_grid_by_total_k():
    q, k, v, cu = _packed([20, 150], 2, 2, 32, torch.float32, seed=2)
    _assert_same_operands(fq.quantize_qkv_fp8(q, k, v, cu), prepare_fp8(q, k, v, cu_seqlens_k=cu))


def test_round_e4m3_rounds_to_nearest_even_across_powers_of_two():
    # the interpreter's own cast drops the carry (126.8 -> 64); the fp32 rounding must give 128
    y = torch.tensor([126.8, 124.0, 0.0137, -3.3e-3, 447.9, 1e-4, 0.0, -120.0], dtype=torch.float32)
    expect = y.to(torch.float8_e4m3fn).float()
    y, out = y.to(DEV), torch.empty(8, dtype=torch.float32, device=DEV)

    import triton
    import triton.language as tl

    @triton.jit
    def round_kernel(x_ptr, o_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(o_ptr + offs, fq._round_e4m3(tl.load(x_ptr + offs)))

    round_kernel[(1,)](y, out, N=8)
    assert torch.equal(out.cpu(), expect)


def test_public_fp8_call_runs_the_fused_operands():
    # attention(fp8=True) on 16-bit inputs gives what the kernel gives on prepare_fp8's operands
    q, k, v, cu = _packed([40, 64], 4, 2, 32, torch.float16, seed=3, outliers=False)
    out = attention_varlen(q, k, v, cu, cu, 64, causal=True, fp8=True)
    same = attention_varlen(q, k, v, cu, cu, 64, causal=True, fp8_prepared=prepare_fp8(q, k, v, cu_seqlens_k=cu))
    assert torch.equal(out, same)
    assert rel_err(out, attention_ref(q, k, v, cu, cu, causal=True)) < 0.07


def _qkv_views(q, k, v):
    """q, k, v as views into one fused QKV projection output [tokens, (Hq + 2 Hkv) * D], as the runtime has them."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    fused = torch.cat([x.reshape(t, -1) for x in (q, k, v)], dim=1)
    views = (fused[:, : hq * d].view(t, hq, d), fused[:, hq * d : (hq + hkv) * d].view(t, hkv, d),
             fused[:, (hq + hkv) * d :].view(t, hkv, d))
    assert not any(x.is_contiguous() for x in views) and all(fq.heads_packed(x) for x in views)
    return views


@pytest.mark.parametrize("lens,hq,hkv,d,dtype", CPU_CASES[1:])
def test_fused_quantization_reads_views_of_a_fused_qkv_in_place(lens, hq, hkv, d, dtype, poisoned_v_storage):
    # the runtime passes views into its QKV output: same operands as from contiguous copies, no copy made
    q, k, v, cu = _packed(lens, hq, hkv, d, dtype, seed=5)
    assert fq.fused_quantization_applies(*_qkv_views(q, k, v))  # the kernels run, not the prepare_fp8 fallback
    _assert_same_operands(fq.quantize_qkv_fp8(*_qkv_views(q, k, v), cu, max(lens)),
                          prepare_fp8(q, k, v, cu_seqlens_k=cu))


def test_public_fp8_call_on_qkv_views_equals_contiguous_inputs(monkeypatch):
    q, k, v, cu = _packed([40, 64], 4, 2, 32, torch.float16, seed=6, outliers=False)
    views = _qkv_views(q, k, v)
    for fp8 in (True, False):
        assert torch.equal(attention_varlen(*views, cu, cu, 64, causal=True, fp8=fp8),
                           attention_varlen(q, k, v, cu, cu, 64, causal=True, fp8=fp8))
    # the fp8 quantization gets the views themselves (no contiguous copy before it)
    seen = []
    real = fq.quantize_qkv_fp8

    def spy(q, k, v, *args):
        seen.append([x.is_contiguous() for x in (q, k, v)])
        return real(q, k, v, *args)

    from quantkit.kernels import attention as attention_module

    monkeypatch.setattr(attention_module, "quantize_qkv_fp8", spy)
    attention_varlen(*views, cu, cu, 64, causal=True, fp8=True)
    assert seen == [[False, False, False]]
    assert not fq.heads_packed(q.transpose(1, 2))  # heads not packed within a token: copied first


def _prequantized(q, k, v):
    """What a projection that emits e4m3 gives: per-token q codes and scales, per-head k and v."""
    q8, q_descale = quantize_fp8_per_token(q)
    k_descale = k.abs().amax(dim=(0, 2)).float() / 448.0
    v_descale = v.abs().amax(dim=(0, 2)).float() / 448.0
    k8 = (k.float() / k_descale[:, None]).to(torch.float8_e4m3fn)
    v8 = (v.float() / v_descale[:, None]).to(torch.float8_e4m3fn)
    return q8, k8, v8, q_descale, k_descale, v_descale


def test_fp8_inputs_with_descales_match_the_dequantized_reference(poisoned_v_storage):
    q, k, v, cu = _packed([37, 64], 4, 2, 32, torch.float32, seed=4, outliers=False)
    q8, k8, v8, qd, kd, vd = _prequantized(q, k, v)
    out = attention_varlen(q8, k8, v8, cu, cu, 64, causal=True, q_descale=qd, k_descale=kd, v_descale=vd,
                           out_dtype=torch.float16)
    assert out.dtype == torch.float16 and out.shape == q.shape
    deq = (q8.float() * qd[..., None], k8.float() * kd[:, None], v8.float() * vd[:, None])
    ref = attention_ref(*deq, cu, cu, causal=True)
    assert torch.isfinite(out).all()
    # only P is rounded to e4m3 inside the kernel (the Triton kernel's P has no 2^8 lift: ~4 % here)
    assert rel_err(out, ref) < 0.06
    # and the kernel saw the codes and scales as given: the same output as from operands built by hand
    n_pad = (k.shape[0] + fq.V_PAD + 31) // 32 * 32
    vt = torch.zeros(2, 32, n_pad, dtype=torch.float8_e4m3fn, device=DEV)
    vt[:, :, _key_perm_positions(n_pad, DEV)[: k.shape[0]]] = v8.permute(1, 2, 0)
    by_hand = (q8, qd, k8, kd.expand(k.shape[:2]), vt[:, :, : k.shape[0]].permute(2, 0, 1), vd)
    assert torch.equal(out, attention_varlen(q.half(), k.half(), v.half(), cu, cu, 64, causal=True,
                                             fp8_prepared=by_hand))
    # the operands: q and k as given, V^T in the kernels' key order, its padding zero
    ops = fq.fp8_operands(q8, k8, v8, qd, kd, vd)
    assert ops[0] is not None and torch.equal(ops[1], qd) and torch.equal(ops[3], kd.expand(k.shape[:2]))
    vt = _storage(ops[4])
    pos = _key_perm_positions(vt.shape[2], vt.device)[: k.shape[0]]
    assert torch.equal(vt[:, :, pos].permute(2, 0, 1).view(torch.uint8), v8.view(torch.uint8))
    empty = torch.ones(vt.shape[2], dtype=torch.bool, device=vt.device)
    empty[pos] = False  # the positions no token was stored at: zeros, read by TMA boxes past the end
    assert (vt.view(torch.uint8)[:, :, empty] == 0).all() and vt.shape[2] >= k.shape[0] + fq.V_PAD


def test_fp8_inputs_through_the_fixed_length_call_with_scalar_descales():
    q, k, v, _ = _packed([64], 2, 2, 32, torch.float32, seed=5, outliers=False)
    q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))  # descale 1: the codes are the values
    out = attention(q8[None], k8[None], v8[None], causal=False, q_descale=1.0, k_descale=torch.tensor(1.0),
                    v_descale=torch.ones(2), out_dtype=torch.float16)
    deq = [x.float() for x in (q8, k8, v8)]
    cu = torch.tensor([0, 64], dtype=torch.int32, device=DEV)
    assert out.shape == (1, 64, 2, 32)
    assert rel_err(out[0], attention_ref(*deq, cu, cu)) < 0.06


def test_fp8_inputs_need_descales_of_known_shapes():
    q, k, v, cu = _packed([32], 2, 2, 32, torch.float32, seed=6)
    q8, k8, v8, qd, kd, vd = _prequantized(q, k, v)
    with pytest.raises(ValueError, match="need q_descale"):
        attention_varlen(q8, k8, v8, cu, cu, 32, q_descale=qd, k_descale=kd)
    with pytest.raises(ValueError, match="k_descale must be"):
        attention_varlen(q8, k8, v8, cu, cu, 32, q_descale=qd, k_descale=torch.ones(32, 2), v_descale=vd)
    with pytest.raises(ValueError, match="v must be torch.float8_e4m3fn"):
        attention_varlen(q8, k8, v.half(), cu, cu, 32, q_descale=qd, k_descale=kd, v_descale=vd)


# ------------------------------------------------------------------------------------------------------------
# GPU: bf16 at the benchmark's head dims, every backend the fp8 call can take
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_fused_quantization_is_prepare_fp8_bit_for_bit(d, poisoned_v_storage):
    q, k, v, cu = _packed([1000, 0, 2051, 300], 16, 4, d, torch.bfloat16, seed=7)
    _assert_same_operands(fq.quantize_qkv_fp8(q, k, v, cu, 2051), prepare_fp8(q, k, v, cu_seqlens_k=cu))
    _assert_same_operands(fq.quantize_qkv_fp8(*_qkv_views(q, k, v), cu, 2051), prepare_fp8(q, k, v, cu_seqlens_k=cu))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_public_fp8_call(backend, causal):
    b, s, h, d = 2, 1024, 8, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = attention(q, k, v, causal=causal, fp8=True, backend=backend)
    flat = [x.reshape(b * s, h, d) for x in (q, k, v)]
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
    same = attention(q, k, v, causal=causal, backend=backend, fp8_prepared=prepare_fp8(*flat, cu_seqlens_k=cu))
    assert torch.equal(out, same)
    ref = attention(q.float(), k.float(), v.float(), causal=causal)
    assert rel_err(out, ref) < 0.06


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_fp8_inputs_with_descales(causal):
    b, s, h, d = 2, 1024, 8, 128
    q, k, v = (torch.randn(b * s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q8, k8, v8, qd, kd, vd = _prequantized(q, k, v)
    out = attention(*(x.view(b, s, h, d) for x in (q8, k8, v8)), causal=causal, q_descale=qd, k_descale=kd,
                    v_descale=vd)
    assert out.dtype == torch.bfloat16
    deq = (q8.float() * qd[..., None], k8.float() * kd[:, None], v8.float() * vd[:, None])
    ref = attention(*(x.view(b, s, h, d) for x in deq), causal=causal)
    assert rel_err(out, ref) < 0.05  # only P is rounded inside the kernel (wrong descales give > 0.1)


def test_fp8_auto_on_the_cpu_runs_16_bit_and_bad_values_are_refused():
    # no Hopper GPU: "auto" has no measured crossover, so the call is the 16-bit one, bit for bit
    q, k, v, cu = _packed([40, 64], 4, 2, 32, torch.float16, seed=3, outliers=False)
    out = attention_varlen(q, k, v, cu, cu, 64, causal=True, fp8="auto")
    assert torch.equal(out, attention_varlen(q, k, v, cu, cu, 64, causal=True))
    with pytest.raises(ValueError, match="fp8 must be"):
        attention_varlen(q, k, v, cu, cu, 64, fp8="yes")


@pytest.mark.gpu
@pytest.mark.parametrize("s,causal,quantized", [(1024, True, False), (2048, True, False), (2048, False, True),
                                                (4096, True, True)])
def test_gpu_fp8_auto_is_one_of_the_two_calls(s, causal, quantized):
    # 16 heads, head dim 128: FP8 from attention work per quantized value 600 on (attention_select.select_fp8)
    q, k, v = (torch.randn(1, s, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = attention(q, k, v, causal=causal, fp8="auto")
    assert torch.equal(out, attention(q, k, v, causal=causal, fp8=quantized))
