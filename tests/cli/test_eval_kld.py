"""``quantkit eval kld BASE QUANTIZED`` on the tiny random Llama."""

from __future__ import annotations

import json
import subprocess
import sys


def quantkit(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantkit.cli.app", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def test_kld_of_a_model_against_itself_is_zero_and_of_rtn_is_not(tiny_llama_dir, tiny_text_file, tmp_path):
    common = ["--data", tiny_text_file, "--seqlen", 32, "--max-windows", 3, "--device", "cpu", "--dtype", "fp32", "--json"]
    same = quantkit("eval", "kld", tiny_llama_dir, tiny_llama_dir, *common)
    assert same.returncode == 0, same.stderr
    result = json.loads(same.stdout)
    assert result["mean_kld"] == 0.0 and result["p99_kld"] == 0.0 and result["top1_changed"] == 0.0
    assert result["tokens"] == 3 * 32 and result["windows"] == 3

    out = tmp_path / "w3"
    made = quantkit("rtn", tiny_llama_dir, "-o", out, "--bits", 3, "--group-size", 32, "--device", "cpu")
    assert made.returncode == 0, made.stderr
    quant = quantkit("eval", "kld", tiny_llama_dir, out, *common)
    assert quant.returncode == 0, quant.stderr
    stats = json.loads(quant.stdout)
    assert 0 < stats["mean_kld"] <= stats["p99_kld"]


def test_kld_refuses_a_model_with_another_vocabulary(tiny_llama_dir, tiny_text_file, tmp_path):
    import torch
    from transformers import LlamaForCausalLM

    from tests.conftest import tiny_llama_config, tiny_tokenizer

    other = tmp_path / "other"
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(vocab_size=300)).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    proc = quantkit("eval", "kld", tiny_llama_dir, other, "--data", tiny_text_file, "--seqlen", 32, "--device", "cpu")
    assert proc.returncode == 2 and "output tokens" in proc.stderr and "Traceback" not in proc.stderr
