"""Random runtimes of a Mixture-of-Experts shape, for ``quantkit bench --shape qwen3-30b-a3b``.

The dense shapes go through a transformers model (``bench.random_hf_model``) so that transformers' own
``generate`` runs on the same weights. A 30B-A3B MoE cannot: its bf16 model alone is 61 GB, three of them do not
fit a GPU one after the other in a reasonable time, and transformers 5 stores the experts as fused 3-D tensors
the INT4 and FP8 layouts split per expert. So the runtime is built straight from tensor names and shapes (a
transformers model on the meta device, its experts split as ``quantkit.moe.experts.unfuse_experts`` splits them
for the checkpoint writer) and random tensors drawn on the device as the loader asks for them:

- ``int4``: every decoder linear (attention, experts, a shared expert) as random packed GPTQ tensors, W4 g128 sym
  (the layout ``quantkit gptq`` writes), the experts through the fused MoE kernel;
- ``fp8``: the same linears as random e4m3 codes with per-channel scales (``quantkit fp8``'s default), the
  experts through the fused kernel's FP8 variant;
- ``bf16``: every tensor random bf16, the experts fused as transformers stores them.

Routers, norms, embeddings and the head stay 16-bit in all three. Values are scaled so that activations keep
their size through the layers (weights ~ 1/sqrt(fan_in)); serving speed does not depend on them otherwise.
"""

from __future__ import annotations

import torch

from quantkit.runtime.model import RuntimeModel
from quantkit.runtime.spec import hf_config, spec_from_config
from quantkit.runtime.weights import QuantInfo, load_weights

FORMATS = ("int4", "fp8", "bf16")
GROUP_SIZE = 128
# 2-D weights under the decoder layers that stay 16-bit in every format (as quantkit gptq / fp8 leave them)
_KEPT_16BIT = (".mlp.gate.weight", ".shared_expert_gate.weight", ".router.weight")


def is_moe_shape(config: dict) -> bool:
    return bool(config.get("num_experts") or config.get("num_local_experts"))


def tensor_shapes(config: dict, split_experts: bool) -> dict[str, torch.Size]:
    """Every tensor name of the model and its shape; ``split_experts``: per-expert linears (the checkpoint
    layout) instead of transformers 5's fused expert tensors."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(config), dtype=torch.bfloat16)
    if split_experts:
        from quantkit.moe.experts import unfuse_experts

        unfuse_experts(model)
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def _quantized(name: str, shape: torch.Size) -> bool:
    return name.startswith("model.layers.") and name.endswith(".weight") and len(shape) == 2 and not name.endswith(
        _KEPT_16BIT)


def random_tensors(shapes: dict[str, torch.Size], fmt: str, device, seed: int = 0):
    """``(source, names)`` for ``load_weights``: ``source(keys)`` draws the asked tensors on ``device``."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    gen = torch.Generator(device=device).manual_seed(seed)
    stored: dict[str, tuple[str, torch.Size]] = {}  # stored name -> (kind, shape of the linear's [N, K] weight)
    for name, shape in shapes.items():
        if fmt == "bf16" or not _quantized(name, shape):
            stored[name] = ("embed" if "embed_tokens" in name else "dense", shape)
            continue
        base = name.removesuffix(".weight")
        leaves = ("qweight", "qzeros", "scales", "g_idx") if fmt == "int4" else ("weight", "weight_scale")
        for leaf in leaves:
            stored[f"{base}.{leaf}"] = (f"{fmt}.{leaf}", shape)

    def draw(kind: str, shape: torch.Size) -> torch.Tensor:
        if kind in ("dense", "embed"):
            if len(shape) == 1:  # norms
                return torch.ones(shape, dtype=torch.bfloat16, device=device)
            std = 1.0 if kind == "embed" else shape[-1] ** -0.5
            return (torch.randn(shape, device=device, generator=gen) * std).to(torch.bfloat16)
        n, k = shape
        groups = -(-k // GROUP_SIZE)
        if kind == "int4.qweight":
            return torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device=device, generator=gen)
        if kind == "int4.qzeros":
            return torch.full((groups, n // 8), 0x77777777, dtype=torch.int32, device=device)  # zero 8, stored 7
        if kind == "int4.scales":  # codes - 8 have std ~4.6: weights ~ 1/sqrt(k)
            return (torch.rand(groups, n, device=device, generator=gen) * 0.43 / k**0.5).to(torch.float16)
        if kind == "int4.g_idx":
            return (torch.arange(k, device=device) // GROUP_SIZE).to(torch.int32)
        if kind == "fp8.weight":
            return torch.randn(n, k, device=device, generator=gen).clamp(-448, 448).to(torch.float8_e4m3fn)
        if kind == "fp8.weight_scale":
            return torch.full((n, 1), k ** -0.5, dtype=torch.float32, device=device)
        raise AssertionError(kind)

    def source(keys):
        return {key: draw(*stored[key]) for key in keys if key in stored}

    return source, set(stored)


def random_moe_runtime(config: dict, fmt: str, device, *, backend: str = "kernels", max_positions: int = 4096,
                       seed: int = 0, name: str = "moe") -> RuntimeModel:
    """A RuntimeModel of the MoE shape ``config`` (a config.json dict) in ``fmt`` with random weights."""
    device = torch.device(device)
    shapes = tensor_shapes(config, split_experts=fmt != "bf16")
    source, names = random_tensors(shapes, fmt, device, seed)
    cfg = hf_config(config)
    spec = spec_from_config(cfg)
    quant = QuantInfo(4, GROUP_SIZE, True) if fmt == "int4" else None
    weights = load_weights(source, names, spec, quant, torch.bfloat16, device, packed_kernel=backend == "kernels")
    return RuntimeModel(spec, cfg, weights, backend=backend, dtype=torch.bfloat16, device=device,
                        max_positions=max_positions, name=name)
