"""The runtime's weights: one record per decoder layer, linears fused at load time.

A linear is either 16-bit (``dense [N, K]``) or packed for the W4A16 kernel (``packed``, a
``W4A16Weights``). q/k/v become one linear and gate/up another: packed tensors are concatenated
along N when their ``g_idx`` agree (otherwise the parts stay separate and their outputs are
concatenated). The reference backend dequantizes packed linears once at load time (float math
identical to :class:`quantkit.qlinear.QuantLinear`'s torch path) so the CPU never unpacks per token.

Tensors are read layer by layer from safetensors (``TensorSource``), so an 8B checkpoint never sits
in host memory as a whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from quantkit.config import QuantkitError
from quantkit.runtime.linear import Linear
from quantkit.runtime.spec import ModelSpec


@dataclass
class LayerWeights:
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    input_norm: torch.Tensor
    post_attn_norm: torch.Tensor  # Llama: the MLP's input norm; Gemma: the attention output's norm
    pre_ff_norm: torch.Tensor | None = None  # Gemma: the MLP's input norm
    post_ff_norm: torch.Tensor | None = None  # Gemma: the MLP output's norm
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    moe: object | None = None  # quantkit.runtime.moe.MoELayer: this layer's MLP is a MoE block (gate_up/down None)


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: Linear

    def linears(self) -> list[Linear]:
        """Every linear, the parts of split ones included."""
        top = [self.lm_head] + [lin for layer in self.layers for lin in _layer_linears(layer)]
        return top + [part for lin in top for part in lin.parts]

    def nbytes(self) -> int:
        """Bytes one decode step reads from the weights (embedding row excluded)."""
        total = self.lm_head.nbytes()
        for layer in self.layers:
            total += sum(lin.nbytes() for lin in (layer.qkv, layer.o, layer.gate_up, layer.down) if lin is not None)
            total += layer.moe.nbytes_per_token() if layer.moe is not None else 0
        return total


def _layer_linears(layer: LayerWeights) -> list[Linear]:
    lins = [layer.qkv, layer.o, layer.gate_up, layer.down]
    if layer.moe is not None:
        lins += [layer.moe.shared_gate_up, layer.moe.shared_down]
    return [lin for lin in lins if lin is not None]


@dataclass(frozen=True)
class QuantInfo:
    """The packed layout of a quantized checkpoint (None for a 16-bit model)."""

    bits: int
    group_size: int
    sym: bool


# A function from tensor names to CPU tensors (the names it was asked for; missing ones absent).
TensorSource = Callable[[list[str]], dict[str, torch.Tensor]]


def _linear(get: dict, name: str, quant: QuantInfo | None, dtype, device, packed_kernel: bool,
            fp8: str = "auto") -> Linear:
    """One linear from the tensors of ``name`` (``.weight`` or ``.qweight`` & co), on ``device``. FP8 weights
    (``.weight`` e4m3 with ``.weight_scale``): ``fp8`` "auto" (FP8 GEMM where supported), "reference" (the float32
    emulation) or "dequantize" (16-bit dense, the same weights)."""
    bias = get.get(f"{name}.bias")
    bias = None if bias is None else bias.to(device=device, dtype=dtype)
    if f"{name}.weight_scale" in get:
        from quantkit.runtime.fp8_weights import fp8_linear_from

        return fp8_linear_from(get, name, bias, dtype, device, fp8)
    if f"{name}.qweight" in get:
        if quant is None:
            raise QuantkitError(f"{name} is packed but the checkpoint names no quantization scheme")
        qweight, qzeros = get[f"{name}.qweight"].to(device), get[f"{name}.qzeros"].to(device)
        scales, g_idx = get[f"{name}.scales"].to(device), get[f"{name}.g_idx"].to(device)
        n = qweight.shape[1]
        if packed_kernel:
            from quantkit.kernels.dispatch import bind
            from quantkit.kernels.w4a16_weights import prepare_w4a16_weights

            # the kernels' repack on any device (the CPU's reference reads it too), bound to its launchers on CUDA
            prepared = bind(prepare_w4a16_weights(qweight, qzeros, scales, g_idx, quant.bits, quant.group_size,
                                                  quant.sym))
            return Linear(n, packed=prepared, bias=bias)
        from quantkit.qtensor import QuantizedWeight

        k = qweight.shape[0] * 32 // quant.bits
        qw = QuantizedWeight(qweight, qzeros, scales, g_idx, quant.bits, quant.group_size, quant.sym, k, n)
        return Linear(n, dense=qw.dequantize(device).to(dtype), bias=bias)
    if f"{name}.weight" not in get:
        raise QuantkitError(f"the checkpoint lacks {name}.weight (or {name}.qweight); is it complete?")
    weight = get[f"{name}.weight"].to(device=device, dtype=dtype)
    return Linear(weight.shape[0], dense=weight, bias=bias)


def _can_concat_packed(get: dict, names: list[str], quant: QuantInfo) -> bool:
    per_word = 32 // quant.bits if 32 % quant.bits == 0 else 0
    if not per_word:
        return False
    first = get[f"{names[0]}.g_idx"]
    return all(torch.equal(get[f"{n}.g_idx"], first) and get[f"{n}.qweight"].shape[1] % per_word == 0 for n in names)


def fused_linear(get: dict, names: list[str], quant: QuantInfo | None, dtype, device, packed_kernel: bool,
                 fp8: str = "auto") -> Linear:
    """One linear whose output is the concatenation of ``names``' outputs (q/k/v or gate/up)."""
    if len(names) == 1:
        return _linear(get, names[0], quant, dtype, device, packed_kernel, fp8)
    if any(f"{n}.weight_scale" in get for n in names):
        from quantkit.runtime.fp8_weights import fused_fp8_linear

        return fused_fp8_linear(get, names, dtype, device, fp8)
    packed = [f"{n}.qweight" in get for n in names]
    biases = [get.get(f"{n}.bias") for n in names]
    if any(b is not None for b in biases) and any(b is None for b in biases):
        return Linear(0, parts=[_linear(get, n, quant, dtype, device, packed_kernel) for n in names])
    if all(packed) and packed_kernel and _can_concat_packed(get, names, quant):
        merged = {
            f"cat.{part}": torch.cat([get[f"{n}.{part}"] for n in names], dim=1)
            for part in ("qweight", "qzeros", "scales")
        }
        merged["cat.g_idx"] = get[f"{names[0]}.g_idx"]
        if biases[0] is not None:
            merged["cat.bias"] = torch.cat(biases)
        return _linear(merged, "cat", quant, dtype, device, packed_kernel)
    if all(packed) and packed_kernel:  # g_idx differ: keep the GEMMs apart
        parts = [_linear(get, n, quant, dtype, device, packed_kernel) for n in names]
        return Linear(sum(p.out_features for p in parts), parts=parts)
    parts = [_linear(get, n, quant, dtype, device, False) for n in names]
    bias = None if biases[0] is None else torch.cat([p.bias for p in parts])
    dense = torch.cat([p.dense for p in parts])
    return Linear(dense.shape[0], dense=dense, bias=bias)


def _norm(get: dict, name: str, device) -> torch.Tensor:
    if name not in get:
        raise QuantkitError(f"the checkpoint lacks {name}; is it complete?")
    return get[name].to(device=device, dtype=torch.float32)  # norms compute in float32


def layer_keys(prefix: str, available: set[str]) -> list[str]:
    return [k for k in available if k.startswith(prefix)]


def load_layer(
    source: TensorSource,
    available: set[str],
    prefix: str,
    spec: ModelSpec,
    quant: QuantInfo | None,
    dtype,
    device,
    packed_kernel: bool,
    fp8: str = "auto",
) -> LayerWeights:
    """The weights of the decoder layer whose tensor names start with ``prefix`` (``model.layers.3.``)."""
    get = {k[len(prefix) :]: v for k, v in source(layer_keys(prefix, available)).items()}
    a, m = "self_attn.", "mlp."
    lin = dict(quant=quant, dtype=dtype, device=device, packed_kernel=packed_kernel, fp8=fp8)
    moe = None
    if spec.num_experts:  # MoE experts: INT4, FP8 or 16-bit
        from quantkit.runtime.moe import is_moe_layer, load_moe

        moe = (load_moe(get, spec, quant=quant, dtype=dtype, device=device, packed_kernel=packed_kernel,
                        fused_linear=fused_linear) if is_moe_layer(get) else None)
    layer = LayerWeights(
        qkv=fused_linear(get, [f"{a}q_proj", f"{a}k_proj", f"{a}v_proj"], **lin),
        o=fused_linear(get, [f"{a}o_proj"], **lin),
        gate_up=None if moe else fused_linear(get, [f"{m}gate_proj", f"{m}up_proj"], **lin),
        down=None if moe else fused_linear(get, [f"{m}down_proj"], **lin),
        moe=moe,
        input_norm=_norm(get, "input_layernorm.weight", device),
        post_attn_norm=_norm(get, "post_attention_layernorm.weight", device),
    )
    if spec.sandwich_norms:
        layer.pre_ff_norm = _norm(get, "pre_feedforward_layernorm.weight", device)
        layer.post_ff_norm = _norm(get, "post_feedforward_layernorm.weight", device)
    if spec.qk_norm:
        layer.q_norm = _norm(get, f"{a}q_norm.weight", device)
        layer.k_norm = _norm(get, f"{a}k_norm.weight", device)
    return layer


def find_prefix(available: set[str]) -> str:
    """The prefix in front of ``embed_tokens.weight`` (``model.`` for most causal LMs)."""
    for key in available:
        if key.endswith("embed_tokens.weight"):
            return key[: -len("embed_tokens.weight")]
    raise QuantkitError("no embed_tokens.weight among the tensors: not a decoder checkpoint the runtime reads")


def load_weights(
    source: TensorSource,
    available: set[str],
    spec: ModelSpec,
    quant: QuantInfo | None,
    dtype,
    device,
    packed_kernel: bool,
    on_layer: Callable[[int], None] | None = None,
    fp8: str = "auto",
) -> ModelWeights:
    """Every weight the runtime needs, layer by layer (``on_layer(i)`` after each: progress). ``fp8``: how FP8
    linears run (see :func:`_linear`)."""
    prefix = find_prefix(available)
    head_prefix = prefix[: -len("model.")] if prefix.endswith("model.") else ""
    embed = source([f"{prefix}embed_tokens.weight"])[f"{prefix}embed_tokens.weight"].to(device=device, dtype=dtype)
    layers = []
    for i in range(spec.num_layers):
        layers.append(load_layer(source, available, f"{prefix}layers.{i}.", spec, quant, dtype, device, packed_kernel,
                                 fp8))
        if on_layer is not None:
            on_layer(i)
    final = source([f"{prefix}norm.weight"])
    head_name = f"{head_prefix}lm_head"
    head_keys = [k for k in available if k.startswith(head_name + ".")]
    if head_keys and not spec.tie_embeddings:
        lm_head = _linear(source(head_keys), head_name, quant, dtype, device, packed_kernel, fp8)
    else:
        lm_head = Linear(embed.shape[0], dense=embed)
    return ModelWeights(
        embed=embed, layers=layers, final_norm=_norm(final, f"{prefix}norm.weight", device), lm_head=lm_head
    )
