"""Random MoE models built from transformers configs (no download), for the MoE benchmarks.

``random_moe`` initialises every weight with std 1/sqrt(fan_in) (embeddings 1) so activations keep their
scale through the layers, and skews the router (rows scaled by a log-normal factor) so that, as in
trained MoEs, some experts are chosen far more often than others.
"""

from __future__ import annotations

import torch

QWEN3_30B_A3B = dict(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
                     num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, vocab_size=151936, norm_topk_prob=True, max_position_embeddings=40960)


def random_moe(model_type: str = "qwen3_moe", *, seed: int = 0, router_skew: float = 1.0,
               device: str = "cpu", dtype: torch.dtype = torch.float32, **config):
    from transformers import AutoConfig, AutoModelForCausalLM

    config.setdefault("tie_word_embeddings", False)
    cfg = AutoConfig.for_model(model_type, **config)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2:
                continue
            fan_in = p.shape[-1]
            p.normal_(0, 1.0 if "embed" in name else fan_in ** -0.5, generator=g)
            if name.endswith("mlp.gate.weight"):  # router [E, H]: skewed row norms
                skew = torch.randn(p.shape[0], 1, device=device, generator=g).mul(router_skew).exp()
                p.mul_(skew.to(p.dtype) * 4)
    return model.eval()


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(
        description="The random MoE models bench_moe.py and moe_calib_mode.py build (a module they import). "
        f"Qwen3-30B-A3B shape: {QWEN3_30B_A3B}."
    ).parse_args()
