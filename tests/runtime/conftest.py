"""Tiny random decoders of every family the runtime serves, saved as real model folders, and quantized ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import tiny_tokenizer

# (config class, overrides): 2 layers, GQA, head_dim 16; Gemma with a sliding window shorter than the tests' prompts
FAMILIES = {
    "llama": ("LlamaConfig", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=5,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3_text": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=5,
                                             layer_types=["sliding_attention", "full_attention"])),
}


def tiny_config(family: str, vocab_size: int):
    import transformers

    cls_name, overrides = FAMILIES[family]
    params = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=family.startswith("gemma"), attn_implementation="eager")
    params.update(overrides)
    return getattr(transformers, cls_name)(**params)


def save_tiny(family: str, folder: Path, seed: int = 0):
    """A random model of ``family`` with the tiny tokenizer, saved to ``folder``; returns the HF model (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer()
    model = AutoModelForCausalLM.from_config(tiny_config(family, len(tokenizer)))
    # random (not unit) norm weights, so an offset or a missing norm shows in the logits
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if family.startswith("gemma") else 1.0, 0.2)
    model.eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    """``tiny_family(name) -> (folder, hf_model)``, built once per family."""
    built: dict[str, tuple[Path, object]] = {}

    def get(family: str):
        if family not in built:
            folder = tmp_path_factory.mktemp(f"tiny_{family}")
            built[family] = (folder, save_tiny(family, folder))
        return built[family]

    return get


@pytest.fixture(scope="session")
def tiny_quantized(tmp_path_factory, tiny_text_file):
    """``tiny_quantized(kind) -> folder``: the tiny Llama quantized with RTN (asym g32) or GPTQ (sym g32, act-order)."""
    built: dict[str, Path] = {}

    def get(kind: str):
        if kind not in built:
            import quantkit
            from quantkit import CalibConfig, QuantScheme

            src = tmp_path_factory.mktemp(f"src_{kind}")
            save_tiny("llama", src)
            out = tmp_path_factory.mktemp(f"q_{kind}") / "w4"
            if kind == "rtn":
                quantkit.quantize(str(src), out, method="rtn", scheme=QuantScheme(4, 32, sym=False))
            else:
                quantkit.quantize(str(src), out, method="gptq", scheme=QuantScheme(4, 32, sym=True),
                                  method_options={"desc_act": True},
                                  calib=CalibConfig(source=str(tiny_text_file), nsamples=4, seqlen=32))
            built[kind] = out
        return built[kind]

    return get
