"""The CUTLASS W4A16 prefill GEMM (kernels/w4a16_cutlass.py): what it takes, its weight copy and its build
arguments on the CPU; on the GPU, against the reference where nvcc and CUTLASS's headers are installed."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantkit.kernels import w4a16_cutlass
from quantkit.kernels.w4a16_configs import CutlassConfig, config_from_dict, config_to_dict

REPO = Path(__file__).resolve().parents[2]


def test_configs_are_checked_and_round_trip_through_the_table_form():
    assert config_from_dict("cutlass", config_to_dict(CutlassConfig(128, 256, 2))) == CutlassConfig(128, 256, 2)
    assert config_from_dict("cutlass", {}) == CutlassConfig()
    with pytest.raises(ValueError, match="two warpgroups"):
        CutlassConfig(64, 128)  # cooperative needs 128 weight rows
    with pytest.raises(ValueError, match="CLUSTER_N"):
        CutlassConfig(CLUSTER_N=4)
    assert CutlassConfig(64, 128, PINGPONG=True).fits(4096, 128) and not CutlassConfig().fits(16, 32)


def _layer(n=16, k=128, group=64, sym=True, seed=0, device="cpu"):
    """Random GPTQ tensors (every code and, asymmetric, every zero point; scales 1e-3 to 1.1e-2), prepared on
    ``device``. ``group`` -1: per-channel scales."""
    from quantkit.kernels.w4a16_weights import prepare_w4a16_weights

    g = torch.Generator().manual_seed(seed)
    groups = 1 if group == -1 else k // group
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, generator=g)
    qzeros = (torch.full((groups, n // 8), 0x77777777, dtype=torch.int32) if sym else
              torch.randint(-(2**31), 2**31 - 1, (groups, n // 8), dtype=torch.int32, generator=g))
    scales = (torch.rand(groups, n, generator=g) * 1e-2 + 1e-3).half()
    return prepare_w4a16_weights(qweight.to(device), qzeros.to(device), scales.to(device), None, 4, group, sym)


@pytest.mark.parametrize("sym", [True, False])
def test_the_kernels_weight_copy_dequantizes_to_the_reference_weights(sym):
    """prepare(): signed codes (code - 8, read as CUTLASS's int4 reads them: two's complement nibbles, K-major),
    bf16 scales, and for zero points the term (8 - zero) x scale: code' x scale + term is the reference's
    (code - zero) x scale up to the bf16 rounding of scale and term."""
    w = _layer(sym=sym)
    p = w4a16_cutlass.prepare(w)
    n, k = w.out_features, w.in_features
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (p.codes[:, :, None] >> shifts) & 0xF  # [N, K/8, 8], K order within a word
    signed = torch.where(nibbles >= 8, nibbles - 16, nibbles).reshape(n, k).float()
    g = torch.arange(k) // p.group
    got = signed * p.scales.float().t()[:, g]
    if p.zero_terms is not None:
        got = got + p.zero_terms.float().t()[:, g]
    codes = ((w.qweight[:, :, None] >> shifts) & 0xF).reshape(n, k).float()
    zeros = 8.0 if w.zeros is None else w.zeros.float().t()[:, g]
    want = (codes - zeros) * w.scales.float().t()[:, g]
    assert p.codes.dtype == torch.int32 and p.scales.dtype == torch.bfloat16 and p.group == 64
    assert (p.zero_terms is None) == sym
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-4)
    if sym:  # exactly code - 8 times the (rounded) scale
        torch.testing.assert_close(signed, codes - 8, rtol=0, atol=0)


def test_what_the_kernel_takes_is_said_before_any_build(monkeypatch):
    w = _layer()
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    ok, reason = w4a16_cutlass.supports(x, w)
    assert not ok and "Hopper" in reason
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(w4a16_cutlass, "capability", lambda device: (9, 0))
    assert w4a16_cutlass.supports(x, w) == (True, "")
    assert "bfloat16" in w4a16_cutlass.supports(x.half(), w)[1]
    assert "multiples of 64" in w4a16_cutlass.supports(x, _layer(group=32))[1]
    assert "multiple of 8" in w4a16_cutlass.supports(x, dataclasses.replace(w, out_features=12))[1]


def test_build_arguments_name_the_config_and_hopper_only():
    args = w4a16_cutlass.build_args(CutlassConfig(64, 256, 2, True), True, [Path("/c/include")])
    assert "-gencode=arch=compute_90a,code=sm_90a" in args and "-DNDEBUG" in args and "-I/c/include" in args
    assert {"-DQK_TILE_N=64", "-DQK_TILE_M=256", "-DQK_CLUSTER_N=2", "-DQK_PINGPONG=1", "-DQK_ZEROS=1"} <= set(args)
    assert w4a16_cutlass.library(CutlassConfig(), False, (8, 0)) is None  # not Hopper: no build


def test_the_headers_version_is_in_the_build_key(tmp_path):
    """Another CUTLASS at the same path (an upgraded package) gives other arguments, so another cached build."""
    version = tmp_path / "cutlass" / "version.h"
    version.parent.mkdir()
    keys = []
    for text in ("#define CUTLASS_MAJOR 4", "#define CUTLASS_MAJOR 5"):
        version.write_text(text)
        args = w4a16_cutlass.build_args(CutlassConfig(), False, [tmp_path])
        keys.append([a for a in args if a.startswith("-DQK_CUTLASS_VERSION_H=")])
    assert len(keys[0]) == len(keys[1]) == 1 and keys[0] != keys[1]


def test_headers_come_from_the_environment_or_are_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CUTLASS_DIR", str(tmp_path))
    assert w4a16_cutlass.include_dirs() is None
    (tmp_path / "include" / "cutlass").mkdir(parents=True)
    (tmp_path / "include" / "cutlass" / "cutlass.h").write_text("")
    assert w4a16_cutlass.include_dirs() == [tmp_path / "include", tmp_path / "tools" / "util" / "include"]


def test_the_prefill_bench_answers_help_without_a_gpu():
    done = subprocess.run([sys.executable, str(REPO / "bench" / "bench_w4a16_prefill.py"), "--help"],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0 and "usage" in done.stdout


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "n", "k", "group", "sym", "cfg"), [
    (333, 256, 512, 128, True, CutlassConfig()),
    (64, 384, 1024, 64, False, CutlassConfig()),
    (1000, 512, 768, -1, True, CutlassConfig(64, 128, 1, True)),
    (2048, 1024, 1024, 128, True, CutlassConfig(128, 128, 2)),
])
def test_cutlass_kernel_matches_the_reference(m, n, k, group, sym, cfg):
    """Against the float32 reference: partial tiles in M, zero points, per-channel scales, a 2-CTA cluster."""
    from quantkit.kernels.w4a16_weights import w4a16_matmul_ref

    if w4a16_cutlass.library(cfg, not sym, torch.cuda.get_device_capability()) is None:
        pytest.skip("no nvcc or CUTLASS headers here, or not a Hopper GPU")
    w = _layer(n, k, group, sym, seed=m, device="cuda")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + 1)).bfloat16().cuda()
    out = w4a16_cutlass.w4a16_cutlass_matmul(x, w, cfg)
    ref = w4a16_matmul_ref(x, w).float()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_a_cutlass_choice_falls_back_where_the_kernel_cannot_serve(monkeypatch):
    """bind_launcher on a ``cutlass`` choice: the CUTLASS kernel where it takes the call and its library loads
    (checked once per activation dtype), the planned fallback otherwise (no nvcc or headers, fp16 activations)."""
    from quantkit.kernels import w4a16
    from quantkit.kernels.w4a16_select import KernelChoice

    calls = []
    fallback = KernelChoice("gemv", None, "test")
    monkeypatch.setattr(w4a16, "_launcher", lambda config: lambda x, w: calls.append("fallback") or "fell back")
    monkeypatch.setattr(w4a16_cutlass, "supports", lambda x, w: (x.dtype == torch.bfloat16, ""))
    built = {"lib": None}
    monkeypatch.setattr(w4a16_cutlass, "library", lambda *a: built["lib"])
    monkeypatch.setattr(w4a16_cutlass, "capability", lambda device: (9, 0))
    monkeypatch.setattr(w4a16_cutlass, "w4a16_cutlass_matmul",
                        lambda x, w, cfg: calls.append(("cutlass", cfg)) or "cutlass")
    cfg = CutlassConfig(128, 256)
    w = _layer()
    run = w4a16.bind_launcher(KernelChoice("cutlass", cfg, "test", fallback), w.facts(), 2048)
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    assert run(x, w) == "fell back"  # no library here
    built["lib"] = object()
    assert run(x, w) == "fell back"  # decided once per dtype
    run = w4a16.bind_launcher(KernelChoice("cutlass", cfg, "test", fallback), w.facts(), 2048)
    assert run(x, w) == "cutlass" and run(x.half(), w) == "fell back"
    assert calls == ["fallback", "fallback", ("cutlass", cfg), "fallback"]
