"""The per-token FP8 activation quantization kernel against its plain-PyTorch reference (bit for bit)."""

from __future__ import annotations

import json

import pytest
import torch

from quantkit.kernels.fp8_quant import quantize_per_token
from quantkit.kernels.fp8_quant_ref import quantize_per_token_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m,k", [(1, 64), (5, 300), (3, 4096), (3, 14336), (3, 20000)])  # the last: rows in blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("static", [False, True])
def test_matches_the_reference_exactly(m, k, dtype, static):
    torch.manual_seed(0)
    x = (torch.randn(m, k) * torch.logspace(-2, 2, m).unsqueeze(1)).to(dtype).to(DEVICE)
    if m > 2:
        x[1] = 0  # an all-zero row gets the tiny scale, not a division by zero
    scale = torch.tensor([0.01], device=DEVICE) if static else None
    q, s = quantize_per_token(x, scale)
    q_ref, s_ref = quantize_per_token_ref(x, scale)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (m, 1)
    assert torch.equal(s, s_ref)
    assert_same_codes(q, q_ref, x.float() / s_ref)


def assert_same_codes(q, q_ref, scaled):
    """Equal codes on the GPU. Triton 3.6's interpreter converts float32 to e4m3 its own way (ties not to even, a
    carry into the next binade lost: 124.3 -> 64): under it each code must be one of the two e4m3 neighbours of
    the scaled value, and most must be equal."""
    if DEVICE != "cpu":
        assert torch.equal(q.float(), q_ref.float())
        return
    got, ref, scaled = q.float(), q_ref.float(), scaled.clamp(-448, 448)  # static scales saturate
    step = torch.pow(2.0, torch.floor(torch.log2(scaled.abs().clamp_min(2**-6))) - 3)
    ok = (got - scaled).abs() <= step + 1e-6
    carry = (got.abs() * 2 == ref.abs()) & (torch.log2(ref.abs()) == torch.log2(ref.abs()).round())
    assert (ok | carry).all()
    assert (got == ref).float().mean() > 0.95


@pytest.mark.gpu
def test_bfloat16_on_the_gpu():
    torch.manual_seed(0)
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16) * 3
    q, s = quantize_per_token(x)
    q_ref, s_ref = quantize_per_token_ref(x)
    assert torch.equal(s, s_ref) and torch.equal(q.float(), q_ref.float())


@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_gemv_equals_the_scaled_product_of_codes(m, bias):
    from quantkit.kernels.gemv import gemv
    from quantkit.methods.fp8 import FP8Config, fp8_quantize_weight

    torch.manual_seed(0)
    rec, _ = fp8_quantize_weight(torch.randn(96, 320) * 0.1, FP8Config())
    w, ws = rec.weight.to(DEVICE), rec.weight_scale.reshape(1, -1).contiguous().to(DEVICE)
    qx, sx = quantize_per_token_ref(torch.randn(m, 320, device=DEVICE))
    b = torch.randn(96, device=DEVICE).to(torch.bfloat16) if bias else None
    y = gemv(qx, w, b, scales=(sx, ws))
    want = (qx.float() @ w.float().T) * sx * ws + (b.float() if bias else 0)
    assert y.dtype == torch.bfloat16
    assert ((y.float() - want).norm() / want.norm()).item() < 4e-3  # one bfloat16 rounding of the result


_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from quantkit.kernels.fp8_quant import _quant_row_kernel

static, block_k, whole, warps, out = json.loads(sys.argv[1])
signature = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "static_ptr": "*fp32", "K": "i32",
             "stride_xm": "i32", "stride_qm": "i32"}
constexprs = dict(STATIC=static, BLOCK_K=block_k, WHOLE_ROW=whole, PDL=True)  # PDL: as launched on Hopper
signature |= {k: "constexpr" for k in constexprs}
src = ASTSource(fn=_quant_row_kernel, signature=signature, constexprs=constexprs)
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
open(out + ".ptx", "w").write(kernel.asm["ptx"])
open(out + ".cubin", "wb").write(kernel.asm["cubin"])
"""


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("block_k,whole,warps", [(2048, False, 8), (16384, True, 16)])  # looped rows; the longest held
def test_kernel_compiles_for_sm90_with_hardware_e4m3_conversion(sm90, tmp_path, static, block_k, whole, warps):
    """The launcher's kernel builds for Hopper (globals as constexpr, the fp8 store) and converts with the
    saturating round-to-nearest instruction (``cvt.rn.satfinite.e4m3x2.f32``), as torch's cast rounds; a whole row
    of the longest length held in registers does not spill; it lets the next kernel launch and waits for the
    previous one before reading (PDL, as the decoder's other small kernels)."""
    out = str(tmp_path / "quant")
    sm90.compile(_COMPILE, json.dumps([static, block_k, whole, warps, out]))
    ptx = open(out + ".ptx").read()
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    launch, wait = ptx.find("griddepcontrol.launch_dependents"), ptx.find("griddepcontrol.wait")
    assert 0 <= launch < wait < ptx.find("ld.global")
    assert "0 bytes spill stores" in sm90.ptxas_notices(out + ".ptx")
