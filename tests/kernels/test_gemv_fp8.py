"""The one-launch FP8 decode GEMV (kernels/gemv_fp8.py): bit for bit against the two-launch path it replaces
(``quantize_per_token`` then ``gemv(..., scales=)``) at the same config, against the float32 reference
(``gemv_fp8_ref``, ``fp8_linear_ref``) on activations whose e4m3 rounding is exact, its sm_90 machine code compiled
on the CPU, and on CUDA at the Llama-3-8B shapes (``-m gpu``).

Under Triton's interpreter (the CPU) the fp8 loads and casts run, but its float32 -> e4m3 conversion is not torch's
(tests/kernels/test_fp8_quant.py: ties not to even, a carry into the next binade lost). Both paths convert the same
way there, so the bitwise comparison holds on the CPU; the comparison with the reference on random activations,
where rounding decides codes, is a GPU test. On the CPU it uses activations that are e4m3 values times the scale, so
no rounding happens and any error in the scale, the codes or their use shows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from quantkit.fp8_linear import FP8LinearWeights, fp8_linear, fp8_linear_ref, prepare_fp8_linear
from quantkit.kernels.fp8_quant import quantize_per_token
from quantkit.kernels.gemv import DenseGemvConfig, gemv
from quantkit.kernels.gemv_fp8 import (
    DEFAULT_FP8,
    TUNED_FP8,
    VEC,
    amax_block,
    fits,
    fp8_gemv_config,
    gemv_fp8,
    gemv_fp8_ref,
    gemv_fp8_supports,
    m_bucket,
)
from tests.kernels.test_gemv import compile_gemv_sm90

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
C = DenseGemvConfig


def _weights(n, k, seed=0, device=DEV):
    """e4m3 codes ``[N, K]`` and float32 per-channel scales ``[1, N]`` of a random weight (rows of varied size)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=gen, device=device) * torch.logspace(-2, 0, n, device=device)[:, None]
    ws = w.abs().amax(dim=1) / 448
    return (w / ws[:, None]).to(torch.float8_e4m3fn), ws.reshape(1, n).contiguous()


def _x(m, k, dtype, seed=0, zero_row=True, device=DEV):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=device) * torch.logspace(-1, 1, m, device=device)[:, None]
    if zero_row and m > 2:
        x[1] = 0  # the tiny scale, not a division by zero; the output row is the bias
    return x.to(dtype)


def _exact_x(m, k, dtype, scale, device=DEV):
    """Activations ``codes * scale`` with ``scale`` a power of two and a code of 448 in every row: the per-token
    scale is ``scale`` exactly and ``x / scale`` is an e4m3 value, so quantization rounds nothing."""
    gen = torch.Generator(device=device).manual_seed(m + k)
    codes = (torch.randn(m, k, generator=gen, device=device) * 60).to(torch.float8_e4m3fn).float()
    codes[:, k // 3] = 448.0 * torch.sign(torch.randn(m, generator=gen, device=device) + 0.1)
    return (codes * scale).to(dtype)


def cfg_args(cfg):
    return cfg.block_n, cfg.block_k, cfg.num_warps


def _two_launch(x, wq, ws, bias, input_scale, cfg, out_dtype):
    qx, sx = quantize_per_token(x, input_scale)
    return gemv(qx, wq, bias, cfg, scales=(sx, ws), out_dtype=out_dtype)


# N not a multiple of BLOCK_N (the last row tile partly past N), K a multiple of BLOCK_K or not, BLOCK_K past K
CASES = [(37, 300, True, torch.float16, C(8, 64, 2)),
         (48, 256, False, torch.float32, C(4, 128, 1)),
         (9, 200, True, torch.bfloat16, C(2, 512, 4))]


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("n,k,bias,dtype,cfg", CASES)
def test_equals_the_two_launch_path_bitwise(prefetch, m, static, n, k, bias, dtype, cfg):
    """Same codes, same scales, same float32 sums at the same config and vector width (the two-launch path with
    ``vec=8``): the float32 results are equal, and an all-zero row (m > 2: row 1) gives exactly the bias; with the
    next weight tile requested a step ahead (``prefetch``, in either path or both: the same sums in the same
    order)."""
    cfg = dataclasses.replace(cfg, prefetch=prefetch)
    wq, ws = _weights(n, k, seed=n)
    x = _x(m, k, dtype, seed=m)
    b = torch.randn(n, device=DEV).to(dtype) if bias else None
    input_scale = torch.tensor([0.01], device=DEV) if static else None
    y = gemv_fp8(x, wq, ws, b, input_scale, config=cfg, out_dtype=torch.float32)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert torch.equal(y, _two_launch(x, wq, ws, b, input_scale, C(*cfg_args(cfg), vec=8), torch.float32))
    assert torch.equal(y, _two_launch(x, wq, ws, b, input_scale, C(*cfg_args(cfg), vec=8, prefetch=not prefetch),
                                      torch.float32))
    if m > 2:
        assert torch.equal(y[1], b.float() if bias else torch.zeros(n, device=DEV))
    assert gemv_fp8(x, wq, ws, b, input_scale, config=cfg).dtype == dtype  # the output in x's dtype by default


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("n,k,bias,dtype,cfg", CASES)
def test_matches_the_float32_reference(m, static, n, k, bias, dtype, cfg):
    """Against the reference where e4m3 rounding is exact: only the float32 summation order differs. The static
    scale saturates the rows scaled past 448 x scale (clamped to +-448 as the reference clamps)."""
    wq, ws = _weights(n, k, seed=n + 1)
    x = _exact_x(m, k, dtype, 2.0**-3)
    if static:
        x[0, 5] = 2000 * 2.0**-3  # past 448 x the static scale: clamped to 448
    b = torch.randn(n, device=DEV).to(dtype) if bias else None
    input_scale = torch.tensor([2.0**-3], device=DEV) if static else None
    y = gemv_fp8(x, wq, ws, b, input_scale, config=cfg, out_dtype=torch.float32)
    ref = gemv_fp8_ref(x, wq, ws, b, input_scale, out_dtype=torch.float32)
    assert ((y - ref).norm() / ref.norm()).item() < 1e-6


def test_default_config_and_strided_rows():
    """config=None (the default, BLOCK_K shrunk to a small K) and rows that are a view into a wider buffer."""
    wq, ws = _weights(21, 80)
    x = torch.zeros(3, 200, dtype=torch.float16, device=DEV)[:, :80]
    x.copy_(_exact_x(3, 80, torch.float16, 2.0**-4))
    assert fp8_gemv_config(3, 21, 80) == C(2, 128, 4)
    y = gemv_fp8(x, wq, ws, out_dtype=torch.float32)
    ref = gemv_fp8_ref(x, wq, ws, out_dtype=torch.float32)
    assert ((y - ref).norm() / ref.norm()).item() < 1e-6


def _prepared(wq, ws, bias, input_scale, fused):
    return FP8LinearWeights(wq, ws, "scaled_mm", input_scale, bias, gemv=True, gemv_fused=fused)


@pytest.mark.parametrize("static", [False, True])
def test_fp8_linear_takes_the_one_launch_gemv_at_decode(monkeypatch, static):
    """fp8_linear at M <= 4 on the scaled_mm path is gemv_fp8's result (x's shape and dtype kept), and agrees with
    fp8_linear_ref; unfused, it is the two-launch path's."""
    import quantkit.kernels.gemv_fp8 as module

    wq, ws = _weights(40, 96)
    b = torch.randn(40, device=DEV)
    input_scale = torch.tensor([2.0**-2], device=DEV) if static else None
    x = _exact_x(3, 96, torch.float32, 2.0**-2).reshape(1, 3, 96)
    calls = []
    real = module.gemv_fp8
    monkeypatch.setattr(module, "gemv_fp8", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    fused = _prepared(wq, ws, b, input_scale, True)
    y = fp8_linear(x, fused)
    assert calls == [(3, 96)] and y.shape == (1, 3, 40) and y.dtype == torch.float32
    assert torch.equal(y[0], real(x[0], wq, ws, b, input_scale))
    ref = fp8_linear_ref(x, fused)
    assert ((y - ref).norm() / ref.norm()).item() < 1e-6
    y2 = fp8_linear(x, _prepared(wq, ws, b, input_scale, False))
    assert calls == [(3, 96)]  # the two launches
    assert torch.equal(y2[0], _two_launch(x[0], wq, ws, b, input_scale, None, torch.bfloat16).float())


@pytest.mark.parametrize("switch,quant,gemv_fused", [("fused", "apart", True), ("unfused", "apart", False),
                                                     ("auto", "apart", False), ("0", "apart", False),
                                                     ("auto", "inside", True), ("unfused", "inside", False),
                                                     ("mma", "inside", False), ("auto", None, True)])
def test_switch(monkeypatch, switch, quant, gemv_fused):
    """QUANTKIT_FP8_GEMV picks the decode kernels; QUANTKIT_FP8_GEMV_QUANT=inside (the default: None is unset)
    sends 16-bit rows to the one-launch GEMV under ``auto`` only; an unknown value is refused, naming the switch."""
    monkeypatch.setenv("QUANTKIT_FP8_GEMV", switch)
    if quant is None:
        monkeypatch.delenv("QUANTKIT_FP8_GEMV_QUANT", raising=False)
    else:
        monkeypatch.setenv("QUANTKIT_FP8_GEMV_QUANT", quant)
    wq, ws = _weights(16, 32, device="cpu")
    prepared = prepare_fp8_linear(wq, ws.reshape(-1), "channel")
    assert prepared.gemv_fused == gemv_fused and not prepared.gemv  # the CPU: the reference path
    monkeypatch.setenv("QUANTKIT_FP8_GEMV_QUANT", "yes")
    with pytest.raises(ValueError, match="QUANTKIT_FP8_GEMV_QUANT"):
        prepare_fp8_linear(wq, ws.reshape(-1), "channel")


def test_quant_inside_sends_only_16_bit_rows_at_one_row_to_the_one_launch_gemv():
    """Under ``auto`` with QUANTKIT_FP8_GEMV_QUANT=inside (``gemv_fused`` and the tensor-core GEMM on): one 16-bit
    row goes to the one-launch GEMV, codes to the GEMV on codes, two rows or more to the tensor-core GEMM."""
    from quantkit.fp8_linear import fp8_kernel

    wq, ws = _weights(16, 32)
    w = FP8LinearWeights(wq, ws, "scaled_mm", gemv=True, gemv_fused=True, gemv_mma=True)
    assert [fp8_kernel(w, 1), fp8_kernel(w, 1, codes=True), fp8_kernel(w, 2), fp8_kernel(w, 65)] == [
        "gemv_fp8", "gemv", "gemv_mma", "scaled_mm"]


def test_capability_check():
    wq, ws = _weights(8, 32)
    x = torch.zeros(1, 32, dtype=torch.bfloat16, device=DEV)
    assert gemv_fp8_supports(x, wq, ws) == (True, "")
    for bad, words in [((torch.zeros(5, 32, device=DEV), wq, ws), "1..4"),
                       ((x, wq.float(), ws), "float8_e4m3fn"),
                       ((x, wq, ws[:, :4]), "weight scale"),
                       ((x, wq, ws, None, torch.tensor([1.0, 2.0], device=DEV)), "static input scale"),
                       ((torch.zeros(1, 64, device=DEV)[:, ::2], wq, ws), "contiguous"),
                       ((x, wq, ws, torch.zeros(7, device=DEV)), "bias")]:
        ok, reason = gemv_fp8_supports(*bad)
        assert not ok and words in reason, reason
    with pytest.raises(ValueError, match="1..4"):
        gemv_fp8(torch.zeros(0, 32, device=DEV), wq, ws)


def test_config_table():
    """Every table entry and default fits its rows' registers at Llama-3-8B's K; the choice by (N, K, M bucket)."""
    assert {(n, k) for n, k, _ in TUNED_FP8} == {(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)}
    for (n, k, m), cfg in TUNED_FP8.items():
        assert m in (1, 2, 4) and fits(cfg, m, k), (n, k, m, cfg)
    assert all(fits(cfg, m, 4096) for m, cfg in DEFAULT_FP8.items())
    assert [m_bucket(m) for m in (1, 2, 3, 4)] == [1, 2, 4, 4]
    assert fp8_gemv_config(3, 28672, 4096) == TUNED_FP8[(28672, 4096, 4)]
    assert fp8_gemv_config(1, 1000, 4096) == DEFAULT_FP8[1]
    assert not fits(C(16, 4096, 4), 1, 4096)  # 256 accumulators a thread: spills
    assert not fits(C(1, 512, 4), 1, 4096)  # 512 codes over 128 threads: threads without a vector


@pytest.mark.parametrize("m,block_n,block_k,warps,static,prefetch", [(1, 4, 2048, 4, False, False),
                                                                     (4, 2, 2048, 4, False, False),
                                                                     (2, 2, 4096, 8, True, False),
                                                                     (1, 4, 1024, 4, False, True),
                                                                     (4, 2, 2048, 4, False, True)])
def test_sm90_one_launch_variant(sm90, tmp_path, m, block_n, block_k, warps, static, prefetch):
    """The fused kernel for sm_90: its first weight tile (8-byte loads) requested before ``griddepcontrol.wait``
    (ACQBULK) and the next kernel let launch there (PREEXIT); from the first weight load after the wait to the
    last (the main loop) no shared memory and no barrier (x's codes stay in the threads that multiply them); the
    activations rounded with the saturating round-to-nearest instruction and the division ``fp8_quant``'s kernel
    uses (so the codes are the same); no spills; with PREFETCH, too."""
    out = str(tmp_path / "gemv_fp8")
    compile_gemv_sm90(sm90, out, "*bf16", "*fp8e4nv", warps, M=m, BLOCK_N=block_n, BLOCK_K=block_k, SCALED=True,
                      QUANT_X=True, STATIC_X=static, AMAX_BLOCK=amax_block(m, 4096, warps), W_VEC=VEC,
                      PREFETCH=prefetch)
    sass = sm90.sass(out + ".cubin")
    wait = next(i for i, line in enumerate(sass) if "ACQBULK" in line)
    assert sum("LDG.E.64" in line for line in sass[:wait]) == block_n * block_k // (8 * 32 * warps)
    assert any("PREEXIT" in line for line in sass[:wait])
    tile_loads = [i for i in range(wait, len(sass)) if "LDG.E.64" in sass[i]]
    assert tile_loads, "no weight loads after the wait"
    assert not any(op in sass[i] for i in range(tile_loads[0], tile_loads[-1]) for op in ("BAR.SYNC", "STS", "LDS"))
    ptx = open(out + ".ptx").read()
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.full.f32" in ptx
    assert "0 bytes spill stores" in sm90.ptxas_notices(out + ".ptx")


# Llama-3-8B's decode linears: qkv, o, gate_up, down
SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def _sum_order_bound(k: int, magnitude: torch.Tensor) -> torch.Tensor:
    """What two float32 summation orders of the same K products can differ by: each result is within
    ``depth x 2^-24`` of the exact sum of |products| (``magnitude``), depth the longest chain of additions (at most
    K / 512 steps along K, then at most 64 within a tile and across threads, the two scale products)."""
    depth = -(-k // 512) + 64
    return 2 * depth * 2.0**-24 * magnitude


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES_8B)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("static", [False, True])
def test_8b_shapes_on_the_gpu(n, k, m, static):
    """bf16 activations at the 8B shapes: bitwise the two-launch path at the same config and vector width; within
    the float32 summation-order bound of today's two-launch path (16-byte vectors, its config) at the table's
    config; within bf16 output rounding of the float32 reference."""
    wq, ws = _weights(n, k, seed=n + k, device="cuda")
    x = _x(m, k, torch.bfloat16, seed=m, device="cuda")
    b = torch.randn(n, device="cuda").to(torch.bfloat16) if m == 2 else None
    input_scale = torch.tensor([0.02], device="cuda") if static else None
    cfg = C(2, 2048, 4) if m != 2 else C(2, 4096, 8)
    got = gemv_fp8(x, wq, ws, b, input_scale, config=cfg)
    assert torch.equal(got, _two_launch(x, wq, ws, b, input_scale, C(*cfg_args(cfg), vec=8), torch.bfloat16))
    y = gemv_fp8(x, wq, ws, b, input_scale, out_dtype=torch.float32)  # the table's config
    y_today = _two_launch(x, wq, ws, b, input_scale, None, torch.float32)  # gemv's own FP8 default
    qx, sx = quantize_per_token(x, input_scale)
    magnitude = (qx.float().abs() * sx) @ (wq.float().abs() * ws.reshape(-1, 1)).T  # sum of |products|
    assert ((y - y_today).abs() <= _sum_order_bound(k, magnitude)).all()
    ref = gemv_fp8_ref(x, wq, ws, b, input_scale, out_dtype=torch.float32)
    got = gemv_fp8(x, wq, ws, b, input_scale)
    assert got.dtype == torch.bfloat16 and ((got.float() - ref).norm() / ref.norm()).item() < 4e-3
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES_8B)
@pytest.mark.parametrize("m", [1, 4])
def test_prefetch_changes_no_bit_on_the_gpu(n, k, m):
    """The next weight tile requested a step ahead (``prefetch``) at the 8B shapes and the tables' configs, in the
    one-launch GEMV and in the GEMV on codes (the runtime's default at one row): bitwise the result without it."""
    from quantkit.kernels.device_info import gpu_card
    from quantkit.kernels.gemv import _fp8_codes_config

    wq, ws = _weights(n, k, seed=n + k + 1, device="cuda")
    x = _x(m, k, torch.bfloat16, seed=m + 1, device="cuda")
    cfg = fp8_gemv_config(m, n, k)
    for prefetch in (False, True):
        want = gemv_fp8(x, wq, ws, config=dataclasses.replace(cfg, prefetch=not prefetch), out_dtype=torch.float32)
        assert torch.equal(gemv_fp8(x, wq, ws, config=dataclasses.replace(cfg, prefetch=prefetch),
                                    out_dtype=torch.float32), want)
    codes_cfg = _fp8_codes_config(m, n, k, gpu_card("cuda"))
    qx, sx = quantize_per_token(x)
    want = gemv(qx, wq, None, dataclasses.replace(codes_cfg, prefetch=not codes_cfg.prefetch), scales=(sx, ws))
    assert torch.equal(gemv(qx, wq, None, codes_cfg, scales=(sx, ws)), want)
    assert torch.equal(gemv(qx, wq, None, scales=(sx, ws)), want)  # the launcher's own pick is that config


def test_codes_config_table(monkeypatch):
    """The GEMV on codes takes the entry measured on this card at M = 1 (prefetch and all), else bf16's config
    with BLOCK_K doubled; a small K shrinks BLOCK_K either way."""
    from quantkit.kernels import gemv as dense

    for (card, n, k), cfg in dense.TUNED_FP8_CODES.items():
        assert isinstance(card, str) and fits(cfg, 1, k, vec=16), (card, n, k, cfg)
    monkeypatch.setattr(dense, "TUNED_FP8_CODES", {("Card X", 4096, 14336): C(8, 512, 4, prefetch=True),
                                                   ("Card X", 64, 64): C(4, 1024, 4)})
    doubled = dense._gemv_config(1, 4096, 14336)
    doubled = C(doubled.block_n, 2 * doubled.block_k, doubled.num_warps)
    assert dense._fp8_codes_config(1, 4096, 14336, "Card X") == C(8, 512, 4, prefetch=True)
    assert dense._fp8_codes_config(1, 4096, 14336, "Card Y") == doubled
    assert dense._fp8_codes_config(1, 4096, 14336) == doubled
    assert dense._fp8_codes_config(2, 4096, 14336, "Card X").prefetch is False  # M = 1 only
    assert dense._fp8_codes_config(1, 64, 64, "Card X") == C(4, 64, 4)


def _codes_entries():
    from quantkit.kernels.gemv import TUNED_FP8_CODES

    return sorted(TUNED_FP8_CODES.items())


def _entry_id(entry) -> str:
    (card, n, k), _cfg = entry
    return f"{card.replace(' ', '_')}-{n}x{k}"


@pytest.mark.parametrize("entry", _codes_entries(), ids=_entry_id)
def test_every_cards_codes_entry_computes_the_product(entry):
    """Each card's tuned config of the GEMV on codes, whatever card (or none) runs the suite: its tiles (BLOCK_N,
    BLOCK_K, warps, prefetch) on a weight two and a bit tiles each way (the last tile of either partly past the
    edge), at one row, against the float32 reference on activations whose e4m3 rounding is exact. An entry is only
    picked on its own card, so without this the suite on another card never ran it."""
    (_card, _n, _k), cfg = entry
    n, k = 2 * cfg.block_n + 3, 2 * cfg.block_k + 96
    wq, ws = _weights(n, k, seed=n + k)
    x = _exact_x(1, k, torch.bfloat16 if CUDA else torch.float16, 2.0**-3)
    qx, sx = quantize_per_token(x)
    y = gemv(qx, wq, None, cfg, scales=(sx, ws.reshape(-1)), out_dtype=torch.float32)
    ref = gemv_fp8_ref(x, wq, ws, out_dtype=torch.float32)
    assert ((y - ref).norm() / ref.norm()).item() < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("entry", _codes_entries(), ids=_entry_id)
def test_every_cards_codes_entry_at_its_shape_on_the_gpu(entry):
    """Each card's entry at the shape it was tuned for, on the GPU at hand: within bf16 rounding of the float32
    reference on random activations (the per-token rounding is the runtime's)."""
    (_card, n, k), cfg = entry
    wq, ws = _weights(n, k, seed=n + k, device="cuda")
    x = _x(1, k, torch.bfloat16, seed=k, device="cuda")
    qx, sx = quantize_per_token(x)
    y = gemv(qx, wq, None, cfg, scales=(sx, ws.reshape(-1)))
    ref = gemv_fp8_ref(x, wq, ws, out_dtype=torch.float32)
    assert y.dtype == torch.bfloat16 and ((y.float() - ref).norm() / ref.norm()).item() < 4e-3


@pytest.mark.gpu
def test_fp8_linear_on_cuda_is_the_one_launch_gemv(monkeypatch):
    """The prepared Hopper linear at M = 1 with QUANTKIT_FP8_GEMV=fused: bitwise gemv_fp8's result; within bf16
    rounding of fp8_linear_ref."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the scaled_mm path needs compute capability 8.9+")
    monkeypatch.setenv("QUANTKIT_FP8_GEMV", "fused")
    wq, ws = _weights(4096, 4096, device="cuda")
    fast = prepare_fp8_linear(wq, ws.reshape(-1), "channel", device="cuda")
    assert fast.path == "scaled_mm" and fast.gemv and fast.gemv_fused, fast.reason
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(fp8_linear(x, fast), gemv_fp8(x, wq, fast.scale))
    ref = fp8_linear_ref(x, fast)
    assert ((fp8_linear(x, fast).float() - ref.float()).norm() / ref.float().norm()).item() < 4e-3


def test_sass_reading_compiles_the_launchers_configs():
    """bench/sass_fp8_gemv.py reads the configs the launchers run at M = 1: bf16's, the two-launch path's (the
    same function ``gemv`` calls) and the one-launch table's, for each 8B linear."""
    import importlib.util
    import sys
    from pathlib import Path

    from quantkit.kernels import gemv as dense
    from quantkit.kernels import gemv_fp8

    bench = Path(__file__).resolve().parents[2] / "bench"
    sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location("sass_fp8_gemv", bench / "sass_fp8_gemv.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    by = {(c["layer"], c["path"]): c for c in mod.cases()}
    assert len(by) == 12
    for layer, (n, k) in mod.SHAPES.items():
        assert by[(layer, "bf16")]["config"] == dense._gemv_config(1, n, k).__dict__
        assert by[(layer, "fp8_two_launch")]["config"] == dense._fp8_codes_config(1, n, k).__dict__
        assert by[(layer, "fp8_one_launch")]["config"] == gemv_fp8.TUNED_FP8[(n, k, 1)].__dict__
        assert by[(layer, "fp8_one_launch")]["cx"]["QUANT_X"] and not by[(layer, "fp8_two_launch")]["cx"].get("QUANT_X")
