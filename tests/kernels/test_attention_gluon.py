"""GPU tests of the Gluon (FA3-ordered) attention kernel, kernels/attention_gluon.py.

Gluon kernels do not run under the CPU interpreter: on a machine without a Hopper GPU only the
dispatch is checked (`attention_varlen` falls back to the Triton kernel)."""

import pytest
import torch

from quantkit.kernels import attention_gluon
from quantkit.kernels.attention import attention_ref, attention_varlen

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _cu(lens, device):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)


def test_gluon_not_used_without_hopper():
    q = torch.randn(8, 2, 64)
    assert not attention_gluon.supported(q, q)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,config", [(64, None), (128, None), (128, (128, 128, 8, 3))])
@pytest.mark.parametrize("lens_q,lens_k", [
    ([1000, 37, 300], [1000, 37, 300]),   # varlen, lengths off the block size
    ([5, 130, 1], [700, 300, 129]),       # prefill against a cache (bottom-right causal)
    ([200], [77]),                        # more queries than keys: early rows see no key
])
def test_gluon_varlen_gqa(causal, d, config, lens_q, lens_k):
    gen = torch.Generator().manual_seed(7)
    hq, hkv = 8, 2
    q = torch.randn(sum(lens_q), hq, d, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(sum(lens_k), hkv, d, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(sum(lens_k), hkv, d, generator=gen).to("cuda", torch.bfloat16)
    cu_q, cu_k = _cu(lens_q, "cuda"), _cu(lens_k, "cuda")
    out = attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), causal=causal, backend="gluon", config=config)
    ref = attention_ref(q, k, v, cu_q, cu_k, causal=causal)
    assert torch.isfinite(out).all()
    # the reference runs in float32 on the same bf16 inputs; bf16 P and output give ~2-3e-3
    assert _rel_err(out, ref) < 1e-2
    assert (out[ref.abs().sum(-1) == 0] == 0).all()  # rows with no visible key are exactly 0


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hadamard", [False, True])
def test_gluon_fp8(causal, hadamard):
    """fp8 e4m3 Q, K, V and P; sequence starts on multiples of 32 (the gluon fp8 condition), lengths
    not multiples of the 128-key tile or K scale block."""
    gen = torch.Generator().manual_seed(8)
    lens = [1024, 96, 320]
    q, k, v = (torch.randn(sum(lens), h, 128, generator=gen).to("cuda", torch.bfloat16) for h in (8, 2, 2))
    cu = _cu(lens, "cuda")
    assert attention_gluon.supported(q, k, causal, fp8=True, cu_seqlens_k=cu)
    out = attention_varlen(q, k, v, cu, cu, max(lens), causal=causal, fp8=True, hadamard=hadamard, backend="gluon")
    out_triton = attention_varlen(q, k, v, cu, cu, max(lens), causal=causal, fp8=True, hadamard=hadamard,
                                  backend="triton")
    ref = attention_ref(q, k, v, cu, cu, causal=causal)
    assert torch.isfinite(out).all()
    assert _rel_err(out, ref) < 0.06  # e4m3: ~3-5% on gaussian data
    # same quantized inputs, same math: the two kernels differ by accumulation order only
    assert _rel_err(out, out_triton) < 0.02
