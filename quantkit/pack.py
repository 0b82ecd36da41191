"""Packing integer codes into int32 words: the one place the bit order is defined.

Every packed tensor quantkit writes or reads goes through this module. Two layouts exist.

GPTQ layout (``checkpoint_format = "gptq"``, the one transformers, vLLM and SGLang load)
-------------------------------------------------------------------------------------------
For a linear layer ``y = x @ W.T`` with ``W`` of shape ``[out, in]`` and ``G`` quantization groups:

* ``qweight`` int32 ``[in * bits / 32, out]``: the codes of ``W.T`` (shape ``[in, out]``) packed
  **along the input dimension**. Within each output column the codes form a little-endian
  bitstream: the code of input row ``r`` occupies bits ``[r * bits, (r + 1) * bits)`` of the
  column's stream, and word ``k`` of the stream holds stream bits ``[32 k, 32 k + 32)``, least
  significant bit first. For 2, 4 and 8 bits a code never straddles two words (for 4 bits:
  row ``r`` sits in word ``r // 8`` at bit ``4 * (r % 8)``); for 3 bits 32 codes fill exactly
  three words and codes 10 and 21 straddle a word boundary.
* ``qzeros`` int32 ``[G, out * bits / 32]``: the zero points packed the same way **along the
  output dimension**, and stored **minus one** (the "v1" convention of the original GPTQ code
  that vLLM and transformers expect): ``stored = zero - 1``. quantkit keeps every zero point in
  ``[1, 2**bits - 1]`` so the stored value never wraps (see ``primitives.compute_qparams``).
* ``scales`` float16 ``[G, out]``; ``g_idx`` int32 ``[in]``: the group of every input row.
* Dequantization: ``W[o, i] = (code[o, i] - zero[g_idx[i], o]) * scales[g_idx[i], o]``.
* GPTQModel's "v2" (``format = "gptq_v2"``) is the same layout with zero points stored as they are
  (no minus one); :func:`qzeros_v2_to_v1` converts its ``qzeros``.

AWQ GEMM layout (``quant_method = "awq"``, ``version = "gemm"``; 4 bits only)
-------------------------------------------------------------------------------
* ``qweight`` int32 ``[in, out / 8]`` and ``qzeros`` int32 ``[G, out / 8]``: codes packed **along the
  output dimension**, eight to a word, in the interleaved order ``AWQ_ORDER``: nibble ``j`` (bits
  ``[4 j, 4 j + 4)``) of a word holds output column ``8 w + AWQ_ORDER[j]``. Zero points are stored
  as they are (no offset). ``scales`` float16 ``[G, out]``; groups are contiguous, no ``g_idx``.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_BITS = (2, 3, 4, 8)
WORD_BITS = 32
# Nibble j of an AWQ word holds output column AWQ_ORDER[j] of its block of eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")


def whole_word_multiple(bits: int) -> int:
    """The count of ``bits``-bit codes a packed dimension must be a multiple of to fill whole 32-bit words."""
    return WORD_BITS // math.gcd(bits, WORD_BITS)


def packed_rows(n: int, bits: int) -> int:
    """Number of int32 words that hold ``n`` codes of ``bits`` bits (``n * bits`` must fill whole words)."""
    _check_bits(bits)
    if (n * bits) % WORD_BITS:
        raise ValueError(
            f"{n} codes of {bits} bits do not fill whole 32-bit words; the GPTQ layout needs "
            f"the packed dimension to be a multiple of {whole_word_multiple(bits)}"
        )
    return n * bits // WORD_BITS


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Reinterpret unsigned 32-bit values held in int64 as int32 (two's complement)."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(codes: torch.Tensor, bits: int, chunk_elements: int = 1 << 22) -> torch.Tensor:
    """Pack integer codes ``[n, m]`` (values in ``[0, 2**bits)``) along dim 0 into int32 ``[n*bits/32, m]``.

    Columns are independent: a large matrix is packed ``chunk_elements`` codes at a time, so the int64
    temporaries stay small (whole, they were four times the int32 codes: 270 MB for one 8192 x 2048 linear)."""
    if codes.numel():  # one check (one host round trip on a GPU) for the whole matrix, not one per chunk
        low, high = torch.aminmax(codes)
        if bool((low < 0) | (high >= 2**bits)):
            raise ValueError(f"codes out of range for {bits} bits")
    return _pack_rows_checked(codes, bits, chunk_elements)


def _pack_rows_checked(codes: torch.Tensor, bits: int, chunk_elements: int) -> torch.Tensor:
    """:func:`pack_rows` on codes already known to lie in ``[0, 2**bits)``."""
    n, m = codes.shape
    step = max(1, chunk_elements // max(n, 1))
    if m > step:
        return torch.cat([_pack_rows_checked(codes[:, c : c + step], bits, chunk_elements)
                          for c in range(0, m, step)], dim=1)
    n_words = packed_rows(n, bits)
    codes = codes.to(torch.int64)
    if WORD_BITS % bits == 0:
        per_word = WORD_BITS // bits
        shifts = torch.arange(per_word, device=codes.device, dtype=torch.int64) * bits
        # codes [n, m] -> [n_words, per_word, m]; OR of disjoint bit fields == their sum
        words = (codes.view(n_words, per_word, m) << shifts.view(1, per_word, 1)).sum(dim=1)
        return _to_int32(words)
    # Bit widths that straddle words (3): expand to a bitstream, then regroup into words.
    bit_pos = torch.arange(bits, device=codes.device, dtype=torch.int64)
    stream = (codes.unsqueeze(1) >> bit_pos.view(1, bits, 1)) & 1  # [n, bits, m]
    stream = stream.reshape(n_words, WORD_BITS, m)
    weights = torch.ones(WORD_BITS, dtype=torch.int64, device=codes.device) << torch.arange(
        WORD_BITS, device=codes.device, dtype=torch.int64
    )
    words = (stream * weights.view(1, WORD_BITS, 1)).sum(dim=1)
    return _to_int32(words)


def unpack_rows(packed: torch.Tensor, bits: int, n: int | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_rows`: int32 ``[n*bits/32, m]`` -> int32 codes ``[n, m]``."""
    _check_bits(bits)
    if packed.dtype != torch.int32:
        raise TypeError(f"packed tensors are int32, got {packed.dtype}")
    n_words, m = packed.shape
    total = n_words * WORD_BITS // bits
    if n is not None and n != total:
        raise ValueError(f"{n_words} words of {bits}-bit codes hold {total} rows, expected {n}")
    words = packed.to(torch.int64) & 0xFFFFFFFF
    mask = (1 << bits) - 1
    if WORD_BITS % bits == 0:
        per_word = WORD_BITS // bits
        shifts = torch.arange(per_word, device=packed.device, dtype=torch.int64) * bits
        codes = (words.unsqueeze(1) >> shifts.view(1, per_word, 1)) & mask  # [n_words, per_word, m]
        return codes.reshape(total, m).to(torch.int32)
    bit_pos = torch.arange(WORD_BITS, device=packed.device, dtype=torch.int64)
    stream = (words.unsqueeze(1) >> bit_pos.view(1, WORD_BITS, 1)) & 1  # [n_words, 32, m]
    stream = stream.reshape(total, bits, m)
    weights = torch.ones(bits, dtype=torch.int64, device=packed.device) << torch.arange(
        bits, device=packed.device, dtype=torch.int64
    )
    return (stream * weights.view(1, bits, 1)).sum(dim=1).to(torch.int32)


def pack_gptq(codes: torch.Tensor, zeros: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[out, in]`` and zero points ``[G, out]`` ->
    (``qweight [in*bits/32, out]``, ``qzeros [G, out*bits/32]``)."""
    low, high = torch.aminmax(zeros) if zeros.numel() else (None, None)
    if zeros.numel() and bool((low < 1) | (high >= 2**bits)):
        raise ValueError(
            "GPTQ v1 checkpoints store zero - 1, so every zero point must lie in [1, 2**bits - 1]; "
            "compute quantization parameters with quantkit.primitives.compute_qparams"
        )
    qweight = pack_rows(codes.t(), bits)
    qzeros = _pack_rows_checked((zeros.to(torch.int64) - 1).t(), bits, 1 << 22).t().contiguous()  # in range: above
    return qweight, qzeros


def unpack_gptq(
    qweight: torch.Tensor, qzeros: torch.Tensor, bits: int, in_features: int, out_features: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_gptq`: returns codes ``[out, in]`` and zero points ``[G, out]`` (int32)."""
    codes = unpack_rows(qweight, bits, in_features).t().contiguous()
    # Stored values are zero - 1; reading them back as unsigned and adding one restores the zero.
    zeros = unpack_rows(qzeros.t().contiguous(), bits, out_features).t().contiguous() + 1
    return codes, zeros


def _awq_permute(n_cols: int, device: torch.device) -> torch.Tensor:
    """Column order that puts output column ``8 w + AWQ_ORDER[j]`` at packed position ``8 w + j``."""
    base = torch.arange(0, n_cols, 8, device=device).view(-1, 1)
    return (base + torch.tensor(AWQ_ORDER, device=device).view(1, 8)).reshape(-1)


def pack_awq(codes: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[out, in]`` and zeros ``[G, out]`` -> AWQ GEMM (``qweight [in, out/8]``, ``qzeros [G, out/8]``)."""
    out_features = codes.shape[0]
    if out_features % 8:
        raise ValueError(f"the AWQ layout needs out_features divisible by 8, got {out_features}")
    order = _awq_permute(out_features, codes.device)
    qweight = pack_rows(codes[order].contiguous(), 4).t().contiguous()  # [in, out/8]
    qzeros = pack_rows(zeros.t()[order].contiguous(), 4).t().contiguous()  # [G, out/8]
    return qweight, qzeros


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_awq`: returns codes ``[out, in]`` and zeros ``[G, out]`` (int32)."""
    out_features = qweight.shape[1] * 8
    inverse = torch.argsort(_awq_permute(out_features, qweight.device))
    codes = unpack_rows(qweight.t().contiguous(), 4)[inverse]
    zeros = unpack_rows(qzeros.t().contiguous(), 4)[inverse].t().contiguous()
    return codes.contiguous(), zeros


def qzeros_v2_to_v1(qzeros: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    """GPTQ v2 ``qzeros`` (zero points stored as they are) -> v1 (stored minus one), same packing.

    Raises ``ValueError`` when a zero point is 0: v1 cannot hold it (its stored value would wrap).
    """
    zeros = unpack_rows(qzeros.t().contiguous(), bits, out_features)  # [out, G], the zero points
    if zeros.numel() and zeros.min() < 1:
        raise ValueError("a zero point is 0, which GPTQ v1 (zero - 1 stored) cannot hold")
    return pack_rows(zeros - 1, bits).t().contiguous()
