"""The one-launch FP8 MLP of a decode token (kernels/fp8_mlp.py) against its reference: under the interpreter (one
program, so the grid barrier is passed by the only arrival), compiled for sm_90 on the CPU, and on the GPU with
its whole persistent grid, the state it leaves reused by the next call and a CUDA-graph replay."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from quantkit.kernels.fp8_mlp import FP8MlpConfig, FP8MlpState, fp8_mlp, fp8_mlp_problem, fp8_mlp_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _operands(k: int, inter: int, hidden: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g)
    sx = (x.abs().amax() / 448).reshape(1, 1)
    qx = (x / sx).clamp(-448, 448).to(torch.float8_e4m3fn)
    wgu = (torch.randn(2 * inter, k, generator=g) * 8).clamp(-448, 448).to(torch.float8_e4m3fn)
    sgu = torch.rand(2 * inter, generator=g) * 0.005 + 0.001  # gate values of a few units: exp stays finite
    wd = (torch.randn(hidden, inter, generator=g) * 8).clamp(-448, 448).to(torch.float8_e4m3fn)
    sd = torch.rand(hidden, generator=g) * 0.02 + 0.005
    return [t.to(DEVICE) for t in (qx, sx.float(), wgu, sgu.float(), wd, sd.float())]


def _close(y: torch.Tensor, ref: torch.Tensor, tol: float = 2e-2) -> None:
    # the sums differ in float32 order only, but a 16-bit rounding of gate/up or h, or h's e4m3 code, can flip where
    # the orders disagree on a tie; the outputs are bf16
    err = (y.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err < tol, err


def _check_phases(y, state, qx, sx, wgu, sgu, wd, sd, activation):
    """Each phase against plain PyTorch: ``h`` (the first phase's output, kept in the state) against the
    activation of the reference's gate/up, and ``y`` against the down product of that ``h`` quantized by
    ``quantize_per_token``, the kernel the runtime runs: under the interpreter its float32 -> e4m3 conversion is
    not torch's (tests/kernels/test_fp8_quant.py), and the fused kernel's in-register rounding is the same
    conversion. On the GPU the whole reference as well."""
    from quantkit.kernels.decoder_ops_ref import act_mul_ref
    from quantkit.kernels.fp8_quant import quantize_per_token

    gate_up = (qx.float() * sx) @ wgu.float().t() * sgu.reshape(1, -1)
    _close(state.h.reshape(1, -1), act_mul_ref(gate_up.to(torch.bfloat16), activation))
    qh, sh = quantize_per_token(state.h.reshape(1, -1))
    _close(y, (qh.float() @ wd.float().t()) * sh * sd.reshape(1, -1), tol=1e-2)
    if y.is_cuda:
        _close(y, fp8_mlp_ref(qx, sx, wgu, sgu, wd, sd, activation))


@pytest.mark.parametrize(("k", "inter", "hidden", "activation"), [
    (600, 300, 48, "silu"),  # one warp: K tiles of 512 and 256, so K and I past one tile, masked at the end
    (1024, 512, 32, "gelu_tanh"),
])
def test_fp8_mlp_matches_the_reference(k, inter, hidden, activation):
    ops = _operands(k, inter, hidden)
    cfg = FP8MlpConfig(pairs=4, rows=8, num_warps=1)
    state = FP8MlpState.create(inter, torch.device(DEVICE))
    y = fp8_mlp(*ops, state, activation, cfg)
    assert y.shape == (1, hidden) and y.dtype == torch.bfloat16
    _check_phases(y, state, *ops, activation)
    # the call left the barrier at rest, the generation bumped and the next call's absmax slot zeroed (its own
    # keeps this call's absmax): a second call gives the same result and zeroes the first slot
    assert state.barrier.tolist() == [0, 1] and state.amax[1].item() == 0 and state.amax[0].item() > 0
    y2 = fp8_mlp(*ops, state, activation, cfg)
    assert torch.equal(y, y2)
    assert state.barrier.tolist() == [0, 2] and state.amax[0].item() == 0 and state.amax[1].item() > 0


def test_fp8_mlp_without_preloading_gives_the_same_rows():
    ops = _operands(600, 300, 32, seed=1)
    state = FP8MlpState.create(300, torch.device(DEVICE))
    on = fp8_mlp(*ops, state, "silu", FP8MlpConfig(num_warps=1, preload=True))
    off = fp8_mlp(*ops, state, "silu", FP8MlpConfig(num_warps=1, preload=False))
    assert torch.equal(on, off)


def test_fp8_mlp_refuses_what_it_cannot_take():
    qx, sx, wgu, sgu, wd, sd = _operands(64, 32, 16)
    assert "one activation row" in fp8_mlp_problem(torch.cat([qx, qx]), sx, wgu, wd, "silu")
    assert "down must be" in fp8_mlp_problem(qx, sx, wgu, wd[:, :16], "silu")
    assert "float8_e4m3fn" in fp8_mlp_problem(qx.float(), sx, wgu, wd, "silu")
    assert "relu" in fp8_mlp_problem(qx, sx, wgu, wd, "relu")
    with pytest.raises(ValueError, match="gate/up must be"):
        fp8_mlp(qx, sx, wgu[:-1], sgu, wd, sd, FP8MlpState.create(32, torch.device(DEVICE)))
    with pytest.raises(ValueError, match="power of two"):
        FP8MlpConfig(rows=6)


def test_fp8_mlp_compiles_for_sm90_without_spills(sm90, tmp_path):
    """The default config as launched on Hopper: PDL's launch and wait in that order, the grid's atomics, no
    spills, and few enough registers for the programs an SM is meant to hold."""
    cfg = FP8MlpConfig()
    signature = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "wgu_ptr": "*fp8e4nv", "sgu_ptr": "*fp32",
                 "wd_ptr": "*fp8e4nv", "sd_ptr": "*fp32", "h_ptr": "*bf16", "amax_ptr": "*fp32", "state_ptr": "*i32",
                 "y_ptr": "*bf16", "INTER": "i32", "K": "i32", "H": "i32", "stride_gu": "i32", "stride_d": "i32",
                 "GRID": "i32"}
    constexprs = dict(GELU=False, PAIRS=cfg.pairs, BLOCK_K1=cfg.block_k1, ROWS=cfg.rows, BLOCK_K2=cfg.block_k2,
                      EVEN_K1=True, EVEN_K2=True, PRELOAD=cfg.preload, PDL=True, VEC1=16, VEC2=8)
    ptx = sm90.triton_ptx(str(tmp_path / "fp8_mlp.ptx"), "quantkit.kernels.fp8_mlp", "_fp8_mlp_kernel", signature,
                          constexprs, num_warps=cfg.num_warps, num_stages=1,
                          aligned=("x_ptr", "wgu_ptr", "wd_ptr", "h_ptr", "K", "INTER", "stride_gu", "stride_d"))
    notices = sm90.ptxas_notices(ptx)
    assert "0 bytes spill stores" in notices, notices
    # the default's 8 programs an SM (its tiles in flight) need at most 64 registers a thread of 4 warps
    regs = int(re.search(r"Used (\d+) registers", notices).group(1))
    assert regs <= 65536 // (cfg.ctas_per_sm * 32 * cfg.num_warps), notices
    text = Path(ptx).read_text()
    assert 0 <= text.find("griddepcontrol.launch_dependents") < text.find("griddepcontrol.wait")
    assert "atom.global" in text or "atom." in text


@pytest.mark.gpu
@pytest.mark.parametrize(("k", "inter", "hidden"), [(4096, 14336, 4096), (2048, 6144, 2048), (576, 1536, 576)])
def test_fp8_mlp_whole_grid_on_the_gpu(k, inter, hidden):
    """The persistent grid on the card (every program resident, the barrier crossed by all), against the
    reference and against the three unfused launches the runtime runs otherwise; repeated calls and a CUDA graph
    replaying it reuse the state each call leaves."""
    from quantkit.kernels.decoder_ops import act_mul_fp8
    from quantkit.kernels.gemv import gemv

    qx, sx, wgu, sgu, wd, sd = _operands(k, inter, hidden, seed=3)
    state = FP8MlpState.create(inter, qx.device)
    y = fp8_mlp(qx, sx, wgu, sgu, wd, sd, state)
    _check_phases(y, state, qx, sx, wgu, sgu, wd, sd, "silu")
    gate_up = gemv(qx, wgu, scales=(sx, sgu.reshape(1, -1)), out_dtype=torch.bfloat16)
    qh, sh = act_mul_fp8(gate_up)
    unfused = gemv(qh, wd, scales=(sh, sd.reshape(1, -1)), out_dtype=torch.bfloat16)
    _close(y, unfused)
    for _ in range(5):
        assert torch.equal(fp8_mlp(qx, sx, wgu, sgu, wd, sd, state), y)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_mlp(qx, sx, wgu, sgu, wd, sd, state)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, y)
    assert state.barrier[0].item() == 0
