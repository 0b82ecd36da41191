"""What the runtime needs to know about a decoder, as one frozen record read from a Hugging Face config.

The families differ in a handful of facts (norm offset, sandwich norms, q/k norms, activation,
soft-capping, sliding windows, embedding scale); everything else is one decoder. The record is keyed
by ``model_type`` like :mod:`quantkit.arch`'s quantization records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quantkit.config import QuantkitError

LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3")
GEMMA_TYPES = ("gemma2", "gemma3_text")
# MoE families (quantkit.runtime.moe)
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
QK_NORMS = ("", "head", "full")
SUPPORTED_TYPES = LLAMA_TYPES + GEMMA_TYPES + MOE_TYPES


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and per-family facts of one decoder (``head_dim`` may differ from hidden / heads)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    max_position_embeddings: int
    tie_embeddings: bool
    qkv_bias: bool = False
    # RMSNorm of q and k before RoPE: "head" over each head (Qwen3, Gemma 3), "full" over the whole
    # projection, all heads at once (OLMoE: weights [heads * head_dim]), "" none
    qk_norm: str = ""
    clip_qkv: float = 0.0  # OLMoE: q (after its norm), k and v clamped to +-clip_qkv; 0: no clamp
    norm_offset: float = 0.0  # Gemma: RMSNorm multiplies by (1 + weight)
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and MLP too
    activation: str = "silu"  # or "gelu_tanh"
    embed_scale: float = 1.0  # Gemma: sqrt(hidden_size)
    attn_scale: float = 0.0  # softmax scale; 0: 1/sqrt(head_dim)
    attn_softcap: float = 0.0  # Gemma 2: tanh soft-capping of attention logits
    final_softcap: float = 0.0  # Gemma 2: of the output logits
    sliding_window: int = 0  # keys visible to a sliding layer: the last `sliding_window` positions
    sliding_layers: tuple[bool, ...] = ()
    num_experts: int = 0  # MoE: experts per block (0: dense)
    top_k: int = 0  # MoE: experts per token
    moe_renormalize: bool = True  # MoE: renormalize the top-k routing weights to sum to one

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_TYPES:
            raise QuantkitError(
                f"the runtime serves {', '.join(SUPPORTED_TYPES)}; this model is {self.model_type!r}"
            )
        if self.num_heads % self.num_kv_heads:
            raise QuantkitError(f"{self.num_heads} attention heads are not a multiple of {self.num_kv_heads} kv heads")
        if self.qk_norm not in QK_NORMS:
            raise QuantkitError(f"qk_norm {self.qk_norm!r} is not one of {QK_NORMS}")
        if self.activation not in ("silu", "gelu_tanh"):
            raise QuantkitError(f"activation {self.activation!r} is not one the runtime implements")
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise QuantkitError("sliding_layers must name every layer")

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    def window_left(self, layer: int) -> int:
        """Keys a query at position i sees on ``layer``: i - window_left .. i (-1: all)."""
        if self.sliding_window and self.sliding_layers and self.sliding_layers[layer]:
            return self.sliding_window - 1
        return -1

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def unsupported_message(model_type: str | None) -> str | None:
    """Why the runtime cannot run ``model_type`` and what works instead (None: it can)."""
    if model_type in SUPPORTED_TYPES:
        return None
    from quantkit.arch import arch_for

    spec = arch_for(model_type or "")
    if spec is not None and spec.no_runtime:
        return (f"{model_type}: {spec.no_runtime}, so generate, serve, verify and bench cannot run it. quantkit "
                "quantizes it and reads the checkpoint back: `quantkit eval perplexity CKPT` and `quantkit eval kld` "
                "run it through transformers' own modeling code; vLLM serves the checkpoint (docs/moe.md)")
    return f"the runtime serves {', '.join(SUPPORTED_TYPES)}; this model's model_type is {model_type!r}"


def hf_config(config: dict, trust_remote_code: bool = False):
    """The transformers config object for a ``config.json`` dict (normalizes rope and layer types).

    Multimodal Gemma 3 folders keep the decoder's config under ``text_config``.
    """
    from transformers import AutoConfig

    config = dict(config)
    config.pop("quantization_config", None)
    model_type = config.get("model_type")
    if model_type == "gemma3" and isinstance(config.get("text_config"), dict):
        config = {**config["text_config"], "model_type": "gemma3_text"}
        model_type = "gemma3_text"
    refusal = unsupported_message(model_type)
    if refusal:
        raise QuantkitError(refusal)
    fields = {k: v for k, v in config.items() if k != "model_type"}
    return AutoConfig.for_model(model_type, **fields)


def spec_from_config(cfg) -> ModelSpec:
    """The :class:`ModelSpec` of a transformers config object (see :func:`hf_config`)."""
    mt = cfg.model_type
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    gemma = mt in GEMMA_TYPES
    layer_types = tuple(getattr(cfg, "layer_types", None) or ())
    window = getattr(cfg, "sliding_window", None) or 0
    if mt in ("qwen2", "qwen2_moe", "qwen3_moe") and not getattr(cfg, "use_sliding_window", False):
        window = 0
    sliding = tuple(t == "sliding_attention" for t in layer_types) if window and layer_types else ()
    query_scalar = getattr(cfg, "query_pre_attn_scalar", None)
    return ModelSpec(
        model_type=mt,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim,
        rms_eps=getattr(cfg, "rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.max_position_embeddings,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=mt in ("qwen2", "qwen2_moe") or bool(getattr(cfg, "attention_bias", False)),
        qk_norm="head" if mt in ("qwen3", "gemma3_text", "qwen3_moe") else "full" if mt == "olmoe" else "",
        clip_qkv=float(getattr(cfg, "clip_qkv", None) or 0.0) if mt == "olmoe" else 0.0,
        norm_offset=1.0 if gemma else 0.0,
        sandwich_norms=gemma,
        activation="gelu_tanh" if gemma else "silu",
        embed_scale=math.sqrt(cfg.hidden_size) if gemma else 1.0,
        attn_scale=query_scalar**-0.5 if gemma and query_scalar else 0.0,
        attn_softcap=float(getattr(cfg, "attn_logit_softcapping", None) or 0.0) if gemma else 0.0,
        final_softcap=float(getattr(cfg, "final_logit_softcapping", None) or 0.0) if gemma else 0.0,
        sliding_window=window if sliding else 0,
        sliding_layers=sliding,
        num_experts=int(getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or 0)
        if mt in MOE_TYPES else 0,
        top_k=int(getattr(cfg, "num_experts_per_tok", 0) or 0) if mt in MOE_TYPES else 0,
        moe_renormalize=mt == "mixtral" or bool(getattr(cfg, "norm_topk_prob", True)),
    )


def rope_tables(cfg, spec: ModelSpec, device, max_len: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """float32 ``(cos, sin)`` tables ``[max_len, head_dim / 2]`` per layer type ("" when every layer shares one).

    The inverse frequencies come from transformers' own rope functions (Llama 3, linear, YaRN, ...),
    so the runtime rotates exactly as the reference model does.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    per_type = {k: v for k, v in params.items() if isinstance(v, dict)}
    if not per_type:
        per_type = {"": params}
    tables = {}
    positions = torch.arange(max_len, dtype=torch.float32)
    for layer_type, p in per_type.items():
        rope_type = p.get("rope_type", "default")
        kwargs = {"layer_type": layer_type} if layer_type else {}
        if rope_type == "default":
            dim = spec.head_dim
            inv_freq = 1.0 / (p["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            scaling = 1.0
        elif rope_type in ROPE_INIT_FUNCTIONS:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, None, **kwargs)
        else:
            raise QuantkitError(f"rope type {rope_type!r} is not supported by the runtime")
        freqs = positions[:, None] * inv_freq.float()[None, :]
        tables[layer_type] = ((freqs.cos() * scaling).to(device), (freqs.sin() * scaling).to(device))
    return tables


def layer_rope_key(cfg, layer: int, tables: dict) -> str:
    """Which rope table ``layer`` uses."""
    if "" in tables:
        return ""
    return cfg.layer_types[layer]
