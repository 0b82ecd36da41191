"""The runtime's MoE block: router, top-k, the experts (fused W4A16 or 16-bit kernel), shared expert.

Read from either expert layout: per-expert tensors (``{block}.experts.{e}.{gate,up,down}`` with
``.qweight``/``.weight``; Mixtral's ``w1``/``w3``/``w2``), as quantkit and GPTQ tools write them, or the
fused 3-D ``{block}.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` of a transformers-5 state
dict. The block is ``mlp`` or ``block_sparse_moe``. Routing follows the family (``ModelSpec``): softmax
over the router logits (float32), top-k, renormalized when ``moe_renormalize``; Qwen2-MoE adds a shared
expert scaled by ``sigmoid(shared_expert_gate(x))``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.config import QuantkitError
from quantkit.runtime.spec import ModelSpec

_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


@dataclass
class MoELayer:
    router: torch.Tensor  # [E, H]
    experts: object  # quantkit.kernels.moe_w4a16.MoEExperts
    top_k: int
    renormalize: bool
    use_kernel: bool
    shared_gate_up: object | None = None  # runtime Linear [2I_s, H]
    shared_down: object | None = None
    shared_gate: torch.Tensor | None = None  # [1, H]
    act_quant: object | None = None  # FP8 experts: the activations' e4m3 rounding (quantkit.runtime.fp8_weights)
    # the fused router's arrival counter (kernels/moe_router.py): one int32 zero on the router's device, made once
    # here so that a CUDA graph captures no fill of it
    router_counter: torch.Tensor | None = None
    # the decode GEMV's arrival counters (kernels/moe_gemv.py: counters_for), made once for the same reason (also
    # where the reference serves: the runtime may switch use_kernel after loading)
    gemv_counters: torch.Tensor | None = None
    _ref: tuple | None = None  # dequantized experts for the reference path (made once)

    def __post_init__(self) -> None:
        if self.router_counter is None:
            self.router_counter = torch.zeros(1, dtype=torch.int32, device=self.router.device)
        if self.gemv_counters is None:
            from quantkit.kernels.moe_gemv import counters_for

            self.gemv_counters = torch.zeros(counters_for(self.experts), dtype=torch.int32, device=self.router.device)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights and expert ids ``[M, k]`` (softmax in float32, top-k, optional renormalization)."""
        from quantkit.kernels.moe_align import route_ref

        return route_ref(torch.nn.functional.linear(x, self.router), self.top_k, self.renormalize)

    def normed(self, delta: torch.Tensor, residual: torch.Tensor | None, norm: torch.Tensor, eps: float,
               offset: float, add_rms_norm, act_mul, parts: bool = False):
        """``(block(rms_norm(delta + residual)), delta + residual)``: the pre-norm (``add_rms_norm``, the backend's)
        then the block, or, where the fused router serves (unless ``QUANTKIT_MOE_NORM_ROUTER=apart``), the norm
        inside the router's launch (``moe_router.norm_router_route_and_align``: one launch fewer a layer).
        ``parts``: the caller's next norm takes ``decoder_ops.RowParts``; where the kernels serve and no shared
        expert is added, the block's output may be its unsummed rows (:meth:`__call__`)."""
        from quantkit.kernels.moe_router import norm_router_selected

        # the switch first: where it says apart, the block's own call decides its routing once, below
        if norm_router_selected() and self.use_kernel and self.act_quant is None \
                and self._routing(delta.shape[0]) == "router":
            from quantkit.kernels.moe_align import BLOCK_M
            from quantkit.kernels.moe_router import norm_router_route_and_align
            from quantkit.kernels.moe_w4a16 import fused_moe

            x, summed, weights, ids, aligned = norm_router_route_and_align(
                delta, residual, norm, eps, offset, self.router, self.top_k, self.renormalize, self.router_counter,
                BLOCK_M, self._router_lays_out(delta.shape[0]))
            y = fused_moe(x, weights, ids, self.experts, aligned=aligned, counters=self.gemv_counters,
                          parts=self._parts(parts))
            return self._with_shared(x, y, act_mul), summed
        x, summed = add_rms_norm(delta, residual, norm, eps, offset)
        return self(x, act_mul, parts), summed

    def __call__(self, x: torch.Tensor, act_mul, parts: bool = False):
        """The block's output on the normed rows ``x``: a tensor ``[M, H]``, or with ``parts`` (a caller whose next
        norm sums them, :meth:`normed`) possibly ``decoder_ops.RowParts``."""
        from quantkit.kernels.moe_align import BLOCK_M, route_and_align
        from quantkit.kernels.moe_router import router_route_and_align
        from quantkit.kernels.moe_w4a16 import fused_moe, fused_moe_ref

        if self.use_kernel and self.act_quant is None:
            parts = self._parts(parts)
            routing = self._routing(x.shape[0])
            if routing == "router":
                # a decode batch of a few tokens: the router GEMM, routing and layout in one launch
                weights, ids, aligned = router_route_and_align(x, self.router, self.top_k, self.renormalize,
                                                               self.router_counter, BLOCK_M,
                                                               self._router_lays_out(x.shape[0]))
                y = fused_moe(x, weights, ids, self.experts, aligned=aligned, counters=self.gemv_counters,
                              parts=parts)
            elif routing == "align":
                # decode-sized: routing and the pairs' layout in one launch (kernels/moe_align.py says why)
                logits = torch.nn.functional.linear(x, self.router)
                weights, ids, aligned = route_and_align(logits, self.top_k, self.renormalize)
                y = fused_moe(x, weights, ids, self.experts, aligned=aligned, counters=self.gemv_counters,
                              parts=parts)
            else:
                weights, ids = self.route(x)
                y = fused_moe(x, weights, ids, self.experts, counters=self.gemv_counters, parts=parts)
        else:  # the reference (and FP8 experts off the kernel path: their activation rounding emulated)
            weights, ids = self.route(x)
            y = fused_moe_ref(x, weights, ids, self._reference_experts(), self.act_quant)
        return self._with_shared(x, y, act_mul)

    def _parts(self, wanted: bool) -> bool:
        """Whether the kernels leave the routed rows unsummed: asked for, and no shared expert to add to their sum."""
        return wanted and self.shared_gate_up is None

    def _router_lays_out(self, tokens: int) -> bool:
        """Whether the fused router also writes the pairs' layout for ``tokens`` tokens: not where the decode GEMV
        serves them (it reads none)."""
        from quantkit.kernels.moe_w4a16 import decode_kernel

        return decode_kernel(self.experts, tokens * self.top_k) != "gemv"

    def _with_shared(self, x: torch.Tensor, y: torch.Tensor, act_mul) -> torch.Tensor:
        """``y`` plus the shared expert's output on ``x`` (gated where the family gates it)."""
        if self.shared_gate_up is not None:
            s = self.shared_down(act_mul(self.shared_gate_up(x), "silu"))
            if self.shared_gate is None:
                y = y + s
            elif self.use_kernel:  # the gate, its sigmoid and the sum in one launch (kernels/decoder_ops.py)
                from quantkit.kernels.decoder_ops import add_sigmoid_gated

                y = add_sigmoid_gated(y, s, x, self.shared_gate)
            else:
                from quantkit.kernels.decoder_ops_ref import add_sigmoid_gated_ref

                y = add_sigmoid_gated_ref(y, s, x, self.shared_gate)
        return y

    def _routing(self, tokens: int) -> str:
        """How the kernel path routes ``tokens`` rows: "router" (a decode batch of a few tokens: the router GEMM,
        routing and the pairs' layout in one launch), "align" (routing and layout in one launch after the router
        GEMM), or "plain"."""
        from quantkit.kernels.moe_align import align_in_one_program
        from quantkit.kernels.moe_router import router_fused_selected

        n_exp, device = self.experts.num_experts, self.router.device
        if router_fused_selected(tokens, self.top_k, n_exp, device):
            return "router"
        return "align" if align_in_one_program(tokens * self.top_k, n_exp, device) else "plain"

    def kernel_label(self, tokens: int) -> str:
        """Which kernel serves the experts of ``tokens`` rows, as :meth:`__call__` and ``fused_moe`` decide it (for
        bench records): the decode GEMV (its maths for 4-bit experts and its config), the tiled kernel (its tiles),
        or the reference."""
        from quantkit.kernels import moe_gemv
        from quantkit.kernels.moe_w4a16 import decode_kernel, tile_config

        if not (self.use_kernel and self.act_quant is None):
            return "reference"
        pairs = tokens * self.top_k
        if decode_kernel(self.experts, pairs) == "gemv":
            cfg = moe_gemv.gemv_config(self.experts, pairs)
            math = f" {moe_gemv.gemv_math()}" if self.experts.quantized else ""
            return f"gemv{math} {cfg.block_n} cols/{cfg.num_warps}w/{cfg.target_programs} programs"
        t = tile_config(self.experts, pairs, aligned=self._routing(tokens) != "plain")
        return f"tiles {t.block_m}x{t.block_n}/{t.num_warps}w/{t.num_stages} stages"

    def _reference_experts(self):
        if self._ref is None:
            from quantkit.kernels.moe_w4a16 import stack_dense

            w13, w2 = self.experts.dequantized()  # float32, once (the CPU never unpacks per token)
            self._ref = (stack_dense(w13, w2),)
        return self._ref[0]

    def nbytes_per_token(self) -> int:
        """Bytes one decode token reads: its k experts' weights, the router, the shared expert."""
        per_expert = self.experts.nbytes() // self.experts.num_experts
        total = self.top_k * per_expert + self.router.numel() * self.router.element_size()
        for lin in (self.shared_gate_up, self.shared_down):
            total += lin.nbytes() if lin is not None else 0
        return total


def _block(get: dict) -> str | None:
    for block in ("mlp", "block_sparse_moe"):
        if f"{block}.gate.weight" in get and any(k.startswith(f"{block}.experts.") for k in get):
            return block
    return None


def is_moe_layer(get: dict) -> bool:
    return _block(get) is not None


def load_moe(get: dict, spec: ModelSpec, quant, dtype, device, packed_kernel: bool, fused_linear) -> MoELayer:
    """The MoE block of one decoder layer from its tensors ``get`` (names relative to the layer); ``fused_linear``:
    the dense loader's builder of one (fused) linear, for the shared expert (passed in, so weights -> moe is the
    only import between the two)."""
    from quantkit.kernels.moe_w4a16 import stack_dense, stack_quantized

    block = _block(get)
    ex = f"{block}.experts."
    act_quant = None
    if f"{ex}gate_up_proj" in get:  # transformers 5's fused 16-bit experts
        experts = stack_dense(get[f"{ex}gate_up_proj"].to(device, dtype), get[f"{ex}down_proj"].to(device, dtype))
    else:
        names = next((n for n in _NAMES if f"{ex}0.{n[0]}.qweight" in get or f"{ex}0.{n[0]}.weight" in get), None)
        if names is None:
            raise QuantkitError(f"{block}.experts: no per-expert gate/up/down tensors found")
        n = spec.num_experts
        if f"{ex}0.{names[0]}.qweight" in get:
            if quant is None or quant.bits != 4:
                raise QuantkitError("the runtime's MoE kernel serves 4-bit experts")
            from quantkit.qtensor import QuantizedWeight

            def qw(name: str) -> QuantizedWeight:
                t = {leaf: get[f"{name}.{leaf}"] for leaf in ("qweight", "qzeros", "scales", "g_idx")}
                k, nout = t["qweight"].shape[0] * 8, t["qweight"].shape[1]
                return QuantizedWeight(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, quant.group_size,
                                       quant.sym, k, nout)

            experts = stack_quantized([tuple(qw(f"{ex}{e}.{lin}") for lin in names) for e in range(n)], dtype,
                                      device)
        elif packed_kernel and f"{ex}0.{names[0]}.weight_scale" in get:  # FP8 experts, kept e4m3 for the kernel
            from quantkit.kernels.moe_w4a16 import stack_fp8
            from quantkit.runtime.fp8_weights import fp8_expert_records

            experts = stack_fp8(fp8_expert_records(get, ex, n, names), device)
        else:
            if f"{ex}0.{names[0]}.weight_scale" in get:  # FP8 experts: their 16-bit values, activations emulated
                from quantkit.runtime.fp8_weights import fp8_expert_weights

                weight, act_quant = fp8_expert_weights(get, ex, n, names)
            else:
                def weight(name: str) -> torch.Tensor:
                    return get[f"{name}.weight"]
            w13 = torch.stack([torch.cat([weight(f"{ex}{e}.{names[0]}"), weight(f"{ex}{e}.{names[1]}")])
                               for e in range(n)])
            w2 = torch.stack([weight(f"{ex}{e}.{names[2]}") for e in range(n)])
            experts = stack_dense(w13.to(device, dtype), w2.to(device, dtype))
    if experts.quantized and not packed_kernel:  # the reference backend, or --dequantize: 16-bit experts
        w13, w2 = experts.dequantized()
        experts = stack_dense(w13.to(dtype), w2.to(dtype))
    lin = dict(quant=quant, dtype=dtype, device=device, packed_kernel=packed_kernel)
    layer = MoELayer(router=get[f"{block}.gate.weight"].to(device, dtype), experts=experts, top_k=spec.top_k,
                     renormalize=spec.moe_renormalize, use_kernel=packed_kernel, act_quant=act_quant)
    shared = f"{block}.shared_expert."
    if any(k.startswith(shared) for k in get):
        layer.shared_gate_up = fused_linear(get, [f"{shared}gate_proj", f"{shared}up_proj"], **lin)
        layer.shared_down = fused_linear(get, [f"{shared}down_proj"], **lin)
        if f"{block}.shared_expert_gate.weight" in get:
            layer.shared_gate = get[f"{block}.shared_expert_gate.weight"].to(device, dtype)
    return layer
