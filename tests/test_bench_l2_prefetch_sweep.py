"""bench/l2_prefetch_sweep.py on the CPU: its refusals, and the closing table from a run's rounds (the sweep itself
needs a GPU: gpu_check.sh's l2-prefetch mode runs it)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "l2_prefetch_sweep.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_sizes_outside_the_switch_are_refused_and_no_gpu_exits_2():
    done = _run("--mbs", "0,12")
    assert done.returncode == 2 and "QUANTKIT_L2_PREFETCH_MB" in done.stderr
    done = _run("--plans", "each,all")
    assert done.returncode == 2 and "QUANTKIT_L2_PREFETCH_PLAN" in done.stderr
    done = _run("--mbs", "16", "--formats", "bf16")
    assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr


def test_table_takes_each_size_best_round_against_none():
    spec = importlib.util.spec_from_file_location("l2_prefetch_sweep", SCRIPT)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    rounds = [{"0": {"1": 100.0, "8": 700.0}, "16p": {"1": 110.0, "8": 690.0}},
              {"0": {"1": 102.0, "8": 710.0}, "16p": {"1": 120.0, "8": 700.0}}]
    lines = sweep.table([{"format": "fp8", "rounds": rounds}], ["0", "16p"], [1, 8])
    assert lines[1].split() == ["fp8", "0", "102.0", "1.000", "710.0", "1.000"]
    assert lines[2].split() == ["fp8", "16p", "120.0", "1.176", "700.0", "0.986"]
