"""The attention selection (kernels/attention_select.py): one capability check of the Gluon kernels with its
reasons, and the H200 picks. CPU only."""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels.attention_select import (
    AttentionCall,
    fp8_work_ratio,
    gluon_attention_supports,
    select_attention,
    select_fp8,
)

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


# fp8="auto": the H200 crossover (bench/results/attention_fp8_crossover_h200.json), pinned at the measured
# points: (heads, head dim, seqlen, causal) -> FP8 chosen, beside the measured FP8-call / bf16 ratio.
@pytest.mark.parametrize("hq,hkv,d,s,causal,fp8", [
    (16, 16, 128, 1536, False, False),  # 0.997x
    (16, 16, 128, 2048, False, True),   # 1.067x
    (16, 16, 128, 2048, True, False),   # 0.918x
    (16, 16, 128, 3072, True, False),   # 1.023x: ratio 512, at the crossover
    (16, 16, 128, 4096, True, True),    # 1.093x
    (32, 8, 128, 1024, False, True),    # 1.079x
    (32, 8, 128, 1024, True, False),    # 0.926x
    (32, 8, 128, 1536, True, False),    # 1.007x
    (32, 8, 128, 2048, True, True),     # 1.085x
    (16, 16, 64, 2048, False, False),   # 0.973x
    (16, 16, 64, 3072, False, True),    # 1.042x
    (16, 16, 64, 4096, True, False),    # 0.994x
    (16, 16, 64, 8192, True, True),     # 1.093x
])
def test_fp8_auto_crossover(hq, hkv, d, s, causal, fp8):
    chosen, reason = select_fp8(call(heads_q=hq, heads_kv=hkv, head_dim=d, max_seqlen_q=s, causal=causal))
    assert chosen == fp8 and reason.startswith("fp8" if fp8 else "16-bit")


def test_fp8_auto_reads_keys_and_declines_what_it_has_not_measured():
    # chunked prefill: 512 new queries over 8192 keys attend ~7936 keys each, FP8 pays though the queries are few
    assert fp8_work_ratio(call(max_seqlen_q=512, max_seqlen_k=8192, causal=True, heads_q=16, heads_kv=16)) == 7936 / 3
    assert select_fp8(call(max_seqlen_q=512, max_seqlen_k=8192, causal=True, heads_q=16, heads_kv=16))[0]
    long = dict(max_seqlen_q=16384, heads_q=16, heads_kv=16)
    assert select_fp8(call(**long))[0]
    for kw in (dict(head_dim=256), dict(arch="sm80"), dict(arch=None), dict(window_left=128), dict(kv_aligned=False),
               dict(head_dim=96)):
        chosen, reason = select_fp8(call(**long | kw))
        assert not chosen and reason.startswith("16-bit")
