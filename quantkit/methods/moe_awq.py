"""AWQ on a layer with MoE blocks: the architecture record's scaling groups, expanded for this layer's experts.

* The MoE block's input (the post-attention norm's output) feeds every expert's gate and up (and the shared
  expert's): one scale for all of them, folded into the norm (and into the 16-bit router's columns, so that
  the routing stays the same). Its search scores the **MoE block's output**
  (routed experts, plus the shared expert; what the next layer sees) on a sample of tokens, with every
  consumer's weights fake-quantized at each candidate scale.
* Each expert's up -> down (and the shared expert's): a scale folded into up's rows, scored on the down
  projection's own outputs over that expert's inputs.

While AWQ captures and searches, the experts run in "all" mode: every token reaches every expert, so each
expert's statistics come from all calibration tokens, and the block's output stays the routed sum.
"""

from __future__ import annotations

import dataclasses

from quantkit.arch import ArchSpec, ScalingGroup
from quantkit.moe.experts import SeparateExperts


def moe_scaling(spec: ArchSpec, blocks: dict[str, SeparateExperts], norm: str = "post_attention_layernorm"
                ) -> tuple[ScalingGroup, ...]:
    """The scaling groups of one decoder layer whose MoE blocks are ``blocks`` (path -> experts): the record's own
    groups (attention; its dense-MLP groups find no linears in an MoE layer and are skipped), then the MoE block's.

    The router and the shared-expert gate read the norm's output too: they are the group's ``passthrough`` (the
    scale folded into their columns exactly), so folding ``1/s`` into the norm changes no routing decision."""
    moe = spec.moe
    groups = list(spec.scaling)
    for path, experts in blocks.items():
        gate, up, down = experts[0].names
        shared = f"{moe.block}.{moe.shared_expert}" if moe.shared_expert else None
        consumers = [f"{shared}.gate_proj", f"{shared}.up_proj"] if shared else []
        consumers += [f"{path}.{e}.{n}" for e in range(experts.num_experts) for n in (gate, up)]
        passthrough = tuple(f"{moe.block}.{n}" for n in (moe.router, moe.shared_gate) if n)
        groups.append(ScalingGroup(norm, tuple(consumers), "norm", block=moe.block, tokenwise=True,
                                   passthrough=passthrough))
        if shared:
            groups.append(ScalingGroup(f"{shared}.up_proj", (f"{shared}.down_proj",), "linear"))
        groups += [ScalingGroup(f"{path}.{e}.{up}", (f"{path}.{e}.{down}",), "linear")
                   for e in range(experts.num_experts)]
    return tuple(groups)


def awq_layer_spec(spec: ArchSpec, blocks: dict[str, SeparateExperts]) -> ArchSpec:
    return dataclasses.replace(spec, scaling=moe_scaling(spec, blocks))
