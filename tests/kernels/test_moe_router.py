"""The router's GEMM, routing and layout in one launch (kernels/moe_router.py): the interpreter against
``route_ref(F.linear(x, router))`` and the align's exact layout, called again (the last program put the counter back
to zero), inside the runtime's MoE block, compiled for sm_90; and on a GPU, against the unfused path in bf16 and as
CUDA-graph replays."""

from __future__ import annotations

import pytest
import torch
import triton

from quantkit.kernels import moe_align as align
from quantkit.kernels.moe_align import route_and_align, route_ref
from quantkit.kernels.moe_router import (
    ROUTER_FUSED_MAX_TOKENS,
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


@pytest.mark.parametrize(("tokens", "with_layout", "pdl"), [(1, False, False), (1, True, False), (4, True, False),
                                                            (1, False, True)])
def test_fused_router_compiles_for_sm90_without_spills(sm90, tmp_path, tokens, with_layout, pdl):
    """Qwen3-30B-A3B's router (128 experts of 2048, top-8) at 1 and 4 tokens: the GEMM's product and the last
    program's routing in registers. With PDL (the default on Hopper): the wait for the previous kernel before any global load."""
    from quantkit.kernels.moe_align import FILL, _blocks_a_step, _warps
    from quantkit.kernels.moe_router import BLOCK_E

    pairs, n_exp, hidden = tokens * 8, 128, 2048
    toks = triton.next_power_of_2(tokens)
    signature = {"x_ptr": "*bf16", "stride_xt": "i32", "w_ptr": "*bf16", "stride_we": "i32", "logits_ptr": "*bf16",
                 "counter_ptr": "*i32", "weights_ptr": "*fp32", "ids_ptr": "*i64", "sorted_ptr": "*i32",
                 "block_expert_ptr": "*i32", "num_tokens": "i32", "num_experts": "i32", "hidden": "i32",
                 "n_blocks": "i32", "n_slots": "i32"}
    constexprs = dict(TOP_K=8, RENORM=True, BLOCK_M=align.BLOCK_M, TOKENS=toks, PAIRS=triton.next_power_of_2(pairs),
                      EXPERTS=n_exp, FILL=FILL, BLOCKS=_blocks_a_step(n_exp), BLOCK_E=BLOCK_E,
                      BLOCK_H=max(32, min(hidden, 4096 // (toks * BLOCK_E))), ALIGN=with_layout, TOP_K_P2=8,
                      PDL=pdl)
    ptx = sm90.triton_ptx(str(tmp_path / "router.ptx"), "quantkit.kernels.moe_router", "_router_route_kernel",
                          signature, constexprs, num_warps=_warps(pairs, n_exp))
    notices = sm90.ptxas_notices(ptx)
    assert "0 bytes spill stores, 0 bytes spill loads" in notices, notices
    assert_waits_before_loads(open(ptx).read(), pdl)


def assert_waits_before_loads(ptx: str, pdl: bool) -> None:
    """With PDL the kernel lets its dependents launch and waits for its prerequisite before its first global load
    (nothing it reads may be read earlier); without, neither instruction is there."""
    first_load = ptx.index("ld.global")
    if not pdl:
        assert "griddepcontrol" not in ptx
        return
    assert ptx.index("griddepcontrol.launch_dependents") < first_load
    assert ptx.index("griddepcontrol.wait") < first_load


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
def test_moe_block_with_pdl_on_the_gpu_gives_the_same_outputs_in_a_graph(monkeypatch):
    """The runtime's int4 MoE block at batch 1 (fused router, both GEMVs, the sum) with PDL (the default) against
    without (QUANTKIT_MOE_PDL=0), eagerly and replayed from a CUDA graph: the same bits."""
    from quantkit.kernels.moe_w4a16 import stack_quantized
    from quantkit.runtime.moe import MoELayer
    from tests.kernels.test_moe_w4a16 import experts_q

    ex = stack_quantized(experts_q(16, 2048, 768, 128), torch.bfloat16, "cuda")
    x, router = _inputs(1, 16, 2048, torch.bfloat16, seed=3, device="cuda")
    monkeypatch.setenv("QUANTKIT_MOE_PDL", "0")
    want = MoELayer(router, ex, 8, True, True)(x, None)
    monkeypatch.setenv("QUANTKIT_MOE_PDL", "1")
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
