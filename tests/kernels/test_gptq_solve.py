"""The GPTQ block kernel against the torch column loop it replaces (``gptq._columns``).

On the CPU the kernel runs in Triton's interpreter (fp32, small shapes); ``-m gpu`` repeats the
comparison on CUDA at Llama-3-8B sizes. Min/max groups (dynamic or static) and static ``mse`` groups
must give bitwise-equal codes and parameters: the arithmetic is the same op for op. Dynamic ``mse``
groups sum their shrink errors in another order than torch's reduction, so a near-tie may choose
another shrink step for a row; rows are independent, so such a row differs alone and its
H-weighted error stays within float32 noise of the reference's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from quantkit.config import QuantScheme
from quantkit.methods.gptq import GPTQConfig, _columns, damped_inverse_factor, gptq_quantize, solve_columns

# On a CUDA machine the interpreter is off and solver="triton" on CPU tensors would quietly take the loop.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines")


def _problem(rows: int, cols: int, seed: int = 0, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * cols, cols, generator=g) @ (torch.eye(cols) + 0.3 * torch.randn(cols, cols, generator=g))
    H = (2.0 / x.shape[0]) * x.t() @ x  # correlated inputs: GPTQ's updates matter
    w = torch.randn(rows, cols, generator=g) * 0.05
    return w.to(device), H.to(device)


def _reference_and_kernel(w, H, scheme, config, static_params=None):
    from quantkit.kernels.gptq_solve import block_solve_supported

    assert block_solve_supported(config.block_size, w.device) == (True, "")  # the kernel, not the loop, runs
    U, _ = damped_inverse_factor(H, config.damp, 0)
    gs = scheme.group_size if scheme.group_size != -1 else w.shape[1]
    ref = solve_columns(w, U, scheme, gs, dataclasses.replace(config, solver="torch"), static_params)
    ker = solve_columns(w, U, scheme, gs, dataclasses.replace(config, solver="triton"), static_params)
    return ref, ker


def _static(w, scheme, config, gs):
    from quantkit.methods.gptq import _static_params
    from quantkit.primitives import default_g_idx

    s, z = _static_params(w, scheme, config, gs)
    gi = default_g_idx(w.shape[1], gs).long()
    return s[gi], z[gi].float()


CASES = [  # bits, group size, sym, block
    (4, 32, True, 32), (4, 32, False, 64), (4, 64, True, 128), (3, 32, False, 128), (2, 64, True, 64),
    (8, 32, False, 32), (4, 48, True, 64), (4, 64, False, 100),
]


@pytest.mark.parametrize("bits,gs,sym,block", CASES)
def test_minmax_groups_bitwise(bits, gs, sym, block):
    """Dynamic groups (computed at group starts inside the kernel), every bit width, sym/asym, partial
    last groups (256 % 48, 256 % 100 blocks) and blocks that are not a power of two."""
    w, H = _problem(64, 256, seed=bits + gs)
    scheme, config = QuantScheme(bits, gs, sym), GPTQConfig(block_size=block)
    (c0, s0, z0), (c1, s1, z1) = _reference_and_kernel(w, H, scheme, config)
    assert torch.equal(c0, c1)
    assert torch.equal(s0, s1) and torch.equal(z0, z1)


@pytest.mark.parametrize("mse", [False, True])
@pytest.mark.parametrize("sym", [True, False])
def test_static_groups_bitwise(sym, mse):
    """Static groups (and one group for the whole row): per-column parameters read by the kernel."""
    w, H = _problem(64, 256, seed=3)
    scheme, config = QuantScheme(4, 64, sym), GPTQConfig(block_size=64, mse=mse, static_groups=True)
    (c0, _, _), (c1, _, _) = _reference_and_kernel(w, H, scheme, config, _static(w, scheme, config, 64))
    assert torch.equal(c0, c1)


def test_mse_groups_within_rounding():
    w, H = _problem(64, 256, seed=5)
    scheme, config = QuantScheme(4, 32, False), GPTQConfig(block_size=64, mse=True, mse_grid=20)
    (c0, s0, z0), (c1, s1, z1) = _reference_and_kernel(w, H, scheme, config)
    same_rows = (c0 == c1).all(dim=1)
    assert same_rows.float().mean() >= 0.95, same_rows.float().mean()
    assert torch.equal(s0[:, same_rows], s1[:, same_rows])
    assert torch.equal(z0[:, same_rows], z1[:, same_rows])


@pytest.mark.parametrize("mse_weight", ["hessian", "residual"])
def test_weighted_mse_groups_within_rounding(mse_weight):
    """The mse search weighted per column (``mse_weight``): kernel and loop agree as unweighted, and the
    weights reach both (the result differs from the unweighted search's)."""
    from quantkit.methods.gptq import mse_column_weights

    w, H = _problem(64, 256, seed=5)
    w[:, ::7] *= 4  # a few wide columns, so a weight that ignores them moves the chosen ranges
    scheme = QuantScheme(4, 32, False)
    config = GPTQConfig(block_size=64, mse=True, mse_grid=20, mse_weight=mse_weight)
    U, _ = damped_inverse_factor(H, config.damp, 0)
    cw = mse_column_weights(config, H, U, None)
    assert cw is not None and cw.shape == (256,) and abs(float(cw.mean()) - 1) < 1e-5
    c0, s0, z0 = solve_columns(w, U, scheme, 32, dataclasses.replace(config, solver="torch"), None, cw)
    c1, s1, z1 = solve_columns(w, U, scheme, 32, dataclasses.replace(config, solver="triton"), None, cw)
    same_rows = (c0 == c1).all(dim=1)
    assert same_rows.float().mean() >= 0.95, same_rows.float().mean()
    assert torch.equal(s0[:, same_rows], s1[:, same_rows]) and torch.equal(z0[:, same_rows], z1[:, same_rows])
    _, s_plain, _ = solve_columns(w, U, scheme, 32, dataclasses.replace(config, solver="triton", mse_weight="none"),
                                  None, None)
    assert not torch.equal(s1, s_plain)


@pytest.mark.parametrize("mse_weight", ["hessian", "residual"])
@pytest.mark.parametrize("desc_act", [False, True])
def test_weighted_mse_through_gptq_quantize(mse_weight, desc_act):
    """The whole gptq_quantize, dynamic and static groups: static parameters (weights mapped back to
    the original column order) are computed once by torch, so those codes are bitwise equal."""
    w, H = _problem(64, 256, seed=13)
    scheme = QuantScheme(4, 64, True)
    for static in (False, True):
        base = GPTQConfig(block_size=64, desc_act=desc_act, mse=True, mse_grid=20, mse_weight=mse_weight,
                          static_groups=static)
        ref = gptq_quantize(w, H, scheme, dataclasses.replace(base, solver="torch"))
        ker = gptq_quantize(w, H, scheme, dataclasses.replace(base, solver="triton"))
        if static:
            assert torch.equal(ref.codes, ker.codes) and torch.equal(ref.scales, ker.scales)
        else:
            assert (ref.codes == ker.codes).all(dim=1).float().mean() >= 0.95
            assert abs(ker.err_gptq - ref.err_gptq) <= 1e-3 * ref.err_gptq


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_quantize_through_kernel(desc_act):
    """The whole gptq_quantize with the kernel (act-order permutation applied outside it)."""
    w, H = _problem(64, 256, seed=7)
    scheme = QuantScheme(4, 32, True)
    ref = gptq_quantize(w, H, scheme, GPTQConfig(block_size=64, desc_act=desc_act, solver="torch"))
    ker = gptq_quantize(w, H, scheme, GPTQConfig(block_size=64, desc_act=desc_act, solver="triton"))
    assert torch.equal(ref.codes, ker.codes) and torch.equal(ref.g_idx, ker.g_idx)
    assert torch.equal(ref.scales, ker.scales) and torch.equal(ref.zeros, ker.zeros)


@pytest.mark.parametrize("bits,gs,sym,block,mse,static,weighted", [
    (4, 32, True, 64, False, False, False), (3, 48, False, 96, False, False, False),
    (4, 32, False, 64, True, False, False), (4, 32, False, 64, True, False, True),
    (8, 64, True, 32, False, True, False),
])
def test_every_scaled_error_bitwise(bits, gs, sym, block, mse, static, weighted):
    """Not only the codes (a last-bit difference rarely flips one): every column's scaled error
    ``(w - dq) / U_ii``, which carries every op of the in-block update and of the trailing GEMM's input."""
    from quantkit.kernels.gptq_solve import gptq_columns_triton

    w, H = _problem(32, 192, seed=11)
    scheme, config = QuantScheme(bits, gs, sym), GPTQConfig(block_size=block, mse=mse, mse_grid=20)
    U, _ = damped_inverse_factor(H, config.damp, 0)
    params = _static(w, scheme, config, gs) if static else None
    cw = torch.diagonal(U).pow(-2) if weighted else None
    e_ref, e_ker = torch.zeros(192, 32), torch.zeros(192, 32)
    c_ref, _ = _columns(w, U, scheme, gs, config, params, errors=e_ref, mse_weight=cw)
    c_ker, _, _ = gptq_columns_triton(w, U, bits, sym, gs, block, params, mse, config.mse_max_shrink,
                                      config.mse_grid, config.search_norm, errors=e_ker, mse_weight=cw)
    assert torch.equal(c_ref, c_ker)
    assert torch.equal(e_ref, e_ker), (e_ref - e_ker).abs().max()


def test_loop_is_the_reference():
    """solve_columns with solver='torch' is _columns unchanged (the baseline of these tests)."""
    w, H = _problem(16, 64, seed=9)
    U, _ = damped_inverse_factor(H, 0.01, 0)
    scheme, config = QuantScheme(4, 32, True), GPTQConfig(block_size=32, solver="torch")
    codes, groups = _columns(w, U, scheme, 32, config, None)
    c, s, _ = solve_columns(w, U, scheme, 32, config, None)
    assert torch.equal(codes, c) and torch.equal(torch.stack([g[0] for g in groups]), s)


def test_capability_check():
    from quantkit.kernels.gptq_solve import block_solve_supported

    ok, reason = block_solve_supported(512, torch.device("cuda"))
    assert not ok and "512" in reason
    assert block_solve_supported(128, torch.device("cuda")) == (True, "")


_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from quantkit.kernels.gptq_solve import _gptq_block_kernel

static, mse, weighted, sym, block, tile, warps, out = json.loads(sys.argv[1])
signature = {"wt_ptr": "*fp32", "u_ptr": "*fp32", "codes_ptr": "*i32", "err_ptr": "*fp32", "cscale_ptr": "*fp32",
             "czero_ptr": "*fp32", "gscale_ptr": "*fp32", "gzero_ptr": "*i32", "shrink_ptr": "*fp32", "cw_ptr": "*fp32", "i1": "i32",
             "n_cols": "i32", "n_out": "i32", "ld_u": "i32", "gs": "i32", "inv_maxq": "fp32", "inv_maxq_m1": "fp32",
             "norm": "fp32"}
constexprs = dict(BLOCK=block, TILE=tile, MAXQ=15, SYM=sym, STATIC=static, MSE=mse, N_SHRINK=20 if mse else 0,
                  RECIP=True, EMULATE=False, WEIGHTED=weighted)
signature |= {k: "constexpr" for k in constexprs}
src = ASTSource(fn=_gptq_block_kernel, signature=signature, constexprs=constexprs, attrs={})
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "enable_fp_fusion": False})
open(out + ".ptx", "w").write(kernel.asm["ptx"])
"""


@pytest.mark.parametrize("static,mse,weighted,sym,block,tile,warps", [(False, True, True, False, 128, 8, 1),
                                                                      (True, False, False, True, 256, 16, 4)])
def test_compiles_for_sm90_with_ieee_arithmetic(sm90, tmp_path, static, mse, weighted, sym, block, tile, warps):
    """The compiled path (no interpreter): it builds for sm_90, divides with IEEE rounding (``div.rn``, as
    torch does), keeps the in-block update as fused multiply-adds, and does not spill."""
    import json

    out = str(tmp_path / "k")
    sm90.compile(_COMPILE, json.dumps([static, mse, weighted, sym, block, tile, warps, out]))
    ptx = open(out + ".ptx").read()
    assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx.f32" not in ptx
    assert ptx.count("fma.rn.f32") >= block * tile // (32 * warps)  # the rank-1 update: an fma per element
    assert "0 bytes spill stores" in sm90.ptxas_notices(out + ".ptx")


def test_solver_option_is_validated():
    from quantkit.config import QuantkitError

    with pytest.raises(QuantkitError, match="solver"):
        GPTQConfig(solver="cuda")
