"""The decode-sized MoE GEMV against the plain-PyTorch reference and the tiled kernel (TRITON_INTERPRET=1 on the
CPU: float32 and float16; bfloat16 on a GPU), and the selection between the two kernels."""

from __future__ import annotations

import re

import pytest
import torch

from quantkit.kernels import moe_gemv
from quantkit.kernels.moe_gemv import moe_gemv as gemv
from quantkit.kernels.moe_w4a16 import (
    GEMV_MAX_PAIRS,
    decode_kernel,
    fused_moe,
    fused_moe_ref,
    stack_dense,
    stack_quantized,
)
from tests.conftest import rel_err
from tests.kernels.test_moe_w4a16 import DEVICE, experts_q, routing


@pytest.mark.parametrize("math", moe_gemv.MATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("tokens", "n_exp", "top_k", "hidden", "inter", "group_size"),
                         [(1, 8, 2, 64, 32, 32), (3, 6, 3, 128, 96, 32), (2, 4, 4, 256, 64, 64)])
def test_gemv_matches_reference_and_tiled_kernel(dtype, tokens, n_exp, top_k, hidden, inter, group_size, math,
                                                 monkeypatch):
    """4-bit experts of contiguous groups: N not a multiple of the tile (96 x 2 = 192 columns), K slices that do
    not divide K (the split is sized for a program count), one expert routed twice in one token's pairs; each of
    moe_gemv.MATHS (the row sums with their K masks where the slices overrun K, none where they do not)."""
    ex = stack_quantized(experts_q(n_exp, hidden, inter, group_size), dtype, DEVICE)
    w, ids = routing(tokens, n_exp, top_k, skip=(1,))
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    # 40 programs: several slices of K at these small sizes
    out = gemv(x, w.to(DEVICE), ids.to(DEVICE), ex, block_n=32, target_programs=40, math=math)
    ref = fused_moe_ref(x.float(), w.to(DEVICE), ids.to(DEVICE), ex)
    monkeypatch.setenv("QUANTKIT_MOE_DECODE", "tiles")  # the table would send these sizes to the GEMV itself
    tiled = fused_moe(x, w.to(DEVICE), ids.to(DEVICE), ex, block_n=32, block_k=32)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 5e-3)
    assert rel_err(out, tiled) < (1e-5 if dtype == torch.float32 else 5e-3)


def test_gemv_dense_experts_and_one_slice_or_many():
    g = torch.Generator().manual_seed(5)
    w13 = (torch.randn(4, 96, 80, generator=g) / 9).to(DEVICE)  # [E, 2I, H], I = 48, H = 80 (not a tile multiple)
    w2 = (torch.randn(4, 80, 48, generator=g) / 7).to(DEVICE)
    ex = stack_dense(w13, w2)
    w, ids = routing(2, 4, 2)
    x = torch.randn(2, 80, generator=g).to(DEVICE)
    ref = fused_moe_ref(x, w.to(DEVICE), ids.to(DEVICE), ex)
    for programs in (1, 10_000):  # one slice of K; as many slices as K tiles
        assert rel_err(gemv(x, w.to(DEVICE), ids.to(DEVICE), ex, block_n=32, target_programs=programs), ref) < 1e-5


@pytest.mark.parametrize(("weights", "inter"), [("channel", 32), ("tensor", 48), ("block", 48)])
def test_gemv_fp8_experts_match_the_emulated_reference_and_tiled_kernel(monkeypatch, weights, inter):
    """FP8 experts (e4m3 codes; per-channel, per-tensor or 32x32-block scales) with the activations rounded per
    token (or per token and 32 columns) before each GEMV: against the reference's float32 emulation of the same
    rounding and against the tiled kernel. inter 48 with 32-row blocks: the up half's scales start inside a block.
    The interpreter's own e4m3 rounding is wrong at carries (test_moe_w4a16.py says so): the codes come from the
    torch reference there."""
    from quantkit.kernels import moe_w4a16 as moe
    from quantkit.kernels.fp8_quant_ref import activations_through_e4m3, quantize_per_group_ref, quantize_per_token_ref
    from quantkit.kernels.moe_w4a16 import stack_fp8
    from tests.kernels.test_moe_w4a16 import experts_fp8

    if DEVICE == "cpu":
        reference_codes = lambda v, group: quantize_per_group_ref(v, group) if group else quantize_per_token_ref(v)  # noqa: E731
        monkeypatch.setattr(moe, "quantize_activations", reference_codes)  # the tiled kernel's
        monkeypatch.setattr(moe_gemv, "quantize_activations", reference_codes)
    ex = stack_fp8(experts_fp8(6, 64, inter, weights), DEVICE)
    w, ids = routing(3, 6, 2, skip=(3,))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    assert moe_gemv.applies(ex, ids.numel()) and moe_gemv.block_k_for(ex) == (32 if weights == "block" else 64)
    out = gemv(x, w.to(DEVICE), ids.to(DEVICE), ex, block_n=32, target_programs=40)  # several slices of K
    group = 32 if weights == "block" else 0
    ref = fused_moe_ref(x, w.to(DEVICE), ids.to(DEVICE), ex, lambda v: activations_through_e4m3(v, group))
    monkeypatch.setenv("QUANTKIT_MOE_DECODE", "tiles")
    tiled = fused_moe(x, w.to(DEVICE), ids.to(DEVICE), ex, block_n=32, block_k=32)
    assert rel_err(out, ref) < 1e-4 and rel_err(out, tiled) < 1e-4, (rel_err(out, ref), rel_err(out, tiled))
    monkeypatch.setenv("QUANTKIT_MOE_DECODE", "gemv")
    assert decode_kernel(ex, ids.numel()) == "gemv"
    monkeypatch.delenv("QUANTKIT_MOE_DECODE")
    # by default: the GEMV for per-channel scales (timed faster), tiles for block scales (not timed)
    assert decode_kernel(ex, ids.numel()) == ("tiles" if weights == "block" else "gemv")


def test_split_covers_k_in_whole_tiles():
    for k, block_k, programs in [(2048, 128, 192), (768, 128, 256), (80, 64, 1), (4096, 32, 1), (96, 32, 10**6)]:
        slices, per = moe_gemv._split(k, block_k, programs)
        assert per % block_k == 0 and slices * per >= k and (slices - 1) * per < k, (k, block_k, programs)


def test_selection_table(monkeypatch):
    """By default the GEMV for contiguous-group 4-bit experts up to GEMV_MAX_PAIRS pairs and for per-channel FP8
    experts up to the GEMV's own limit (where each was measured faster), the tiled kernel otherwise (16-bit
    experts, more pairs); forced either way where asked and where the GEMV applies (decode-sized, contiguous 4-bit
    groups that a K tile fits in, FP8 or 16-bit); act-order and many pairs stay tiled. (FP8 experts: the FP8
    interpreter test above.)"""
    contiguous = stack_quantized(experts_q(4, 64, 32, 32), torch.float32, "cpu")
    act_order = stack_quantized(experts_q(4, 64, 32, 32), torch.float32, "cpu")
    act_order = type(act_order)(**{**act_order.__dict__, "group13": 0, "group2": 0})
    dense = stack_dense(torch.zeros(4, 64, 64), torch.zeros(4, 64, 32))
    monkeypatch.delenv("QUANTKIT_MOE_DECODE", raising=False)
    assert GEMV_MAX_PAIRS == 64  # batch 8 of top-8: measured (kernels/moe_w4a16.py's table comment)
    assert decode_kernel(contiguous, 1) == decode_kernel(contiguous, 64) == "gemv"
    assert decode_kernel(contiguous, 65) == decode_kernel(dense, 1) == decode_kernel(act_order, 8) == "tiles"
    monkeypatch.setenv("QUANTKIT_MOE_DECODE", "tiles")
    assert decode_kernel(contiguous, 8) == "tiles"
    monkeypatch.setenv("QUANTKIT_MOE_DECODE", "gemv")
    assert decode_kernel(contiguous, 8) == "gemv" and decode_kernel(dense, 1) == "gemv"
    assert decode_kernel(contiguous, moe_gemv.MAX_PAIRS + 1) == "tiles"
    assert decode_kernel(act_order, 8) == "tiles"
    assert moe_gemv.block_k_for(contiguous) == 32 and moe_gemv.block_k_for(dense) == 64
    monkeypatch.setenv("QUANTKIT_MOE_DECODE", "fast")
    with pytest.raises(ValueError, match="QUANTKIT_MOE_DECODE"):
        decode_kernel(contiguous, 8)


def test_fused_moe_routes_decode_calls_to_the_gemv_when_selected(monkeypatch):
    ex = stack_quantized(experts_q(4, 64, 32, 32), torch.float32, DEVICE)
    w, ids = routing(1, 4, 2)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    calls = []
    real = moe_gemv.moe_gemv
    monkeypatch.setattr(moe_gemv, "moe_gemv", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("QUANTKIT_MOE_DECODE", "gemv")
    out = fused_moe(x, w.to(DEVICE), ids.to(DEVICE), ex)
    assert calls == [1]
    assert rel_err(out, fused_moe_ref(x, w.to(DEVICE), ids.to(DEVICE), ex)) < 1e-5


@pytest.mark.gpu
def test_gemv_bf16_on_the_gpu_matches_the_tiled_kernel(monkeypatch):
    """bf16 (the interpreter's tl.dot is wrong in bf16, so the tiled side runs here only) at the 30B-A3B expert
    shapes, batch 1 and 4 of top-8 over 128 experts."""
    ex = stack_quantized(experts_q(128, 2048, 768, 128), torch.bfloat16, "cuda")
    for tokens in (1, 4):
        w, ids = routing(tokens, 128, 8, seed=tokens)
        x = torch.randn(tokens, 2048, generator=torch.Generator().manual_seed(7)).to("cuda", torch.bfloat16)
        ref = fused_moe_ref(x.float(), w.cuda(), ids.cuda(), ex)
        out = gemv(x, w.cuda(), ids.cuda(), ex)
        monkeypatch.setenv("QUANTKIT_MOE_DECODE", "tiles")
        tiled = fused_moe(x, w.cuda(), ids.cuda(), ex)
        assert rel_err(out, ref) < 1e-2 and rel_err(tiled, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["channel", "block"])
def test_gemv_fp8_experts_on_the_gpu_match_the_tiled_kernel(monkeypatch, weights):
    """FP8 experts in bf16 on the GPU (the GPU's own e4m3 rounding of the activations), 128 x 128 blocks as
    block-scaled checkpoints ship them; batch 1 and 4 of top-8 over 32 experts at the 30B-A3B expert sizes."""
    from quantkit.kernels.fp8_quant_ref import activations_through_e4m3
    from quantkit.kernels.moe_w4a16 import stack_fp8
    from tests.kernels.test_moe_w4a16 import experts_fp8

    ex = stack_fp8(experts_fp8(32, 2048, 768, weights, block=(128, 128)), "cuda")
    group = 128 if weights == "block" else 0
    for tokens in (1, 4):
        w, ids = routing(tokens, 32, 8, seed=tokens)
        x = torch.randn(tokens, 2048, generator=torch.Generator().manual_seed(7)).to("cuda", torch.bfloat16)
        ref = fused_moe_ref(x.float(), w.cuda(), ids.cuda(), ex, lambda v: activations_through_e4m3(v, group))
        out = gemv(x, w.cuda(), ids.cuda(), ex)
        monkeypatch.setenv("QUANTKIT_MOE_DECODE", "tiles")
        tiled = fused_moe(x, w.cuda(), ids.cuda(), ex)
        assert rel_err(out, ref) < 2e-2 and rel_err(out, tiled) < 2e-2, (rel_err(out, ref), rel_err(out, tiled))


def _gemv_ptx(sm90, out, kind, block_k, num_stages=None, unroll=None, pdl=False, math="tile", finish=0):
    """The GEMV compiled for Hopper as Triton's launcher specializes it at run time: unit strides as constexpr 1,
    aligned pointers and strides divisible by 16. ``math``: moe_gemv.MATHS; the row sums' down GEMV reads the
    gated input whole (no prologue), K whole tiles; inline PTX as on a GPU."""
    quant, fp8 = kind in ("int4", "int4-down"), kind == "fp8"
    rows = math != "tile"
    gated = kind == "int4-down" and not rows
    w = "*i32" if quant else "*fp8e4nv"
    signature = {"a_ptr": "*fp8e4nv" if fp8 else "*bf16", "p1_ptr": "*fp32", "w_ptr": w,
                 "s_ptr": "*fp32" if fp8 else "*bf16", "z_ptr": "*bf16" if quant else w, "ids_ptr": "*i64",
                 "topw_ptr": "*fp32", "out_ptr": "*fp32", "as_ptr": "*fp32"}
    signature |= {name: "i32" for name in ("N", "K", "TOP_K", "IN_SPLITS", "INTER", "stride_am", "stride_we",
                                           "stride_wk", "stride_wn", "stride_se", "stride_sg", "stride_sn",
                                           "stride_ps", "stride_pp", "stride_os", "stride_op", "stride_asm")}
    units = ("stride_wn", "stride_sn") if quant else ("stride_wk",)  # [E, K/8, N] words / [E, N, K] codes
    for name in units:
        del signature[name]
    constexprs = dict({name: 1 for name in units}, QUANT=quant, GROUP=128, GATED_INPUT=gated,
                      MUL_ROUTED=kind == "int4-down", FP8=fp8, K_SPLIT=768, BLOCK_N=64, BLOCK_K=block_k,
                      NUM_STAGES=num_stages, UNROLL=unroll, PDL=pdl, ROWS=moe_gemv.MATHS.index(math),
                      EVEN_K=rows, ASM=True, FINISH=finish)
    if finish:  # the counters and the finished rows
        signature |= {"cnt_ptr": "*i32", "fin_ptr": "*bf16", "ROW_PAIRS": "i32"}
    unaligned = ("TOP_K", "IN_SPLITS", "ROW_PAIRS") + (() if quant else ("stride_sg", "stride_sn"))
    aligned = tuple(name for name in signature if name not in unaligned)
    return sm90.triton_ptx(out, "quantkit.kernels.moe_gemv", "_moe_gemv_kernel", signature, constexprs,
                           num_warps=4, aligned=aligned)


@pytest.mark.parametrize(("kind", "block_k", "num_stages", "unroll"),
                         [("int4", 128, None, None), ("int4-down", 128, None, None), ("fp8", 64, None, None),
                          ("int4", 128, 3, None), ("int4-down", 128, None, 2), ("fp8", 64, 3, 2),
                          ("int4", 128, *moe_gemv.PIPELINING), ("int4-down", 128, *moe_gemv.PIPELINING)])
def test_gemv_compiles_for_sm90_without_spills(sm90, tmp_path, kind, block_k, num_stages, unroll):
    """The GEMV at 128-groups (4-bit gate/up and down with its gated prologue) and FP8 at its 64-row tile
    (block_k_for), plain, with the default pipelining and with others the bench sweeps, compiled for Hopper: no
    spill stores.
    (The FP8 and 16-bit tiles are [N, K], rows of K-contiguous codes: read as [K, N] like the 4-bit words, the FP8
    tile took 255 registers and spilled.) The 4-bit words load 16 bytes at a time; with stages, through cp.async."""
    ptx = _gemv_ptx(sm90, str(tmp_path / "gemv.ptx"), kind, block_k, num_stages, unroll)
    notices = sm90.ptxas_notices(ptx)
    assert "0 bytes spill stores" in notices, notices
    sass = " ".join(sm90.sass(sm90.cubin(ptx)))
    if kind.startswith("int4"):
        assert "LDG.E.128" in sass or "LDGSTS.E.BYPASS.128" in sass
    if kind == "int4" and num_stages:
        assert "LDGSTS.E.BYPASS.128" in sass and "LDGDEPBAR" in sass  # the words' tiles requested stages ahead


def _loop_body(sass_text: str) -> list[str]:
    """The lines of a kernel's longest loop: from the label of a backward branch to that branch."""
    lines = sass_text.splitlines()
    labels = {line.strip()[:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\s*\.L_x_\d+:", line)}
    spans = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"BRA `\((\.L_x_\d+)\)", line)) and labels.get(m.group(1), i) < i]
    assert spans, "no loop"
    start, end = max(spans, key=lambda span: span[1] - span[0])
    return lines[start:end + 1]


@pytest.mark.parametrize("math", ["rows", "offset"])
@pytest.mark.parametrize("kind", ["int4", "int4-down"])
@pytest.mark.parametrize(("num_stages", "unroll"), [moe_gemv.PIPELINING, (None, 2)])
def test_gemv_row_sums_move_nothing_between_threads_in_the_k_loop(sm90, tmp_path, kind, num_stages, unroll, math):
    """The row sums' K loop (sm_90 SASS): no shuffle or shared-memory store (the tile sums had five barriers a
    tile, their K sum crossing warps), no int-to-float conversion (the codes become floats through their bits), no
    spills; no barrier at all in a plain loop, and with cp.async stages only the ring's two an iteration. "offset"
    also without the bit-field extracts and the per-code subtractions of "rows"."""
    ptx = _gemv_ptx(sm90, str(tmp_path / "gemv.ptx"), kind, 128, num_stages, unroll, math=math)
    assert "0 bytes spill stores" in sm90.ptxas_notices(ptx)
    body = " ".join(_loop_body(sm90.sass_text(sm90.cubin(ptx))))
    for op in ("SHFL", "STS", "I2F"):
        assert not re.search(rf"\s{op}\b", body), op  # (LDGSTS, cp.async's, is not STS)
    assert body.count("BAR.SYNC") == (0 if num_stages is None else 2)
    assert "FFMA" in body and ("LDG.E.128" in body or "LDGSTS.E.BYPASS.128" in body)
    if math == "offset":  # a shift, one LOP3 (the inline PTX) and the FMA a code: no extract, no subtraction
        assert not re.search(r"SGXT\.U32 \w+, \w+, 0x4 ", body)  # (a 3-bit one is cp.async's addressing)
        assert 2 * len(re.findall(r"\sFADD\b", body)) < len(re.findall(r"\sFFMA\b", body))


@pytest.mark.parametrize(("kind", "finish"), [("int4", 0), ("int4-down", 0), ("int4", 1), ("int4-down", 2)])
def test_gemv_with_pdl_waits_before_any_load(sm90, tmp_path, kind, finish):
    """With PDL (the default on Hopper; QUANTKIT_MOE_PDL=0 turns it off) the GEMV waits for the previous kernel
    before its first global load (the expert id it reads first is the routing's output), at the default
    pipelining, without spills; also where it finishes its parts (gate/up forming h, down adding the parts
    up: an atomic count a program, the last one's loads past L1)."""
    from tests.kernels.test_moe_router import assert_waits_before_loads

    ptx = _gemv_ptx(sm90, str(tmp_path / "gemv.ptx"), kind, 128, *moe_gemv.PIPELINING, pdl=True,
                    math="offset" if finish else "tile", finish=finish)
    if finish:
        text = open(ptx).read()
        assert "atom.global" in text and ".acq_rel" in text and "ld.global.cg" in text
    assert "0 bytes spill stores" in sm90.ptxas_notices(ptx)
    assert_waits_before_loads(open(ptx).read(), True)


@pytest.mark.parametrize("math", moe_gemv.MATHS)
@pytest.mark.parametrize(("num_stages", "unroll"), [(3, 1), (1, 4), (2, 2)])
def test_gemv_pipelining_gives_the_same_sums(monkeypatch, num_stages, unroll, math):
    """Software pipelining and unrolling of the K loops change when loads go out, not the sums or their order:
    the same result bit for bit, 4-bit (with several slices of K and partial sums to add) and 16-bit."""
    if DEVICE == "cpu" and (unroll == 1 or (math != moe_gemv.gemv_math() and (num_stages, unroll) != (2, 2))):
        # Triton's interpreter ignores num_stages (a compiler option), so stages alone change nothing there; the
        # unrolled loops are checked for the default math at both unrolls and for the others at the default
        # pipelining (each case is ~30 s interpreted). The GPU runs every case.
        pytest.skip("interpreter: stages alone change nothing; other maths at the default pipelining only")
    ex = stack_quantized(experts_q(6, 256, 96, 32), torch.float32, DEVICE)
    w, ids = routing(3, 6, 2, skip=(1,))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    cfg = dict(block_n=32, target_programs=40)  # a few slices of K
    plain = gemv(x, w.to(DEVICE), ids.to(DEVICE), ex, num_stages=1, unroll=1, math=math, **cfg)
    got = gemv(x, w.to(DEVICE), ids.to(DEVICE), ex, num_stages=num_stages, unroll=unroll, math=math, **cfg)
    assert torch.equal(got, plain)
    monkeypatch.setenv("QUANTKIT_MOE_GEMV_STAGES", str(num_stages))
    monkeypatch.setenv("QUANTKIT_MOE_GEMV_UNROLL", str(unroll))
    assert moe_gemv.pipelining() == tuple(None if v == 1 else v for v in (num_stages, unroll))
    assert torch.equal(gemv(x, w.to(DEVICE), ids.to(DEVICE), ex, math=math, **cfg), plain)


def test_pipelining_switches_refuse_what_is_not_a_count(monkeypatch):
    monkeypatch.delenv("QUANTKIT_MOE_GEMV_STAGES", raising=False)
    monkeypatch.delenv("QUANTKIT_MOE_GEMV_UNROLL", raising=False)
    assert moe_gemv.pipelining() == moe_gemv.PIPELINING == (2, 2)  # measured faster in whole steps
    assert moe_gemv.pipelining(1, 1) == (None, None)  # one stage, an unroll by one: a plain loop
    monkeypatch.setenv("QUANTKIT_MOE_GEMV_STAGES", "three")
    with pytest.raises(ValueError, match="QUANTKIT_MOE_GEMV_STAGES"):
        moe_gemv.pipelining()


def test_gemv_config_table_and_its_switch(monkeypatch):
    """The table's rows by weights and pairs (4-bit at 8 and 64 pairs as measured), the plain config elsewhere;
    QUANTKIT_MOE_GEMV_CONFIG overrides every call and refuses what is not three counts."""
    monkeypatch.delenv("QUANTKIT_MOE_GEMV_CONFIG", raising=False)
    q = stack_quantized(experts_q(4, 64, 32, 32), torch.float32, "cpu")
    dense = stack_dense(torch.zeros(4, 64, 64), torch.zeros(4, 64, 32))
    rows = {(kind, most): c for kind, most, c in moe_gemv.GEMV_CONFIGS}
    assert moe_gemv.gemv_config(q, 1) == moe_gemv.gemv_config(q, 8) == rows[("4bit", 8)]
    assert moe_gemv.gemv_config(q, 9) == moe_gemv.gemv_config(q, 64) == rows[("4bit", 64)]
    assert moe_gemv.gemv_config(dense, 8) == moe_gemv.GemvConfig()
    monkeypatch.setenv("QUANTKIT_MOE_GEMV_CONFIG", "64,4,512")
    assert moe_gemv.gemv_config(q, 8) == moe_gemv.GemvConfig(64, 4, 512) == moe_gemv.GemvConfig()
    for bad in ("64,4", "64,0,512", "a,b,c"):
        monkeypatch.setenv("QUANTKIT_MOE_GEMV_CONFIG", bad)
        with pytest.raises(ValueError, match="QUANTKIT_MOE_GEMV_CONFIG"):
            moe_gemv.gemv_config(q, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("math", moe_gemv.MATHS)
@pytest.mark.parametrize(("num_stages", "unroll"), [(3, 1), (1, 2), (3, 2), (2, 2)])
def test_gemv_pipelining_on_the_gpu_gives_the_same_sums(num_stages, unroll, math):
    """bf16, the 30B-A3B expert sizes at batch 1: pipelined and unrolled K loops against the plain ones (the same
    sums in the same order, so equal up to nothing; a difference would mean the compiler reassociated)."""
    ex = stack_quantized(experts_q(16, 2048, 768, 128), torch.bfloat16, "cuda")
    w, ids = routing(1, 16, 8)
    x = torch.randn(1, 2048, generator=torch.Generator().manual_seed(9)).to("cuda", torch.bfloat16)
    plain = gemv(x, w.cuda(), ids.cuda(), ex, num_stages=1, unroll=1, math=math)
    got = gemv(x, w.cuda(), ids.cuda(), ex, num_stages=num_stages, unroll=unroll, math=math)
    assert rel_err(got, plain) < 1e-6
    assert rel_err(got, fused_moe_ref(x.float(), w.cuda(), ids.cuda(), ex)) < 1e-2


@pytest.mark.parametrize(("kind", "math"), [("int4", "offset"), ("int4", "tile"), ("dense", None), ("fp8", None)])
def test_gemv_finishing_its_own_parts_gives_the_same_bits(monkeypatch, kind, math):
    """The GEMVs' last programs finishing the parts (counters kept by the caller: h formed by the gate/up GEMV for
    the 4-bit row sums, the slices and pairs added by the down GEMV) against the launches of their own: the same
    sums in the same order, so equal bit for bit, over several slices of K and tokens, twice with the same counters
    (which the kernels leave zero); counters too few are refused."""
    from tests.kernels.test_moe_w4a16 import experts_fp8

    if kind == "fp8" and DEVICE == "cpu":
        from quantkit.kernels.fp8_quant_ref import quantize_per_token_ref

        monkeypatch.setattr(moe_gemv, "quantize_activations", lambda v, group: quantize_per_token_ref(v))
    g = torch.Generator().manual_seed(11)
    if kind == "int4":
        ex = stack_quantized(experts_q(6, 256, 96, 32), torch.float32, DEVICE)
    elif kind == "fp8":
        from quantkit.kernels.moe_w4a16 import stack_fp8

        ex = stack_fp8(experts_fp8(6, 128, 64, "channel"), DEVICE)
    else:
        ex = stack_dense((torch.randn(6, 192, 256, generator=g) / 9).to(DEVICE),
                         (torch.randn(6, 256, 96, generator=g) / 7).to(DEVICE))
    w, ids = routing(3, 6, 2, skip=(1,))
    x = torch.randn(3, ex.hidden, generator=g).to(DEVICE)
    counters = torch.zeros(moe_gemv.counters_for(ex), dtype=torch.int32, device=DEVICE)
    cfg = dict(block_n=32, target_programs=40, math=math)  # a few slices of K in both GEMVs
    apart = gemv(x, w.to(DEVICE), ids.to(DEVICE), ex, finish="apart", counters=counters, **cfg)
    for _ in range(2):
        fused = gemv(x, w.to(DEVICE), ids.to(DEVICE), ex, finish="fused", counters=counters, **cfg)
        assert torch.equal(fused, apart)
        assert int(counters.abs().sum()) == 0
    assert rel_err(apart, fused_moe_ref(x, w.to(DEVICE), ids.to(DEVICE), ex,
                                        None if kind != "fp8" else _e4m3_per_token)) < (1e-4 if kind == "fp8" else 1e-5)
    with pytest.raises(ValueError, match="counters"):
        gemv(x, w.to(DEVICE), ids.to(DEVICE), ex, finish="fused", counters=counters[:4], **cfg)


def _e4m3_per_token(v):
    from quantkit.kernels.fp8_quant_ref import activations_through_e4m3

    return activations_through_e4m3(v, 0)


def test_gemv_finish_switch(monkeypatch):
    """QUANTKIT_MOE_GEMV_FINISH picks where the parts are finished (apart until timed in a whole step); without
    counters the GEMVs cannot finish them and the launches of their own run."""
    monkeypatch.delenv("QUANTKIT_MOE_GEMV_FINISH", raising=False)
    assert moe_gemv.gemv_finish() == "apart" and moe_gemv.gemv_finish("fused") == "fused"
    monkeypatch.setenv("QUANTKIT_MOE_GEMV_FINISH", "fused")
    assert moe_gemv.gemv_finish() == "fused"
    monkeypatch.setenv("QUANTKIT_MOE_GEMV_FINISH", "late")
    with pytest.raises(ValueError, match="QUANTKIT_MOE_GEMV_FINISH"):
        moe_gemv.gemv_finish()
    with pytest.raises(ValueError, match="finish"):
        moe_gemv.gemv_finish("late")
    ex = stack_quantized(experts_q(4, 64, 32, 32), torch.float32, "cpu")
    assert moe_gemv.counters_for(ex) == moe_gemv.MAX_PAIRS * (2 + 4)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8])
def test_gemv_finishing_its_own_parts_on_the_gpu(tokens):
    """bf16 at the 30B-A3B expert sizes, batch 1 and 8 of top-8 over 128 experts, with PDL where the card has it:
    the GEMVs finishing their parts give the launches' bits, over repeated calls and in a CUDA graph replayed
    (the counters left zero each time)."""
    ex = stack_quantized(experts_q(128, 2048, 768, 128), torch.bfloat16, "cuda")
    w, ids = routing(tokens, 128, 8, seed=tokens)
    w, ids = w.cuda(), ids.cuda()
    x = torch.randn(tokens, 2048, generator=torch.Generator().manual_seed(7)).to("cuda", torch.bfloat16)
    counters = torch.zeros(moe_gemv.counters_for(ex), dtype=torch.int32, device="cuda")
    apart = gemv(x, w, ids, ex, finish="apart")
    for _ in range(3):
        assert torch.equal(gemv(x, w, ids, ex, finish="fused", counters=counters), apart)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, w, ids, ex, finish="fused", counters=counters)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, apart) and int(counters.abs().sum()) == 0
    assert rel_err(apart, fused_moe_ref(x.float(), w, ids, ex)) < 1e-2


def test_moe_layer_keeps_the_gemv_counters_whatever_its_backend():
    """The runtime may switch a loaded MoE layer to the kernels (RuntimeModel sets use_kernel by backend), so the
    counters the GEMVs finish their parts with are made with the layer either way, zeroed, counters_for's count."""
    from quantkit.runtime.moe import MoELayer

    ex = stack_quantized(experts_q(4, 64, 32, 32), torch.float32, "cpu")
    for use_kernel in (False, True):
        layer = MoELayer(torch.zeros(4, 64), ex, 2, True, use_kernel)
        assert layer.gemv_counters.shape == (moe_gemv.counters_for(ex),) and not layer.gemv_counters.any()
