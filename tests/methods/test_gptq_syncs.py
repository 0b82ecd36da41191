"""GPTQ's host round trips (on a GPU each is a blocking sync; here they are counted): the chunked finite checks
read one flag a call, whatever the number of chunks, and still find a NaN or Inf in any chunk; a layer's error
floats are read together, once a layer, with the values separate reads give."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from quantkit.config import QuantScheme
from quantkit.methods.gptq import _row_errors_packed, all_finite
from quantkit.primitives import quantize


class HostReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense``: every ``.item()``, ``bool()`` or ``float()`` of a tensor."""

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


def test_row_errors_in_bfloat16_keep_the_relative_errors_to_three_digits():
    # what an accelerator runs (gptq._row_errors_packed casts H there): display-only numbers, so bfloat16
    # products are fine as long as the per-linear ratios shown to the user stay put
    from quantkit.methods.gptq import _row_errors, relative_error_tensor
    from quantkit.primitives import dequantize

    w, codes, scales, zeros, g_idx, H, scheme = _packed(96, 256, 64)
    w_gptq = dequantize(codes, scales, zeros, g_idx)
    exact = _row_errors(w, w_gptq, H, scheme)
    fast = _row_errors(w, w_gptq, H.to(torch.bfloat16), scheme)
    assert fast.dtype == torch.float32
    for k in (0, 1):  # GPTQ's and RTN's relative error of the whole linear
        e, f = relative_error_tensor(exact[k], exact[2]), relative_error_tensor(fast[k], fast[2])
        assert abs(float(f) / float(e) - 1) < 2e-3, (k, float(e), float(f))
    torch.testing.assert_close(fast, exact, rtol=2e-2, atol=0)  # and each row close


def test_row_errors_packed_finds_a_bad_scale_in_a_later_block():
    w, codes, scales, zeros, g_idx, H, scheme = _packed(48, 64, 32)
    scales[1, 40] = float("inf")  # row 40: the 9th block of 5 rows
    with pytest.raises(FloatingPointError, match="NaN or Inf in the quantized weight"):
        _row_errors_packed(w, codes, scales, zeros, g_idx, H, scheme, name="x", chunk_elements=64 * 5)


@pytest.mark.parametrize("single_pass_max_tokens", [None, 0], ids=["single-pass", "by-group"])
def test_layer_errors_read_once_a_layer_with_the_same_values(single_pass_max_tokens, monkeypatch):
    from transformers import LlamaForCausalLM

    from quantkit.calibrate.walker import walk
    from quantkit.methods import gptq_method
    from quantkit.methods.gptq import GPTQConfig
    from tests.conftest import tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(1))
    made, reads, scalar_reads = [], [], []
    real_tensor, real_finish, real_tolist = (gptq_method.relative_error_tensor, gptq_method._LayerWork.finish_errors,
                                             torch.Tensor.tolist)

    def tensor(row_err, row_energy):
        with HostReads() as r:
            t = real_tensor(row_err, row_energy)
        scalar_reads.append(r.n)
        made.append(t)
        return t

    def finish(work):
        calls = []
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: calls.append(1) or real_tolist(t))
        try:
            with HostReads() as r:
                real_finish(work)
        finally:
            monkeypatch.setattr(torch.Tensor, "tolist", real_tolist)
        reads.append((len(calls), r.n))

    monkeypatch.setattr(gptq_method, "relative_error_tensor", tensor)
    monkeypatch.setattr(gptq_method._LayerWork, "finish_errors", finish)
    extra = {} if single_pass_max_tokens is None else {"single_pass_max_tokens": single_pass_max_tokens}
    result = walk(copy.deepcopy(model), gptq_method.GPTQMethod(QuantScheme(4, 32, True), GPTQConfig(**extra)),
                  device="cpu", token_ids=ids, batch_size=4)
    n_layers, n_linears = len(result.layer_stats), 7
    assert reads == [(1, 0)] * n_layers  # one tolist a layer, no scalar reads
    assert len(made) == 2 * n_linears * n_layers and not any(scalar_reads)
    got = [s[k] for layer in result.layer_stats for s in layer["linears"].values() for k in ("err_rtn", "err_gptq")]
    assert sorted(got) == sorted(float(t) for t in made)  # what float() of each scalar gives, bit for bit
    assert all(isinstance(v, float) for v in got)
