"""The command line end to end on a tiny random Llama: quantize, inspect, evaluate, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def quantkit(*args: str, check_code: int | None = 0) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "quantkit.cli.app", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=600)
    if check_code is not None:
        assert proc.returncode == check_code, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def test_help_lists_commands():
    out = quantkit("--help").stdout
    for command in ("rtn", "gptq", "awq", "inspect", "eval"):
        assert command in out


def test_rtn_inspect_eval_round_trip(tiny_llama_dir, tiny_text_file, tmp_path):
    out = tmp_path / "rtn"
    report = json.loads(quantkit("rtn", tiny_llama_dir, "-o", out, "--group-size", "32", "--asym", "--json").stdout)
    assert report["method"] == "rtn" and report["n_quantized"] == 2 * 7 and not report["sym"]
    info = json.loads(quantkit("inspect", out, "--json").stdout)
    assert info["bits"] == 4 and info["group_size"] == 32 and info["n_quantized"] == 14
    assert info["compression_ratio"] > 1
    human = quantkit("inspect", out).stdout
    assert "compression" in human
    ppl_q = json.loads(quantkit("eval", "perplexity", out, "--data", tiny_text_file, "--seqlen", "64",
                                "--max-windows", "3", "--json").stdout)
    ppl_fp = json.loads(quantkit("eval", "perplexity", tiny_llama_dir, "--data", tiny_text_file, "--seqlen", "64",
                                 "--max-windows", "3", "--json").stdout)
    assert ppl_q["windows"] == ppl_fp["windows"] == 3
    # A random model is near-uniform over its vocabulary either way; quantization must not break it.
    assert 0.5 * ppl_fp["ppl"] < ppl_q["ppl"] < 2 * ppl_fp["ppl"]


def test_existing_output_is_refused_then_overwritten(tiny_llama_dir, tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    proc = quantkit("rtn", tiny_llama_dir, "-o", out, check_code=2)
    assert "--overwrite" in proc.stderr
    quantkit("rtn", tiny_llama_dir, "-o", out, "--overwrite", "--group-size", "32")
    assert (out / "config.json").is_file()


@pytest.mark.parametrize("args,message", [
    (["rtn", "does/not/exist", "-o", "x"], "does not exist"),
    (["rtn", "{model}", "-o", "{tmp}/o", "--group-size", "100"], "group-size"),
    (["rtn", "{model}", "-o", "{tmp}/o", "--bits", "5"], "bits"),
    (["eval", "perplexity", "{model}", "--data", "wikitext2", "--max-windows", "1", "--seqlen", "64"], "--data"),
    (["inspect", "{tmp}"], "config.json"),
])
def test_bad_input_exits_2_with_a_message(tiny_llama_dir, tmp_path, args, message):
    args = [a.format(model=tiny_llama_dir, tmp=tmp_path) for a in args]
    proc = quantkit(*args, check_code=2)
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_gptq_and_awq_commands(tiny_llama_dir, tiny_text_file, tmp_path):
    common = ["--calib", tiny_text_file, "--nsamples", "4", "--seqlen", "32", "--group-size", "32", "--json"]
    stats = tmp_path / "stats.json"
    gptq = json.loads(quantkit("gptq", tiny_llama_dir, "-o", tmp_path / "g", *common, "--desc-act",
                               "--no-static-groups", "--save-stats", stats).stdout)
    assert gptq["method"] == "gptq" and gptq["n_quantized"] == 14
    assert json.loads(stats.read_text())["layers"] and stats.with_suffix(".png").is_file()
    info = json.loads(quantkit("inspect", tmp_path / "g", "--json").stdout)
    assert info["desc_act"] is True
    awq = json.loads(quantkit("awq", tiny_llama_dir, "-o", tmp_path / "a", *common).stdout)
    assert awq["method"] == "awq" and not awq["sym"]


def test_gptq_static_groups_default_follows_the_grid(tiny_llama_dir, tiny_text_file, tmp_path):
    common = ["--calib", tiny_text_file, "--nsamples", "2", "--seqlen", "32", "--group-size", "32", "--json"]
    asym = json.loads(quantkit("gptq", tiny_llama_dir, "-o", tmp_path / "asym", *common, "--asym").stdout)
    assert asym["options"]["static_groups"] is False and asym["options"]["desc_act"] is True
    assert json.loads(quantkit("inspect", tmp_path / "asym", "--json").stdout)["desc_act"] is True
    static = json.loads(quantkit("gptq", tiny_llama_dir, "-o", tmp_path / "static", *common, "--asym",
                                 "--static-groups").stdout)
    assert static["options"]["static_groups"] is True
    assert json.loads(quantkit("inspect", tmp_path / "static", "--json").stdout)["desc_act"] is False


def test_foreign_architecture_rtn_works_awq_refuses(tmp_path, tiny_text_file):
    """GPT-NeoX has no architecture record: RTN/GPTQ find its layers generically, AWQ says it cannot fold."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from tests.conftest import tiny_tokenizer

    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    config = GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=128)
    folder = tmp_path / "neox"
    GPTNeoXForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    report = json.loads(quantkit("rtn", folder, "-o", tmp_path / "r", "--group-size", "32", "--json").stdout)
    assert report["n_quantized"] == 2 * 4  # query_key_value, dense, dense_h_to_4h, dense_4h_to_h
    proc = quantkit("awq", folder, "-o", tmp_path / "a", "--calib", tiny_text_file, "--nsamples", "2",
                    "--seqlen", "32", check_code=2)
    assert "not supported" in proc.stderr and not (tmp_path / "a").exists()
