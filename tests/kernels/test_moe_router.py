"""The router's GEMM, routing and layout in one launch (kernels/moe_router.py): the interpreter against
``route_ref(F.linear(x, router))`` and the align's exact layout, called again (the last program put the counter back
to zero), inside the runtime's MoE block, compiled for sm_90; and on a GPU, against the unfused path in bf16 and as
CUDA-graph replays."""

from __future__ import annotations

import re

import pytest
import torch
import triton

from quantkit.kernels import moe_align as align
from quantkit.kernels.moe_align import route_and_align, route_ref
from quantkit.kernels.moe_router import (
    ROUTER_FUSED_MAX_TOKENS,
    norm_router_route_and_align,
    router_fused_applies,
    router_fused_selected,
    router_route_and_align,
)
from tests.kernels.test_moe_w4a16 import DEVICE, _align_layout, experts_q, rel_err, stack_quantized


def _inputs(tokens, n_exp, hidden, dtype, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    router = (3 * torch.randn(n_exp, hidden, generator=g) / hidden**0.5).to(device, dtype)
    return x, router


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(("tokens", "n_exp", "top_k", "hidden", "dtype"),
                         [(1, 128, 8, 256, torch.float32), (3, 60, 4, 96, torch.float16), (4, 8, 2, 64, torch.float32)])
def test_fused_router_equals_the_linear_then_the_routing(renormalize, tokens, n_exp, top_k, hidden, dtype):
    """Weights and experts as route_ref gives them on F.linear's logits, the align's exact layout of those experts,
    and the same again on a second call (the counter is back at zero)."""
    x, router = _inputs(tokens, n_exp, hidden, dtype, seed=tokens)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    want_w, want_ids = route_ref(torch.nn.functional.linear(x, router), top_k, renormalize)
    expected_ids, expected_experts = _align_layout(want_ids.tolist(), n_exp, align.BLOCK_M)
    for _ in range(2):
        weights, ids, (sorted_ids, block_expert) = router_route_and_align(x, router, top_k, renormalize, counter,
                                                                          align.BLOCK_M)
        assert ids.dtype == torch.int64 and weights.dtype == torch.float32
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_w, rtol=1e-4, atol=1e-6)
        assert sorted_ids.tolist() == expected_ids and block_expert.tolist() == expected_experts
        assert counter.item() == 0
    # without the layout (the decode GEMV reads none): the same weights and experts
    weights, ids, aligned = router_route_and_align(x, router, top_k, renormalize, counter, align.BLOCK_M, False)
    assert aligned is None and torch.equal(ids, want_ids) and counter.item() == 0
    torch.testing.assert_close(weights, want_w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize(("tokens", "n_exp", "top_k", "hidden", "dtype", "offset"),
                         [(1, 128, 8, 256, torch.float32, 0.0), (3, 60, 4, 96, torch.float16, 1.0),
                          (4, 8, 2, 200, torch.float16, 0.0)])
def test_norm_router_equals_the_norm_then_the_router(with_residual, tokens, n_exp, top_k, hidden, dtype, offset):
    """The block's add + RMSNorm inside the router's launch: the normed rows and the sum as add_rms_norm_ref gives
    them, the routing of those normed rows as route_ref on F.linear's logits, the align's layout; twice (the
    counter is back at zero). H = 200 is not a power of two: the masks."""
    from quantkit.kernels.decoder_ops_ref import add_rms_norm_ref

    delta, router = _inputs(tokens, n_exp, hidden, dtype, seed=tokens + 11)
    g = torch.Generator().manual_seed(5)
    residual = (4 * torch.randn(tokens, hidden, generator=g)).to(DEVICE, dtype) if with_residual else None
    norm_w = (torch.rand(hidden, generator=g) + 0.5).to(DEVICE, dtype)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    want_x, want_sum = add_rms_norm_ref(delta, residual, norm_w, 1e-6, offset)
    want_w, want_ids = route_ref(torch.nn.functional.linear(want_x, router), top_k, True)
    expected_ids, expected_experts = _align_layout(want_ids.tolist(), n_exp, align.BLOCK_M)
    for _ in range(2):
        x, summed, weights, ids, (sorted_ids, block_expert) = norm_router_route_and_align(
            delta, residual, norm_w, 1e-6, offset, router, top_k, True, counter, align.BLOCK_M)
        assert x.dtype == dtype and summed.dtype == dtype
        torch.testing.assert_close(x, want_x, rtol=1e-3 if dtype == torch.float16 else 1e-5, atol=1e-5)
        assert torch.equal(summed, want_sum)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_w, rtol=1e-3, atol=1e-6)
        assert sorted_ids.tolist() == expected_ids and block_expert.tolist() == expected_experts
        assert counter.item() == 0
    with pytest.raises(ValueError, match="norm weight"):
        norm_router_route_and_align(delta, residual, norm_w[:-1], 1e-6, offset, router, top_k, True, counter,
                                    align.BLOCK_M)


def test_fused_router_refuses_what_it_does_not_take():
    x, router = _inputs(ROUTER_FUSED_MAX_TOKENS + 1, 8, 64, torch.float32)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="not a fused-router call"):
        router_route_and_align(x, router, 2, True, counter, align.BLOCK_M)
    with pytest.raises(ValueError, match="features"):
        router_route_and_align(x[:1], router[:, :32], 2, True, counter, align.BLOCK_M)
    with pytest.raises(ValueError, match="counter"):
        router_route_and_align(x[:1], router, 2, True, torch.zeros(1, device=DEVICE), align.BLOCK_M)


def test_selection_is_the_fused_router_wherever_it_applies(monkeypatch):
    """Fused by default for decode batches (timed faster), apart with QUANTKIT_MOE_ROUTER=apart or past the cap."""
    dev = torch.device(DEVICE)
    monkeypatch.delenv("QUANTKIT_MOE_ROUTER", raising=False)
    assert router_fused_applies(1, 8, 128, dev) and router_fused_selected(1, 8, 128, dev)
    assert not router_fused_selected(ROUTER_FUSED_MAX_TOKENS + 1, 8, 128, dev)
    monkeypatch.setenv("QUANTKIT_MOE_ROUTER", "apart")
    assert not router_fused_selected(1, 8, 128, dev)
    monkeypatch.setenv("QUANTKIT_MOE_ROUTER", "fast")
    with pytest.raises(ValueError, match="QUANTKIT_MOE_ROUTER"):
        router_fused_selected(1, 8, 128, dev)


def test_runtime_moe_block_with_the_fused_router_equals_its_reference(monkeypatch):
    from quantkit.runtime.moe import MoELayer

    monkeypatch.setenv("QUANTKIT_MOE_ROUTER", "fused")
    n_exp, hidden, inter = 8, 64, 32
    ex = stack_quantized(experts_q(n_exp, hidden, inter, 32), torch.float32, DEVICE)
    x, router = _inputs(2, n_exp, hidden, torch.float32, seed=7)
    calls = []
    from quantkit.kernels import moe_router

    real = moe_router.router_route_and_align
    monkeypatch.setattr(moe_router, "router_route_and_align", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("QUANTKIT_MOE_DECODE", "gemv")  # routing only: the GEMV reads no layout
    out = MoELayer(router, ex, 2, True, True)(x, None)
    monkeypatch.setenv("QUANTKIT_MOE_DECODE", "tiles")  # routing and layout
    out_tiles = MoELayer(router, ex, 2, True, True)(x, None)
    ref = MoELayer(router, ex, 2, True, False)(x, None)
    assert len(calls) == 2 and rel_err(out, ref) < 1e-5 and rel_err(out_tiles, ref) < 1e-5


@pytest.mark.parametrize(("tokens", "with_layout", "pdl", "norm"),
                         [(1, False, False, False), (1, True, False, False), (4, True, False, False),
                          (1, False, True, False), (1, False, True, True), (4, True, True, True),
                          (1, True, True, True)])
def test_fused_router_compiles_for_sm90_without_spills(sm90, tmp_path, tokens, with_layout, pdl, norm, config=None):
    """Qwen3-30B-A3B's router (128 experts of 2048, top-8) at 1 and 4 tokens: the GEMM's product and the last
    program's routing in registers. With PDL (the default on Hopper): the wait for the previous kernel before any
    global load. ``config``: (rows a program, warps) instead of the default's."""
    from quantkit.kernels.moe_align import FILL, _blocks_a_step, _warps
    from quantkit.kernels.moe_router import BLOCK_E

    pairs, n_exp, hidden = tokens * 8, 128, 2048
    block_e, warps = config or (BLOCK_E, _warps(pairs, n_exp))
    toks = triton.next_power_of_2(tokens)
    signature = {"x_ptr": "*bf16", "stride_xt": "i32", "w_ptr": "*bf16", "stride_we": "i32", "logits_ptr": "*bf16",
                 "counter_ptr": "*i32", "weights_ptr": "*fp32", "ids_ptr": "*i64", "sorted_ptr": "*i32",
                 "block_expert_ptr": "*i32", "num_tokens": "i32", "num_experts": "i32", "hidden": "i32",
                 "n_blocks": "i32", "n_slots": "i32", "res_ptr": "*bf16", "stride_rt": "i32", "norm_ptr": "*bf16",
                 "xo_ptr": "*bf16", "ro_ptr": "*bf16", "stride_ot": "i32", "eps": "fp32", "offset": "fp32"}
    constexprs = dict(TOP_K=8, RENORM=True, BLOCK_M=align.BLOCK_M, TOKENS=toks, PAIRS=triton.next_power_of_2(pairs),
                      EXPERTS=n_exp, FILL=FILL, BLOCKS=_blocks_a_step(n_exp), BLOCK_E=block_e,
                      BLOCK_H=max(32, min(hidden, 1024 * warps // (toks * block_e))),
                      ALIGN=with_layout, TOP_K_P2=8, PDL=pdl, NORM=norm, HAS_RES=norm)
    # 16-byte aligned pointers and strides, as the launcher specializes them at this shape (vector loads)
    aligned = ("x_ptr", "stride_xt", "w_ptr", "stride_we", "res_ptr", "stride_rt", "norm_ptr", "xo_ptr", "ro_ptr",
               "stride_ot", "logits_ptr", "hidden")
    ptx = sm90.triton_ptx(str(tmp_path / "router.ptx"), "quantkit.kernels.moe_router", "_router_route_kernel",
                          signature, constexprs, num_warps=warps, aligned=aligned)
    notices = sm90.ptxas_notices(ptx)
    assert "0 bytes spill stores, 0 bytes spill loads" in notices, notices
    assert_waits_before_loads(open(ptx).read(), pdl)


@pytest.mark.parametrize("config", [(2, 1), (4, 2), (8, 2)])
def test_fused_router_configs_compile_and_route_alike(sm90, tmp_path, monkeypatch, config):
    """QUANTKIT_MOE_ROUTER_CONFIG (rows a program, warps: the benches' switch) at one token of the 30B-A3B router
    with its norm and PDL compiles without spills, and routes as the default does (interpreter or GPU); a value
    that is not two powers of two is refused."""
    from quantkit.kernels.moe_router import router_config

    test_fused_router_compiles_for_sm90_without_spills(sm90, tmp_path, 1, False, True, True, config)
    x, router = _inputs(1, 128, 256, torch.float32, seed=5)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    monkeypatch.delenv("QUANTKIT_MOE_ROUTER_CONFIG", raising=False)
    want = router_route_and_align(x, router, 8, True, counter, align.BLOCK_M, False)
    monkeypatch.setenv("QUANTKIT_MOE_ROUTER_CONFIG", ",".join(map(str, config)))
    assert router_config(8, 128) == config
    got = router_route_and_align(x, router, 8, True, counter, align.BLOCK_M, False)
    assert torch.equal(got[1], want[1]) and counter.item() == 0
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-7)
    monkeypatch.setenv("QUANTKIT_MOE_ROUTER_CONFIG", "3,1")
    with pytest.raises(ValueError, match="QUANTKIT_MOE_ROUTER_CONFIG"):
        router_config(8, 128)


def assert_waits_before_loads(ptx: str, pdl: bool) -> None:
    """With PDL the kernel lets its dependents launch and waits for its prerequisite before any global load;
    without PDL, neither instruction is there."""
    if not pdl:
        assert "griddepcontrol" not in ptx
        return
    assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("ld.global")
    before_wait = ptx[:ptx.index("griddepcontrol.wait")]
    assert not re.findall(r"\bld\.global\S*", before_wait), re.findall(r"\bld\.global\S*", before_wait)


def test_moe_pdl_is_on_by_default_and_only_where_pdl_runs(monkeypatch):
    """On wherever PDL runs unless QUANTKIT_MOE_PDL=0; never on the CPU or under the interpreter (no
    griddepcontrol there); a value other than 0 or 1 is refused, naming the variable."""
    from quantkit.kernels.device_info import moe_programmatic_launch, programmatic_launch

    monkeypatch.delenv("QUANTKIT_MOE_PDL", raising=False)
    assert not moe_programmatic_launch("cpu")
    monkeypatch.setenv("QUANTKIT_MOE_PDL", "1")
    assert not moe_programmatic_launch("cpu")
    monkeypatch.setenv("QUANTKIT_MOE_PDL", "yes")
    with pytest.raises(ValueError, match="QUANTKIT_MOE_PDL"):
        moe_programmatic_launch("cpu")
    if torch.cuda.is_available():
        monkeypatch.delenv("QUANTKIT_MOE_PDL")
        assert moe_programmatic_launch("cuda") == programmatic_launch("cuda")
        monkeypatch.setenv("QUANTKIT_MOE_PDL", "0")
        assert not moe_programmatic_launch("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("finish", ["apart", "fused"])
def test_moe_block_with_pdl_on_the_gpu_gives_the_same_outputs_in_a_graph(monkeypatch, finish):
    """The runtime's int4 MoE block at batch 1 (fused router, both GEMVs, the sum) with PDL (the default) against
    without (QUANTKIT_MOE_PDL=0), eagerly and replayed from a CUDA graph: the same bits; with the GEMVs'
    parts finished by launches of their own and by the GEMVs (QUANTKIT_MOE_GEMV_FINISH)."""
    from quantkit.kernels.moe_w4a16 import stack_quantized
    from quantkit.runtime.moe import MoELayer
    from tests.kernels.test_moe_w4a16 import experts_q

    ex = stack_quantized(experts_q(16, 2048, 768, 128), torch.bfloat16, "cuda")
    x, router = _inputs(1, 16, 2048, torch.bfloat16, seed=3, device="cuda")
    monkeypatch.setenv("QUANTKIT_MOE_PDL", "0")
    monkeypatch.setenv("QUANTKIT_MOE_GEMV_FINISH", "apart")
    want = MoELayer(router, ex, 8, True, True)(x, None)
    monkeypatch.setenv("QUANTKIT_MOE_PDL", "1")
    monkeypatch.setenv("QUANTKIT_MOE_GEMV_FINISH", finish)
    block = MoELayer(router, ex, 8, True, True)
    assert torch.equal(block(x, None), want)
    graph = torch.cuda.CUDAGraph()
    static_x = x.clone()
    block(static_x, None)  # compiled before the capture
    with torch.cuda.graph(graph):
        out = block(static_x, None)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 4])
def test_fused_router_on_the_gpu_equals_the_unfused_path_and_replays(tokens):
    """bf16 at the 30B-A3B router's size: the same experts as cuBLAS's logits through route_and_align (up to
    near-ties, which the weights then show as equal), and the same outputs from CUDA-graph replays."""
    x, router = _inputs(tokens, 128, 2048, torch.bfloat16, seed=tokens, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    weights, ids, aligned = router_route_and_align(x, router, 8, True, counter, align.BLOCK_M)
    want_w, want_ids, want_aligned = route_and_align(torch.nn.functional.linear(x, router), 8, True)
    same = ids == want_ids
    assert same.float().mean() > 0.9, (ids, want_ids)
    torch.testing.assert_close(weights[same], want_w[same], rtol=1e-2, atol=1e-3)
    if bool(same.all()):
        assert all(torch.equal(a, b) for a, b in zip(aligned, want_aligned))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = router_route_and_align(x, router, 8, True, counter, align.BLOCK_M)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[1], ids) and torch.equal(out[0], weights) and counter.item() == 0


def test_runtime_moe_block_norm_inside_the_router_equals_the_norm_apart(monkeypatch):
    """MoELayer.normed with QUANTKIT_MOE_NORM_ROUTER=fused (the pre-norm inside the router's launch) against the
    norm apart and against the reference block: the same sum, the same block output; the fused launch is taken
    exactly once, and never off the kernel path."""
    from quantkit.kernels import moe_router
    from quantkit.kernels.decoder_ops_ref import add_rms_norm_ref
    from quantkit.runtime.moe import MoELayer

    n_exp, hidden, inter = 8, 64, 32
    ex = stack_quantized(experts_q(n_exp, hidden, inter, 32), torch.float32, DEVICE)
    delta, router = _inputs(2, n_exp, hidden, torch.float32, seed=9)
    g = torch.Generator().manual_seed(2)
    residual = (3 * torch.randn(2, hidden, generator=g)).to(DEVICE)
    norm = (torch.rand(hidden, generator=g) + 0.5).to(DEVICE)
    calls = []
    real = moe_router.norm_router_route_and_align
    monkeypatch.setattr(moe_router, "norm_router_route_and_align", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("QUANTKIT_MOE_ROUTER", "fused")
    outs = {}
    for mode in ("apart", "fused"):
        monkeypatch.setenv("QUANTKIT_MOE_NORM_ROUTER", mode)
        outs[mode] = MoELayer(router, ex, 2, True, True).normed(delta, residual, norm, 1e-6, 0.0, add_rms_norm_ref,
                                                                  None)
    ref = MoELayer(router, ex, 2, True, False).normed(delta, residual, norm, 1e-6, 0.0, add_rms_norm_ref, None)
    assert len(calls) == 1
    (y_apart, s_apart), (y_fused, s_fused) = outs["apart"], outs["fused"]
    assert torch.equal(s_fused, s_apart) and torch.equal(s_fused, ref[1])
    assert rel_err(y_fused, y_apart) < 1e-5 and rel_err(y_fused, ref[0]) < 1e-5
    monkeypatch.setenv("QUANTKIT_MOE_NORM_ROUTER", "inside")
    with pytest.raises(ValueError, match="QUANTKIT_MOE_NORM_ROUTER"):
        MoELayer(router, ex, 2, True, True).normed(delta, residual, norm, 1e-6, 0.0, add_rms_norm_ref, None)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4])
def test_norm_router_on_the_gpu_equals_the_kernels_apart_and_replays(tokens):
    """bf16 at the 30B-A3B block's size: the fused norm + router against decoder_ops.add_rms_norm then the fused
    router (normed rows within a bf16 rounding, the same sum, the same experts up to near-ties), and the same
    outputs from CUDA-graph replays."""
    from quantkit.kernels.decoder_ops import add_rms_norm

    delta, router = _inputs(tokens, 128, 2048, torch.bfloat16, seed=tokens, device="cuda")
    residual = 4 * torch.randn_like(delta)
    norm = torch.rand(2048, device="cuda", dtype=torch.bfloat16) + 0.5
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    x, summed, weights, ids, _ = norm_router_route_and_align(delta, residual, norm, 1e-6, 0.0, router, 8, True,
                                                             counter, align.BLOCK_M, False)
    want_x, want_sum = add_rms_norm(delta, residual, norm, 1e-6, 0.0)
    want_w, want_ids, _ = router_route_and_align(want_x, router, 8, True, counter, align.BLOCK_M, False)
    assert torch.equal(summed, want_sum)
    assert rel_err(x, want_x) < 4e-3
    same = ids == want_ids
    assert same.float().mean() > 0.9, (ids, want_ids)
    torch.testing.assert_close(weights[same], want_w[same], rtol=1e-2, atol=1e-3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = norm_router_route_and_align(delta, residual, norm, 1e-6, 0.0, router, 8, True, counter,
                                          align.BLOCK_M, False)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[0], x) and torch.equal(out[3], ids) and counter.item() == 0
