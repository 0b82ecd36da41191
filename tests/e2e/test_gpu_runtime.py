"""The runtime on the GPU (kernels backend, CUDA graphs, bf16) against the CPU reference path (float32) on the
same quantized checkpoint: greedy tokens equal for at least 32 tokens, or the first divergence a logit tie.

SmolLM2 itself runs where its GGUF is present; a random model of SmolLM2's shape (30 layers, widths 576 / 1536,
9 heads of 64, 3 KV heads: partial g128 groups) runs everywhere CUDA is.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_llama_config, tiny_tokenizer

pytestmark = pytest.mark.gpu

N_TOKENS = 40


def _greedy_matches_reference(folder, prompt: list[int]) -> None:
    from quantkit.runtime.loader import load_engine, load_runtime_model
    from quantkit.runtime.types import SamplingParams

    engine = load_engine(str(folder), device="cuda", max_batch=4, max_seq_len=256)
    assert engine.model.backend == "kernels" and engine.graphs is not None
    params = SamplingParams(max_tokens=N_TOKENS, ignore_eos=True)
    # one request alone, then the same prompt beside two others that join later (continuous batching)
    alone = _run(engine, [(0, prompt, params)])[0]
    mixed = _run(engine, [(0, prompt[:5], params), (1, prompt, params), (3, prompt[2:], params)])
    reference, _ = load_runtime_model(str(folder), device="cpu", backend="reference")
    gpu_model = engine.model
    for tokens in (alone, mixed[1]):
        seq = torch.tensor([prompt + tokens])
        ref_logits = reference.forward_logits(seq)[0, len(prompt) - 1:-1]  # the logits each token was chosen from
        gpu_logits = gpu_model.forward_logits(seq.cuda())[0, len(prompt) - 1:-1].cpu()
        noise = (gpu_logits - ref_logits).abs().max().item()
        expected = ref_logits.argmax(-1).tolist()
        first_diff = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
        if first_diff is None:
            assert len(tokens) >= 32
            continue
        gap = (ref_logits[first_diff, expected[first_diff]] - ref_logits[first_diff, tokens[first_diff]]).item()
        assert first_diff >= 32 or gap <= 2 * noise, (
            f"token {first_diff} differs ({tokens[first_diff]} vs {expected[first_diff]}): the reference prefers its "
            f"token by {gap:.4f}, more than twice the bf16 logit noise {noise:.4f}"
        )


def _run(engine, schedule) -> list[list[int]]:
    """Add each (step, prompt, params) at its step; the generated token ids of each request."""
    ids, out, step = {}, {}, 0
    while schedule or engine.has_work():
        for entry in [e for e in schedule if e[0] <= step]:
            ids[engine.add_request(entry[1], entry[2])] = len(ids)
            schedule.remove(entry)
        for event in engine.step():
            if event.token_id is not None:
                out.setdefault(ids[event.request_id], []).append(event.token_id)
        step += 1
    return [out[i] for i in range(len(ids))]


def test_smollm2_shaped_checkpoint_greedy_matches_cpu_reference(tmp_path, tiny_text_file):
    from transformers import LlamaForCausalLM

    import quantkit
    from quantkit import CalibConfig, QuantScheme
    from quantkit.config import LoadConfig

    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    config = tiny_llama_config(vocab_size=len(tokenizer), hidden_size=576, intermediate_size=1536,
                               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                               rope_theta=100000.0, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "w4"
    quantkit.quantize(str(folder), out, method="gptq", scheme=QuantScheme(bits=4, group_size=128, sym=False),
                      calib=CalibConfig(source=str(tiny_text_file), nsamples=8, seqlen=64),
                      load=LoadConfig(device="cuda"))
    _greedy_matches_reference(out, tokenizer("the quick brown fox jumps over the lazy dog")["input_ids"])


def test_smollm2_rtn_greedy_matches_cpu_reference(smollm2_gguf, tmp_path):
    import quantkit
    from quantkit.config import LoadConfig, QuantScheme

    out = tmp_path / "smollm2-rtn"
    quantkit.quantize(str(smollm2_gguf), out, method="rtn", scheme=QuantScheme(4, 128, sym=False),
                      load=LoadConfig(device="cuda"))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    _greedy_matches_reference(out, tokenizer("The capital of France is")["input_ids"])
