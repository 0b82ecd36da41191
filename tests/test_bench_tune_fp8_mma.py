"""bench/tune_fp8_mma.py end to end on the CPU (``--smoke``: Triton's interpreter, one small shape, wall-clock
timing): every candidate is checked and timed, the baselines are timed, and the JSON says what was measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "tune_fp8_mma.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


def test_bad_rows_exit_2():
    done = _run("--ms", "1,65")
    assert done.returncode == 2 and "1 to 64 rows" in done.stderr and "Traceback" not in done.stderr


def test_smoke_run_checks_and_times_every_candidate(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    from tune_fp8_mma import candidates

    from quantkit.kernels.gemv_fp8_mma import mma_config

    out = tmp_path / "fp8_mma.json"
    done = _run("--smoke", "--ms", "1,8", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["complete"] and result["card"] == "CPU smoke run"
    assert [c["M"] for c in result["cells"]] == [1, 8]
    for cell in result["cells"]:
        expected = candidates(cell["M"], 64, 512)
        assert [r["cfg"] for r in cell["rows"]] == [c.__dict__ for c in expected]
        assert expected[0] == mma_config(cell["M"], 64, 512)  # the rule first
        assert all(r["err"] < 0.5 and r["us"] > 0 for r in cell["rows"]), cell["rows"]
        assert cell["best"]["config"] in {r["config"] for r in cell["rows"]}
        assert min(cell["quant_us"], cell["fp8_today_us"], cell["fp8_mma_rule_us"], cell["bf16_us"]) > 0
    assert "| 64x512 | 8 |" in done.stdout
