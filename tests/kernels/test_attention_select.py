"""The attention selection (kernels/attention_select.py): one capability check of the Gluon kernels with its
reasons, and the H200 picks. CPU only."""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels.attention_select import AttentionCall, gluon_attention_supports, select_attention

BF16 = str(torch.bfloat16)


def call(**kw):
    return AttentionCall(**({"arch": "sm90", "dtype": BF16, "k_dtype": BF16, "head_dim": 128} | kw))


@pytest.mark.parametrize("kw,backend", [
    (dict(max_seqlen_q=4096), "gluon_ws"),
    (dict(max_seqlen_q=256, causal=True), "gluon"),
    (dict(max_seqlen_q=256, causal=True, head_dim=64), "gluon"),
    (dict(max_seqlen_q=256), "gluon_ws"),
    (dict(max_seqlen_q=512, causal=True), "gluon_ws"),
    (dict(max_seqlen_q=1024, causal=True), "gluon_ws"),
    (dict(max_seqlen_q=512, head_dim=64), "gluon_ws"),
    (dict(max_seqlen_q=256, causal=True, fp8=True), "gluon_ws"),
    (dict(max_seqlen_q=512, fp8=True), "gluon_ws"),
    (dict(max_seqlen_q=4096, fp8=True, kv_aligned=False), "triton"),
    (dict(max_seqlen_q=4096, fp8=True, fp8_pv=False), "triton"),
    (dict(max_seqlen_q=4096, window_left=256), "triton"),
    (dict(max_seqlen_q=4096, softcap=50.0), "triton"),
    (dict(max_seqlen_q=4096, head_dim=256), "triton"),
    (dict(max_seqlen_q=4096, arch="sm80"), "triton"),
    (dict(max_seqlen_q=4096, arch=None), "triton"),
    (dict(max_seqlen_q=4096, dtype="torch.float32", k_dtype="torch.float32"), "triton"),
])
def test_selection(kw, backend):
    picked, reason = select_attention(call(**kw))
    assert picked == backend and reason
    assert gluon_attention_supports(call(**kw))[0] == (backend != "triton")


def test_explicit_gluon_backend_on_an_unsupported_call_says_why():
    from quantkit.kernels.attention import attention_varlen

    q = torch.randn(8, 2, 16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="Hopper"):
        attention_varlen(q, q, q, cu, cu, 8, backend="gluon_ws")
    with pytest.raises(ValueError, match="backend must be"):
        attention_varlen(q, q, q, cu, cu, 8, backend="flash")
