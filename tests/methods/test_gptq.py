"""GPTQ core on synthetic Hessians with known answers, and GPTQ through the walker on a tiny Llama."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from quantkit.config import QuantkitError, QuantScheme
from quantkit.methods import gptq
from quantkit.methods.gptq import (
    GPTQConfig,
    HessianAccumulator,
    damped_inverse_factor,
    gptq_quantize,
    output_error,
)
from quantkit.methods.gptq_method import GPTQMethod
from quantkit.methods.rtn import RTNMethod, rtn_quantize
from quantkit.primitives import dequantize
from quantkit.qtensor import QuantizedWeight


def correlated_inputs(n: int, d: int, seed: int) -> torch.Tensor:
    """``[n, d]`` activations with strongly correlated channels and a few large ones (LLM-like)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g) / d**0.5 + torch.eye(d)
    x = torch.randn(n, d, generator=g) @ mix
    return x * (1 + 4 * torch.rand(d, generator=g))


def hessian(x: torch.Tensor) -> torch.Tensor:
    acc = HessianAccumulator(x.shape[-1])
    acc.add(x)
    return acc.H


def test_hessian_running_mean_matches_one_shot():
    x = correlated_inputs(3000, 48, 0)
    acc = HessianAccumulator(48, chunk_rows=700)
    for part in x.split([1000, 1, 1999]):
        acc.add(part.reshape(1, -1, 48) if part.shape[0] > 1 else part)
    assert acc.n == 3000
    torch.testing.assert_close(acc.H, 2 * x.t() @ x / 3000, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("sym", [True, False])
def test_identity_hessian_equals_rtn(bits, group_size, sym):
    torch.manual_seed(bits + group_size)
    w = torch.randn(40, 192)  # 192 at g128: one full group and a partial one
    scheme = QuantScheme(bits, group_size, sym)
    res = gptq_quantize(w, torch.eye(192), scheme)
    rtn = rtn_quantize(w, scheme)
    assert torch.equal(res.codes, rtn.codes)
    assert torch.equal(res.scales, rtn.scales) and torch.equal(res.zeros, rtn.zeros)
    assert torch.equal(res.g_idx, rtn.g_idx)
    assert res.err_gptq == pytest.approx(res.err_rtn, rel=1e-5)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("desc_act,static", [(False, False), (True, False), (True, True)])
def test_gptq_beats_rtn_on_correlated_inputs(sym, desc_act, static):
    gains = []
    for seed in range(3):
        torch.manual_seed(seed)
        H = hessian(correlated_inputs(4096, 128, seed))
        w = torch.randn(64, 128)
        res = gptq_quantize(w, H, QuantScheme(4, 32, sym), GPTQConfig(desc_act=desc_act, static_groups=static))
        # The reported errors are the H-weighted errors of what the record dequantizes to.
        assert res.err_gptq == pytest.approx(output_error(w, res.dequantize(), H), rel=1e-5)
        assert res.err_gptq <= res.err_rtn
        gains.append(res.err_rtn / res.err_gptq)
    assert sum(gains) / len(gains) > 1.2


@pytest.mark.parametrize("static", [False, True])
def test_act_order_g_idx_is_valid_grouping(static):
    torch.manual_seed(0)
    H = hessian(correlated_inputs(2048, 96, 1))
    w = torch.randn(32, 96)
    res = gptq_quantize(w, H, QuantScheme(4, 32, False), GPTQConfig(desc_act=True, static_groups=static))
    counts = torch.bincount(res.g_idx.long(), minlength=3)
    assert counts.tolist() == [32, 32, 32]
    perm = torch.argsort(torch.diagonal(H), descending=True)
    if static:
        assert torch.equal(res.g_idx.long(), torch.arange(96) // 32)
    else:
        # Groups follow the act-order permutation: position j of the order is in group j // 32.
        assert torch.equal(res.g_idx.long()[perm], torch.arange(96) // 32)
    qw = QuantizedWeight.from_codes(res.codes, res.scales, res.zeros, res.g_idx, QuantScheme(4, 32, False))
    torch.testing.assert_close(qw.dequantize(), res.dequantize(), rtol=0, atol=0)


def test_partial_last_group():
    torch.manual_seed(0)
    H = hessian(correlated_inputs(2048, 576, 2))
    w = torch.randn(16, 576)
    for desc_act in (False, True):
        res = gptq_quantize(w, H, QuantScheme(4, 128, True), GPTQConfig(desc_act=desc_act))
        assert res.scales.shape == (5, 16)
        assert torch.bincount(res.g_idx.long()).tolist() == [128, 128, 128, 128, 64]
        assert res.err_gptq < res.err_rtn


def test_dead_columns():
    torch.manual_seed(0)
    x = correlated_inputs(2048, 64, 3)
    x[:, [5, 17, 40]] = 0
    H = hessian(x)
    w = torch.randn(24, 64)
    res = gptq_quantize(w, H, QuantScheme(4, 32, False), GPTQConfig(desc_act=True))
    dq = res.dequantize()
    assert torch.isfinite(dq).all()
    assert (dq[:, [5, 17, 40]] == 0).all()
    assert res.err_gptq < res.err_rtn


def test_singular_hessian_escalates_damping_with_warning():
    H = torch.ones(32, 32)  # rank one
    H[0, 0] = -1.0  # indefinite: no small damping makes it positive definite
    with pytest.warns(RuntimeWarning, match="escalating damping"):
        U, damp = damped_inverse_factor(H, 0.01, 4, name="layers.0.q")
    assert damp > 0.01 and torch.isfinite(U).all()
    with pytest.raises(FloatingPointError, match="layers.0.q"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        damped_inverse_factor(H, 0.0, 0, name="layers.0.q")


def test_nan_is_reported_with_the_layer_name():
    H = torch.eye(32)
    w = torch.randn(8, 32)
    w[3, 4] = float("nan")
    with pytest.raises(FloatingPointError, match="model.layers.7.mlp.down_proj"):
        gptq_quantize(w, H, QuantScheme(4, 32, True), name="model.layers.7.mlp.down_proj")


def test_no_nan_with_extreme_weights_and_mse():
    torch.manual_seed(0)
    H = hessian(correlated_inputs(1024, 64, 4))
    w = torch.randn(16, 64) * 1e-3
    w[0] = 0.0  # an all-zero row
    w[1, :8] = 50.0  # an outlier group
    for bits in (2, 3, 4, 8):
        res = gptq_quantize(w, H, QuantScheme(bits, 32, False), GPTQConfig(mse=True, desc_act=True))
        assert torch.isfinite(res.dequantize()).all()
        assert (res.dequantize()[0] == 0).all()


def test_mse_scales_not_worse_than_minmax_in_weight_error():
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    w[:, ::16] *= 6  # outliers make a shrunk range pay off
    H = torch.eye(128)
    plain = gptq_quantize(w, H, QuantScheme(3, 32, False))
    mse = gptq_quantize(w, H, QuantScheme(3, 32, False), GPTQConfig(mse=True))
    assert mse.err_gptq < plain.err_gptq


@pytest.mark.parametrize("desc_act,static", [(False, False), (True, False), (True, True)])
def test_hessian_weighted_mse_minimizes_gptqs_objective_on_a_diagonal_hessian(desc_act, static):
    """With ``H`` diagonal GPTQ moves no error between columns, so its objective ``tr(dW H dW^T)`` is
    ``sum_j H_jj dw_j^2`` group by group: exactly what ``mse_weight="hessian"`` (norm 2) minimizes over the
    shrink grid. So every row's error is at most the unweighted search's (same grid, same norm), and
    lower where a few heavy channels sit among light ones (act-order and static groups: the weights must
    follow the columns through the permutation)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 128, generator=g)
    w[:, ::9] *= 5  # wide columns: where the range is clipped matters
    d = torch.rand(128, generator=g) * 0.1 + 0.01
    d[::5] *= 300  # heavy input channels, spread over every group
    H = torch.diag(d)
    scheme = QuantScheme(4, 32, False)
    base = GPTQConfig(mse=True, desc_act=desc_act, static_groups=static)
    plain = gptq_quantize(w, H, scheme, GPTQConfig(**{**base.__dict__, "mse_weight": "none", "mse_norm": 2.0}))
    weighted = gptq_quantize(w, H, scheme, GPTQConfig(**{**base.__dict__, "mse_weight": "hessian"}))
    assert (weighted.row_err_gptq <= plain.row_err_gptq * (1 + 1e-5)).all()
    assert weighted.err_gptq < 0.97 * plain.err_gptq, (weighted.err_gptq, plain.err_gptq)


def test_mse_weight_options():
    assert GPTQConfig().mse_weight == "none" and GPTQConfig().search_norm == 2.4  # the plain algorithm
    assert GPTQConfig(mse_weight="hessian").search_norm == 2.0
    assert GPTQConfig(mse_weight="hessian", mse_norm=2.4).search_norm == 2.4
    with pytest.raises(QuantkitError, match="mse_weight"):
        GPTQConfig(mse_weight="diag")


def test_config_validation():
    with pytest.raises(QuantkitError):
        GPTQConfig(damp=-0.1)
    with pytest.raises(QuantkitError):
        GPTQConfig(block_size=0)
    with pytest.raises(QuantkitError):
        GPTQConfig(mse_max_shrink=1.5)


# ----------------------------------------------------------------------------- through the walker


@pytest.fixture(scope="module")
def tiny_model_and_data():
    from transformers import LlamaForCausalLM

    from tests.conftest import tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    # "Calibration-like" data: token sequences from a small Markov chain, so inputs are structured.
    g = torch.Generator().manual_seed(1)
    trans = torch.softmax(torch.randn(256, 256, generator=g) * 3, dim=-1)
    ids = torch.zeros(24, 48, dtype=torch.long)
    ids[:, 0] = torch.randint(0, 256, (24,), generator=g)
    for t in range(1, 48):
        ids[:, t] = torch.multinomial(trans[ids[:, t - 1]], 1, generator=g).squeeze(1)
    return model, ids[:16], ids[16:]


def _logit_error(model, quantized, ids) -> float:
    with torch.no_grad():
        ref = model(ids).logits
        out = quantized(ids).logits
    return float((out - ref).norm() / ref.norm())


@pytest.mark.parametrize("config", [GPTQConfig(), GPTQConfig(desc_act=True),
                                    GPTQConfig(true_sequential=False)])
def test_walker_gptq_closer_to_fp_than_rtn(tiny_model_and_data, config):
    from quantkit.calibrate.walker import walk

    model, calib, held_out = tiny_model_and_data
    scheme = QuantScheme(4, 32, True)
    rtn_model, gptq_model = copy.deepcopy(model), copy.deepcopy(model)
    walk(rtn_model, RTNMethod(scheme), device="cpu")
    result = walk(gptq_model, GPTQMethod(scheme, config), device="cpu", token_ids=calib, batch_size=4)
    assert len(result.weights) == 2 * 7
    stats = result.layer_stats[1]["linears"]
    assert set(stats["self_attn.q_proj"]) >= {"err_rtn", "err_gptq", "seconds", "damp"}
    assert all(s["err_gptq"] < s["err_rtn"] for s in stats.values())
    assert _logit_error(model, gptq_model, held_out) < _logit_error(model, rtn_model, held_out)


def test_single_pass_equals_group_by_group(tiny_model_and_data):
    """One forward with groups quantized inside it gives the same codes as one pass per group."""
    from quantkit.calibrate.walker import walk

    model, calib, _ = tiny_model_and_data
    scheme = QuantScheme(4, 32, False)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    ra = walk(a, GPTQMethod(scheme, GPTQConfig()), device="cpu", token_ids=calib, batch_size=4)
    rb = walk(b, GPTQMethod(scheme, GPTQConfig(single_pass_max_tokens=0)), device="cpu", token_ids=calib,
              batch_size=4)
    for name, qa in ra.weights.items():
        qb = rb.weights[name]
        # Batched and per-batch matmuls may round differently: allow a rare code flip.
        mismatch = (qa.dequantize() != qb.dequantize()).float().mean().item()
        assert mismatch < 0.01, name


def test_checkpoint_extra():
    method = GPTQMethod(QuantScheme(4, 128, True), GPTQConfig(desc_act=True, damp=0.02))
    assert method.checkpoint_extra() == {"desc_act": True, "static_groups": False, "damp_percent": 0.02,
                                         "true_sequential": True}
    assert method.name == "gptq" and method.needs_calibration


def test_dequantize_through_g_idx_matches_record():
    torch.manual_seed(0)
    H = hessian(correlated_inputs(1024, 64, 5))
    res = gptq_quantize(torch.randn(8, 64), H, QuantScheme(4, 32, True), GPTQConfig(desc_act=True))
    manual = dequantize(res.codes, res.scales, res.zeros, res.g_idx)
    assert torch.equal(manual, res.dequantize())


@pytest.mark.parametrize("config", [GPTQConfig(), GPTQConfig(single_pass_max_tokens=0),
                                    GPTQConfig(true_sequential=False)], ids=["single-pass", "by-group", "one-pass"])
def test_same_input_linears_share_one_hessian_and_solve(tiny_model_and_data, config, monkeypatch):
    """q/k/v and gate/up read one input: one Hessian each and one stacked solve (4 per layer, not 7)."""
    from quantkit.calibrate.walker import walk
    from quantkit.methods import gptq_method

    model, calib, _ = tiny_model_and_data
    built, solved = [], []
    real_acc, real_solve = gptq_method.HessianAccumulator, gptq_method.gptq_quantize

    def counting_acc(*args, **kwargs):
        built.append(args[0])
        return real_acc(*args, **kwargs)

    def counting_solve(w, H, *args, **kwargs):
        solved.append((tuple(w.shape), kwargs.get("name", "")))
        return real_solve(w, H, *args, **kwargs)

    monkeypatch.setattr(gptq_method, "HessianAccumulator", counting_acc)
    monkeypatch.setattr(gptq_method, "gptq_quantize", counting_solve)
    walk(copy.deepcopy(model), GPTQMethod(QuantScheme(4, 32, True), config), device="cpu", token_ids=calib,
         batch_size=4)
    n_layers = model.config.num_hidden_layers
    assert len(built) == 4 * n_layers and len(solved) == 4 * n_layers
    names = [n.split(".", 3)[-1] for _, n in solved[:4]]
    assert "self_attn.q_proj+self_attn.k_proj+self_attn.v_proj" in names[0]
    assert any("mlp.gate_proj+mlp.up_proj" in n for n in names)


@pytest.mark.parametrize("desc_act", [False, True])
def test_inverse_factor_equals_the_three_step_reference(desc_act):
    """``damped_inverse_factor`` (one Cholesky of the reversed matrix and an in-place triangular inverse)
    gives the upper Cholesky factor of the damped inverse that ``cholesky(cholesky_inverse(cholesky(H)),
    upper=True)`` gives, to float64 rounding: after the cast to float32, at most one entry in 10^4 differs
    (in its last bit). With ``perm`` it factors the permuted Hessian."""
    torch.manual_seed(0)
    x = correlated_inputs(1024, 96, 3)
    H = hessian(x)
    perm = torch.argsort(torch.diagonal(H), descending=True) if desc_act else None
    Hp = H if perm is None else H[perm][:, perm]
    H64 = Hp.double() + 0.01 * torch.diagonal(Hp).double().mean() * torch.eye(96, dtype=torch.float64)
    ref = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H64)), upper=True)
    # the float64 factor (the host's fallback, and the accelerators' path) to float64 rounding
    n = H.shape[0]
    order = torch.arange(n - 1, -1, -1) if perm is None else perm[torch.arange(n - 1, -1, -1)]
    shift = 0.01 * float(torch.diagonal(Hp).double().mean())
    U64 = gptq._inverse_factor_in_place(H, order, torch.arange(n), shift, torch.float64)
    assert torch.equal(U64, torch.triu(U64))
    assert (U64 != ref.float()).float().mean() <= 1e-4
    torch.testing.assert_close(U64.double(), ref, rtol=1e-6, atol=1e-9)
    # the host's default: float32, in place, to float32 factorization accuracy
    U, damp = damped_inverse_factor(H, 0.01, 0, perm=perm)
    assert damp == 0.01 and U.dtype == torch.float32 and U.is_contiguous() and torch.equal(U, torch.triu(U))
    rel = (U.double() - ref).abs().max() / ref.abs().max()
    assert 0 < rel < 1e-5, rel
    inv_check = U.double().t() @ U.double() @ H64 - torch.eye(n, dtype=torch.float64)
    assert inv_check.abs().max() < 1e-4


@pytest.mark.parametrize("n, block", [(1, 4), (7, 2), (300, 64), (1030, 256)])
def test_anti_transpose_in_place(n, block):
    """The in-place reflection across the anti-diagonal (how the host factor flips to ``J L^-1 J`` without a
    second matrix) is ``J A^T J`` exactly, for sizes the blocks do not divide."""
    A = torch.randn(n, n)
    expected = A.t().flip((0, 1)).clone()
    out = gptq.anti_transpose_(A, block)
    assert out.data_ptr() == A.data_ptr() and torch.equal(out, expected)


@pytest.mark.parametrize("n, block", [(50, 1024), (301, 64), (1000, 128)])
def test_invert_lower_in_place_matches_the_triangular_solve(n, block):
    """The blocked in-place inverse of a lower-triangular factor (what ``damped_inverse_factor`` uses to keep
    one float64 matrix alive) equals ``solve_triangular(L, I)`` to float64 rounding, in L's own storage,
    lower-triangular, also for a column-major L (the layout the in-place Cholesky leaves)."""
    from quantkit.methods.gptq import invert_lower_

    torch.manual_seed(0)
    x = torch.randn(2 * n, n, dtype=torch.float64)
    L = torch.linalg.cholesky(x.t() @ x / n + 0.1 * torch.eye(n, dtype=torch.float64))
    ref = torch.linalg.solve_triangular(L, torch.eye(n, dtype=torch.float64), upper=False)
    for Lc in (L.clone(), L.t().contiguous().t()):
        ptr = Lc.data_ptr()
        got = invert_lower_(Lc, block=block)
        assert got.data_ptr() == ptr and torch.equal(got, torch.tril(got))
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_host_and_accelerator_factorizations_agree():
    """The host's in-place factorization in float64 and the accelerators' two-matrix one give the same factor to
    float64 rounding (both run here on the CPU), the host's float32 one agrees to float32 accuracy, and all
    report a failed factorization as None."""
    from quantkit.methods.gptq import _inverse_factor, _inverse_factor_in_place

    torch.manual_seed(0)
    n = 1300  # above invert_lower_'s block: the blocked inverse runs
    x = correlated_inputs(2 * n, n, 3)
    H = hessian(x)
    order = torch.argsort(torch.diagonal(H), descending=True).flip(0)
    idx = torch.arange(n)
    shift = 0.01 * float(torch.diagonal(H).double().mean())
    a, b = _inverse_factor(H, order, idx, shift), _inverse_factor_in_place(H, order, idx, shift, torch.float64)
    assert a.is_contiguous() and b.is_contiguous()
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    # the host's float32 default: float32 factorization accuracy, relative to the factor's scale
    c = _inverse_factor_in_place(H, order, idx, shift)
    assert c.dtype == torch.float32 and c.is_contiguous() and torch.equal(c, torch.triu(c))
    assert float((c.double() - a.double()).abs().max() / a.double().abs().max()) < 1e-5
    bad = -torch.eye(8)
    assert _inverse_factor(bad, torch.arange(8), torch.arange(8), 0.0) is None
    assert _inverse_factor_in_place(bad, torch.arange(8), torch.arange(8), 0.0) is None
