"""Experts as one ``nn.Linear`` per projection, so the walker, the methods and the checkpoint see them.

transformers 5 stores a MoE block's experts as two fused 3-D parameters (``experts.gate_up_proj``
``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``) that no ``nn.Linear`` search finds.
``unfuse_experts`` replaces each such module by :class:`SeparateExperts`: ``E`` small MLPs whose linears
carry the family's own per-expert names (``experts.{e}.gate_proj``/``up_proj``/``down_proj``, or
Mixtral's ``w1``/``w3``/``w2``), the names vLLM's fused-MoE loader maps. Its ``forward`` has the fused
module's signature ``(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` and computes
the same sum; a model built on the meta device (the reader) is unfused the same way.

Calibration (``quantkit.methods.moe``) sets ``observer``: it is called with each expert's inputs, and
with ``mode == "all"`` every token goes through every expert (one expert at a time, so the intermediate
``[T, 2I]`` stays bounded) while the output still sums only the routed experts. ``routed_tokens [E]``
counts the (token, expert) routings seen while an observer is set.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# observer(expert or None, kind, x): kind "in" (the input of gate/up; expert None: every expert's, "all"
# mode) or "down_in" (the input of expert e's down projection).
Observer = Callable[[int | None, str, torch.Tensor], None]


class ExpertMLP(nn.Module):
    """One expert: ``down(act(gate(x)) * up(x))`` with the family's linear names."""

    def __init__(self, names: tuple[str, str, str], hidden: int, inter: int, act: nn.Module,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.names = names
        # weights left uninitialised: their values are copied in (split_fused) or read from the checkpoint. A
        # default nn.Linear draws kaiming-uniform values first: 3.0 s against 0.4 s a Qwen3-30B-A3B layer on two
        # CPU cores, minutes thrown away for the 48 layers of a model held in memory (bench/moe_unfuse_time.py)
        for name, (n_in, n_out) in zip(names, ((hidden, inter), (hidden, inter), (inter, hidden))):
            setattr(self, name, nn.utils.skip_init(nn.Linear, n_in, n_out, bias=False, dtype=dtype, device=device))
        self.act_fn = act

    def linears(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        return tuple(getattr(self, n) for n in self.names)  # type: ignore[return-value]

    def hidden_act(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, _ = self.linears()
        return self.act_fn(gate(x)) * up(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linears()[2](self.hidden_act(x))


class SeparateExperts(nn.ModuleList):
    """``E`` :class:`ExpertMLP` s behind the fused experts' call signature (see the module docstring)."""

    is_expert_list = True  # ``quantkit.arch.find_decoder_layers`` never takes these for decoder layers

    def __init__(self, experts: list[ExpertMLP]) -> None:
        super().__init__(experts)
        self.num_experts = len(experts)
        self.observer: Observer | None = None
        self.mode = "routed"  # or "all" (calibration only)
        self.routed_tokens = torch.zeros(len(experts), dtype=torch.long)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        # hidden_states [T, H]; top_k_index, top_k_weights [T, k]
        out = torch.zeros_like(hidden_states)
        if self.observer is not None:
            self.routed_tokens += torch.bincount(top_k_index.reshape(-1).cpu(), minlength=self.num_experts)
        if self.mode == "all":
            return self._all_experts(hidden_states, top_k_index, top_k_weights, out)
        for e in torch.unique(top_k_index).tolist():
            token, slot = torch.where(top_k_index == e)
            x = hidden_states[token]  # [t_e, H]
            y = self._expert(e, x)
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        expert = self[e]
        if self.observer is not None:
            self.observer(e, "in", x)
        h = expert.hidden_act(x)
        if self.observer is not None:
            self.observer(e, "down_in", h)
        return expert.linears()[2](h)

    def _all_experts(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     out: torch.Tensor) -> torch.Tensor:
        """Every token through every expert, one expert at a time (so the intermediates stay ``[T, 2I]``);
        only the routed rows are summed. Each expert's linears are called as modules on all tokens, so hooks
        on them (AWQ's capture) see every token."""
        if self.observer is not None:
            self.observer(None, "in", x)
        # weight of expert e for each token (0 where not routed): [T, E]
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=top_k_weights.dtype, device=x.device)
        dense.scatter_(1, top_k_index, top_k_weights)
        for e in range(self.num_experts):
            h = self[e].hidden_act(x)  # [T, I]
            if self.observer is not None:
                self.observer(e, "down_in", h)
            routed = dense[:, e] != 0
            down = self[e].linears()[2]
            if self.observer is None:  # hooks on down (AWQ's capture) see all tokens; the routed rows are kept.
                # torch.where, not a boolean index: indexing by a mask reads its count on the host, a sync per
                # expert (AWQ's scale search runs this block for each of its candidates)
                y = (down(h) * dense[:, e, None]).to(out.dtype)
                out += torch.where(routed[:, None], y, 0.0)
            else:  # the observer already has down's input: run it on the routed rows only (E/k less work)
                y = down(h[routed])
                out[routed] += (y * dense[routed, e, None]).to(out.dtype)
        return out


def _fused_children(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules holding fused 3-D expert weights (``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``)."""
    found = []
    for name, module in model.named_modules():
        gu = module._parameters.get("gate_up_proj")
        down = module._parameters.get("down_proj")
        if gu is not None and down is not None and gu.dim() == 3 and down.dim() == 3:
            found.append((name, module))
    return found


def has_fused_experts(model: nn.Module) -> bool:
    return bool(_fused_children(model))


@torch.no_grad()
def split_fused(module: nn.Module, names: tuple[str, str, str]) -> SeparateExperts:
    """A :class:`SeparateExperts` holding ``module``'s fused weights (copied, or meta on the meta device)."""
    gu, down = module.gate_up_proj, module.down_proj  # [E, 2I, H], [E, H, I]
    if getattr(module, "has_bias", False) or getattr(module, "gate_up_proj_bias", None) is not None:
        from quantkit.config import QuantkitError

        raise QuantkitError(f"{type(module).__name__}: experts with biases are not supported")
    n, two_inter, hidden = gu.shape
    inter = two_inter // 2
    if tuple(down.shape) != (n, hidden, inter):
        from quantkit.config import QuantkitError

        raise QuantkitError(f"{type(module).__name__}: down_proj {tuple(down.shape)} does not match gate_up_proj "
                            f"{tuple(gu.shape)} (expected [E, H, I] = {[n, hidden, inter]})")
    act = module.act_fn
    experts = []
    for e in range(n):
        expert = ExpertMLP(names, hidden, inter, act, gu.dtype, gu.device)
        gate, up, dn = expert.linears()
        if not gu.is_meta:
            gate.weight.copy_(gu[e, :inter])  # transformers: gate, up = linear(x, gate_up_proj[e]).chunk(2)
            up.weight.copy_(gu[e, inter:])
            dn.weight.copy_(down[e])
        experts.append(expert)
    return SeparateExperts(experts)


def unfuse_experts(model: nn.Module, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> list[str]:
    """Replace every fused experts module in ``model`` by :class:`SeparateExperts` (in place); returns their
    names. ``names``: the family's per-expert (gate, up, down) linear names."""
    done = []
    for name, module in _fused_children(model):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, split_fused(module, names))
        done.append(name)
    return done


def find_separate_experts(layer: nn.Module) -> dict[str, SeparateExperts]:
    """The :class:`SeparateExperts` modules of a decoder layer, by relative path."""
    return {name: m for name, m in layer.named_modules() if isinstance(m, SeparateExperts)}
