"""The kernel benchmarks' plots, drawn from their JSON on the CPU (no GPU, no Triton launch)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

REPO = Path(__file__).resolve().parents[1]
# the plots know the benchmarks' JSON schemas, so they live with the benchmarks (bench/plot_results.py)
_spec = importlib.util.spec_from_file_location("plot_results", REPO / "bench" / "plot_results.py")
plot_results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_results)
plot_attention_bench, plot_w4a16_bench = plot_results.plot_attention_bench, plot_results.plot_w4a16_bench


def _png_ok(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_w4a16_plot_takes_failed_cells(tmp_path):
    rows = [dict(N=n, K=k, M=m, triton_us=10.0 * m ** 0.5, cublas_us=30.0 + m, torch_int4_us=8.0 * m)
            for n, k in ((4096, 4096), (8192, 28672)) for m in (1, 4, 16, 1024)]
    rows[1]["torch_int4_us"] = "RuntimeError: not supported"  # a peer that did not run is left out
    png = plot_w4a16_bench(dict(rows=rows, group_size=128, card="test card", date="2026-12-01"), tmp_path / "w.png")
    assert _png_ok(png)


def test_attention_plot(tmp_path):
    rows = [dict(hq=16, hkv=16, head_dim=128, seqlen=s, batch=16384 // s, causal=c, ours="not run",
                 ours_ws=500.0 + s / 100, ours_fp8=700.0, cudnn=600.0, flash=350.0, efficient="not run")
            for s in (2048, 8192) for c in (False, True)]
    png = plot_attention_bench(dict(prefill=rows, card="test card", date="2026-12-01"), tmp_path / "a.png")
    assert _png_ok(png)


def test_plot_script_on_a_recorded_run(tmp_path):
    # the command docs/kernels.md gives, on a JSON the H200 wrote (copied: the PNG goes beside it)
    src = REPO / "bench" / "results" / "w4a16_gemm_h200.json"
    if not src.is_file():
        pytest.skip("bench/results/w4a16_gemm_h200.json is not in this checkout")
    copy = tmp_path / src.name
    copy.write_text(src.read_text())
    done = subprocess.run([sys.executable, str(REPO / "bench" / "plot_results.py"), str(copy)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert _png_ok(copy.with_suffix(".png"))


def test_plot_script_refuses_other_json(tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": []}))
    done = subprocess.run([sys.executable, str(REPO / "bench" / "plot_results.py"), str(other)],
                          capture_output=True, text=True)
    assert done.returncode == 1 and "neither a bench_w4a16 result" in done.stderr
