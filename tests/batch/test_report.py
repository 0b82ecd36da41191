from __future__ import annotations

import json
import subprocess
import sys

from quantkit.batch.records import JobResult, record_path, write_json_atomic
from quantkit.batch.report import markdown_table, pareto_front, table_rows, write_order, write_report


def test_pareto_front_keeps_only_undominated_points():
    points = [(4.2, 27.0), (4.6, 25.0), (4.6, 26.0), (3.2, 40.0), (4.2, 27.0), (5.0, 25.0)]
    # (4.6, 26) is beaten by (4.6, 25); (5.0, 25) by (4.6, 25); equal points do not dominate each other.
    assert pareto_front(points) == [0, 1, 3, 4]


def test_pareto_front_counts_sizes_a_few_bytes_apart_as_one_size():
    """Three 3-bit checkpoints whose files differ by metadata bytes: the worst model is not on the front because
    its file is 700 bytes smaller (the SmolLM2 sweep's RTN / GPTQ / AWQ w3 rows)."""
    points = [(102862070.0, 161.9), (102862283.0, 69.4), (102862984.0, 71.2), (110860000.0, 36.0)]
    assert pareto_front(points) == [1, 3]
    assert pareto_front(points, same_x_rel=0.0) == [0, 1, 3]


def _result(name, method, bpw, ppl, kl, status="ok"):
    settings = {"model": "/m/smol.gguf", "method": method, "bits": 4, "group_size": 128, "sym": False}
    return JobResult(name=name, status=status, settings=settings, size_bytes=2**20, bits_per_weight=bpw,
                     perplexity={"/d/test.txt": ppl} if status == "ok" else {},
                     kld={"mean_kld": kl, "p99_kld": 3 * kl, "top1_changed": 0.1} if status == "ok" else None,
                     seconds=1.0, peak_host_bytes=2**30, error=None if status == "ok" else "boom")


def _batch_folder(tmp_path):
    results = [_result("rtn", "rtn", 4.2, 27.0, 0.09), _result("gptq", "gptq", 4.2, 25.0, 0.05),
               _result("awq", "awq", 4.6, 24.0, 0.06), _result("bad", "awq", 0, 0, 0, status="failed")]
    for result in results:
        write_json_atomic(record_path(tmp_path, result.name), result.to_dict())
    write_json_atomic(tmp_path / "baselines" / "m.json", {"model": "/m/smol.gguf", "perplexity": {"/d/test.txt": 20.0}})
    write_order(tmp_path, ["rtn", "gptq", "awq", "bad"])
    return tmp_path


def test_rows_in_batch_order_with_pareto_marks(tmp_path):
    rows = table_rows(_batch_folder(tmp_path))
    assert [r["job"] for r in rows] == ["unquantized", "rtn", "gptq", "awq", "bad"]
    marks = {r["job"]: r["pareto"] for r in rows}
    assert marks == {"unquantized": "", "rtn": "", "gptq": "ppl,kl", "awq": "ppl", "bad": ""}
    assert rows[1]["ppl test.txt"] == 27.0 and rows[1]["top1_changed_pct"] == 10.0 and rows[1]["size_mib"] == 1.0
    assert rows[4]["status"] == "failed: boom"
    assert list(rows[0])[-2:] == ["status", "pareto"]


def test_report_files_and_cli(tmp_path):
    folder = _batch_folder(tmp_path)
    paths = write_report(folder)
    assert json.loads(paths["json"].read_text())[2]["job"] == "gptq"
    assert paths["csv"].read_text().splitlines()[0].startswith("job,model,method,bits,group_size")
    assert paths["png"].stat().st_size > 10_000
    assert markdown_table(table_rows(folder)) in paths["md"].read_text()
    proc = subprocess.run([sys.executable, "-m", "quantkit.cli.app", "batch", "report", str(folder), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [r["job"] for r in json.loads(proc.stdout)] == ["unquantized", "rtn", "gptq", "awq", "bad"]


def test_report_of_an_empty_folder_says_what_to_do(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "quantkit.cli.app", "batch", "report", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "run `quantkit batch` first" in proc.stderr
