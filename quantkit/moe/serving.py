"""Which tensor-parallel sizes vLLM's MoE kernels can serve a GPTQ MoE checkpoint at, and why not.

Facts from vLLM (``quantization/utils/marlin_utils.py``, ``check_moe_marlin_supports_layer``): the
GPTQ-Marlin MoE kernel needs hidden % 128 == 0, the per-rank expert intermediate size
``I / tp`` divisible by ``max(64, group_size)``, group size in {-1, 32, 64, 128} and a SiLU
activation; expert tensors are sharded along ``I``, so ``I`` must split evenly over ``tp`` at all.
Where Marlin refuses, vLLM tries its MoE-WNA16 Triton path (not checked here).
"""

from __future__ import annotations

import re
from typing import Any

from quantkit.arch import arch_for

TP_SIZES = (1, 2, 4, 8)
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.[^.]+$")


def moe_sizes(config: dict) -> dict[str, int] | None:
    """Experts, top-k, hidden and expert intermediate size of an MoE ``config.json`` (None: not MoE)."""
    spec = arch_for(config.get("model_type", ""))
    if spec is None or spec.moe is None:
        return None
    experts = config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts")
    inter = config.get("moe_intermediate_size") or config.get("intermediate_size")
    return {"num_experts": int(experts), "top_k": int(config.get("num_experts_per_tok", 0)),
            "hidden_size": int(config["hidden_size"]), "intermediate_size": int(inter)}


def marlin_moe_support(hidden: int, inter: int, group_size: int, tp: int, act: str = "silu") -> str | None:
    """None when vLLM's GPTQ-Marlin MoE kernel serves these experts at ``tp`` ranks, else the reason."""
    if inter % tp:
        return f"intermediate size {inter} does not split over {tp} ranks"
    per_rank = inter // tp
    if group_size not in (-1, 32, 64, 128):
        return f"group size {group_size} (Marlin MoE takes -1, 32, 64, 128)"
    if hidden % 128:
        return f"hidden size {hidden} is not a multiple of 128"
    need = max(64, group_size)
    if per_rank % need:
        return f"I/tp = {per_rank} is not a multiple of {need} (max(64, group size))"
    if act != "silu":
        return f"activation {act} (Marlin MoE needs silu)"
    return None


def moe_summary(config: dict, group_size: int, packed_names: list[str]) -> dict[str, Any] | None:
    """What ``inspect`` shows for an MoE checkpoint: sizes, experts found packed per block, and the
    tensor-parallel sizes vLLM's Marlin MoE kernel serves (with the reason where it cannot)."""
    sizes = moe_sizes(config)
    if sizes is None:
        return None
    blocks: dict[str, set[int]] = {}
    for name in packed_names:
        m = _EXPERT.match(name)
        if m:
            blocks.setdefault(m.group(1), set()).add(int(m.group(2)))
    act = config.get("hidden_act", "silu")
    vllm = {str(tp): marlin_moe_support(sizes["hidden_size"], sizes["intermediate_size"], group_size, tp, act)
            or "ok" for tp in TP_SIZES}
    incomplete = sorted(b for b, e in blocks.items() if len(e) != sizes["num_experts"])
    return {**sizes, "moe_blocks": len(blocks), "packed_experts": sum(len(e) for e in blocks.values()),
            "incomplete_blocks": incomplete, "vllm_marlin_moe_tp": vllm}
