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
# DeepSeek: multi-head latent attention (kv_lora_rank, q_lora_rank: None is V2-Lite's plain q_proj), one dense
# first layer (first_k_dense_replace), 8 routed experts in 4 groups of which the router keeps 2, top-2, one
# shared expert. V2 scores by softmax (group_limited_greedy), V3 by sigmoid with e_score_correction_bias.
_MLA = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4)
DEEPSEEK = {
    "deepseek_v2": dict(_MLA, q_lora_rank=None, topk_method="group_limited_greedy"),
    "deepseek_v2_qlora": dict(_MLA, q_lora_rank=32, topk_method="group_limited_greedy"),
    "deepseek_v3": dict(_MLA, q_lora_rank=32, norm_topk_prob=True, routed_scaling_factor=2.5),
}
FAMILIES.update(DEEPSEEK)


def tiny_moe(model_type: str, seed: int = 0, layers: int = 2, **overrides):
    """A random ``model_type`` model with 2 layers, hidden 64, 8 experts (top-2), vocabulary 128, float32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(FAMILIES[model_type])
    kw.update(overrides)
    config = AutoConfig.for_model(model_type.removesuffix("_qlora"), **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random init of the fused expert tensors (transformers leaves some at zero/empty)
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02 if "embed" not in name else 1.0)
        for name, b in model.named_buffers():  # DeepSeek-V3's router bias: a non-zero one, so that it counts
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
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


LEAVES = ("qweight", "qzeros", "scales", "g_idx")


def expected_deepseek_names(config) -> tuple[set[str], set[str]]:
    """(packed linears, 16-bit router tensors) of a DeepSeek-V2/V3 checkpoint, built from the config as vLLM's
    ``DeepseekV2ForCausalLM.load_weights`` maps them: per-expert ``mlp.experts.{e}.{gate,up,down}_proj`` (its
    ``FusedMoE.make_expert_params_mapping``), ``mlp.shared_experts.*``, the dense first layers' ``mlp.*_proj``,
    q_a_proj + kv_a_proj_with_mqa (stacked into its ``fused_qkv_a_proj``), q_b_proj or q_proj, kv_b_proj, o_proj;
    the router ``mlp.gate.weight`` (and V3's ``e_score_correction_bias``) unquantized."""
    mlp = ("gate_proj", "up_proj", "down_proj")
    q = ("q_a_proj", "q_b_proj") if config.q_lora_rank is not None else ("q_proj",)
    packed, kept = set(), set()
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}"
        packed |= {f"{p}.self_attn.{n}" for n in (*q, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")}
        if layer < config.first_k_dense_replace:
            packed |= {f"{p}.mlp.{n}" for n in mlp}
            continue
        packed |= {f"{p}.mlp.experts.{e}.{n}" for e in range(config.n_routed_experts) for n in mlp}
        packed |= {f"{p}.mlp.shared_experts.{n}" for n in mlp}
        kept.add(f"{p}.mlp.gate.weight")
        if config.model_type == "deepseek_v3":
            kept.add(f"{p}.mlp.gate.e_score_correction_bias")
    return packed, kept
