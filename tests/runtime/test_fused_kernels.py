"""The fused Triton kernels of a decoder step against their plain-PyTorch references (TRITON_INTERPRET=1 on the
CPU, float32 and float16)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.kernels.conftest import _fix_interpreter_index  # NumPy >= 2.4 and run-time loop bounds

    _fix_interpreter_index()

from quantkit.kernels import decoder_ops as fused_kernels  # noqa: E402
from quantkit.kernels import decoder_ops_ref as ops
from tests.conftest import rel_err  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]


def _tol(dtype):
    return 1e-6 if dtype == torch.float32 else 2e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual,offset", [(False, 0.0), (True, 0.0), (True, 1.0)])
def test_add_rms_norm(dtype, with_residual, offset):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 96, generator=g).to(DEV, dtype)
    res = torch.randn(3, 96, generator=g).to(DEV, dtype) if with_residual else None
    w = torch.randn(96, generator=g).to(DEV)
    out, new_res = fused_kernels.add_rms_norm(x, res, w, 1e-6, offset)
    ref_out, ref_res = ops.add_rms_norm_ref(x, res, w, 1e-6, offset)
    assert rel_err(out, ref_out) < _tol(dtype)
    assert torch.equal(new_res, ref_res)


@pytest.mark.parametrize("parts_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual,fp8", [(True, False), (False, False), (True, True)])
def test_add_rms_norm_sums_row_parts_first_with_the_same_bits(parts_dtype, with_residual, fp8):
    """A MoE block's unsummed rows (RowParts: the decode GEMV's float32 slices, or the tiled kernel's k rows in the
    model's dtype) summed inside the norm: bitwise the sum's own launch (moe_gemv._sum_parts_kernel) then the
    norm, residual stream included (stored where there is no residual to add)."""
    from quantkit.kernels.moe_gemv import _sum_parts_kernel

    dtype = torch.float16
    g = torch.Generator().manual_seed(9)
    rows = (torch.randn(3, 5, 96, generator=g) * 3).to(DEV, parts_dtype)
    res = torch.randn(3, 96, generator=g).to(DEV, dtype) if with_residual else None
    w = torch.randn(96, generator=g).to(DEV)
    summed = torch.empty(3, 96, device=DEV, dtype=dtype)
    _sum_parts_kernel[(3, 1)](rows, summed, 96, 5, BLOCK=128)
    parts = fused_kernels.RowParts(rows, dtype)
    assert parts.shape == (3, 96)
    norm = fused_kernels.add_rms_norm_fp8 if fp8 else fused_kernels.add_rms_norm
    got, want = norm(parts, res, w, 1e-6, 1.0), norm(summed, res, w, 1e-6, 1.0)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(got[-1], summed if res is None else (summed.float() + res.float()).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_head,hq,hkv,d,offset", [(True, 4, 2, 16, 0.0), (True, 3, 1, 24, 1.0),
                                                     (False, 4, 2, 16, 0.0), (False, 3, 1, 24, 0.0)])
def test_qk_norm_in_place(dtype, per_head, hq, hkv, d, offset):
    """Per head (Qwen3, Gemma 3: ``[D]`` weights) and over the whole q and k (OLMoE); head sizes off a power of
    two; v and every other row untouched."""
    g = torch.Generator().manual_seed(2)
    m = 3
    qkv = (torch.randn(m, (hq + 2 * hkv) * d, generator=g) * 3).to(DEV, dtype)
    wq = torch.randn(d if per_head else hq * d, generator=g).to(DEV, dtype)
    wk = torch.randn(d if per_head else hkv * d, generator=g).to(DEV, dtype)
    expected = qkv.clone()
    ops.qk_norm_ref(expected, wq, wk, hq, hkv, d, 1e-6, offset, per_head=per_head)
    fused = qkv.clone()
    fused_kernels.qk_norm(fused, wq, wk, hq, hkv, d, 1e-6, offset, per_head=per_head)
    assert rel_err(fused, expected) < _tol(dtype)
    v = slice((hq + hkv) * d, None)
    assert torch.equal(fused[:, v], qkv[:, v]) and not torch.equal(expected[:, : hq * d], qkv[:, : hq * d])
    heads = expected[:, : (hq + hkv) * d].float().view(m, hq + hkv, d) if per_head else None
    if per_head and offset == 0.0:  # each head normed on its own: the norm of head / weight is sqrt(D)
        w = torch.cat([wq.float().expand(hq, d), wk.float().expand(hkv, d)])
        assert torch.allclose((heads / w).pow(2).mean(-1), torch.ones(m, hq + hkv), rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "h"), [(1, 64), (3, 200)])  # 200: the gate's row and the columns off a power of two
def test_add_sigmoid_gated(dtype, m, h):
    """Qwen2-MoE's shared expert: ``y + sigmoid(x . gate) * s`` in one launch, against the model's own op chain."""
    g = torch.Generator().manual_seed(3)
    y, s, x = (torch.randn(m, h, generator=g).to(DEV, dtype) for _ in range(3))
    gate = (torch.randn(1, h, generator=g) / h**0.5).to(DEV, dtype)
    out = fused_kernels.add_sigmoid_gated(y, s, x, gate)
    ref = ops.add_sigmoid_gated_ref(y, s, x, gate)
    assert out.dtype == dtype and rel_err(out, ref) < _tol(dtype)
    assert rel_err(out, y + s) > 10 * _tol(dtype)  # the gate scales s: not the plain sum


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("write_cache", [False, True])
def test_rope_cache(dtype, write_cache):
    g = torch.Generator().manual_seed(1)
    hq, hkv, d, m = 4, 2, 16, 5
    qkv = torch.randn(m, (hq + 2 * hkv) * d, generator=g).to(DEV, dtype)
    angles = torch.rand(32, d // 2, generator=g) * 6
    cos, sin = angles.cos().to(DEV), angles.sin().to(DEV)
    positions = torch.tensor([0, 3, 7, 31, 2], dtype=torch.int32, device=DEV)
    slots = torch.tensor([1, 1, 0, 2, 3], dtype=torch.int32, device=DEV)
    caches = [torch.zeros(4, 32, hkv, d, dtype=dtype, device=DEV) for _ in range(4)] if write_cache else [None] * 4
    expected = qkv.clone()
    ops.rope_cache_ref(expected, cos, sin, positions, hq, hkv, d, caches[0], caches[1], slots if write_cache else None)
    fused_kernels.rope_cache(qkv, cos, sin, positions, hq, hkv, d, caches[2], caches[3], slots if write_cache else None)
    assert rel_err(qkv, expected) < _tol(dtype)
    if write_cache:
        assert rel_err(caches[2], caches[0]) < _tol(dtype) and caches[0].abs().sum() > 0
        assert torch.equal(caches[3], caches[1])  # values are copied, not rotated


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_act_mul(dtype, activation):
    x = torch.randn(3, 2 * 200, generator=torch.Generator().manual_seed(2)).to(DEV, dtype) * 3
    out = fused_kernels.act_mul(x, activation)
    assert rel_err(out, ops.act_mul_ref(x, activation)) < _tol(dtype) * 2


def _assert_quantized_rows(q, s, rows, input_scale):
    """``(q, s)`` is bitwise the per-token quantization kernel's result on ``rows``; the codes times the scales
    give ``rows`` back within e4m3's rounding (3 mantissa bits; the interpreter's conversion does not round to
    nearest, tests/kernels/test_fp8_quant.py)."""
    from quantkit.kernels.fp8_quant import quantize_per_token

    q2, s2 = quantize_per_token(rows, input_scale)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (rows.shape[0], 1)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    if input_scale is None:
        assert rel_err(q.float() * s, rows.float()) < 0.1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual,offset", [(False, 0.0), (True, 1.0)])
@pytest.mark.parametrize("static", [False, True])
def test_add_rms_norm_fp8_is_the_norm_then_the_quantization(dtype, with_residual, offset, static):
    """One launch giving what add_rms_norm then quantize_per_token give (bitwise: the normed rows rounded to the
    model's dtype first), the residual sum the same; an all-zero row gets the tiny scale and zero codes."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 96, generator=g).to(DEV, dtype)
    x[2] = 0
    res = torch.randn(4, 96, generator=g).to(DEV, dtype) if with_residual else None
    if res is not None:
        res[2] = 0
    w = torch.randn(96, generator=g).to(DEV)
    input_scale = torch.tensor([0.01], device=DEV) if static else None
    q, s, new_res = fused_kernels.add_rms_norm_fp8(x, res, w, 1e-6, offset, input_scale)
    out, ref_res = fused_kernels.add_rms_norm(x, res, w, 1e-6, offset)
    assert torch.equal(new_res, ref_res)
    _assert_quantized_rows(q, s, out, input_scale)
    assert not q[2].float().any() and (s[2] > 0).all()


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("inter,static", [(200, False), (200, True), (16400, False)])
def test_act_mul_fp8_is_the_activation_then_the_quantization(activation, inter, static):
    """One program a row up to fp8_quant.WHOLE_ROW_MAX values, bitwise act_mul then quantize_per_token; longer rows
    (16400) take those two launches."""
    x = torch.randn(3, 2 * inter, generator=torch.Generator().manual_seed(3)).to(DEV, torch.float16) * 3
    input_scale = torch.tensor([0.02], device=DEV) if static else None
    q, s = fused_kernels.act_mul_fp8(x, activation, input_scale)
    _assert_quantized_rows(q, s, fused_kernels.act_mul(x, activation), input_scale)
