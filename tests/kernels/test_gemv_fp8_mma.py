"""The tensor-core FP8 decode GEMM (kernels/gemv_fp8_mma.py): against its float32 reference under the interpreter
(codes in, so no rounding decides anything: only the float32 summation order differs), split K included; the
prepared FP8 linear's ``QUANTKIT_FP8_GEMV=mma`` path; its sm_90 machine code compiled on the CPU (the FP8
warpgroup MMA on the codes as they are, a cp.async pipeline, one release/acquire counter per split tile); and on
CUDA at the Llama-3-8B shapes and decode batch sizes (``-m gpu``)."""

from __future__ import annotations

import re

import pytest
import torch

from quantkit.fp8_linear import FP8LinearWeights, fp8_linear, fp8_linear_ref, prepare_fp8_linear
from quantkit.kernels.gemv_fp8_mma import (
    MAX_M,
    SMEM_BUDGET,
    Fp8MmaConfig,
    block_m,
    counters_for,
    gemv_fp8_mma,
    gemv_fp8_mma_ref,
    gemv_fp8_mma_supports,
    mma_config,
    smem_bytes,
)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
C = Fp8MmaConfig
SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down


def _operands(m, n, k, seed=0, device=DEV):
    """e4m3 activation codes with per-row scales and e4m3 weights with per-channel scales, magnitudes varied."""
    gen = torch.Generator(device=device).manual_seed(seed)
    qx = (torch.randn(m, k, generator=gen, device=device) * 80).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, generator=gen, device=device) * 80).to(torch.float8_e4m3fn)
    xs = torch.logspace(-3, 0, m, device=device).reshape(m, 1).contiguous()
    ws = torch.logspace(-2, 0, n, device=device).reshape(1, n).contiguous()
    return qx, xs, w, ws


def _rel(y, ref):
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


# (m, n, k, config): 64-row tiles (the FP8 warpgroup MMA) and 16/32-row ones (mma.sync), one split and several,
# K a multiple of BLOCK_K and not, N not a multiple of the tile, a split that would start past K (5 splits of
# 3 steps), the narrow side 16, 32 and 64
CASES = [
    (1, 96, 256, C(64, 64, 1, 4, 2)),
    (3, 100, 200, C(32, 64, 3, 4, 2)),
    (4, 64, 512, C(64, 128, 4)),
    (16, 80, 96, C(16, 32, 2, 2, 2)),
    (17, 70, 192, C(64, 64, 5, 4, 3)),
    (64, 64, 128, C(64, 32, 2, 4, 2)),
]


@pytest.mark.parametrize("m,n,k,cfg", CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_float32_reference(m, n, k, cfg, bias):
    """Codes in: the products are exact, so the result is the reference's up to float32 summation order; the
    split-K counters are zero again after each of two calls on one buffer."""
    qx, xs, w, ws = _operands(m, n, k, seed=m + n)
    b = torch.randn(n, device=DEV) if bias else None
    counters = counters_for(n, DEV)
    for _ in range(2):
        y = gemv_fp8_mma(qx, xs, w, ws, b, cfg, out_dtype=torch.float32, counters=counters)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert _rel(y, gemv_fp8_mma_ref(qx, xs, w, ws, b, out_dtype=torch.float32)) < 1e-6
        assert not counters.any()


def test_default_config_and_output_dtype():
    """config None (the rule), bf16 out by default, the counters allocated by the call; a row of zero codes gives
    the bias."""
    qx, xs, w, ws = _operands(5, 48, 160)
    qx[2] = 0
    b = torch.randn(48, device=DEV).to(torch.bfloat16)
    y = gemv_fp8_mma(qx, xs, w, ws, b)
    assert y.dtype == torch.bfloat16 and torch.equal(y[2], b)
    assert _rel(y, gemv_fp8_mma_ref(qx, xs, w, ws, b)) < 4e-3


def test_config_rule_at_the_8b_shapes():
    """64-row tiles, 4 stages within the shared-memory budget (3 at 64 rows of activations), and a K split only
    where the tiles leave SMs idle and each split keeps 4096 columns or more, the programs within one wave; the
    narrow side padded to 16, 32, 64."""
    for m in (1, 8, 16, 32, 64):
        for n, k in SHAPES_8B:
            cfg = mma_config(m, n, k, sms=132)
            tiles = -(-n // cfg.block_n)
            assert cfg.block_n == 64 and cfg.block_k == 256 and smem_bytes(cfg, m) <= SMEM_BUDGET
            assert cfg.num_stages == (4 if m <= 32 else 3)
            assert cfg.split_k == 1 or (tiles * cfg.split_k <= 132 and k // cfg.split_k >= 4096)
    # what the H100 sweep found best or within 0.3 us of it at M = 1, 8, 32: qkv (96 tiles), o (64 tiles, K 4096)
    # and gate_up (448 tiles) unsplit; down (64 tiles, K 14336) split in two
    assert [mma_config(1, n, k, sms=132).split_k for n, k in SHAPES_8B] == [1, 1, 1, 2]
    assert mma_config(1, 4096, 4096, sms=132) == C(64, 256, 1, 4, 4)
    assert mma_config(8, 1024, 65536, sms=132).split_k == 8  # 16 tiles: splits up to 8 keep 8192 columns each
    assert mma_config(1, 64, 2048, sms=132) == C(64, 256, 1, 4, 4)  # too short a K to split
    assert [block_m(m) for m in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]


def test_refusals_name_the_problem():
    qx, xs, w, ws = _operands(2, 32, 64)
    assert gemv_fp8_mma_supports(qx, xs, w, ws) == (True, "")
    for args, words in [((qx[:, :32], xs, w, ws), "agree on K"),
                        ((torch.zeros(MAX_M + 1, 64, device=DEV).to(torch.float8_e4m3fn), xs, w, ws), "M must be"),
                        ((qx.float(), xs, w, ws), "float8_e4m3fn"),
                        ((qx, xs[:1], w, ws), "activation scales"),
                        ((qx, xs, w, ws[:, :8]), "weight scales"),
                        ((qx, xs, w, ws, torch.zeros(31, device=DEV)), "bias"),
                        ((qx, xs, w.t().contiguous().t(), ws), "contiguous along K")]:
        ok, reason = gemv_fp8_mma_supports(*args)
        assert not ok and words in reason, reason
    with pytest.raises(ValueError, match="M must be"):
        gemv_fp8_mma(qx[:0], xs[:0], w, ws)
    with pytest.raises(ValueError, match="counters"):
        gemv_fp8_mma(qx, xs, w, ws, config=C(16, 16, 2), counters=torch.zeros(1, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="power of two"):
        C(48, 128)


def test_switch_is_checked_and_the_cpu_keeps_the_reference(monkeypatch):
    from quantkit.kernels.gemv_fp8 import gemv_fp8_ref  # noqa: F401  (the module the other FP8 decode path uses)

    qx, xs, w, ws = _operands(1, 16, 32, device="cpu")
    monkeypatch.setenv("QUANTKIT_FP8_GEMV", "mma")
    prepared = prepare_fp8_linear(w, ws.reshape(-1), "channel")
    assert prepared.path == "reference" and not prepared.gemv_mma and prepared.mma_counters is None
    monkeypatch.setenv("QUANTKIT_FP8_GEMV", "tensorcores")
    with pytest.raises(ValueError, match="QUANTKIT_FP8_GEMV must be one of"):
        prepare_fp8_linear(w, ws.reshape(-1), "channel")


@pytest.mark.parametrize("m", [2, 8, 40])
def test_fp8_linear_takes_the_mma_path_up_to_64_rows(m):
    """A prepared scaled_mm linear as the default prepares it (the GEMV for one row, gemv_mma): batches of 2..64
    rows go through the quantization kernel and gemv_fp8_mma, x's shape and dtype kept; activations whose e4m3 rounding is exact
    give fp8_linear_ref's result up to summation order."""
    _, _, w, ws = _operands(1, 40, 96)
    gen = torch.Generator(device=DEV).manual_seed(m)
    codes = (torch.randn(m, 96, generator=gen, device=DEV) * 60).to(torch.float8_e4m3fn).float()
    codes[:, 0] = 448  # the row's absmax: the per-token scale is exactly 2^-2
    x = (codes * 2.0**-2).reshape(1, m, 96)
    b = torch.randn(40, device=DEV)
    prepared = FP8LinearWeights(w, ws, "scaled_mm", None, b, gemv=True, gemv_mma=True,
                                mma_counters=counters_for(40, DEV))
    y = fp8_linear(x, prepared)
    assert y.shape == (1, m, 40) and y.dtype == torch.float32
    assert _rel(y, fp8_linear_ref(x, prepared)) < 4e-3  # bf16 out, as _scaled_mm's
    expected = gemv_fp8_mma(codes.to(torch.float8_e4m3fn), torch.full((m, 1), 0.25, device=DEV), w, ws, b)
    assert torch.equal(y[0], expected.float())


@pytest.mark.parametrize("m,mma", [(1, False), (4, False), (8, True), (2, True)])
def test_linear_from_codes_is_the_linear_on_what_they_quantize(m, mma):
    """runtime.Linear.from_codes on quantize_per_token's codes gives bitwise what the linear gives on the 16-bit
    rows (the CUDA-core GEMV at M <= 4, the tensor-core GEMM with gemv_mma), so a fused producer that writes those
    codes changes nothing but the launches; the switch that turns it on is checked."""
    from quantkit.kernels.fp8_quant import quantize_per_token
    from quantkit.runtime.linear import Linear

    _, _, w, ws = _operands(1, 48, 64)
    prepared = FP8LinearWeights(w, ws, "scaled_mm", None, torch.randn(48, device=DEV), gemv=True, gemv_mma=mma,
                                mma_counters=counters_for(48, DEV), codes_in=True)
    linear = Linear(48, fp8=prepared)
    assert linear.takes_fp8_codes and not Linear(48, fp8=prepared, parts=[linear]).takes_fp8_codes
    x = torch.randn(m, 64, generator=torch.Generator(device=DEV).manual_seed(m), device=DEV).to(torch.float16)
    qx, sx = quantize_per_token(x)
    got = linear.from_codes(qx, sx, torch.float16)
    assert got.dtype == torch.float16 and torch.equal(got, linear(x))


@pytest.mark.parametrize("switch,quant,by_rows", [
    ("auto", None, {1: "gemv_fp8", 2: "gemv_mma", 64: "gemv_mma", 65: "scaled_mm"}),  # the defaults
    ("auto", "apart", {1: "gemv", 2: "gemv_mma", 64: "gemv_mma", 65: "scaled_mm"}),
    ("unfused", None, {1: "gemv", 4: "gemv", 5: "scaled_mm", 64: "scaled_mm"}),
    ("fused", None, {1: "gemv_fp8", 4: "gemv_fp8", 5: "scaled_mm"}),
    ("mma", None, {1: "gemv_mma", 64: "gemv_mma", 65: "scaled_mm"}),
    ("0", None, {1: "scaled_mm", 8: "scaled_mm"}),
])
def test_decode_kernel_by_rows(monkeypatch, switch, quant, by_rows):
    """Which kernel a Hopper linear runs for how many rows under each QUANTKIT_FP8_GEMV choice (the CPU cannot
    run the scaled_mm path: it is forced here and only prepared); under ``auto`` one 16-bit row goes to the
    one-launch GEMV unless QUANTKIT_FP8_GEMV_QUANT=apart; with codes in, the one-launch GEMV (which quantizes
    16-bit rows itself) gives way to the GEMV on codes."""
    import quantkit.fp8_linear as fp8_linear_module
    from quantkit.fp8_linear import fp8_kernel

    monkeypatch.setattr(fp8_linear_module, "scaled_mm_supported", lambda device, n, k: (True, "forced"))
    if switch != "auto":
        monkeypatch.setenv("QUANTKIT_FP8_GEMV", switch)
    if quant is not None:
        monkeypatch.setenv("QUANTKIT_FP8_GEMV_QUANT", quant)
    _, _, w, ws = _operands(1, 16, 32, device="cpu")
    prepared = prepare_fp8_linear(w, ws.reshape(-1), "channel")
    assert {m: fp8_kernel(prepared, m) for m in by_rows} == by_rows
    codes_at_one = "gemv" if by_rows[1] == "gemv_fp8" else by_rows[1]
    assert fp8_kernel(prepared, 1, codes=True) == codes_at_one


def test_fused_quant_switch(monkeypatch):
    """QUANTKIT_FP8_FUSED_QUANT=1 lets a per-token FP8 linear take codes on any path (the reference path's
    producers quantize as its emulation does); block weights never (their activations are quantized per column
    group); an unknown value is refused."""
    _, _, w, ws = _operands(1, 16, 32, device="cpu")
    assert prepare_fp8_linear(w, ws.reshape(-1), "channel").codes_in  # the default
    for value, expected in (("1", True), ("0", False)):
        monkeypatch.setenv("QUANTKIT_FP8_FUSED_QUANT", value)
        assert prepare_fp8_linear(w, ws.reshape(-1), "channel").codes_in is expected
    block = prepare_fp8_linear(w, torch.ones(1, 1), "block", block=(16, 32))
    assert block.act_group and not block.codes_in
    monkeypatch.setenv("QUANTKIT_FP8_FUSED_QUANT", "yes")
    with pytest.raises(ValueError, match="QUANTKIT_FP8_FUSED_QUANT must be one of"):
        prepare_fp8_linear(w, ws.reshape(-1), "channel")


def _compile(sm90, tmp_path, cfg: C, m: int, split: int):
    out = str(tmp_path / f"mma_{cfg.block_n}_{split}.ptx")
    signature = dict(x_ptr="*fp8e4nv", xs_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32", b_ptr="*bf16",
                     y_ptr="*bf16", part_ptr="*fp32", count_ptr="*i32", M="i32", N="i32", K="i32", K_SPLIT="i32",
                     stride_xm="i32", stride_wn="i32", stride_ym="i32")
    constexprs = dict(HAS_BIAS=False, BLOCK_M=block_m(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split,
                      EVEN_K=True, PDL=True, PROMOTE=cfg.block_k)
    aligned = ("x_ptr", "w_ptr", "y_ptr", "part_ptr", "N", "K", "K_SPLIT", "stride_xm", "stride_wn", "stride_ym")
    sm90.triton_ptx(out, "quantkit.kernels.gemv_fp8_mma", "_fp8_mma_kernel", signature, constexprs, cfg.num_warps,
                    aligned, num_stages=cfg.num_stages)
    return sm90.sass(sm90.cubin(out)), sm90.ptxas_notices(out)


def test_sm90_multiplies_the_codes_as_they_are(sm90, tmp_path):
    """The rule's config at M = 1 on the 4096 x 14336 layer: FP8 warpgroup MMAs (QGMMA ... E4M3.E4M3) on the codes,
    no e4m3 conversion instruction anywhere, weights brought in by cp.async (LDGSTS) and no plain global loads
    of them, no spills; the split-K tail orders the partials before its one counter atomic (MEMBAR, then ATOMG)
    and drops stale L1 lines after it (CCTL)."""
    cfg = mma_config(1, 4096, 14336, sms=132)  # the down projection: split in two
    assert cfg.split_k == 2
    sass, notices = _compile(sm90, tmp_path, cfg, 1, cfg.split_k)
    ops = [re.sub(r"^.*?\*/\s*(@!?U?P\w+\s+)?", "", line).split()[0] for line in sass]
    assert any(op.startswith("QGMMA.64x16x32.F32.E4M3.E4M3") for op in ops), sorted(set(ops))
    assert not any("E4M3" in op for op in ops if op.startswith("F2FP"))
    assert sum(op.startswith("LDGSTS") for op in ops) >= cfg.num_stages * 2
    assert "0 bytes spill stores" in notices
    assert ops.count("FADD") >= 8  # each K step's MMA sum added into float32 (the launcher's default)
    atomics = [i for i, op in enumerate(ops) if op.startswith("ATOMG")]
    assert len(atomics) == 1 and "MEMBAR" in " ".join(ops[atomics[0] - 3:atomics[0]])
    assert "CCTL" in " ".join(ops[atomics[0]:atomics[0] + 3])


def test_sm90_narrow_tiles_fall_back_to_fp16_mma(sm90, tmp_path):
    """A 32-row tile is below the warpgroup MMA's 64: Triton converts the codes two at a time (exact) for fp16
    mma.sync; still pipelined, no split tail (one split), no atomics."""
    sass, _ = _compile(sm90, tmp_path, C(32, 256, 1, 4, 4), 1, 1)
    text = "\n".join(sass)
    assert "HMMA.16816.F32" in text and "F2FP.F16.E4M3.UNPACK_B" in text and "LDGSTS" in text
    assert "ATOMG" not in text and "QGMMA" not in text


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES_8B)
@pytest.mark.parametrize("m", [1, 4, 8, 16, 32, 64])
def test_8b_shapes_on_the_gpu(n, k, m):
    """bf16 activations quantized per token by the runtime's kernel, then the rule's config: within bf16 output
    rounding of the float32 reference; the split-K sum bitwise the same on a second call (deterministic order);
    the counters zero after; a CUDA graph replay gives the eager result."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the FP8 warpgroup MMA needs Hopper")
    from quantkit.kernels.fp8_quant import quantize_per_token

    gen = torch.Generator(device="cuda").manual_seed(n + m)
    x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    _, _, w, ws = _operands(1, n, k, seed=k, device="cuda")
    b = torch.randn(n, device="cuda").to(torch.bfloat16) if m == 8 else None
    qx, xs = quantize_per_token(x)
    counters = counters_for(n, "cuda")
    y = gemv_fp8_mma(qx, xs, w, ws, b, counters=counters)
    # bf16 output rounding alone is ~1.7e-3; left to the FP8 tensor cores' own accumulator across K (before each
    # K step's sum was added into float32) the error reached 3.4e-3 at K = 14336 (module docstring)
    assert _rel(y, gemv_fp8_mma_ref(qx, xs, w, ws, b)) < 2.2e-3
    assert torch.equal(gemv_fp8_mma(qx, xs, w, ws, b, counters=counters), y)
    assert not counters.any()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemv_fp8_mma(qx, xs, w, ws, b, counters=counters)  # compiled and warmed outside the capture
        with torch.cuda.graph(graph, stream=stream):
            out = gemv_fp8_mma(qx, xs, w, ws, b, counters=counters)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, y) and not counters.any()


@pytest.mark.gpu
def test_fp8_linear_on_cuda_with_the_mma_switch(monkeypatch):
    """QUANTKIT_FP8_GEMV=mma on Hopper: the prepared linear takes the tensor-core GEMM at decode batch sizes,
    within bf16 rounding of fp8_linear_ref."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the FP8 warpgroup MMA needs Hopper")
    monkeypatch.setenv("QUANTKIT_FP8_GEMV", "mma")
    _, _, w, ws = _operands(1, 4096, 4096, device="cuda")
    fast = prepare_fp8_linear(w, ws.reshape(-1), "channel", device="cuda")
    assert fast.path == "scaled_mm" and fast.gemv_mma and fast.mma_counters is not None, fast.reason
    for m in (1, 32):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        assert _rel(fp8_linear(x, fast), fp8_linear_ref(x, fast)) < 4e-3
