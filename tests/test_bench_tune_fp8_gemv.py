"""bench/tune_fp8_gemv.py end to end on the CPU (``--smoke``: Triton's interpreter, one small shape, wall-clock
timing, one compile process): every step runs and the JSON and the lines to paste say what was measured."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "tune_fp8_gemv.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


def test_help_without_a_gpu():
    done = _run("--help")
    assert done.returncode == 0 and "--deadline" in done.stdout and "--smoke" in done.stdout


def test_bad_rows_exit_2():
    done = _run("--ms", "1,8")
    assert done.returncode == 2 and "1 to 4 rows" in done.stderr and "Traceback" not in done.stderr


def _candidates(m: int, k: int, path: str) -> int:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import tune_fp8_gemv
    finally:
        sys.path.pop(0)
    return len(tune_fp8_gemv.candidates(m, k, path))


def test_smoke_run_writes_every_cell(tmp_path):
    """The fused path: every candidate (with and without prefetch) compiled, checked and timed; the two-launch
    path at the confirmed configs; ``TUNED_FP8`` lines."""
    out = tmp_path / "fp8_gemv.json"
    done = _run("--smoke", "--path", "fused", "--ms", "1,4", "--jobs", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = re.search(r"compiled (\d+) of (\d+) kernels", done.stdout)
    want = _candidates(1, 512, "fused") + _candidates(4, 512, "fused")
    assert want == 26  # 7 tiles at M = 1, 6 at M = 4, each with and without prefetch
    assert compiled and int(compiled.group(1)) == int(compiled.group(2)) == want
    assert "TUNED_FP8 entries" in done.stdout
    result = json.loads(out.read_text())
    assert result["complete"] and result["path"] == "fused" and [c["M"] for c in result["cells"]] == [1, 4]
    for cell in result["cells"]:
        rows = {r["config"]: r for r in cell["rows"]}
        assert all("us" in r for r in rows.values()), rows  # every candidate checked, then timed
        assert rows["2x512/4w"]["same"] and rows["2x512/4w+pf"]["same"]  # the two-launch path's config
        assert cell["best"]["config"] in rows and cell["two_launch_us"] > 0 and cell["cublas_us"] > 0
        # the two-launch GEMV timed at the confirmed configs, its fastest named
        assert any(r.get("two_launch_us", 0) > 0 for r in rows.values())
        assert cell["two_launch_best"]["config"] in rows
    assert result["paste"][0].startswith("    (16, 512, 1): C(")


def test_smoke_run_of_the_codes_path(tmp_path):
    """The GEMV on codes (the default path): 16-code vectors, so fewer tiles fit; the table's config among the
    rows and bitwise itself; the lines to paste keyed by the card, M = 1 only."""
    out = tmp_path / "fp8_codes.json"
    done = _run("--smoke", "--ms", "1,2", "--jobs", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = re.search(r"compiled (\d+) of (\d+) kernels", done.stdout)
    want = _candidates(1, 512, "codes") + _candidates(2, 512, "codes")
    assert 0 < want < _candidates(1, 512, "fused") + _candidates(2, 512, "fused")
    assert compiled and int(compiled.group(1)) == int(compiled.group(2)) == want
    result = json.loads(out.read_text())
    assert result["complete"] and result["path"] == "codes"
    for cell in result["cells"]:
        rows = {r["config"]: r for r in cell["rows"]}
        assert all("us" in r for r in rows.values()), rows
        assert rows[cell["table"]]["same"] and "two_launch_best" not in cell
    assert "TUNED_FP8_CODES entries" in done.stdout
    assert len(result["paste"]) == 1 and result["paste"][0].startswith("    ('CPU smoke run', 16, 512): C(")


def test_no_gpu_says_so():
    if torch.cuda.is_available():
        return
    done = _run("--ms", "1")
    assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr and "Traceback" not in done.stderr


def test_codes_table_wrapper_reads_the_tuners_picks(tmp_path, monkeypatch):
    """bench/lib/with_fp8_codes_table.py (gpu_check.sh's fp8-codes mode): a codes run's M = 1 picks, prefetch and
    all, keyed by the run's card, go into gemv.TUNED_FP8_CODES for the command it runs; a fused run is refused."""
    import pytest

    monkeypatch.syspath_prepend(str(REPO / "bench" / "lib"))
    from with_fp8_codes_table import picks

    from quantkit.kernels import gemv

    cell = dict(N=4096, K=14336, M=1, best=dict(cfg=[8, 512, 4, True]))
    tune = dict(path="codes", card="NVIDIA H200", cells=[cell, dict(cell, M=2, best=dict(cfg=[2, 512, 4, False])),
                                                         dict(N=6144, K=4096, M=1)])  # no best: not timed
    entries = picks(tune)
    assert entries == {("NVIDIA H200", 4096, 14336): gemv.DenseGemvConfig(8, 512, 4, prefetch=True)}
    monkeypatch.setattr(gemv, "TUNED_FP8_CODES", dict(entries))
    assert gemv._fp8_codes_config(1, 4096, 14336, "NVIDIA H200").prefetch
    with pytest.raises(SystemExit, match="--path fused"):
        picks(dict(tune, path="fused"))
