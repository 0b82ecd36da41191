"""The W4A16 kernel's weights: the one-time repack of GPTQ tensors, and the plain-PyTorch reference.

No Triton here, so the CPU path (and the reference the tests compare against) never imports it.
The GPTQ layout itself is defined in :mod:`quantkit.pack`.
"""

from __future__ import annotations

import dataclasses

import torch

from quantkit.kernels.device_info import gpu_arch, gpu_card
from quantkit.kernels.w4a16_configs import DIRECT_MAX_M, PAIR_TILE_K, kernel_group_size
from quantkit.kernels.w4a16_select import LayerFacts, W4A16Plan, plan_w4a16
from quantkit.pack import pack_rows, unpack_gptq, unpack_rows
from quantkit.primitives import default_g_idx

__all__ = ["CutlassOperands", "W4A16Weights", "prepare_w4a16_weights", "reference_w4a16_weights", "w4a16_matmul_ref"]


@dataclasses.dataclass(frozen=True)
class CutlassOperands:
    """What the CUTLASS prefill kernel reads of a layer (:func:`quantkit.kernels.w4a16_cutlass.prepare`):
    ``codes`` int32 ``[N, K / 8]`` 4-bit codes, K-major (the layer's own ``qweight``, unsigned; the bench's signed
    build takes a copy with every nibble XOR 8); ``scales`` bf16 ``[G, N]``; ``zero_terms`` bf16 ``[G, N]`` (None
    for the signed build); ``group``: codes a scale (K for per-channel scales)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zero_terms: torch.Tensor | None
    group: int


@dataclasses.dataclass(frozen=True)
class W4A16Weights:
    """Kernel-ready weights (see :func:`prepare_w4a16_weights`). ``N`` = out, ``K`` = in features.

    * ``qweight`` int32 ``[N, K * bits / 32]``: codes packed along K, K contiguous per row, in the (possibly
      act-order permuted) K order the kernel reads.
    * ``scales`` float16 ``[G, N]``; ``zeros`` uint8 ``[G, N]``, None when symmetric (zero = ``2**(bits-1)``).
    * ``g_idx`` int32 ``[K]``: group of each (permuted) input row; ``perm`` int64 ``[K]`` or None: the kernel
      multiplies ``x[:, perm]``. ``group_size``: the contiguous group length (``PER_CHANNEL_GROUP`` per channel),
      None when groups are not contiguous runs of one length (the kernels refuse; the reference works).
    * ``pair_index`` int64 ``[K]`` or None: the activation columns in paired-nibble order
      (:func:`_paired_nibble_index`, composed with ``perm``); None for 8-bit or K not a multiple of ``PAIR_TILE_K``.
    * ``tile_counters`` int32 ``[N / 16 + 1]`` and ``partial_sums`` float32 ``[DIRECT_MAX_M * N]`` (None where the
      direct decode kernel cannot take the layer): its stream-K counters and workspace, left zeroed by each call,
      so a layer's GPU calls must run one at a time (two concurrent streams need two copies of the weights).
    * ``plan``: kernel and config per activation-row bucket on the weights' GPU
      (:mod:`quantkit.kernels.w4a16_select`); None off CUDA.
    * ``launchers``: the plan bound to its launch functions, one per bucket (None: the reference), by the front
      door at load (:func:`quantkit.kernels.dispatch.prepare_w4a16`); None where no kernel serves the layer.
    * ``cutlass``: the CUTLASS prefill kernel's bf16 scales and zero terms (:func:`quantkit.kernels.w4a16_cutlass.
      prepare`), made by the front door at load where the plan has a CUTLASS entry; None otherwise.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor
    perm: torch.Tensor | None
    bits: int
    group_size: int | None
    in_features: int
    out_features: int
    pair_index: torch.Tensor | None = None
    tile_counters: torch.Tensor | None = None
    partial_sums: torch.Tensor | None = None
    plan: W4A16Plan | None = None
    launchers: tuple | None = dataclasses.field(default=None, repr=False, compare=False)
    cutlass: CutlassOperands | None = dataclasses.field(default=None, repr=False, compare=False)

    def facts(self) -> LayerFacts:
        """What kernel selection reads of these weights."""
        return LayerFacts(self.out_features, self.in_features, self.bits, self.group_size,
                          has_zeros=self.zeros is not None, act_order=self.perm is not None)


def _paired_nibble_index(k: int, device=None) -> torch.Tensor:
    """Column order of the paired-nibble kernels: ``x[:, index]`` lines the activations up with the codes.

    A word holds 8 codes, code ``p`` at bit ``4p``; shifted right by ``4j`` it has codes ``j`` and ``j + 4`` at
    bits 0 and 16, one tensor-core register of two neighbouring K positions. So within a ``PAIR_TILE_K`` tile,
    dot ``j`` (of 4) sees at its column ``2w + h`` code ``j + 4h`` of word ``w``: original column ``8w + j + 4h``.
    """
    words = PAIR_TILE_K // 8
    t = torch.arange(k // PAIR_TILE_K, device=device).view(-1, 1, 1, 1)
    j = torch.arange(4, device=device).view(1, -1, 1, 1)
    w = torch.arange(words, device=device).view(1, 1, -1, 1)
    h = torch.arange(2, device=device).view(1, 1, 1, -1)
    return (t * PAIR_TILE_K + 8 * w + j + 4 * h).reshape(-1)


def prepare_w4a16_weights(qweight, qzeros, scales, g_idx, bits, group_size, sym) -> W4A16Weights:
    """One-time repack of GPTQ tensors (layout of :mod:`quantkit.pack`) into :class:`W4A16Weights`: transposed
    so K is contiguous per row, zero points unpacked to bytes, act-order K permuted so groups are contiguous.

    qweight int32 ``[K*bits/32, N]``, qzeros int32 ``[G, N*bits/32]``, scales fp16 ``[G, N]``,
    g_idx int ``[K]`` (or None), ``group_size`` as quantized (-1: per channel).
    """
    if bits not in (4, 8):
        raise ValueError(f"the W4A16 kernel reads 4- or 8-bit codes, got {bits}")
    n_words, n = qweight.shape
    k = n_words * 32 // bits
    if g_idx is None:
        g_idx = default_g_idx(k, group_size, device=qweight.device)
    g_idx = g_idx.to(device=qweight.device, dtype=torch.int32)
    perm = None
    if bool((g_idx[1:] < g_idx[:-1]).any()):
        # Act-order: sort rows by group so each group is one contiguous run of K.
        perm = torch.argsort(g_idx.long(), stable=True)
        codes, _ = unpack_gptq(qweight, qzeros, bits, k, n)
        qweight = pack_rows(codes[:, perm].t(), bits)
        g_idx = g_idx[perm]
    zeros_u8 = _zero_points(qweight, qzeros, bits, n, sym)
    kernel_group = None
    if torch.equal(g_idx, default_g_idx(k, group_size, device=g_idx.device)):
        kernel_group = kernel_group_size(group_size, k)
    pair_index = None
    if bits == 4 and k % PAIR_TILE_K == 0:
        pair_index = _paired_nibble_index(k, qweight.device)
        if perm is not None:
            pair_index = perm[pair_index]
    facts = LayerFacts(n, k, bits, kernel_group, has_zeros=zeros_u8 is not None, act_order=perm is not None)
    direct = facts.direct  # the direct decode kernel can take the layer: it needs its workspace
    return W4A16Weights(
        qweight=qweight.t().contiguous(),
        scales=scales.to(torch.float16).contiguous(),
        zeros=zeros_u8,
        g_idx=g_idx,
        perm=perm,
        bits=bits,
        group_size=kernel_group,
        in_features=k,
        out_features=n,
        pair_index=pair_index,
        tile_counters=torch.zeros(n // 16 + 1, device=qweight.device, dtype=torch.int32) if direct else None,
        partial_sums=torch.zeros(DIRECT_MAX_M * n, device=qweight.device, dtype=torch.float32) if direct else None,
        plan=plan_w4a16(facts, gpu_arch(qweight.device), gpu_card(qweight.device)),
    )


def reference_w4a16_weights(qweight, qzeros, scales, g_idx, bits, group_size, sym) -> W4A16Weights:
    """The same record for the plain-PyTorch reference alone (off CUDA): no repack, no plan.

    ``qweight`` is the checkpoint tensor's transposed view (no copy), rows in checkpoint order (``perm`` None,
    ``g_idx`` as stored); only the zero points are unpacked. The repack serves CUDA kernels only; on the CPU it
    would double every layer's packed bytes for nothing.
    """
    n_words, n = qweight.shape
    k = n_words * 32 // bits
    if g_idx is None:
        g_idx = default_g_idx(k, group_size, device=qweight.device)
    zeros_u8 = _zero_points(qweight, qzeros, bits, n, sym)
    return W4A16Weights(qweight=qweight.t(), scales=scales.to(torch.float16), zeros=zeros_u8,
                        g_idx=g_idx.to(torch.int32), perm=None, bits=bits, group_size=None, in_features=k,
                        out_features=n)


def _zero_points(qweight, qzeros, bits: int, n: int, sym: bool) -> torch.Tensor | None:
    """The zero points as contiguous uint8 ``[G, N]``; None for symmetric weights whose zero points are all
    ``2**(bits-1)``, which the kernels then assume."""
    _, zeros = unpack_gptq(qweight[:0], qzeros, bits, 0, n)
    return None if sym and bool((zeros == 2 ** (bits - 1)).all()) else zeros.to(torch.uint8).contiguous()


def w4a16_matmul_ref(x: torch.Tensor, w: W4A16Weights) -> torch.Tensor:
    """Plain-PyTorch reference: dequantize to float32, matmul. ``x [M, K]`` -> ``[M, N]`` (x's dtype)."""
    codes = unpack_rows(w.qweight.t().contiguous(), w.bits, w.in_features)  # [K, N]
    gi = w.g_idx.long()
    zeros = 2 ** (w.bits - 1) if w.zeros is None else w.zeros[gi].float()
    w_kn = (codes.float() - zeros) * w.scales[gi].float()
    if w.perm is not None:
        x = x[:, w.perm]
    return (x.float() @ w_kn).to(x.dtype)
