"""``quantkit gptq|awq ... --gpus N``: the CLI relaunches its own command line through torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import quantkit.distributed.launch as launch_mod


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_gpus_relaunches_the_same_command_line(monkeypatch, tmp_path, tiny_llama_dir, method):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    calls = []
    monkeypatch.setattr(launch_mod, "launch", lambda entry, args, nproc, **kw: calls.append((entry, args, nproc)))
    argv = ["quantkit", method, str(tiny_llama_dir), "-o", str(tmp_path / "out"), "--gpus", "2", "--nsamples", "4",
            "--seqlen", "64"]  # within the tiny model's 256 positions: checked before the launch
    monkeypatch.setattr(sys, "argv", argv)
    from quantkit.cli.app import main

    try:
        main()
    except SystemExit as exit_:
        assert exit_.code in (0, None)
    assert calls == [(["-m", "quantkit.cli.app"], argv[1:], 2)]
    assert not (tmp_path / "out").exists()  # the launcher itself loads and writes nothing


def test_gpus_2_on_the_cpu_end_to_end(tiny_llama_dir, tiny_text_file, tmp_path):
    """Two gloo ranks through the real command: one JSON report (rank 0's) and one checkpoint."""
    out = tmp_path / "q"
    env = dict(os.environ, HF_HUB_OFFLINE="1", QUANTKIT_DIST_TIMEOUT="60")
    proc = subprocess.run(
        [sys.executable, "-m", "quantkit.cli.app", "gptq", str(tiny_llama_dir), "-o", str(out), "--calib",
         str(tiny_text_file), "--nsamples", "8", "--seqlen", "32", "--batch-size", "2", "--group-size", "32",
         "--device", "cpu", "--gpus", "2", "--json"],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["n_quantized"] == 14 and (out / "model.safetensors").is_file()


def test_gpus_must_agree_with_torchrun(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    from quantkit.config import QuantkitError

    with pytest.raises(QuantkitError, match="--gpus 3 but torchrun started 2"):
        launch_mod.setup(3, "cpu")
