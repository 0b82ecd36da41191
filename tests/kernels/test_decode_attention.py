"""The decode-attention reference (kernels/decode_attention.py) against PyTorch's SDPA, and the fused decode
kernel's split-count rule. The fused kernel itself is tested in test_decode_attention_rope.py."""

import pytest
import torch
import torch.nn.functional as F

# tests/kernels/conftest.py sets TRITON_INTERPRET=1 without CUDA (before this import)
from quantkit.kernels.decode_attention import _rope_decode_splits, decode_attention_ref  # noqa: E402
from tests.conftest import rel_err  # noqa: E402


def _sdpa_rows(q, k_cache, v_cache, lengths, slots, window_left):
    """Row by row through SDPA in float64 with an explicit mask (causal among the new tokens, optional window)."""
    out = []
    group = q.shape[2] // k_cache.shape[2]
    for i, (length, row) in enumerate(zip(lengths, slots)):
        sq = q.shape[1]
        k = k_cache[row, :length].double().repeat_interleave(group, 1).transpose(0, 1)
        v = v_cache[row, :length].double().repeat_interleave(group, 1).transpose(0, 1)
        pos = torch.arange(sq)[:, None] + length - sq
        cols = torch.arange(length)[None, :]
        visible = cols <= pos
        if window_left >= 0:
            visible &= cols >= pos - window_left
        out.append(F.scaled_dot_product_attention(q[i].double().transpose(0, 1), k, v, attn_mask=visible)
                   .transpose(0, 1))
    return torch.stack(out)


@pytest.mark.parametrize("sq,hq,hkv,window_left", [(1, 4, 4, -1), (3, 8, 2, -1), (2, 4, 1, 6)])
def test_reference_matches_sdpa(sq, hq, hkv, window_left):
    """Several new tokens (causal among them), GQA/MQA, ragged lengths, rows on other cache rows, a window."""
    gen = torch.Generator().manual_seed(sq + 10 * hq + window_left)
    q = torch.randn(3, sq, hq, 32, generator=gen)
    k = torch.randn(4, 50, hkv, 32, generator=gen)
    v = torch.randn(4, 50, hkv, 32, generator=gen)
    lengths, slots = [9, 50, 23], [3, 0, 2]
    ref = decode_attention_ref(q, k, v, torch.tensor(lengths, dtype=torch.int32),
                               cache_slots=torch.tensor(slots, dtype=torch.int32), window_left=window_left)
    assert rel_err(ref, _sdpa_rows(q, k, v, lengths, slots, window_left)) < 1e-6


def test_reference_softcap():
    """Soft-capping: a cap far above the logits changes nothing; a tight one flattens the attention."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, 2, 32, generator=gen) * 3
    k = torch.randn(1, 40, 2, 32, generator=gen)
    v = torch.randn(1, 40, 2, 32, generator=gen)
    lens = torch.tensor([40], dtype=torch.int32)
    plain = decode_attention_ref(q, k, v, lens)
    assert rel_err(decode_attention_ref(q, k, v, lens, softcap=1e4), plain) < 1e-6
    flat = decode_attention_ref(q, k, v, lens, softcap=1e-3)  # every logit ~0: the mean of the values
    assert rel_err(flat[0, 0], v[0].mean(0)) < 1e-3


@pytest.mark.parametrize("batch,n_kv,max_len,splits", [
    (1, 8, 32768, 16),   # 8 programs a split: 16 splits fill one wave of 132 SMs (17 would spill 4 programs)
    (2, 8, 32768, 8),    # 16 programs a split: one wave is 8 splits
    (4, 8, 8192, 8),
    (8, 8, 8192, 4),
    (32, 8, 1024, 1),
    (64, 8, 2048, 1),
    (1, 3, 2048, 8),     # SmolLM2: the row's length caps it (2048 / 256 keys)
    (1, 1, 1 << 20, 64),  # the cap
])
def test_fused_split_count(batch, n_kv, max_len, splits):
    """The fused kernel's split counts on an H200 (132 SMs; bench/archive/NOTES_decode.md has the sweep behind them)."""
    assert _rope_decode_splits(batch, n_kv, max_len, 256, 132) == splits
