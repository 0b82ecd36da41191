"""Kill a running batch with SIGKILL in the middle of a job, resume it, and get the table an
uninterrupted run gives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from quantkit.batch.recipe import load_recipe
from quantkit.batch.records import read_record, record_path
from quantkit.batch.report import markdown_table, table_rows
from quantkit.batch.runner import run_recipe
from tests.batch.recipes import write_recipe


def _start(recipe):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    return subprocess.Popen([sys.executable, "-m", "quantkit.cli.app", "batch", str(recipe)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def _kill_during_second_job(proc, deadline_s: float = 240) -> list[str]:
    """Read the batch's output until job 2 of 3 has started quantizing its layers, then SIGKILL it."""
    lines, started, in_job_2 = [], time.monotonic(), False
    for line in proc.stdout:
        lines.append(line)
        in_job_2 = in_job_2 or "job 2 of 3" in line
        if in_job_2 and line.startswith("layer 1/2"):
            proc.send_signal(signal.SIGKILL)
            break
        assert time.monotonic() - started < deadline_s, "".join(lines)
    proc.wait(timeout=30)
    return lines


def test_sigkill_mid_job_then_resume_gives_the_uninterrupted_table(tmp_path, tiny_llama_dir, tiny_text_file):
    killed = write_recipe(tmp_path / "killed.toml", tiny_llama_dir, tiny_text_file, tmp_path / "killed")
    proc = _start(killed)
    lines = _kill_during_second_job(proc)
    assert proc.returncode == -signal.SIGKILL, "".join(lines)
    plan = load_recipe(killed)
    first, second, third = (job.name for job in plan.jobs)
    assert read_record(record_path(plan.output, first))["status"] == "ok"
    # The job that was killed left no record: it is unfinished, whatever its folder holds.
    assert not record_path(plan.output, second).exists() and not record_path(plan.output, third).exists()

    resumed = _start(killed)
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output
    assert "job 1 of 3: complete from an earlier run, skipped" in output

    reference = write_recipe(tmp_path / "reference.toml", tiny_llama_dir, tiny_text_file, tmp_path / "reference")
    assert not run_recipe(load_recipe(reference)).failed
    got, want = table_rows(plan.output), table_rows(tmp_path / "reference")
    assert markdown_table(got, volatile=False) == markdown_table(want, volatile=False)
    assert len(got) == 4 and all(row["status"] == "ok" for row in got)
    assert (plan.output / "report.md").is_file() and (plan.output / "report.png").is_file()
