"""GPTQ's host round trips: the chunked finite checks read one flag a call, whatever the number of chunks, and
still find a NaN or Inf in any chunk (on a GPU each read is a blocking sync; here they are counted)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from quantkit.config import QuantScheme
from quantkit.methods.gptq import _row_errors_packed, all_finite
from quantkit.primitives import quantize


class HostReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense``: every ``.item()``, ``bool()``, ``float()`` or ``.tolist()`` of a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "_local_scalar_dense":
            self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("where", [None, 0, 517, 2999])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_all_finite_one_read_whatever_the_chunks(where, bad):
    t = torch.randn(3000)
    if where is not None:
        t[where] = bad
    with HostReads() as reads:
        got = all_finite(t, chunk_elements=100)  # 30 chunks
    assert got == (where is None) == bool(torch.isfinite(t).all())
    assert reads.n == 1


def test_all_finite_non_contiguous_and_empty():
    w = torch.randn(40, 30)
    w[7, 3] = float("nan")
    assert not all_finite(w.t(), chunk_elements=64)
    assert all_finite(torch.randn(40, 30).t(), chunk_elements=64)
    assert all_finite(torch.empty(0))


def _packed(out: int, inp: int, gs: int):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out, inp, generator=g)
    scheme = QuantScheme(4, gs, False)
    G = inp // gs
    grouped = w.reshape(out, G, gs)
    lo, hi = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp_min(1e-8).t().contiguous()  # [G, out]
    zeros = torch.round(-lo / scales.t()).clamp(0, 15).t().to(torch.int32).contiguous()  # [G, out]
    g_idx = torch.arange(inp, dtype=torch.int32) // gs
    codes = quantize(w, scales, zeros, g_idx, 4)  # [out, in]
    x = torch.randn(256, inp, generator=g)
    return w, codes, scales, zeros, g_idx, x.t() @ x / 256, scheme


def test_row_errors_packed_one_read_and_chunks_agree():
    w, codes, scales, zeros, g_idx, H, scheme = _packed(48, 64, 32)
    whole = _row_errors_packed(w, codes, scales, zeros, g_idx, H, scheme, chunk_elements=1 << 20)
    with HostReads() as reads:
        chunked = _row_errors_packed(w, codes, scales, zeros, g_idx, H, scheme, chunk_elements=64 * 5)  # 10 blocks
    assert reads.n == 1
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=0)


def test_row_errors_packed_finds_a_bad_scale_in_a_later_block():
    w, codes, scales, zeros, g_idx, H, scheme = _packed(48, 64, 32)
    scales[1, 40] = float("inf")  # row 40: the 9th block of 5 rows
    with pytest.raises(FloatingPointError, match="NaN or Inf in the quantized weight"):
        _row_errors_packed(w, codes, scales, zeros, g_idx, H, scheme, name="x", chunk_elements=64 * 5)
