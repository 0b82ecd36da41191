"""Architecture knowledge as small typed records, one per family.

Decoder layers and their linear sub-modules are found generically (the longest ``nn.ModuleList`` of
identical blocks that hold linears). The records below add only what an algorithm needs and cannot
discover: the order in which sub-modules see their inputs (GPTQ's true-sequential groups) and which
operation produces each group's input (AWQ's scale folding). Paths are relative to a decoder layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from quantkit.config import QuantkitError


@dataclass(frozen=True)
class ScalingGroup:
    """Linears that read the same input, the operation that produces it, and the block to measure.

    ``prev`` is a norm (``prev_kind="norm"``) or a linear (``"linear"``) whose output channels can
    absorb ``1/s``; ``block`` is the module whose output the scale search compares (``""``: the
    linears themselves). ``tokenwise``: the block maps each token on its own (an MLP, not attention),
    so its search may score any sample of tokens rather than whole windows (the linears themselves
    always are).
    """

    prev: str
    linears: tuple[str, ...]
    prev_kind: str = "norm"
    block: str = ""
    tokenwise: bool = False
    # 16-bit modules that read the same input (an MoE router, a shared-expert gate): the scale is folded into
    # their weight's input columns exactly, so what they compute does not change; never searched or quantized
    passthrough: tuple[str, ...] = ()


@dataclass(frozen=True)
class MoESpec:
    """A sparse MoE block: where it is, its experts' linear names, its router and shared expert.

    ``block`` is the block's path in quantkit's layout and in checkpoints (what vLLM maps); ``model_block``
    the attribute transformers 5 gives it (Mixtral: ``mlp``, stored as ``block_sparse_moe``). ``experts``
    hold ``{e}.{gate,up,down}`` named ``expert_names``. The router (``router``: an ``nn.Linear``, or
    DeepSeek's router module with a ``weight`` and V3's ``e_score_correction_bias``) and the shared-expert
    gate stay 16-bit. ``shared_expert``: an MLP with gate/up/down beside the routed experts (reads the same
    input). ``scoring``: "softmax" or "sigmoid" over the router logits (DeepSeek's grouped top-k is
    transformers' own code either way); ``renormalize``: True, or the config attribute that says whether
    the top-k weights are renormalized (``norm_topk_prob``).
    """

    block: str = "mlp"
    model_block: str = "mlp"
    experts: str = "experts"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    router: str = "gate"
    shared_expert: str | None = None
    shared_gate: str | None = None
    scoring: str = "softmax"
    renormalize: bool | str = "norm_topk_prob"

    @property
    def keep_16bit(self) -> tuple[str, ...]:
        """Modules of the block that stay 16-bit (router, shared-expert gate), relative to the decoder layer."""
        names = [self.router] + ([self.shared_gate] if self.shared_gate else [])
        return tuple(f"{self.block}.{n}" for n in names)


@dataclass(frozen=True)
class ArchSpec:
    family: str
    model_types: tuple[str, ...]
    # True-sequential order: each tuple's linears read the same input and are quantized together.
    sequential: tuple[tuple[str, ...], ...]
    scaling: tuple[ScalingGroup, ...] = ()
    # Gemma's RMSNorm multiplies by (1 + weight): folding a scale must keep that offset.
    norm_offset: float = 0.0
    layers_path: str | None = None  # None: found generically
    notes: tuple[str, ...] = field(default=())
    moe: MoESpec | None = None  # sparse MoE families
    # Why quantkit's runtime (generate/serve/verify/bench) cannot run this family ("": it can, or it is dense)
    no_runtime: str = ""

    @property
    def keep_16bit(self) -> tuple[str, ...]:
        """Linears of a decoder layer that stay 16-bit by design (routers, shared-expert gates)."""
        return self.moe.keep_16bit if self.moe is not None else ()


_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_LLAMA_SEQUENTIAL = (_ATTN, ("self_attn.o_proj",), ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


def _llama_like_scaling(mlp_norm: str) -> tuple[ScalingGroup, ...]:
    return (
        ScalingGroup("input_layernorm", _ATTN, "norm", block="self_attn"),
        # v -> o folds only where o's input channels map one-to-one onto v's outputs (no GQA
        # repetition); the method checks the shapes and skips with a note otherwise.
        ScalingGroup("self_attn.v_proj", ("self_attn.o_proj",), "linear"),
        ScalingGroup(mlp_norm, ("mlp.gate_proj", "mlp.up_proj"), "norm", block="mlp", tokenwise=True),
        ScalingGroup("mlp.up_proj", ("mlp.down_proj",), "linear"),
    )


ARCHITECTURES: tuple[ArchSpec, ...] = (
    ArchSpec(
        family="llama",
        model_types=("llama", "mistral", "qwen2", "qwen3", "smollm3"),
        sequential=_LLAMA_SEQUENTIAL,
        scaling=_llama_like_scaling("post_attention_layernorm"),
    ),
    ArchSpec(
        family="gemma1",
        model_types=("gemma",),
        sequential=_LLAMA_SEQUENTIAL,
        # Gemma 1 is laid out like Llama (the MLP reads post_attention_layernorm) with (1 + w) norms.
        scaling=_llama_like_scaling("post_attention_layernorm"),
        norm_offset=1.0,
    ),
    ArchSpec(
        family="gemma",
        model_types=("gemma2", "gemma3_text"),
        sequential=_LLAMA_SEQUENTIAL,
        # Gemma 2/3 normalize the attention output with post_attention_layernorm before the residual;
        # the MLP's input comes from pre_feedforward_layernorm.
        scaling=_llama_like_scaling("pre_feedforward_layernorm"),
        norm_offset=1.0,
    ),
)


_QWEN_SHARED = (("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"), ("mlp.shared_expert.down_proj",))
# MoE families: the experts' groups are made by quantkit.methods.moe (they depend on the calibration mode) and
# their AWQ scaling groups by quantkit.methods.moe_awq (after the record's own); Qwen3-MoE's mlp_only_layers are
# dense (the llama MLP groups).
MOE_ARCHITECTURES: tuple[ArchSpec, ...] = (
    ArchSpec(family="mixtral", model_types=("mixtral",), sequential=(_ATTN, ("self_attn.o_proj",)),
             scaling=_llama_like_scaling("post_attention_layernorm")[:2],
             moe=MoESpec(block="block_sparse_moe", model_block="mlp", expert_names=("w1", "w3", "w2"),
                         renormalize=True)),
    ArchSpec(family="qwen2_moe", model_types=("qwen2_moe",), sequential=(*_LLAMA_SEQUENTIAL, *_QWEN_SHARED),
             scaling=_llama_like_scaling("post_attention_layernorm"),
             moe=MoESpec(shared_expert="shared_expert", shared_gate="shared_expert_gate")),
    ArchSpec(family="qwen3_moe", model_types=("qwen3_moe", "olmoe"), sequential=_LLAMA_SEQUENTIAL,
             scaling=_llama_like_scaling("post_attention_layernorm"),
             moe=MoESpec()),
)

# DeepSeek-V2/V3: multi-head latent attention. V3 (and V2 with q_lora_rank) projects q through a rank-r bottleneck
# (q_a_proj -> q_a_layernorm -> q_b_proj), V2-Lite directly (q_proj); kv_a_proj_with_mqa gives the kv latent (its
# first kv_lora_rank outputs, normed by kv_a_layernorm, feed kv_b_proj) and the shared rope key. The first
# first_k_dense_replace layers have a dense MLP (mlp.{gate,up,down}_proj), the rest an MoE block: routed experts,
# shared_experts (no gate), and the router mlp.gate (grouped top-k) kept 16-bit with V3's correction bias.
_MLA_SEQUENTIAL = (
    ("self_attn.q_proj", "self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),  # input_layernorm's output
    ("self_attn.q_b_proj",),  # q_a_layernorm's output
    ("self_attn.kv_b_proj",),  # kv_a_layernorm's output
    ("self_attn.o_proj",),
)
_DEEPSEEK_SHARED = (("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"), ("mlp.shared_experts.down_proj",))
_MLA_SCALING = (
    ScalingGroup("input_layernorm", ("self_attn.q_proj", "self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
                 "norm", block="self_attn"),
    ScalingGroup("self_attn.q_a_layernorm", ("self_attn.q_b_proj",), "norm"),
    ScalingGroup("self_attn.kv_a_layernorm", ("self_attn.kv_b_proj",), "norm"),
    # o_proj reads the attention's values, made by kv_b_proj's value rows interleaved with its key rows per head:
    # no single op to fold into; AWQ clips and rounds it alone.
)
_MLA_NO_RUNTIME = ("multi-head latent attention (low-rank q/kv projections with kv_b_proj absorbed per head) and the "
                   "grouped top-k router are not implemented by quantkit's runtime")
_DEEPSEEK = dict(
    sequential=(*_MLA_SEQUENTIAL, *_LLAMA_SEQUENTIAL[2:], *_DEEPSEEK_SHARED),
    scaling=_MLA_SCALING + _llama_like_scaling("post_attention_layernorm")[2:],
    no_runtime=_MLA_NO_RUNTIME,
)
MLA_ARCHITECTURES: tuple[ArchSpec, ...] = (
    ArchSpec(family="deepseek_v2", model_types=("deepseek_v2",), **_DEEPSEEK,
             moe=MoESpec(shared_expert="shared_experts", scoring="softmax")),
    ArchSpec(family="deepseek_v3", model_types=("deepseek_v3",), **_DEEPSEEK,
             moe=MoESpec(shared_expert="shared_experts", scoring="sigmoid")),
)
ARCHITECTURES = ARCHITECTURES + MOE_ARCHITECTURES + MLA_ARCHITECTURES


def arch_for(model_type: str) -> ArchSpec | None:
    """The record for a ``config.model_type``, or None for an architecture without one."""
    for spec in ARCHITECTURES:
        if model_type in spec.model_types:
            return spec
    return None


def supported_model_types() -> list[str]:
    return sorted(t for spec in ARCHITECTURES for t in spec.model_types)


def require_arch(model_type: str) -> ArchSpec:
    spec = arch_for(model_type)
    if spec is None:
        raise QuantkitError(
            f"architecture {model_type!r} is not supported yet; supported: {', '.join(supported_model_types())}"
        )
    return spec


def is_linear_like(module: nn.Module) -> bool:
    """An ``nn.Linear`` or a packed linear (``QuantLinear``: in/out features and a ``qweight`` buffer)."""
    return isinstance(module, nn.Linear) or (
        hasattr(module, "in_features") and isinstance(getattr(module, "qweight", None), torch.Tensor)
    )


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder layers: the longest ``nn.ModuleList`` of same-class blocks that contain linears
    (plain or already packed)."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if getattr(module, "is_expert_list", False) or name.rpartition(".")[2] == "experts":
            continue  # a MoE block's experts (quantkit.moe.experts), not decoder layers
        classes = {type(child) for child in module}
        if len(classes) != 1:
            continue
        if not any(is_linear_like(m) for m in module[0].modules()):
            continue
        if best is None or len(module) > len(best[1]):
            best = (name, module)
    if best is None:
        raise QuantkitError(
            f"could not find decoder layers in {type(model).__name__}: no list of repeated blocks with linear layers"
        )
    return best


def find_linears(layer: nn.Module) -> dict[str, nn.Linear]:
    """All ``nn.Linear`` sub-modules of a decoder layer (the ones a method can quantize), by relative path."""
    return {name: m for name, m in layer.named_modules() if isinstance(m, nn.Linear)}


def find_linear_like(layer: nn.Module) -> dict[str, nn.Module]:
    """Plain and packed linears of a decoder layer, in module order, by relative path."""
    return {name: m for name, m in layer.named_modules() if is_linear_like(m)}


def sequential_groups(spec: ArchSpec | None, linears: dict[str, nn.Linear]) -> list[list[str]]:
    """Groups of linear names in true-sequential order; linears the record does not name come last."""
    if spec is None:
        return [[name] for name in linears]
    groups = [[n for n in group if n in linears] for group in spec.sequential]
    groups = [g for g in groups if g]
    named = {n for g in groups for n in g}
    groups += [[n] for n in linears if n not in named]
    return groups
