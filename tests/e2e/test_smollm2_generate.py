"""`quantkit generate` on SmolLM2-135M-Instruct quantized with RTN, GPTQ and AWQ (a few samples): greedy text equals
transformers' greedy generate through QuantLinear on the same checkpoint, and the chat answer names Paris."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(smollm2_folder, tmp_path_factory, tiny_text_file):
    """``checkpoint(method) -> folder``: SmolLM2 quantized with ``method`` (asym g64), made on first use (from the
    GGUF's weights saved as a folder: quantizing from the GGUF itself is tested in test_smollm2.py)."""
    from quantkit import api
    from quantkit.config import CalibConfig, LoadConfig, QuantScheme

    root = tmp_path_factory.mktemp("smollm2_runtime")
    made = {}

    def get(method: str):
        if method not in made:
            calib = {} if method == "rtn" else {"calib": CalibConfig(source=str(tiny_text_file), nsamples=4, seqlen=64)}
            # The searches that only improve quality (GPTQ's MSE grid, AWQ's 21-point scale grid and clip search)
            # cut short: what is tested is that generate reproduces transformers on the written checkpoint.
            options = {"gptq": {"mse": False}, "awq": {"grid": 4, "clip": False}}.get(method)
            api.quantize(str(smollm2_folder), root / method, method=method, scheme=QuantScheme(4, 64, sym=False),
                         method_options=options, load=LoadConfig(dtype="float32", device="cpu"), **calib)
            made[method] = root / method
        return made[method]

    return get


def _cli_generate(folder, prompt: str, *extra: str) -> dict:
    env = {**os.environ, "QUANTKIT_ROOT": os.environ.get("QUANTKIT_ROOT", os.getcwd())}
    done = subprocess.run([sys.executable, "-m", "quantkit.cli.app", "generate", str(folder), prompt, "--device", "cpu",
                           "--json", *extra], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_generate_equals_transformers_greedy(checkpoint, method):
    import quantkit

    folder = checkpoint(method)
    result = _cli_generate(folder, "The capital of France is", "--max-tokens", "24", "--ignore-eos")
    model, tokenizer = quantkit.load_quantized(folder, device="cpu", dtype=torch.float32)
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = out[0, ids.shape[1]:].tolist()
    assert result["token_ids"] == expected
    assert result["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert result["decode_tps"] > 0 and result["prefill_tps"] > 0


def test_chat_answer_stops_at_im_end(checkpoint):
    result = _cli_generate(checkpoint("rtn"), "What is the capital of France?", "--chat", "--max-tokens", "40")
    assert result["finish_reason"] == "stop"  # the generation config's eos (<|im_end|>, id 2), not the tokenizer's
    assert result["token_ids"][-1] == 2
    assert "Paris" in result["text"]
