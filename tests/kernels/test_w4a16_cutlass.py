"""The CUTLASS W4A16 prefill GEMM (kernels/w4a16_cutlass.py): what it takes, its weight copy and its build
arguments on the CPU; on the GPU, against the reference where nvcc and CUTLASS's headers are installed."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import types
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
def test_the_kernels_operands_dequantize_to_the_reference_weights(sym):
    """prepare(): the layer's own codes (no copy), bf16 scales, and the zero terms -zero x scale; CUTLASS's
    dequantization (code x scale, then + term, each rounded to bf16) gives the reference's (code - zero) x scale
    within two bf16 roundings of values under 16 x scale plus the scale's own rounding (0.16 x scale), and where
    symmetric the term is exactly -8 x the rounded scale."""
    w = _layer(sym=sym)
    p = w4a16_cutlass.prepare(w)
    n, k = w.out_features, w.in_features
    assert p.codes.data_ptr() == w.qweight.data_ptr() and p.codes.dtype == torch.int32
    assert p.scales.dtype == p.zero_terms.dtype == torch.bfloat16 and p.group == 64
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    codes = ((p.codes[:, :, None] >> shifts) & 0xF).reshape(n, k).float()  # unsigned nibbles, K order in a word
    g = torch.arange(k) // p.group
    scale, term = p.scales.t()[:, g], p.zero_terms.t()[:, g]
    got = ((codes.bfloat16() * scale).float() + term.float()).bfloat16().float()
    zeros = 8.0 if w.zeros is None else w.zeros.float().t()[:, g]
    s16 = w.scales.float().t()[:, g]
    want = (codes - zeros) * s16
    assert ((got - want).abs() <= s16 * (16 * 2**-7 + 15 * 2**-9)).all()
    assert (got - want).abs().mean() < 0.03 * s16.mean()  # the rounding, not a wrong code or term
    if sym:
        torch.testing.assert_close(p.zero_terms.float(), -8 * p.scales.float(), rtol=0, atol=0)


def test_the_front_door_makes_the_operands_once_where_a_cutlass_entry_serves(monkeypatch):
    """dispatch.bind: CUTLASS operands at load for a plan with a ``cutlass`` choice on a machine that can build
    the kernel, none otherwise; the matmul reads them from the weights instead of making its own."""
    from quantkit.kernels import dispatch
    from quantkit.kernels.w4a16_select import KernelChoice, W4A16Plan

    w = _layer()
    gemv = KernelChoice("gemv", None, "test")
    monkeypatch.setattr(dispatch, "bound_launchers", lambda *a: (None,))
    plain = dispatch.bind(dataclasses.replace(w, plan=W4A16Plan("sm90", ((1, gemv),))))
    assert plain.cutlass is None and plain.launchers == (None,)
    cut = W4A16Plan("sm90", ((1, gemv), (2048, KernelChoice("cutlass", CutlassConfig(), "test", gemv))))
    monkeypatch.setattr(w4a16_cutlass, "buildable", lambda: False)  # no nvcc or headers: the fallback serves
    assert dispatch.bind(dataclasses.replace(w, plan=cut)).cutlass is None
    monkeypatch.setattr(w4a16_cutlass, "buildable", lambda: True)
    bound = dispatch.bind(dataclasses.replace(w, plan=cut))
    assert bound.cutlass is not None and bound.cutlass.codes.data_ptr() == w.qweight.data_ptr()
    torch.testing.assert_close(bound.cutlass.zero_terms, w4a16_cutlass.prepare(w).zero_terms, rtol=0, atol=0)
    monkeypatch.setattr(w4a16_cutlass, "supports", lambda x, w: (True, ""))
    monkeypatch.setattr(w4a16_cutlass, "capability", lambda device: (9, 0))
    monkeypatch.setattr(w4a16_cutlass, "prepare", lambda w: pytest.fail("operands made per call"))
    seen = {}

    class Lib:  # records what the launch receives, writes nothing
        def qk_cutlass_workspace(self, *a):
            return 0

        def qk_cutlass_gemm(self, codes, x, scales, terms, *rest):
            seen.update(codes=codes, scales=scales, terms=terms)
            return 0

    monkeypatch.setattr(w4a16_cutlass, "library", lambda cfg, cap, signed=False: None if signed else Lib())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: types.SimpleNamespace(cuda_stream=0))
    w4a16_cutlass.w4a16_cutlass_matmul(torch.zeros(2, 128, dtype=torch.bfloat16), bound, CutlassConfig())
    assert seen == dict(codes=w.qweight.data_ptr(), scales=bound.cutlass.scales.data_ptr(),
                        terms=bound.cutlass.zero_terms.data_ptr())


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
    args = w4a16_cutlass.build_args(CutlassConfig(64, 256, 2, True), [Path("/c/include")])
    assert "-gencode=arch=compute_90a,code=sm_90a" in args and "-DNDEBUG" in args and "-I/c/include" in args
    assert {"-DQK_TILE_N=64", "-DQK_TILE_M=256", "-DQK_CLUSTER_N=2", "-DQK_PINGPONG=1", "-DQK_SIGNED=0"} <= set(args)
    assert "-DQK_SIGNED=1" in w4a16_cutlass.build_args(CutlassConfig(), [Path("/c/include")], signed=True)
    assert w4a16_cutlass.library(CutlassConfig(), (8, 0)) is None  # not Hopper: no build


def test_the_headers_version_is_in_the_build_key(tmp_path):
    """Another CUTLASS at the same path (an upgraded package) gives other arguments, so another cached build."""
    version = tmp_path / "cutlass" / "version.h"
    version.parent.mkdir()
    keys = []
    for text in ("#define CUTLASS_MAJOR 4", "#define CUTLASS_MAJOR 5"):
        version.write_text(text)
        args = w4a16_cutlass.build_args(CutlassConfig(), [tmp_path])
        keys.append([a for a in args if a.startswith("-DQK_CUTLASS_VERSION_H=")])
    assert len(keys[0]) == len(keys[1]) == 1 and keys[0] != keys[1]


def test_headers_come_from_the_environment_or_are_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CUTLASS_DIR", str(tmp_path))
    assert w4a16_cutlass.include_dirs() is None
    (tmp_path / "include" / "cutlass").mkdir(parents=True)
    (tmp_path / "include" / "cutlass" / "cutlass.h").write_text("")
    assert w4a16_cutlass.include_dirs() == [tmp_path / "include", tmp_path / "tools" / "util" / "include"]


def test_the_prefill_bench_proposes_the_fastest_config_past_the_margin(monkeypatch):
    """bench_w4a16_prefill.candidate_entries: the fastest timed CUTLASS config, where it beats today's pick by more
    than max(1 us, 5 %), as a card-specific ``cutlass`` entry the table reader accepts; rows without a config (the
    comparison rows) are never proposed, and a smaller gain gives none."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from bench_w4a16_prefill import candidate_entries

    best = config_to_dict(CutlassConfig(128, 256, 2))

    def cell(n, today, cutlass):
        return {"N": n, "K": 4096, "M": 2048, "cublas_us": 90.0, "variants": [
            {"name": "today", "us": today}, {"name": "cutlass 128x256", "us": cutlass, "config": best},
            {"name": "cutlass 128x128", "us": cutlass + 5, "config": config_to_dict(CutlassConfig())},
            {"name": "cutlass 128x256, signed-code build", "us": cutlass - 20}]}

    entries = candidate_entries([cell(4096, 130.0, 100.0), cell(6144, 130.0, 125.0)], "NVIDIA H100 80GB HBM3")
    assert [(e["n"], e["kernel"], e["config"], e["us"], e["card"]) for e in entries] == [
        (4096, "cutlass", best, 100.0, "NVIDIA H100 80GB HBM3")]
    assert config_from_dict("cutlass", entries[0]["config"]) == CutlassConfig(128, 256, 2)


def test_the_prefill_bench_builds_the_cutlass_configs_a_table_names(monkeypatch, tmp_path):
    """bench_w4a16_prefill.py --build-table: each CUTLASS config the table's entries name, once, through the bench's
    parallel builder (no other kernel's config); a failed build is the exit status."""
    import json

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import bench_w4a16_prefill

    big, small = config_to_dict(CutlassConfig(128, 256)), config_to_dict(CutlassConfig(64, 128, 1, True))
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"entries": [
        {"n": 4096, "k": 4096, "m": 2048, "kernel": "cutlass", "config": big},
        {"n": 6144, "k": 4096, "m": 2048, "kernel": "cutlass", "config": big},
        {"n": 4096, "k": 4096, "m": 256, "kernel": "cutlass", "config": small},
        {"n": 4096, "k": 4096, "m": 1, "kernel": "gemv", "config": {"BLOCK_N": 64}}]}))
    asked, failing = [], {CutlassConfig(64, 128, 1, True)}

    def fake_prebuild(log, jobs):
        asked.append(sorted(jobs, key=str))
        return {job: job[0] not in failing for job in jobs}

    monkeypatch.setattr(bench_w4a16_prefill, "prebuild", fake_prebuild)
    assert bench_w4a16_prefill.build_table(str(table), lambda *a: None) == 1
    assert asked == [sorted([(CutlassConfig(128, 256), False), (CutlassConfig(64, 128, 1, True), False)], key=str)]
    failing.clear()
    assert bench_w4a16_prefill.build_table(str(table), lambda *a: None) == 0


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

    if w4a16_cutlass.library(cfg, torch.cuda.get_device_capability()) is None:
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
