"""The fused MoE W4A16 kernel against its plain-PyTorch reference (TRITON_INTERPRET=1 without a GPU)."""

from __future__ import annotations

import pytest
import torch

import quantkit.kernels.moe_align as align
import quantkit.kernels.moe_w4a16 as moe
from quantkit.config import QuantScheme
from quantkit.kernels.moe_align import moe_align, route_and_align, route_ref
from quantkit.kernels.moe_w4a16 import fused_moe, fused_moe_ref, stack_dense, stack_quantized
from quantkit.methods.rtn import rtn_quantize
from quantkit.primitives import compute_qparams, quantize
from quantkit.qtensor import QuantizedWeight
from tests.conftest import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def tiled_kernel(monkeypatch):
    """This file tests the tiled kernel at every size, the decode sizes included where fused_moe's table would
    pick the GEMV (tests/kernels/test_moe_gemv.py tests that one and the table)."""
    monkeypatch.setenv("QUANTKIT_MOE_DECODE", "tiles")


def experts_q(n_exp, hidden, inter, group_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    scheme = QuantScheme(4, group_size, sym=False)
    out = []
    for _ in range(n_exp):
        trio = []
        for rows, cols in ((inter, hidden), (inter, hidden), (hidden, inter)):
            w = torch.randn(rows, cols, generator=g) / cols**0.5
            res = rtn_quantize(w, scheme)
            trio.append(QuantizedWeight.from_codes(res.codes, res.scales, res.zeros, res.g_idx, scheme))
        out.append(tuple(trio))
    return out


def routing(tokens, n_exp, top_k, seed=1, skip=()):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, n_exp, generator=g)
    for e in skip:
        logits[:, e] = -1e9
    w, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return (w / w.sum(-1, keepdim=True)), ids


def test_moe_align_groups_pairs_by_expert():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    sorted_ids, block_expert = moe_align(ids, num_experts=4, block_m=4)
    pairs = 6
    used = [b for b in range(block_expert.numel()) if sorted_ids[4 * b] < pairs]
    assert [block_expert[b].item() for b in used] == [0, 1, 2]  # expert 3 has no pair, no block
    assert used == [0, 1, 2]  # the runs come first, padding blocks after
    for b in used:
        e = block_expert[b].item()
        block = [p for p in sorted_ids[4 * b : 4 * b + 4].tolist() if p < pairs]
        assert sorted(block) == sorted(p for p in range(pairs) if ids.reshape(-1)[p] == e)
    assert sorted(p for p in sorted_ids.tolist() if p < pairs) == list(range(pairs))


def _align_layout(ids: list[list[int]], num_experts: int, block_m: int) -> tuple[list[int], list[int]]:
    """moe_align's layout built plainly: each expert's pairs in pair order, its run padded to block_m with the
    pair count; padding blocks after the last run; each block's expert (the last expert for trailing padding)."""
    flat = [e for row in ids for e in row]
    pairs = len(flat)
    n_blocks = (pairs + num_experts * (block_m - 1) + block_m - 1) // block_m
    sorted_ids, block_expert = [], []
    for e in range(num_experts):
        run = [p for p in range(pairs) if flat[p] == e]
        run += [pairs] * (-len(run) % block_m)
        sorted_ids += run
        block_expert += [e] * (len(run) // block_m)
    sorted_ids += [pairs] * (n_blocks * block_m - len(sorted_ids))
    block_expert += [num_experts - 1] * (n_blocks - len(block_expert))
    return sorted_ids, block_expert


@pytest.mark.parametrize("impl", ["torch", "one_program"])
@pytest.mark.parametrize(("tokens", "n_exp", "top_k", "block_m"), [(1, 8, 2, 16), (5, 4, 2, 4), (37, 16, 4, 16),
                                                                   (64, 128, 8, 16), (3, 6, 3, 1), (2, 60, 4, 64)])
def test_moe_align_layout_exactly(monkeypatch, impl, tokens, n_exp, top_k, block_m):
    """Both ways of building the layout (torch ops; one Triton program, here under the interpreter) give it exactly;
    (64, 128, 8) has 512 pairs, beyond the one-program limit, so there ``auto`` takes the torch ops."""
    monkeypatch.setenv("QUANTKIT_MOE_ALIGN", "torch" if impl == "torch" else "auto")
    ids = torch.stack([torch.randperm(n_exp, generator=torch.Generator().manual_seed(t))[:top_k]
                       for t in range(tokens)])
    one = align.align_in_one_program(tokens * top_k, n_exp, torch.device(DEVICE))
    assert one == (impl == "one_program" and tokens * top_k <= 256)
    sorted_ids, block_expert = moe_align(ids.to(DEVICE), n_exp, block_m)
    expected_ids, expected_experts = _align_layout(ids.tolist(), n_exp, block_m)
    assert sorted_ids.dtype == torch.int32 and block_expert.dtype == torch.int32
    assert sorted_ids.tolist() == expected_ids and block_expert.tolist() == expected_experts


def test_align_switch_refuses_what_it_does_not_know(monkeypatch):
    """QUANTKIT_MOE_ALIGN takes auto (the one program where it fits) or torch; anything else is refused by name."""
    monkeypatch.setenv("QUANTKIT_MOE_ALIGN", "fast")
    with pytest.raises(ValueError, match="QUANTKIT_MOE_ALIGN"):
        align.align_in_one_program(8, 128, torch.device(DEVICE))
    monkeypatch.setenv("QUANTKIT_MOE_ALIGN", "torch")
    assert not align.align_in_one_program(8, 128, torch.device(DEVICE))


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(("tokens", "n_exp", "top_k", "dtype"), [(1, 128, 8, torch.float32), (7, 60, 4, torch.float16),
                                                                 (32, 128, 8, torch.float32), (5, 8, 2, torch.float16)])
def test_route_and_align_in_one_program_equals_the_torch_ops(monkeypatch, renormalize, tokens, n_exp, top_k, dtype):
    """The one-launch routing (softmax, top-k, renormalization) and align give the reference's weights and experts
    and the align's exact layout of those experts."""
    monkeypatch.setenv("QUANTKIT_MOE_ALIGN", "auto")
    logits = (3 * torch.randn(tokens, n_exp, generator=torch.Generator().manual_seed(tokens))).to(DEVICE, dtype)
    weights, ids, (sorted_ids, block_expert) = route_and_align(logits, top_k, renormalize)
    want_w, want_ids = route_ref(logits, top_k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-7)
    expected_ids, expected_experts = _align_layout(want_ids.tolist(), n_exp, align.BLOCK_M)
    assert sorted_ids.tolist() == expected_ids and block_expert.tolist() == expected_experts


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_and_align_gives_ties_to_the_lower_expert(monkeypatch, renormalize):
    """Equal probabilities (ties among the top, a row of equal logits, experts past a non-power-of-2 count) are
    picked lowest expert first, with each weight its own probability."""
    monkeypatch.setenv("QUANTKIT_MOE_ALIGN", "auto")
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0],   # three-way tie at the top: experts 1, 3, 4
                           [0.5, 0.5, 0.5, 0.5, 0.5, 0.5],    # all equal: 0, 1, 2
                           [-9.0, -9.0, 3.0, -9.0, -9.0, -9.0]], device=DEVICE)  # one, then ties at the bottom
    weights, ids, _ = route_and_align(logits, 3, renormalize)
    assert ids.tolist() == [[1, 3, 4], [0, 1, 2], [2, 0, 1]]
    probs = torch.softmax(logits.float(), dim=-1).gather(1, ids)
    want = probs / probs.sum(-1, keepdim=True) if renormalize else probs
    torch.testing.assert_close(weights, want, rtol=1e-6, atol=1e-8)


def test_route_and_align_refuses_what_one_program_does_not_take(monkeypatch):
    monkeypatch.setenv("QUANTKIT_MOE_ALIGN", "auto")
    with pytest.raises(ValueError, match="exceed one program"):
        route_and_align(torch.randn(64, 128, device=DEVICE), 8, True)
    with pytest.raises(ValueError, match="top_k"):
        route_and_align(torch.randn(2, 4, device=DEVICE), 5, True)


@pytest.mark.parametrize("one_program", [True, False])
def test_runtime_moe_layer_kernel_path_equals_its_reference(monkeypatch, one_program):
    """The runtime's MoE block on the kernel path (routing and align in one launch, or torch ops) against its
    reference path on the same experts, a shared expert included."""
    from quantkit.runtime.moe import MoELayer

    monkeypatch.setenv("QUANTKIT_MOE_ALIGN", "auto" if one_program else "torch")
    n_exp, hidden, inter = 8, 64, 32
    g = torch.Generator().manual_seed(5)
    ex = stack_quantized(experts_q(n_exp, hidden, inter, 32), torch.float32, DEVICE)
    router = torch.randn(n_exp, hidden, generator=g).to(DEVICE)
    shared_gate = torch.randn(1, hidden, generator=g).to(DEVICE)
    w_su = torch.randn(2 * inter, hidden, generator=g).to(DEVICE) / hidden**0.5
    w_sd = torch.randn(hidden, inter, generator=g).to(DEVICE) / inter**0.5

    def act_mul(h, act):
        return torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]

    def layer(use_kernel):
        return MoELayer(router, ex, 2, True, use_kernel, lambda v: v @ w_su.t(), lambda v: v @ w_sd.t(), shared_gate)

    x = torch.randn(6, hidden, generator=g).to(DEVICE)
    assert align.align_in_one_program(6 * 2, n_exp, x.device) == one_program
    out, ref = layer(True)(x, act_mul), layer(False)(x, act_mul)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("tokens", "n_exp", "top_k", "hidden", "inter", "group_size"),
                         [(5, 4, 2, 64, 32, 32), (1, 8, 2, 64, 64, 64), (19, 6, 3, 96, 48, -1)])
def test_fused_moe_w4a16_matches_reference(dtype, tokens, n_exp, top_k, hidden, inter, group_size):
    if dtype == torch.float16 and DEVICE == "cpu" and group_size == -1:
        pytest.skip("one fp16 case is enough under the interpreter")
    ex = stack_quantized(experts_q(n_exp, hidden, inter, group_size), dtype, DEVICE)
    # the group size found once when stacking (no host read per call): a whole row is one group for -1
    assert (ex.group13, ex.group2) == ((group_size, group_size) if group_size > 0 else (hidden, inter))
    w, ids = routing(tokens, n_exp, top_k, skip=(1,))  # expert 1 receives no token
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    out = fused_moe(x, w.to(DEVICE), ids.to(DEVICE), ex, block_m=16, block_n=32, block_k=32)
    ref = fused_moe_ref(x.float(), w.to(DEVICE), ids.to(DEVICE), ex)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize("block_m", [32, 64])
def test_fused_moe_w4a16_taller_tiles(block_m):
    """The prefill sweep's taller tiles (bench_moe.py's PREFILL_TILE_CANDIDATES): the same sums, each expert's run
    padded to the taller tile."""
    ex = stack_quantized(experts_q(6, 64, 32, 32), torch.float32, DEVICE)
    w, ids = routing(40, 6, 2, skip=(1,))
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    out = fused_moe(x, w.to(DEVICE), ids.to(DEVICE), ex, block_m=block_m, block_n=32, block_k=32)
    assert rel_err(out, fused_moe_ref(x, w.to(DEVICE), ids.to(DEVICE), ex)) < 1e-5


def test_tile_table_picks_taller_tiles_for_prefill(monkeypatch):
    """TILE_CONFIGS: 4-bit experts get the measured taller tiles from 2,048 pairs (256 tokens of top-8) and the
    tallest from 16,384 (2,048 tokens); FP8 experts multiplied as codes (the default) 64-row tiles from 16,384 (the
    least rows of Hopper's FP8 warpgroup MMA), converted (QUANTKIT_MOE_FP8_DOT=convert) none; fewer pairs, 16-bit
    weights and aligned calls keep TileConfig(), as does every call under QUANTKIT_MOE_TILES=plain. Unknown
    switch values are refused."""
    from quantkit.kernels.moe_w4a16 import TileConfig, stack_fp8, tile_config

    for name in ("QUANTKIT_MOE_TILES", "QUANTKIT_MOE_FP8_DOT"):
        monkeypatch.delenv(name, raising=False)
    q = stack_quantized(experts_q(4, 64, 32, 32), torch.float32, "cpu")
    dense = stack_dense(torch.zeros(4, 64, 64), torch.zeros(4, 64, 32))
    fp8 = stack_fp8(experts_fp8(2, 64, 32), "cpu")
    assert tile_config(q, 2047) == tile_config(dense, 10**6) == tile_config(fp8, 16383) == TileConfig()
    assert tile_config(q, 16384, aligned=True) == tile_config(fp8, 16384, aligned=True) == TileConfig()
    assert tile_config(q, 2048) == tile_config(q, 16383) == TileConfig(block_m=32, block_n=128)
    assert tile_config(q, 16384) == tile_config(fp8, 16384) == TileConfig(block_m=64, block_n=64)
    monkeypatch.setenv("QUANTKIT_MOE_FP8_DOT", "convert")
    assert tile_config(fp8, 16384) == TileConfig()
    monkeypatch.setenv("QUANTKIT_MOE_TILES", "plain")
    assert tile_config(q, 16384) == TileConfig()
    for name, bad in (("QUANTKIT_MOE_TILES", "tall"), ("QUANTKIT_MOE_FP8_DOT", "fp8")):
        monkeypatch.delenv("QUANTKIT_MOE_TILES")
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            tile_config(fp8, 16384)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [256, 2048])
def test_fused_moe_with_the_tile_table_on_the_gpu_matches_the_reference(tokens):
    """bf16 4-bit experts at the prefill sizes whose rows the table changes (2,048 and 16,384 pairs of top-8):
    fused_moe's own picks against the float32 reference."""
    ex = stack_quantized(experts_q(32, 256, 128, 128), torch.bfloat16, "cuda")
    w, ids = routing(tokens, 32, 8)
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(6)).to("cuda", torch.bfloat16)
    out = fused_moe(x, w.cuda(), ids.cuda(), ex)
    assert rel_err(out, fused_moe_ref(x.float(), w.cuda(), ids.cuda(), ex)) < 5e-3


@pytest.mark.parametrize("dot", ["convert", "codes"])
def test_sm90_fp8_codes_go_to_the_fp8_tensor_cores(sm90, tmp_path, dot):
    """The gate/up GEMM of FP8 experts at the 64-row prefill tiles, compiled for sm_90 (Qwen3-30B-A3B's sizes):
    with the codes as they are, FP8 warpgroup MMAs (QGMMA ... E4M3.E4M3) and no e4m3 conversion in the K loop;
    converted, 16-bit ones (HGMMA ... BF16) behind an unpack of every code."""
    signature = dict(a_ptr="*fp8e4nv", w_ptr="*fp8e4nv", s_ptr="*fp32", z_ptr="*fp8e4nv", g_ptr="*fp8e4nv",
                     out_ptr="*bf16", sorted_ptr="*i32", block_expert_ptr="*i32", topw_ptr="*fp32", as_ptr="*fp32",
                     num_pairs="i32", N="i32", K="i32", UP_OFFSET="i32", TOP_K="i32", SCALE_K="i32", stride_am="i32",
                     stride_we="i32", stride_wn="i32", stride_se="i32", stride_om="i32")
    constexprs = dict(stride_wk=1, stride_sg=1, stride_sn=1, stride_asm=1, QUANT=False, GROUP=0, GATED=True,
                      A_BY_TOKEN=True, MUL_ROUTED=False, FP8=True, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64,
                      DTYPE="tl.bfloat16", OP_DTYPE="tl.float8e4nv" if dot == "codes" else "tl.bfloat16")
    aligned = ("a_ptr", "w_ptr", "s_ptr", "out_ptr", "sorted_ptr", "block_expert_ptr", "topw_ptr", "as_ptr",
               "num_pairs", "N", "K", "UP_OFFSET", "SCALE_K", "stride_am", "stride_we", "stride_wn", "stride_se",
               "stride_om")
    ptx = sm90.triton_ptx(str(tmp_path / "moe.ptx"), "quantkit.kernels.moe_w4a16", "_moe_gemm_kernel", signature,
                          constexprs, 4, aligned, num_stages=3)
    text = "\n".join(sm90.sass(sm90.cubin(ptx)))
    if dot == "codes":
        assert "QGMMA.64x64x32.F32.E4M3.E4M3" in text and "E4M3.UNPACK" not in text and "HGMMA" not in text
    else:
        assert "HGMMA.64x64x16.F32.BF16" in text and "F2FP.F16.E4M3.UNPACK_B" in text and "QGMMA" not in text
    assert "0 bytes spill stores" in sm90.ptxas_notices(ptx)


@pytest.mark.gpu
@pytest.mark.parametrize("dot", ["convert", "codes"])
@pytest.mark.parametrize(("weights", "tokens"), [("channel", 2048), ("channel", 200), ("block", 2048)])
def test_fused_moe_fp8_experts_at_prefill_on_the_gpu(monkeypatch, dot, weights, tokens):
    """bf16 activations, FP8 experts at prefill sizes (2,048 tokens of top-8: the 64-row tiles of "codes"; 200:
    16-row tiles), both dots, against the reference's float32 emulation of the same rounding."""
    from quantkit.kernels.fp8_quant_ref import activations_through_e4m3
    from quantkit.kernels.moe_w4a16 import stack_fp8

    monkeypatch.setenv("QUANTKIT_MOE_FP8_DOT", dot)
    trios = experts_fp8(16, 256, 128, weights, block=(128, 128))
    ex = stack_fp8(trios, "cuda")
    w, ids = routing(tokens, 16, 8)
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(9)).to("cuda", torch.bfloat16)
    out = fused_moe(x, w.cuda(), ids.cuda(), ex)
    group = 128 if weights == "block" else 0
    ref = fused_moe_ref(x.float(), w.cuda(), ids.cuda(), ex, lambda v: activations_through_e4m3(v, group))
    assert rel_err(out, ref) < 2e-2, rel_err(out, ref)  # bf16 x and intermediate against float32: 1.1-1.2e-2 (H100)


def experts_fp8(n_exp, hidden, inter, weights="channel", block=(32, 32), seed=0):
    from quantkit.fp8_weight import FP8Config, fp8_quantize_weight

    g = torch.Generator().manual_seed(seed)
    config = FP8Config(weights=weights, block=block)
    return [tuple(fp8_quantize_weight(torch.randn(rows, cols, generator=g) / cols**0.5, config)[0]
                  for rows, cols in ((inter, hidden), (inter, hidden), (hidden, inter))) for _ in range(n_exp)]


@pytest.mark.parametrize("dot", ["convert", "codes"])
@pytest.mark.parametrize(("weights", "inter"), [("channel", 32), ("tensor", 48), ("block", 48)])
def test_fused_moe_fp8_experts_match_the_emulated_reference(monkeypatch, weights, inter, dot):
    """FP8 experts (e4m3 codes, per-channel, per-tensor or 32x32-block scales; activations rounded per token, or
    per token and 32 columns for blocks) through the fused kernel against the reference's float32 emulation of the
    same rounding: only the float32 summation order differs. inter 48 with 32-row blocks: the up half's scales
    start inside a block, which the per-column scale layout takes. Under the CPU interpreter the per-token codes
    come from the torch reference: Triton 3.6's interpreter rounds float32 to e4m3 wrongly at carries (see
    test_fp8_quant.py; on a GPU the kernel's codes are the reference's bit for bit). ``dot``: the K tiles' codes
    multiplied as they are (the default), or converted to 16 bits (QUANTKIT_MOE_FP8_DOT=convert)."""
    from quantkit.kernels.fp8_quant_ref import activations_through_e4m3, quantize_per_group_ref, quantize_per_token_ref
    from quantkit.kernels.moe_w4a16 import stack_fp8

    monkeypatch.setenv("QUANTKIT_MOE_FP8_DOT", dot)

    if DEVICE == "cpu":
        monkeypatch.setattr(moe, "quantize_activations", lambda v, group: quantize_per_group_ref(v, group) if group
                            else quantize_per_token_ref(v))

    trios = experts_fp8(6, 64, inter, weights)
    ex = stack_fp8(trios, DEVICE)
    assert ex.fp8 and ex.w13.dtype == torch.float8_e4m3fn and ex.s13.shape[:2] == (6, 2 * inter)
    assert (ex.group13, ex.group2) == ((32, 32) if weights == "block" else (0, 0))
    w, ids = routing(7, 6, 2, skip=(3,))
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    out = fused_moe(x, w.to(DEVICE), ids.to(DEVICE), ex, block_n=32, block_k=32)
    group = 32 if weights == "block" else 0
    ref = fused_moe_ref(x, w.to(DEVICE), ids.to(DEVICE), ex, lambda v: activations_through_e4m3(v, group))
    dequantized = torch.stack([torch.cat([t[0].dequantize(), t[1].dequantize()]) for t in trios])
    assert torch.equal(ex.dequantized()[0].cpu(), dequantized)
    assert rel_err(out, ref) < 1e-4, rel_err(out, ref)


def test_fp8_experts_refuse_a_k_tile_across_their_blocks():
    from quantkit.kernels.moe_w4a16 import stack_fp8

    ex = stack_fp8(experts_fp8(2, 64, 32, "block"), DEVICE)
    w, ids = routing(3, 2, 1)
    with pytest.raises(ValueError, match="must divide the FP8 scale blocks"):
        fused_moe(torch.randn(3, 64).to(DEVICE), w.to(DEVICE), ids.to(DEVICE), ex, block_n=32, block_k=64)


def test_reference_matches_dequantized_linears():
    """The reference's stacked weights are exactly each expert's dequantized gate/up/down."""
    trios = experts_q(3, 64, 32, 32)
    ex = stack_quantized(trios, torch.float32, "cpu")
    w13, w2 = ex.dequantized()
    for e, (gate, up, down) in enumerate(trios):
        assert torch.allclose(w13[e, :32], gate.dequantize(), atol=1e-6)
        assert torch.allclose(w13[e, 32:], up.dequantize(), atol=1e-6)
        assert torch.allclose(w2[e], down.dequantize(), atol=1e-6)


def test_fused_moe_act_order_groups():
    """A permuted g_idx (act-order) is gathered per row."""
    trios = experts_q(2, 64, 32, 32)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(3))
    scheme = QuantScheme(4, 32, sym=False)
    permuted = []
    for gate, up, down in trios:
        g_idx = (torch.arange(64) // 32)[perm].to(torch.int32)
        new = []
        for qw in (gate, up):
            w = qw.dequantize()
            s, z, gi = compute_qparams(w, 4, 32, False, g_idx=g_idx)
            new.append(QuantizedWeight.from_codes(quantize(w, s, z, gi, 4), s, z, gi, scheme))
        permuted.append((*new, down))
    ex = stack_quantized(permuted, torch.float32, DEVICE)
    assert (ex.group13, ex.group2) == (0, 32)  # gate/up permuted: gathered per row; down contiguous
    w, ids = routing(7, 2, 1)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    out = fused_moe(x, w.to(DEVICE), ids.to(DEVICE), ex, block_n=32, block_k=32)
    assert rel_err(out, fused_moe_ref(x, w.to(DEVICE), ids.to(DEVICE), ex)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_moe_dense_experts_same_structure(dtype):
    g = torch.Generator().manual_seed(5)
    w13 = (torch.randn(4, 64, 64, generator=g) / 8).to(DEVICE, dtype)  # [E, 2I, H], I = 32
    w2 = (torch.randn(4, 64, 32, generator=g) / 6).to(DEVICE, dtype)
    ex = stack_dense(w13, w2)
    w, ids = routing(9, 4, 2)
    x = torch.randn(9, 64, generator=g).to(DEVICE, dtype)
    out = fused_moe(x, w.to(DEVICE), ids.to(DEVICE), ex, block_n=32, block_k=32)
    ref = fused_moe_ref(x.float(), w.to(DEVICE), ids.to(DEVICE), ex)
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 5e-3)


HOST_READS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "unique", "_unique2"}


class _NoLaunch:
    """Stands for a Triton kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _recorded_ops(fn) -> set[str]:
    """The names of the tensor ops ``fn()`` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    record = Record()
    with record:
        fn()
    return record.ops


@pytest.mark.parametrize("align_impl", ["torch", "auto"])
def test_fused_moe_reads_nothing_on_the_host(monkeypatch, align_impl):
    """The MoE decode runs in CUDA graphs: ``fused_moe``'s host code may not read a tensor's value (a host sync,
    illegal while capturing). It read the experts' g_idx so (``int(max)``, ``bool(all)``) and the int4 MoE graph
    capture failed on an H200. Every tensor op of a call is recorded, with the kernel launches stubbed out (the
    CPU's Triton interpreter reads tensors itself). Both ways of aligning the pairs: torch ops, one Triton program."""
    ex = stack_quantized(experts_q(4, 64, 32, 32), torch.float32, "cpu")
    w, ids = routing(5, 4, 2)
    monkeypatch.setattr(moe, "_launch", lambda *args, **kwargs: None)
    monkeypatch.setattr(align, "_moe_align_kernel", _NoLaunch())
    monkeypatch.setenv("QUANTKIT_MOE_ALIGN", align_impl)
    ops = _recorded_ops(lambda: moe.fused_moe(torch.randn(5, 64), w, ids, ex, block_n=32, block_k=32))
    assert ("sort" in ops) == (align_impl == "torch") and ops & HOST_READS == set()


@pytest.mark.parametrize("align_impl", ["torch", "auto"])
def test_runtime_moe_block_reads_nothing_on_the_host(monkeypatch, align_impl):
    """The same for the runtime's whole MoE block (router, routing, align, experts) on the kernel path."""
    from quantkit.runtime.moe import MoELayer

    ex = stack_quantized(experts_q(4, 64, 32, 32), torch.float32, "cpu")
    monkeypatch.setattr(moe, "_launch", lambda *args, **kwargs: None)
    monkeypatch.setattr(align, "_moe_align_kernel", _NoLaunch())
    monkeypatch.setattr(align, "_route_align_kernel", _NoLaunch())
    monkeypatch.setenv("QUANTKIT_MOE_ALIGN", align_impl)
    layer = MoELayer(torch.randn(4, 64), ex, 2, True, True)
    ops = _recorded_ops(lambda: layer(torch.randn(5, 64), None))
    assert ("topk" in ops) == (align_impl == "torch") and ops & HOST_READS == set()


@pytest.mark.parametrize(("tokens", "n_exp", "top_k"), [(1, 128, 8), (16, 128, 8)])
def test_route_and_align_compiles_for_sm90_within_registers(sm90, tmp_path, tokens, n_exp, top_k):
    """The one program compiles for Hopper (the CPU interpreter runs no compiler) and keeps its matrices in
    registers up to 16 tokens of top-8 over 128 experts (32 tokens, 16 warps, spill a few hundred bytes)."""
    import triton

    from quantkit.kernels import moe_align as m

    pairs = tokens * top_k
    signature = {"logits_ptr": "*bf16", "stride_lt": "i32", "weights_ptr": "*fp32", "ids_ptr": "*i64",
                 "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "num_tokens": "i32", "num_experts": "i32",
                 "n_blocks": "i32", "n_slots": "i32"}
    constexprs = dict(TOP_K=top_k, RENORM=True, BLOCK_M=m.BLOCK_M, TOKENS=triton.next_power_of_2(tokens),
                      PAIRS=triton.next_power_of_2(pairs), EXPERTS=triton.next_power_of_2(n_exp), FILL=m.FILL,
                      BLOCKS=m._blocks_a_step(n_exp), TOP_K_P2=triton.next_power_of_2(top_k))
    ptx = sm90.triton_ptx(str(tmp_path / "route.ptx"), "quantkit.kernels.moe_align", "_route_align_kernel", signature,
                          constexprs, num_warps=m._warps(pairs, n_exp))
    notices = sm90.ptxas_notices(ptx)
    assert "0 bytes spill stores, 0 bytes spill loads" in notices, notices
