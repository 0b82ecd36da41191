"""The decode GEMV (kernels/gemv.py) against its float32 reference: under Triton's interpreter on the CPU (fp16 and
fp32: bf16 is broken there), its sm_90 machine code compiled on the CPU, and in bf16 on CUDA at Llama-3-8B shapes
against cuBLAS (``-m gpu``)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from quantkit.kernels.dispatch import _gemv_wanted, dense_linear
from quantkit.kernels.gemv import TUNED_M1, DenseGemvConfig, _gemv_config, gemv, gemv_ref, gemv_supports

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _rel(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _problem(m, n, k, dtype, bias, seed=0, device=DEV):
    gen = torch.Generator(device=device).manual_seed(seed)  # on the device: the 8B lm_head is 0.5 G values
    x = torch.randn(m, k, generator=gen, device=device).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen, device=device).to(dtype) if bias else None
    return x, w, b


# small odd sizes: N and K not multiples of the tile, the last row tile partly past N, K tiles masked
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k,bias,dtype,cfg", [
    (37, 100, True, torch.float16, DenseGemvConfig(8, 32, 1)),
    (50, 64, False, torch.float32, DenseGemvConfig(4, 16, 2)),  # K a multiple of the tile: the unmasked loop
    (9, 300, True, torch.float32, DenseGemvConfig(2, 128, 4)),
])
def test_matches_reference(m, n, k, bias, dtype, cfg):
    x, w, b = _problem(m, n, k, dtype, bias, seed=m)
    y = gemv(x, w, b, cfg)
    assert y.shape == (m, n) and y.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-3  # fp16: the output rounding only
    assert _rel(y, gemv_ref(x, w, b)) < tol


def test_default_config_and_strided_rows():
    """config=None (BLOCK_K shrunk to a small K) and x rows with a stride: a view into a wider buffer."""
    x_wide, w, b = _problem(3, 21, 80, torch.float16, True)
    x = torch.randn(3, 200, dtype=torch.float16)[:, :80]
    x.copy_(x_wide)
    assert _gemv_config(3, 21, 80).block_k == 128
    assert _rel(gemv(x, w, b), gemv_ref(x, w, b)) < 1e-3


def test_capability_check():
    x, w, _ = _problem(1, 8, 16, torch.float16, False)
    assert gemv_supports(x, w) == (True, "")
    ok, reason = gemv_supports(torch.zeros(5, 16, dtype=torch.float16), w)
    assert not ok and "1..4" in reason
    ok, reason = gemv_supports(x.float(), w)
    assert not ok and "dtype" in reason
    ok, reason = gemv_supports(x, w.T.contiguous().T)
    assert not ok and "contiguous" in reason
    ok, reason = gemv_supports(torch.zeros(1, 15, dtype=torch.float16), w)
    assert not ok and "features" in reason
    with pytest.raises(ValueError, match="bias"):
        gemv(x, w, torch.zeros(7, dtype=torch.float16))


def test_config_validation():
    with pytest.raises(ValueError, match="power of two"):
        DenseGemvConfig(3, 2048, 8)


def test_config_choice():
    assert _gemv_config(1, 28672, 4096) == TUNED_M1[(28672, 4096)]  # the measured table
    assert _gemv_config(1, 1000, 4096) == DenseGemvConfig(2, 1024, 4)  # a shape the table lacks: the M = 1 default
    assert _gemv_config(2, 4096, 4096) == DenseGemvConfig(2, 2048, 8)
    assert _gemv_config(4, 4096, 4096) == DenseGemvConfig(2, 1024, 4)


def test_selection(monkeypatch):
    """The GEMV takes decode-sized 16-bit linears on CUDA only; QUANTKIT_BF16_GEMV=0 sends them to cuBLAS."""
    monkeypatch.delenv("QUANTKIT_BF16_GEMV", raising=False)
    assert _gemv_wanted("cuda", 1, torch.bfloat16) and _gemv_wanted("cuda", 1, torch.float16)
    assert not _gemv_wanted("cuda", 4, torch.bfloat16)  # measured slower than cuBLAS at M = 4
    assert not _gemv_wanted("cuda", 5, torch.bfloat16)  # prefill: cuBLAS
    assert not _gemv_wanted("cuda", 1, torch.float32)
    assert not _gemv_wanted("cpu", 1, torch.bfloat16)
    monkeypatch.setenv("QUANTKIT_BF16_GEMV", "0")
    assert not _gemv_wanted("cuda", 1, torch.bfloat16)


def test_runtime_linear_goes_through_the_selection_point(monkeypatch):
    from quantkit.kernels import dispatch
    from quantkit.runtime.weights import Linear

    calls = []

    def spy(x, weight, bias=None):
        calls.append(x.shape)
        return F.linear(x, weight, bias)

    monkeypatch.setattr(dispatch, "dense_linear", spy)
    x, w, b = _problem(2, 6, 8, torch.float32, True, device="cpu")
    y = Linear(6, dense=w, bias=b)(x)
    assert calls == [(2, 8)] and torch.allclose(y, F.linear(x, w, b))
    assert torch.equal(dense_linear(x, w, b), F.linear(x, w, b))  # on the CPU: cuBLAS's stand-in
    Linear(6, dense=w, bias=b, gemv=False)(x)  # the reference backend's: plain PyTorch
    assert calls == [(2, 8)]


_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from quantkit.kernels.gemv import _gemv_kernel

x_ty, w_ty, warps, constexprs, out = json.loads(sys.argv[1])
signature = {"x_ptr": x_ty, "w_ptr": w_ty, "b_ptr": "*bf16", "y_ptr": "*bf16", "N": "i32", "K": "i32",
             "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", "xs_ptr": "*fp32", "ws_ptr": "*fp32"}
signature |= {k: "constexpr" for k in constexprs}
attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 5, 6, 7, 8)}
src = ASTSource(fn=_gemv_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 1})
open(out + ".ptx", "w").write(kernel.asm["ptx"])
open(out + ".cubin", "wb").write(kernel.asm["cubin"])
"""


def compile_gemv_sm90(sm90, out: str, x_ty: str, w_ty: str, warps: int, **constexprs) -> None:
    """``_gemv_kernel`` compiled for sm_90 into ``out``.ptx / .cubin: x and W of Triton pointer types ``x_ty`` /
    ``w_ty``, no bias, K a multiple of BLOCK_K, PDL on, and ``constexprs`` (M, BLOCK_N, BLOCK_K, SCALED, ...)."""
    constexprs = {"HAS_BIAS": False, "EVEN_K": True, "PDL": True} | constexprs
    sm90.compile(_COMPILE, json.dumps([x_ty, w_ty, warps, constexprs, out]))


@pytest.mark.parametrize("m,block_n,block_k,warps", [(1, 4, 2048, 8), (4, 2, 1024, 4)])
def test_sm90_loads_weights_before_the_wait(sm90, tmp_path, m, block_n, block_k, warps):
    """The compiled kernel requests its first weight tile (16-byte loads) before ``griddepcontrol.wait``
    (ACQBULK), lets the next kernel launch there (PREEXIT), exchanges nothing through shared memory in its
    loop, and does not spill."""
    out = str(tmp_path / "gemv")
    compile_gemv_sm90(sm90, out, "*bf16", "*bf16", warps, M=m, BLOCK_N=block_n, BLOCK_K=block_k, SCALED=False)
    sass = sm90.sass(out + ".cubin")
    wait = next(i for i, line in enumerate(sass) if "ACQBULK" in line)
    tile_loads = block_n * block_k * 2 // (16 * 32 * warps)
    assert sum("LDG.E.128" in line for line in sass[:wait]) == tile_loads
    assert any("PREEXIT" in line for line in sass[:wait])
    loop_end = next(i for i in range(wait, len(sass)) if "BRA" in sass[i])
    assert not any(op in line for line in sass[wait:loop_end] for op in ("BAR.SYNC", "STS", "LDS"))
    assert "0 bytes spill stores" in sm90.ptxas_notices(out + ".ptx")


# Llama-3-8B's decode linears: qkv, o, gate_up, down, lm_head
SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES_8B)
@pytest.mark.parametrize("m", [1, 2, 4])
def test_bf16_8b_shapes_match_cublas(n, k, m):
    """bf16 at the 8B shapes: the GEMV rounds a float32 sum once, so it is within the output rounding (~1.1e-3
    relative) of the float32 product; against cuBLAS (which may reduce split-K partials in bf16) a looser check."""
    x, w, b = _problem(m, n, k, torch.bfloat16, m == 2, seed=n + k + m, device="cuda")
    y = gemv(x, w, b)
    ref = x.float() @ w.float().T + (0 if b is None else b.float())
    assert _rel(y, ref) < 3e-3
    assert _rel(y, F.linear(x, w, b)) < 1e-2
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_selection_point_on_cuda(monkeypatch):
    """dense_linear at M = 1 is the GEMV's result (bitwise), at M = 16 and with the switch off cuBLAS's."""
    x, w, _ = _problem(1, 4096, 4096, torch.bfloat16, False, device="cuda")
    assert torch.equal(dense_linear(x, w), gemv(x, w))
    monkeypatch.setenv("QUANTKIT_BF16_GEMV", "0")
    assert torch.equal(dense_linear(x, w), F.linear(x, w))
    x16 = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(dense_linear(x16, w), F.linear(x16, w))


@pytest.mark.parametrize("m,block_n,block_k,warps,prefetch", [(1, 2, 2048, 4, False), (4, 2, 2048, 4, False),
                                                              (1, 8, 1024, 4, True), (1, 2, 4096, 8, True)])
def test_sm90_fp8_variant_loads_16_byte_vectors_before_the_wait(sm90, tmp_path, m, block_n, block_k, warps,
                                                                 prefetch):
    """The FP8 GEMV (SCALED, e4m3 codes) compiles for sm_90 with the same shape of code: its first weight tile in
    16-byte loads (16 codes each) before ``griddepcontrol.wait``, no shared memory in the loop, no spills; with the
    next tile requested a step ahead (PREFETCH) too."""
    out = str(tmp_path / "gemv_fp8")
    compile_gemv_sm90(sm90, out, "*fp8e4nv", "*fp8e4nv", warps, M=m, BLOCK_N=block_n, BLOCK_K=block_k, SCALED=True,
                      PREFETCH=prefetch)
    sass = sm90.sass(out + ".cubin")
    wait = next(i for i, line in enumerate(sass) if "ACQBULK" in line)
    assert sum("LDG.E.128" in line for line in sass[:wait]) == block_n * block_k // (16 * 32 * warps)
    loop_end = next(i for i in range(wait, len(sass)) if "BRA" in sass[i])
    assert not any(op in line for line in sass[wait:loop_end] for op in ("BAR.SYNC", "STS", "LDS"))
    assert "0 bytes spill stores" in sm90.ptxas_notices(out + ".ptx")
