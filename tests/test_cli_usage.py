"""What a person meets first: usage errors, help, version, exit codes, Ctrl-C, and output that fits 80 columns."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.test_cli import quantkit


def test_help_fast_path_imports_no_torch():
    """--help and a usage error answer without importing torch or transformers (seconds otherwise)."""
    code = ("import sys\n"
            "from quantkit.cli.app import main\n"
            "for argv in (['quantkit', '--help'], ['quantkit', 'gptq', 'm', '--bogus']):\n"
            "    sys.argv = argv\n"
            "    try:\n"
            "        main()\n"
            "    except SystemExit:\n"
            "        pass\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'rich') if m in sys.modules)\n"
            "print('HEAVY', heavy, file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "HEAVY []" in proc.stderr, proc.stderr


@pytest.mark.parametrize("args,needle", [
    ([], "Usage: quantkit"),
    (["gptq", "m"], "Missing option '--output' / '-o'"),
    (["gptq", "m", "-o", "x", "--bogus"], "No such option: --bogus"),
    (["gptq", "m", "-o", "x", "--bits", "four"], "Invalid value for '--bits'"),
    (["gptq", "m", "-o", "x", "--mse-weight", "bogus"], "Invalid value for '--mse-weight'"),
    (["eval", "perplexity"], "Missing argument 'MODEL'"),
])
def test_usage_errors_exit_2_naming_the_option(args, needle):
    proc = quantkit(*args, check_code=2)
    assert needle in proc.stdout + proc.stderr
    assert "Error" in proc.stdout + proc.stderr or not args  # no args: the help itself
    assert "NoSuchOption" not in proc.stderr and "Traceback" not in proc.stderr


def test_short_help_and_version():
    assert "Usage: quantkit gptq" in quantkit("gptq", "-h").stdout
    from quantkit.version import __version__

    assert quantkit("--version").stdout.strip() == f"quantkit {__version__}"


def test_help_fits_80_columns_with_whole_option_names():
    env = dict(os.environ, COLUMNS="80")
    for command in (["gptq"], ["awq"], ["rtn"], ["eval", "perplexity"], ["inspect"]):
        proc = subprocess.run([sys.executable, "-m", "quantkit.cli.app", *command, "--help"], capture_output=True,
                              text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert max(map(len, lines)) <= 80, [line for line in lines if len(line) > 80]
        assert "<bool>" not in proc.stdout and "…" not in proc.stdout
        if command == ["gptq"]:
            for name in ("--no-true-sequential", "--trust-remote-code", "--no-static-groups", "--no-mse"):
                assert name in proc.stdout


def test_existing_output_file_is_called_a_file(tiny_llama_dir, tmp_path):
    target = tmp_path / "out.bin"
    target.write_text("not a folder")
    proc = quantkit("rtn", tiny_llama_dir, "-o", target, check_code=2)
    assert "is an existing file" in proc.stderr and "folder" in proc.stderr
    assert target.read_text() == "not a folder"


def test_seqlen_beyond_the_models_positions_is_refused(tiny_llama_dir, tiny_text_file, tmp_path):
    proc = quantkit("gptq", tiny_llama_dir, "-o", tmp_path / "o", "--calib", tiny_text_file, "--nsamples", "2",
                    "--seqlen", "99999", check_code=2)
    assert "--seqlen 99999 is longer than the model's 256 positions" in proc.stderr
    assert not (tmp_path / "o").exists()
    proc = quantkit("eval", "perplexity", tiny_llama_dir, "--data", tiny_text_file, "--seqlen", "4096",
                    check_code=2)
    assert "256 positions" in proc.stderr


def test_eval_checks_the_data_before_loading_the_model(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    # The model does not exist either: the data error must come first (no 25 s model load before it).
    for data, message in ((tmp_path / "missing.txt", "no such file"), (empty, "holds no text")):
        proc = quantkit("eval", "perplexity", tmp_path / "no-model", "--data", data, check_code=2)
        assert message in proc.stderr and "--data" in proc.stderr


def test_hub_id_offline_fails_fast_with_what_to_do(tmp_path):
    started = time.perf_counter()
    proc = quantkit("rtn", "some-org/not-a-cached-model", "-o", tmp_path / "o", check_code=2)
    assert "not in the local cache" in proc.stderr and ".gguf" in proc.stderr
    assert "Retrying" not in proc.stderr
    assert time.perf_counter() - started < 60  # transformers' own retries take 35 s on top of start-up


def test_quantize_prints_each_thing_once_in_80_columns(tiny_llama_dir, tiny_text_file, tmp_path):
    env = dict(os.environ, COLUMNS="80", HF_HUB_OFFLINE="1")
    out = tmp_path / "g"
    proc = subprocess.run([sys.executable, "-m", "quantkit.cli.app", "gptq", str(tiny_llama_dir), "-o", str(out),
                           "--calib", str(tiny_text_file), "--nsamples", "4", "--seqlen", "32"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    assert sum(line.startswith("layer ") for line in lines) == 2  # one line per decoder layer
    assert "group size 64" in proc.stdout  # chosen for 64/128-wide inputs, and said
    assert "vLLM kernel" in proc.stdout and "gptq_marlin" in proc.stdout
    for leak in ("Loading weights", "Writing model shards", "it/s]"):
        assert leak not in proc.stderr + proc.stdout
    ppl = subprocess.run([sys.executable, "-m", "quantkit.cli.app", "eval", "perplexity", str(out), "--data",
                          str(tiny_text_file), "--seqlen", "32", "--max-windows", "3"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert ppl.returncode == 0, ppl.stderr
    assert ppl.stdout.count("perplexity ") == 1 + ppl.stdout.count("perplexity ━")  # the result line once


def _interrupt_when(args: list, marker: str, tmp_path) -> subprocess.CompletedProcess:
    """Run the CLI, send SIGINT once ``marker`` appears on stdout, return the finished process."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", COLUMNS="200")
    # A shell starts background jobs with SIGINT ignored, and Python keeps an ignored SIGINT ignored: give the
    # child the default disposition, as a terminal's Ctrl-C finds it, wherever the test suite itself was started.
    proc = subprocess.Popen([sys.executable, "-m", "quantkit.cli.app", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            break
    else:
        proc.wait(timeout=60)
        pytest.fail(f"{marker!r} never appeared: {''.join(seen)} {proc.stderr.read()}")
    proc.send_signal(signal.SIGINT)
    started = time.perf_counter()
    stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(args, proc.returncode, "".join(seen) + stdout, stderr), \
        time.perf_counter() - started


def test_ctrl_c_during_gptq_exits_130_and_leaves_nothing(tiny_llama_dir, tiny_text_file, tmp_path):
    out = tmp_path / "g"
    proc, seconds = _interrupt_when(["gptq", tiny_llama_dir, "-o", out, "--calib", tiny_text_file, "--nsamples", "4",
                                     "--seqlen", "32"], "calibration:", tmp_path)
    assert proc.returncode == 130, proc.stderr
    assert "interrupted" in proc.stderr
    assert seconds < 30
    assert not out.exists() and not list(tmp_path.glob("*tmp*"))


def test_ctrl_c_during_eval_exits_130_without_a_result(tiny_llama_dir, tiny_text_file, tmp_path):
    proc, seconds = _interrupt_when(["eval", "perplexity", tiny_llama_dir, "--data", tiny_text_file, "--seqlen", "16"],
                                    "windows of 16 tokens", tmp_path)
    assert proc.returncode == 130, proc.stderr
    assert "interrupted" in proc.stderr and "perplexity 2" not in proc.stdout
    assert not any(line.startswith("perplexity ") and "windows of" in line and "tokens," in line
                   for line in proc.stdout.splitlines())
    assert seconds < 30


def test_gptq_defaults_reach_the_checkpoint(tiny_llama_dir, tiny_text_file, tmp_path):
    """No scheme options: act-order with static groups, MSE, sym, group size from the model; use_cache kept."""
    out = tmp_path / "d"
    report = json.loads(quantkit("gptq", tiny_llama_dir, "-o", out, "--calib", tiny_text_file, "--nsamples", "4",
                                 "--seqlen", "32", "--json").stdout)
    assert report["group_size"] == 64 and report["sym"] is True
    assert report["options"]["desc_act"] and report["options"]["static_groups"] and report["options"]["mse"]
    assert report["options"]["mse_weight"] == "hessian"
    assert "Marlin" in report["engine_kernels"]["vLLM"]
    config = json.loads((out / "config.json").read_text())
    assert config["use_cache"] is True  # the tiny model's own value, not the calibration-time False
    qc = config["quantization_config"]
    assert qc["group_size"] == 64 and qc["sym"] is True and qc["static_groups"] is True
    assert qc["desc_act"] is False  # static groups: contiguous g_idx, nothing for a kernel to reorder
