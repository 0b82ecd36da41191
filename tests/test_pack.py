"""Bit-order tests for quantkit.pack: round trips, and an independent decoder of the GPTQ layout.

The independent decoder below is written from the documented formula (code of input row ``r`` sits
at bits ``[r*bits, (r+1)*bits)`` of its column's little-endian stream of 32-bit words), one shift
at a time in plain Python integers, the way the original GPTQ readers unpack; it shares no code with
the packer it checks.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantkit.pack import (
    AWQ_ORDER,
    pack_awq,
    pack_gptq,
    pack_rows,
    qzeros_v2_to_v1,
    unpack_awq,
    unpack_gptq,
    unpack_rows,
)
from quantkit.primitives import default_g_idx, num_groups

BITS = (2, 3, 4, 8)
GROUP_SIZES = (32, 64, 128, -1)


def row_multiple(bits: int) -> int:
    """Smallest number of codes that fills whole 32-bit words."""
    return {2: 16, 3: 32, 4: 8, 8: 4}[bits]


def decode_column_stream(words: list[int], bits: int, n: int) -> list[int]:
    """Independent GPTQ decoder: ``n`` codes from one column's int32 words, one shift at a time."""
    unsigned = [w & 0xFFFFFFFF for w in words]
    mask = (1 << bits) - 1
    codes = []
    for r in range(n):
        start = r * bits
        word, shift = divmod(start, 32)
        value = unsigned[word] >> shift
        if shift + bits > 32:  # the code straddles into the next word (3-bit codes 10 and 21 of 32)
            value |= unsigned[word + 1] << (32 - shift)
        codes.append(value & mask)
    return codes


def decode_gptq_qweight(qweight: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """Codes ``[out, in]`` from ``qweight [in*bits/32, out]`` with :func:`decode_column_stream`."""
    columns = qweight.t().tolist()
    return torch.tensor([decode_column_stream(col, bits, in_features) for col in columns], dtype=torch.int32)


def decode_gptq_qzeros(qzeros: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    """Zero points ``[G, out]`` from ``qzeros [G, out*bits/32]``: packed along the output, stored minus one."""
    return torch.tensor(
        [[z + 1 for z in decode_column_stream(row, bits, out_features)] for row in qzeros.tolist()]
    )


def to_int32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


@st.composite
def gptq_case(draw):
    bits = draw(st.sampled_from(BITS))
    group_size = draw(st.sampled_from(GROUP_SIZES))
    step = row_multiple(bits)
    in_features = step * draw(st.integers(1, 12))  # often not a multiple of the group size
    out_features = step * draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    return bits, group_size, in_features, out_features, seed


def random_codes_and_zeros(bits, group_size, in_features, out_features, seed):
    gen = torch.Generator().manual_seed(seed)
    maxq = 2**bits - 1
    codes = torch.randint(0, maxq + 1, (out_features, in_features), generator=gen, dtype=torch.int32)
    zeros = torch.randint(1, maxq + 1, (num_groups(in_features, group_size), out_features), generator=gen)
    return codes, zeros.to(torch.int32)


@settings(max_examples=60, deadline=None)
@given(gptq_case())
def test_gptq_round_trip(case):
    bits, group_size, in_features, out_features, _ = case
    codes, zeros = random_codes_and_zeros(*case)
    qweight, qzeros = pack_gptq(codes, zeros, bits)
    assert qweight.dtype == torch.int32 and qzeros.dtype == torch.int32
    assert qweight.shape == (in_features * bits // 32, out_features)
    assert qzeros.shape == (num_groups(in_features, group_size), out_features * bits // 32)
    codes_back, zeros_back = unpack_gptq(qweight, qzeros, bits, in_features, out_features)
    assert torch.equal(codes_back, codes)
    assert torch.equal(zeros_back, zeros)


@settings(max_examples=40, deadline=None)
@given(gptq_case())
def test_gptq_layout_matches_independent_decoder(case):
    bits, _, in_features, out_features, _ = case
    codes, zeros = random_codes_and_zeros(*case)
    qweight, qzeros = pack_gptq(codes, zeros, bits)
    assert torch.equal(decode_gptq_qweight(qweight, bits, in_features), codes)
    assert torch.equal(decode_gptq_qzeros(qzeros, bits, out_features), zeros)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(BITS), st.integers(1, 6), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_pack_rows_round_trip(bits, words, columns, seed):
    n = row_multiple(bits) * words
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, columns), generator=gen, dtype=torch.int32)
    packed = pack_rows(codes, bits)
    assert packed.shape == (n * bits // 32, columns)
    assert torch.equal(unpack_rows(packed, bits, n), codes)


@pytest.mark.parametrize(
    ("bits", "codes", "words"),
    [
        # 4 bits: row r in word r // 8 at bit 4 * (r % 8), so rows 0..7 = 0..7 read 0x76543210.
        (4, list(range(8)), [0x76543210]),
        (4, [15] * 8, [0xFFFFFFFF]),
        # 2 bits: rows 0..15 = 0,1,2,3,... give the byte 0b11100100 four times.
        (2, [r % 4 for r in range(16)], [0xE4E4E4E4]),
        (8, [1, 2, 3, 4], [0x04030201]),
        (8, [0x80, 0, 0, 0xFF], [0xFF000080]),
        # 3 bits: code 5 (0b101) at row 10 straddles words 0 and 1: bits 30-31 get 0b01, word 1 bit 0 gets 1.
        (3, [0] * 10 + [5] + [0] * 21, [0x40000000, 0x00000001, 0]),
        (3, [7] * 32, [0xFFFFFFFF] * 3),
        # code 5 at row 21 (stream bits 63-65): bit 0 -> word 1 bit 31, bits 1-2 (0b10) -> word 2.
        (3, [0] * 21 + [5] + [0] * 10, [0, 0x80000000, 0x00000002]),
    ],
)
def test_known_bit_patterns(bits, codes, words):
    packed = pack_rows(torch.tensor(codes, dtype=torch.int32).view(-1, 1), bits)
    assert packed.view(-1).tolist() == [to_int32(w) for w in words]
    assert decode_column_stream([to_int32(w) for w in words], bits, len(codes)) == codes


@pytest.mark.parametrize("bits", BITS)
def test_symmetric_zero_point_is_stored_minus_one(bits):
    # Symmetric GPTQ uses zero = 2**(bits-1); v1 stores zero - 1 in every field (0x77777777 at 4 bits).
    out_features = row_multiple(bits) * 2
    zeros = torch.full((3, out_features), 2 ** (bits - 1), dtype=torch.int32)
    codes = torch.zeros(out_features, row_multiple(bits), dtype=torch.int32)
    _, qzeros = pack_gptq(codes, zeros, bits)
    stored = decode_column_stream(qzeros[0].tolist(), bits, out_features)
    assert stored == [2 ** (bits - 1) - 1] * out_features
    if bits == 4:
        assert qzeros.unique().tolist() == [0x77777777]


@pytest.mark.parametrize("bits", BITS)
def test_zero_point_outside_v1_range_is_refused(bits):
    n = row_multiple(bits)
    codes = torch.zeros(n, n, dtype=torch.int32)
    zeros = torch.ones(1, n, dtype=torch.int32)
    zeros[0, 0] = 0  # would be stored as -1 and wrap to 2**bits - 1
    with pytest.raises(ValueError, match="zero - 1"):
        pack_gptq(codes, zeros, bits)


def test_codes_out_of_range_are_refused():
    with pytest.raises(ValueError, match="out of range"):
        pack_rows(torch.full((8, 1), 16, dtype=torch.int32), 4)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 8), st.sampled_from(GROUP_SIZES), st.integers(0, 2**31 - 1))
def test_awq_round_trip(out_blocks, in_blocks, group_size, seed):
    out_features, in_features = 8 * out_blocks, 16 * in_blocks
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.int32)
    zeros = torch.randint(
        0, 16, (num_groups(in_features, group_size), out_features), generator=gen, dtype=torch.int32
    )
    qweight, qzeros = pack_awq(codes, zeros)
    assert qweight.shape == (in_features, out_features // 8)
    codes_back, zeros_back = unpack_awq(qweight, qzeros)
    assert torch.equal(codes_back, codes) and torch.equal(zeros_back, zeros)
    # Independent read: nibble j of word w holds output column 8 w + AWQ_ORDER[j], zeros unshifted.
    row, word = 3 % in_features, 0
    value = qweight[row, word].item() & 0xFFFFFFFF
    for j in range(8):
        assert (value >> (4 * j)) & 0xF == codes[8 * word + AWQ_ORDER[j], row].item()
    zword = qzeros[0, 0].item() & 0xFFFFFFFF
    assert [(zword >> (4 * j)) & 0xF for j in range(8)] == [zeros[0, AWQ_ORDER[j]].item() for j in range(8)]


def test_awq_known_pattern():
    # Output columns 0..7 holding codes 0..7 land in nibbles in the order 0,2,4,6,1,3,5,7.
    codes = torch.arange(8, dtype=torch.int32).view(8, 1).expand(8, 16).contiguous()
    qweight, _ = pack_awq(codes, torch.zeros(1, 8, dtype=torch.int32))
    assert qweight[0, 0].item() == 0x75316420


def test_partial_last_group_g_idx():
    # 96 inputs at g64: one full group and a partial one of 32 columns, as the GPTQ layout stores it.
    g_idx = default_g_idx(96, 64)
    assert g_idx[:64].eq(0).all() and g_idx[64:].eq(1).all()
    assert num_groups(96, 64) == 2 and num_groups(96, -1) == 1
    assert default_g_idx(96, -1).eq(0).all()


@pytest.mark.parametrize("bits", BITS)
def test_gptq_v2_zeros_convert_to_v1(bits):
    g = torch.Generator().manual_seed(bits)
    zeros = torch.randint(1, 2**bits, (3, 64), generator=g, dtype=torch.int32)  # [G, out]
    codes = torch.randint(0, 2**bits, (64, 32), generator=g, dtype=torch.int32)  # [out, in]
    v2 = pack_rows(zeros.t().contiguous(), bits).t().contiguous()  # zero points stored as they are
    _, v1 = pack_gptq(codes, zeros, bits)
    assert torch.equal(qzeros_v2_to_v1(v2, bits, 64), v1)
    zeros[1, 5] = 0
    with pytest.raises(ValueError, match="zero point is 0"):
        qzeros_v2_to_v1(pack_rows(zeros.t().contiguous(), bits).t().contiguous(), bits, 64)
