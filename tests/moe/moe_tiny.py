"""Tiny random MoE models of each family, built from transformers configs (no download)."""

from __future__ import annotations

import torch

FAMILIES = {
    "mixtral": dict(hidden_size=64, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                      shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    "qwen3_moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_experts=8,
                      num_experts_per_tok=2, head_dim=16, norm_topk_prob=True),
    "olmoe": dict(hidden_size=64, intermediate_size=64, num_experts=8, num_experts_per_tok=2),
}


def tiny_moe(model_type: str, seed: int = 0, layers: int = 2, **overrides):
    """A random ``model_type`` model with 2 layers, hidden 64, 8 experts (top-2), vocabulary 128, float32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(FAMILIES[model_type], num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128, max_position_embeddings=256, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(overrides)
    config = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random init of the fused expert tensors (transformers leaves some at zero/empty)
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02 if "embed" not in name else 1.0)
    return model.eval()


def expected_checkpoint_names(config) -> set[str]:
    """Packed tensor names vLLM's ``FusedMoE.make_expert_params_mapping`` maps, built from the config:
    ``layers.{l}.{block}.experts.{e}.{gate,up,down}.{qweight,qzeros,scales,g_idx}``."""
    if config.model_type == "mixtral":
        block, names, n = "block_sparse_moe", ("w1", "w3", "w2"), config.num_local_experts
    else:
        block, names, n = "mlp", ("gate_proj", "up_proj", "down_proj"), config.num_experts
    return {f"model.layers.{layer}.{block}.experts.{e}.{lin}.{leaf}"
            for layer in range(config.num_hidden_layers) for e in range(n) for lin in names
            for leaf in ("qweight", "qzeros", "scales", "g_idx")}


def exclude_expert(model, expert: int) -> None:
    """Route no token to ``expert`` in any layer: its router row never wins (logits -inf)."""
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            original = module.forward

            def forward(hidden_states, _orig=original, _m=module):
                logits, _, _ = _orig(hidden_states)
                logits = logits.clone()
                logits[:, expert] = float("-inf")
                probs = torch.softmax(logits.float(), dim=-1)
                top, idx = torch.topk(probs, _m.top_k, dim=-1)
                if getattr(_m, "norm_topk_prob", True):
                    top = top / top.sum(-1, keepdim=True)
                return logits, top.to(logits.dtype), idx

            module.forward = forward
