"""The quantized linears of a checkpoint as the runtime runs them, in layer order, for ``inspect --kernels``.

The runtime (``quantkit.runtime.weights.fused_linear``) concatenates q/k/v into one ``qkv_proj`` GEMM and
gate/up into one ``gate_up_proj`` when their packed words line up (bits dividing 32, output sizes a
whole number of words) and they share one ``g_idx``; otherwise it keeps them apart. This module applies
the same rule to the checkpoint's headers (reading the ``g_idx`` tensors only for act-order checkpoints)
and sorts names the way people count layers (0, 1, 2, ..., 10), so the rows match what runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

# (parent module, the runtime's group in output order, the fused row's name)
FUSED_GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
                ("mlp", ("gate_proj", "up_proj"), "gate_up_proj"))

Layer = tuple  # (name, out_features, in_features, bits, group_size, sym, act_order)


def natural_key(name: str) -> tuple:
    """``model.layers.10.mlp`` after ``model.layers.9.mlp``: digit runs compare as numbers."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def _words_line_up(parts: list[Layer]) -> bool:
    bits = parts[0][3]
    per_word = 32 // bits if 32 % bits == 0 else 0
    return bool(per_word) and all(p[1] % per_word == 0 for p in parts)


def fuse_as_runtime(layers: list[Layer], same_g_idx: Callable[[list[str]], bool] = lambda names: True) -> list[Layer]:
    """``layers`` with each complete q/k/v and gate/up group that the runtime fuses as one row, sorted
    in layer order. ``same_g_idx(names)`` says whether those linears share one ``g_idx``."""
    by_name = {layer[0]: layer for layer in layers}
    out, used = [], set()
    for name in sorted(by_name, key=natural_key):
        if name in used:
            continue
        parent, _, leaf = name.rpartition(".")
        fused = None
        for group_parent, members, fused_name in FUSED_GROUPS:
            if parent.rpartition(".")[2] != group_parent or leaf not in members:
                continue
            names = [f"{parent}.{m}" for m in members]
            parts = [by_name.get(n) for n in names]
            if all(parts) and len({p[2:] for p in parts}) == 1 and _words_line_up(parts) and same_g_idx(names):
                first = parts[0]
                fused = (f"{parent}.{fused_name}", sum(p[1] for p in parts), *first[2:])
                used.update(names)
        out.append(fused or by_name[name])
    return sorted(out, key=lambda layer: natural_key(layer[0]))


def checkpoint_g_idx_reader(path: str | Path) -> Callable[[list[str]], bool]:
    """``same_g_idx`` for a checkpoint folder: compares the stored ``g_idx`` tensors."""
    import torch
    from safetensors import safe_open

    from quantkit.checkpoint.read import weight_files

    where: dict[str, Path] = {}
    for file in weight_files(Path(path)):
        with safe_open(str(file), framework="pt") as f:
            where.update({key: file for key in f.keys() if key.endswith(".g_idx")})

    def read(name: str):
        key = f"{name}.g_idx"
        if key not in where:
            return None
        with safe_open(str(where[key]), framework="pt") as f:
            return f.get_tensor(key)

    def same(names: list[str]) -> bool:
        tensors = [read(n) for n in names]
        if any(t is None for t in tensors):
            return all(t is None for t in tensors)
        return all(torch.equal(t, tensors[0]) for t in tensors[1:])

    return same


def runtime_layers(path: str | Path) -> list[Layer]:
    """The checkpoint's quantized linears as the runtime runs them (fused groups as one row), in layer order."""
    from quantkit.checkpoint.save import inspect_checkpoint

    info = inspect_checkpoint(path)
    layers = [(name, out_f, in_f, info.bits, info.group_size, info.sym, info.desc_act)
              for name, in_f, out_f, _ in info.quantized]
    same = checkpoint_g_idx_reader(path) if info.desc_act else (lambda names: True)
    return fuse_as_runtime(layers, same)


def gpu_target() -> tuple[str, str | None, str]:
    """(arch whose selection to show, the GPU's name or None, words naming it truthfully): this machine's GPU when
    it has one, else the H200 (sm90) table the shipped selections were measured on."""
    try:
        import torch

        from quantkit.kernels.device_info import gpu_arch, gpu_card

        if torch.cuda.is_available():
            arch, name = gpu_arch("cuda"), gpu_card("cuda")  # the names the runtime's plans are made with
            return arch, name, f"on this machine's {name} ({arch})"
    except Exception:  # no usable CUDA: say so below
        pass
    return "sm90", "NVIDIA H200", "the H200 (sm90) selection it would use; no GPU on this machine"
