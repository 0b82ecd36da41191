"""``quantkit fp8`` on the command line: bad options refused before any model loads (exit 2), and an FP8
checkpoint through inspect, eval perplexity, eval kld, verify and generate."""

from __future__ import annotations

import json

import pytest

from tests.test_cli import quantkit

MISSING_MODEL = "/nonexistent/model/folder"  # loading it would fail with a message about the model instead


@pytest.mark.parametrize("args,needle", [
    (["--weights", "row"], "--weights must be one of channel, tensor, block"),
    (["--block", "100", "128"], "--block must be two positive multiples of 16"),
    (["--weights", "block", "--calib", "self"], "--weights block takes dynamic activations only"),
    (["--nsamples", "4"], "only --calib asks for"),
    (["--calib", "/nonexistent/calib.txt"], "calib.txt"),
    (["--stream", "sometimes"], "--stream must be auto, on or off"),
])
def test_bad_options_exit_2_before_the_model_loads(tmp_path, args, needle):
    proc = quantkit("fp8", MISSING_MODEL, "-o", tmp_path / "out", *args, check_code=2)
    assert needle in proc.stderr and "Traceback" not in proc.stderr
    assert "nonexistent/model" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_static_scales_on_a_moe_model_are_refused_before_it_loads(tmp_path, tiny_text_file):
    """Only config.json is there: the refusal must come from reading it, not from loading weights."""
    folder = tmp_path / "moe"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    proc = quantkit("fp8", folder, "-o", tmp_path / "out", "--calib", tiny_text_file, check_code=2)
    assert "not supported on MoE experts (qwen3_moe)" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_existing_output_is_refused(tmp_path):
    (tmp_path / "out").mkdir()
    proc = quantkit("fp8", MISSING_MODEL, "-o", tmp_path / "out", check_code=2)
    assert "already exists" in proc.stderr


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8cli") / "fp8"
    stats = out.parent / "stats.json"
    report = json.loads(quantkit("fp8", tiny_llama_dir, "-o", out, "--json", "--save-stats", stats).stdout)
    assert report["method"] == "fp8" and report["n_quantized"] == 2 * 7 and report["ignored"] == ["lm_head"]
    layers = json.loads(stats.read_text())["layers"]
    assert len(layers) == 2 and all(0 < s["weight_error"] < 0.05 for layer in layers for s in layer["linears"].values())
    return out


def test_inspect_reads_the_fp8_checkpoint(fp8_checkpoint):
    info = json.loads(quantkit("inspect", fp8_checkpoint, "--json").stdout)
    assert info["quant_method"] == "compressed-tensors" and info["bits"] == 8 and info["layout"] == "fp8_e4m3_channel"
    assert info["n_quantized"] == 14 and info["compression_ratio"] > 1


def test_eval_verify_generate_take_the_fp8_checkpoint(tiny_llama_dir, tiny_text_file, fp8_checkpoint):
    ppl = json.loads(quantkit("eval", "perplexity", fp8_checkpoint, "--data", tiny_text_file, "--seqlen", "64",
                              "--max-windows", "2", "--json").stdout)
    assert ppl["ppl"] > 1
    kld = json.loads(quantkit("eval", "kld", tiny_llama_dir, fp8_checkpoint, "--data", tiny_text_file, "--seqlen",
                              "64", "--max-windows", "2", "--json").stdout)
    assert 0 < kld["mean_kld"] < 0.1
    verify = quantkit("verify", fp8_checkpoint, "--decode-tokens", "4", check_code=None)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    gen = quantkit("generate", fp8_checkpoint, "the quick", "--max-tokens", "4", check_code=None)
    assert gen.returncode == 0, gen.stderr
