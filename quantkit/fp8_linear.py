"""The FP8 linear: ``y = x @ W^T + b`` with e4m3 weights and e4m3 activations, as vLLM serves it.

Activations are quantized per token at run time (``s_x = absmax(row) / 448``) or with a static scale
(``input_scale``); with block weights per token and run of ``block[1]`` columns (what vLLM's block GEMM does, and
what the checkpoint declares: ``input_activations`` strategy ``group``). Weights carry one float32 scale per output
channel (per tensor is expanded when prepared) or per block. The paths, chosen once when the weights are prepared
(:func:`prepare_fp8_linear`), never per call:

* ``scaled_mm`` (CUDA, compute capability >= 8.9): activations quantized by one Triton kernel
  (``kernels/fp8_quant.py``), then ``torch._scaled_mm`` with row-wise scales: ``scale_a`` float32
  ``[M, 1]``, ``scale_b`` float32 ``[1, N]``, B column-major (the ``[N, K]`` weight transposed, a view),
  K and N multiples of 16, bfloat16 output (row-wise scaling requires it). No host synchronization:
  CUDA graphs capture it.
  Decode batches take quantkit's kernels instead (``QUANTKIT_FP8_GEMV``, read when the weights are prepared):
  ``auto`` (the default) one row through the CUDA-core FP8 GEMV (``kernels/gemv.py`` with ``scales=``), 2..64 rows
  through the tensor-core FP8 GEMM (``kernels/gemv_fp8_mma.py``: the weight codes go to the FP8 warpgroup MMA as
  they are), ``_scaled_mm`` above. Measured in whole decode steps of the Llama-3-8B shape on one H100
  (bench/results/bench_llama3-8b_fp8_h100_{default,mma}_e9cd379.json): the tensor-core GEMM at batch 8 2,031 tok/s
  against 1,518 with ``_scaled_mm``, at 32 6,504 against 6,039; at batch 1 the GEMV 279 against the GEMM's 271
  (its configs then split K where the sweep later found one split fastest). The A/B choices: ``unfused`` (the
  GEMV up to 4 rows, ``_scaled_mm`` above: the default before), ``fused`` (a one-launch GEMV that quantizes the
  activations itself, ``kernels/gemv_fp8.py``, up to 4 rows), ``mma`` (the tensor-core GEMM for 1..64 rows),
  ``0`` (``_scaled_mm`` for all). The activations come quantized by the kernel in front (the RMSNorm or the gated
  activation writes the codes, ``QUANTKIT_FP8_FUSED_QUANT``, default 1) or by ``kernels/fp8_quant.py``; under
  ``auto``, one 16-bit row that no kernel in front quantized (o's input) goes to the one-launch GEMV, which
  quantizes it itself (``QUANTKIT_FP8_GEMV_QUANT=inside``, the default; ``apart``: the quantization kernel, then
  the GEMV on codes).
* ``scaled_mm_block`` (CUDA, block 128x128 weights, where :func:`block_scaled_mm_layout` finds torch's
  block-scaled GEMM and checks it against the emulation on the device once): activations quantized per token
  and 128 columns, then ``torch.nn.functional.scaled_mm`` with ``BlockWise1x128`` / ``BlockWise128x128`` scales.
* ``reference`` (the CPU, and anything the fast paths do not take): the same rounding, emulated:
  activations quantized to e4m3 (per token, or per token and group), both operands dequantized, one float32
  matmul.

:class:`FP8Linear` is the ``nn.Module`` the checkpoint reader installs in a transformers model;
the runtime keeps the prepared record (:class:`FP8LinearWeights`) in its own ``Linear``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import nn

from quantkit.kernels.device_info import ab_switch
from quantkit.kernels.fp8_quant_ref import activations_through_e4m3
from quantkit.primitives import dequantize_fp8

log = logging.getLogger(__name__)
GEMV_MAX_M = 4  # kernels/gemv.py's MAX_M: rows the decode GEMV takes
GEMV_SWITCH = ("auto", "unfused", "fused", "mma", "0")  # QUANTKIT_FP8_GEMV's choices, the default first
GEMV_QUANT_SWITCH = ("inside", "apart")  # QUANTKIT_FP8_GEMV_QUANT's choices, the default first
MMA_MAX_M = 64  # kernels/gemv_fp8_mma.py's MAX_M: rows the tensor-core FP8 GEMM takes


@dataclass
class FP8LinearWeights:
    """An FP8 linear prepared for one path. ``weight`` e4m3 ``[N, K]``; ``scale`` float32 ``[1, N]``
    (row-wise) or, for block weights on the reference path, the element-wise float32 scale ``[N, K]``;
    ``input_scale`` float32 ``[1]`` (static activations) or None; ``bias`` ``[N]`` or None."""

    weight: torch.Tensor
    scale: torch.Tensor
    path: str
    input_scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    reason: str = ""
    dequantized: torch.Tensor | None = None  # reference path on the CPU: float32 ``[N, K]``, dequantized once
    gemv: bool = False  # scaled_mm path: decode-sized batches (M <= gemv_max_m) through quantkit's FP8 GEMV instead
    gemv_fused: bool = False  # that GEMV quantizes the activations itself (one launch), else a kernel before it
    gemv_mma: bool = False  # scaled_mm path: M <= 64 (past the GEMV's rows) through the tensor-core FP8 GEMM
    codes_in: bool = False  # per-token activations: the runtime may hand it codes a fused producer quantized
    # (the norm or activation kernel before it, QUANTKIT_FP8_FUSED_QUANT=1 (the default); fp8_linear_codes)
    mma_counters: torch.Tensor | None = None  # its split-K tile counters (int32, zero between calls), one set a linear
    act_group: int = 0  # block weights: activations scaled per token and run of this many columns (0: per token)
    block_scale: torch.Tensor | None = None  # scaled_mm_block path: the weight's block scales, laid out as it needs
    block_row_multiple: int = 1  # scaled_mm_block path: activation rows padded to a multiple of this

    @property
    def gemv_max_m(self) -> int:
        """The most rows the FP8 GEMV takes: one where the tensor-core GEMM takes the rest (both on: the default,
        ``auto``), else the GEMV kernel's own limit."""
        return 1 if self.gemv_mma else GEMV_MAX_M

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def nbytes(self) -> int:
        tensors = [self.weight, self.scale, self.input_scale, self.bias]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def scaled_mm_supported(device: torch.device, n: int, k: int) -> tuple[bool, str]:
    """Whether ``torch._scaled_mm`` row-wise serves an ``[N, K]`` FP8 weight on ``device``, and why not."""
    if device.type != "cuda":
        return False, "not a CUDA device: the float32 emulation"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return False, f"compute capability {major}.{minor} has no FP8 tensor cores (needs 8.9+)"
    if n % 16 or k % 16:
        return False, f"[{n}, {k}] is not a multiple of 16 in both dimensions (torch._scaled_mm needs it)"
    return True, "torch._scaled_mm, row-wise scales"


def row_scale(weight_scale: torch.Tensor, strategy: str, n: int) -> torch.Tensor:
    """Channel or tensor scales as the ``[1, N]`` float32 row ``_scaled_mm`` takes (exact: same codes)."""
    s = weight_scale.float().reshape(-1)
    if strategy == "tensor":
        s = s.expand(n) if s.numel() == 1 else s  # vLLM-style per-shard tensor scales arrive per row here
    return s.reshape(1, n).contiguous()


def prepare_fp8_linear(weight: torch.Tensor, weight_scale: torch.Tensor, strategy: str, *,
                       block: tuple[int, int] | None = None, input_scale: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None, device: torch.device | str = "cpu",
                       backend: str = "auto") -> FP8LinearWeights:
    """The prepared linear on ``device``. ``backend``: ``auto`` (``scaled_mm`` where supported), or
    ``reference``. Block 128x128 weights take torch's block-scaled GEMM where :func:`block_scaled_mm_layout`
    found a layout that agrees with the emulation on this device, else the float32 emulation (the reason kept)."""
    device = torch.device(device)
    n, k = weight.shape
    weight = weight.to(device)
    input_scale = None if input_scale is None else input_scale.float().reshape(1).to(device)
    bias = None if bias is None else bias.to(device)
    if strategy == "block":
        from quantkit.fp8_weight import FP8Weight

        rec = FP8Weight(weight, weight_scale.to(device), "block", k, n, block)
        layout, why = block_scaled_mm_layout(device) if backend == "auto" else (None, "reference asked for")
        if layout is not None and (tuple(block) != (128, 128) or n % 128 or k % 128):
            layout, why = None, f"block {tuple(block)} on [{n}, {k}]: the block GEMM takes whole 128x128 blocks"
        if layout is not None:
            scale = weight_scale.float().to(device)
            prepared = FP8LinearWeights(weight, scale, "scaled_mm_block", input_scale, bias, why, act_group=128,
                                        block_scale=layout.weight_scales(scale), block_row_multiple=layout.row_multiple)
        else:
            prepared = FP8LinearWeights(weight, rec.expanded_scale(device).contiguous(), "reference", input_scale,
                                        bias, f"block-wise weights: the float32 emulation ({why})",
                                        act_group=block[1])
    else:
        scale = row_scale(weight_scale, strategy, n).to(device)
        ok, reason = scaled_mm_supported(device, n, k) if backend == "auto" else (False, "reference asked for")
        prepared = FP8LinearWeights(weight, scale, "scaled_mm" if ok else "reference", input_scale, bias, reason)
        # decode: the module docstring says which kernel takes how many rows and what measured it
        switch = ab_switch("QUANTKIT_FP8_GEMV", GEMV_SWITCH)
        prepared.gemv = ok and switch in ("auto", "unfused", "fused")
        # 16-bit rows at one row under ``auto`` (the linears no kernel in front quantizes for: o): the one-launch
        # GEMV that quantizes them itself (``inside``, the default: a launch a layer fewer), or a quantization
        # kernel, then the GEMV on codes (``apart``). The 8B decode step at batch 1 with ``inside``: 287.5 / 287.2
        # tok/s against 286.2 / 286.0 (two alternating runs, one H100, 2026-12-07,
        # bench/results/bench_llama3-8b_fp8_h100_tuned{inside,}{1,2}_1095ee1.json); the tuned o cell on one H200
        # 7.5 us against 10.0 for the two launches (bench/results/fp8_gemv_h200.json)
        inside = ab_switch("QUANTKIT_FP8_GEMV_QUANT", GEMV_QUANT_SWITCH) == "inside"
        prepared.gemv_fused = switch == "fused" or (switch == "auto" and inside)
        prepared.gemv_mma = ok and switch in ("auto", "mma")
        # the norm / activation kernels in front quantize for it (bitwise the quantization kernel's codes and
        # scales), saving a launch a linear: the 8B decode step at batch 1 284 tok/s against 279 (H100, one
        # machine, bench/results/bench_llama3-8b_fp8_h100_fusedq_e9cd379.json), prefill unchanged; the reference
        # backend's producers quantize as the emulation does, so it takes codes too
        prepared.codes_in = ab_switch("QUANTKIT_FP8_FUSED_QUANT", ("1", "0")) == "1"
        if prepared.gemv_mma:
            from quantkit.kernels.gemv_fp8_mma import counters_for

            prepared.mma_counters = counters_for(n, device)
    if prepared.path == "reference" and device.type == "cpu":  # the CPU never dequantizes per call
        prepared.dequantized = _dequantized(prepared)
    return prepared


def concat_fp8_linears(parts: list[FP8LinearWeights]) -> FP8LinearWeights:
    """One prepared linear computing ``parts``' outputs side by side (q/k/v, gate/up): weights, row scales, biases
    and CPU dequantizations stacked; the path and every decode choice the first part was prepared with (the parts
    share their input, its static scale and their strategy: ``runtime.fp8_weights.fused_fp8_linear`` checks), the
    split-K counters sized for the whole."""
    first = parts[0]
    fused = dataclasses.replace(
        first,
        weight=torch.cat([p.weight for p in parts]),
        scale=torch.cat([p.scale for p in parts], dim=1),
        bias=None if first.bias is None else torch.cat([p.bias for p in parts]),
        dequantized=None if first.dequantized is None else torch.cat([p.dequantized for p in parts]),
    )
    if first.mma_counters is not None:
        from quantkit.kernels.gemv_fp8_mma import counters_for

        fused.mma_counters = counters_for(fused.out_features, first.weight.device)
    return fused


def _dequantized(w: FP8LinearWeights) -> torch.Tensor:
    scale = w.scale if w.scale.shape == w.weight.shape else w.scale.reshape(-1, 1)  # [N, K] or [N, 1]
    return dequantize_fp8(w.weight, scale)


def fp8_linear_ref(x: torch.Tensor, w: FP8LinearWeights) -> torch.Tensor:
    """The float32 emulation: ``x [..., K]`` quantized to e4m3 (per token, static, or per token and column group
    for block weights), both operands dequantized, one float32 matmul; the result in ``x``'s dtype."""
    shape = x.shape
    xf = activations_through_e4m3(x.reshape(-1, shape[-1]), w.act_group, w.input_scale)
    return _emulated_product(xf, w, x.dtype).reshape(*shape[:-1], w.out_features)


def _emulated_product(xf: torch.Tensor, w: FP8LinearWeights, out_dtype: torch.dtype) -> torch.Tensor:
    """``xf`` (float32 activations, already through e4m3) times the dequantized weight in float32, plus the bias,
    rounded once to ``out_dtype``: the emulation's product, whichever way the activations were quantized."""
    weight = w.dequantized if w.dequantized is not None else _dequantized(w)
    y = xf @ weight.t()
    if w.bias is not None:
        y = y + w.bias.float()
    return y.to(out_dtype)


def fp8_kernel(w: FP8LinearWeights, m: int, codes: bool = False) -> str:
    """Which kernel runs ``m`` activation rows on ``w``, as :func:`fp8_linear` and :func:`fp8_linear_codes` decide
    it (``codes``: the activations come quantized, so the one-launch GEMV, which quantizes 16-bit rows itself, is
    out): "gemv_fp8" (one launch), "gemv_mma" (tensor cores), "gemv" (the CUDA-core GEMV on codes), "scaled_mm",
    or the prepared path itself ("scaled_mm_block", "reference")."""
    if w.path != "scaled_mm":
        return w.path
    if w.gemv and w.gemv_fused and not codes and 0 < m <= w.gemv_max_m:
        return "gemv_fp8"
    if w.gemv and 0 < m <= w.gemv_max_m:
        return "gemv"
    if w.gemv_mma and 0 < m <= MMA_MAX_M:
        return "gemv_mma"
    return "scaled_mm"


def fp8_linear_scaled_mm(x: torch.Tensor, w: FP8LinearWeights) -> torch.Tensor:
    """The Hopper path: per-token quantization (one kernel), then the kernel :func:`fp8_kernel` names for the
    rows (:func:`fp8_linear_codes`); with ``gemv_fused`` (QUANTKIT_FP8_GEMV=fused) at M <= ``gemv_max_m`` one launch
    that quantizes ``x`` itself (the result in ``x``'s dtype)."""
    from quantkit.kernels.fp8_quant import quantize_per_token

    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    if fp8_kernel(w, x2.shape[0]) == "gemv_fp8":
        from quantkit.kernels.gemv_fp8 import gemv_fp8

        return gemv_fp8(x2, w.weight, w.scale, w.bias, w.input_scale).reshape(*shape[:-1], w.out_features)
    qx, sx = quantize_per_token(x2, w.input_scale)
    return fp8_linear_codes(qx, sx, w, x.dtype).reshape(*shape[:-1], w.out_features)


def fp8_linear_codes(qx: torch.Tensor, sx: torch.Tensor, w: FP8LinearWeights, out_dtype: torch.dtype) -> torch.Tensor:
    """The GEMM on activations already quantized per token (``qx`` e4m3 ``[M, K]``, ``sx`` float32 ``[M, 1]``, as
    ``quantize_per_token`` or a fused producer such as ``decoder_ops.add_rms_norm_fp8`` writes them); ``[M, N]`` in
    ``out_dtype``. The scaled_mm path: the CUDA-core FP8 GEMV (``gemv``, M <= ``gemv_max_m``), else the tensor-core
    FP8 GEMM (``gemv_mma``, M <= 64), else ``torch._scaled_mm``. The reference path (per-token activations
    only): the codes dequantized, one float32 matmul, as :func:`fp8_linear_ref` on the rows they quantize."""
    m = qx.shape[0]
    if w.path == "reference":
        if w.act_group:
            raise ValueError("block weights quantize activations per column group, not per token: use fp8_linear")
        return _emulated_product(dequantize_fp8(qx, sx), w, out_dtype)
    kernel = fp8_kernel(w, m, codes=True)
    if kernel == "gemv_mma":
        from quantkit.kernels.gemv_fp8_mma import gemv_fp8_mma

        y = gemv_fp8_mma(qx, sx, w.weight, w.scale, w.bias, counters=w.mma_counters)
    elif kernel == "gemv":
        from quantkit.kernels.gemv import gemv

        y = gemv(qx, w.weight, w.bias, scales=(sx, w.scale), out_dtype=torch.bfloat16)
    else:
        y = torch._scaled_mm(qx, w.weight.t(), scale_a=sx, scale_b=w.scale, out_dtype=torch.bfloat16)
        if w.bias is not None:
            y = y + w.bias.to(y.dtype)
    return y.to(out_dtype)


def fp8_linear(x: torch.Tensor, w: FP8LinearWeights) -> torch.Tensor:
    """``x @ W^T + b`` through the path chosen when ``w`` was prepared."""
    if w.path == "scaled_mm":
        return fp8_linear_scaled_mm(x, w)
    if w.path == "scaled_mm_block":
        from quantkit.fp8_block import fp8_linear_block

        return fp8_linear_block(x, w)
    return fp8_linear_ref(x, w)


def block_scaled_mm_layout(device: torch.device):
    """``(layout, reason)``: how torch's block-scaled GEMM wants its operands on ``device``
    (a :class:`quantkit.fp8_block.BlockLayout`), or ``(None, why not)``; probed once per device."""
    if device.type != "cuda":
        return None, "not a CUDA device"
    from quantkit.fp8_block import probe_block_layout

    return probe_block_layout(device.index if device.index is not None else torch.cuda.current_device())


class FP8Linear(nn.Module):
    """A linear holding a compressed-tensors FP8 weight: buffers ``weight`` (float8_e4m3fn ``[out, in]``),
    ``weight_scale`` (float32), ``input_scale`` (float32 ``[1]``, static activations only); ``bias``.

    Moving the module (``.to(device, dtype)``, ``.half()``) moves these buffers but never casts them:
    the codes and their float32 scales are the checkpoint's. The prepared path is rebuilt per device.
    """

    def __init__(self, in_features: int, out_features: int, strategy: str, *, block: tuple[int, int] | None = None,
                 static_input: bool = False, bias: bool = False, device=None, dtype=None,
                 scale_shape: tuple[int, ...] = (0,), input_scale_shape: tuple[int, ...] = (1,)) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.strategy, self.block = strategy, block
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn,
                                                   device=device))
        self.register_buffer("weight_scale", torch.empty(scale_shape, dtype=torch.float32, device=device))
        self.register_buffer("input_scale", torch.empty(input_scale_shape, dtype=torch.float32, device=device)
                             if static_input else None)
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False) \
            if bias else None
        self._prepared: FP8LinearWeights | None = None

    _CODES = ("weight", "weight_scale", "input_scale")

    def _apply(self, fn, recurse=True):
        keep = {name: self._buffers.pop(name) for name in self._CODES}
        try:
            super()._apply(fn, recurse)
            probe = fn(torch.empty(0, device=keep["weight"].device))
        finally:
            self._buffers.update(keep)
        for name, t in keep.items():
            if t is not None:
                self._buffers[name] = t.to(probe.device)
        self._prepared = None
        return self

    def to_fp8_weight(self):
        """The :class:`quantkit.methods.fp8.FP8Weight` record this module holds (for saving and inspecting)."""
        from quantkit.fp8_weight import FP8Weight

        return FP8Weight(self.weight, self.weight_scale, self.strategy, self.in_features, self.out_features,
                         self.block, self.input_scale, None if self.bias is None else self.bias.detach())

    def prepared(self) -> FP8LinearWeights:
        if self._prepared is None or self._prepared.weight.device != self.weight.device:
            self._prepared = prepare_fp8_linear(self.weight, self.weight_scale, self.strategy, block=self.block,
                                                input_scale=self.input_scale, bias=self.bias,
                                                device=self.weight.device)
        return self._prepared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.prepared())

    def extra_repr(self) -> str:
        static = ", static input scale" if self.input_scale is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 {self.strategy}{static}"
