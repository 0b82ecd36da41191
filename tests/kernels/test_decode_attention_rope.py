"""The fused decode kernel (RoPE + KV-cache write + split attention + in-kernel combine) against its plain-PyTorch
reference: TRITON_INTERPRET=1 on the CPU in float32/float16, bf16 on the GPU (``-m gpu``)."""

import pytest
import torch

# tests/kernels/conftest.py sets TRITON_INTERPRET=1 without CUDA (before this import)
from quantkit.kernels.decode_attention import decode_attention_rope, decode_attention_rope_ref  # noqa: E402
from tests.conftest import rel_err  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _case(b, hq, hkv, d, s_max, positions, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    slots = b + 1
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=gen).to(DEV, dtype)
    k = torch.randn(slots, s_max, hkv, d, generator=gen).to(DEV, dtype)
    v = torch.randn(slots, s_max, hkv, d, generator=gen).to(DEV, dtype)
    # poison everything at and past each row's position: the kernel must write position p before anything reads
    # it, and read nothing past it
    row_slots = torch.randperm(slots, generator=gen)[:b]
    for slot, p in zip(row_slots.tolist(), positions):
        k[slot, p:] = float("nan")
        v[slot, p:] = float("nan")
    angles = torch.rand(s_max, d // 2, generator=gen) * 6.0
    cos, sin = angles.cos().to(DEV), angles.sin().to(DEV)
    pos = torch.tensor(positions, dtype=torch.int32, device=DEV)
    return qkv, cos, sin, pos, row_slots.to(DEV, torch.int32), k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hkv,d,positions,splits,window,softcap,rope", [
    (4, 2, 16, [0, 37], 3, -1, 0.0, True),      # the first token of a sequence (no cached key) beside a longer one
    (8, 2, 32, [70], 4, -1, 0.0, True),         # GQA group 4, every split busy
    (4, 4, 16, [5, 80, 33], 8, -1, 0.0, True),  # splits past short sequences stay empty
    (4, 1, 16, [50], 1, -1, 0.0, True),         # one split: no combine
    (4, 2, 16, [61, 9], 3, 7, 5.0, True),       # sliding window and soft-cap
    (2, 2, 16, [40], 2, -1, 0.0, False),        # no RoPE
    (32, 2, 128, [90, 41], 8, -1, 0.0, True),   # group 16 at head dim 128: the combine takes 4 splits a block
])
def test_fused_decode_matches_reference(dtype, hq, hkv, d, positions, splits, window, softcap, rope):
    if dtype == torch.float16 and not CUDA and splits > 3:
        pytest.skip("one float16 case per shape family is enough on the interpreter")
    qkv, cos, sin, pos, slots, k, v = _case(len(positions), hq, hkv, d, 96, positions, dtype, seed=sum(positions))
    k_ref, v_ref = k.clone(), v.clone()
    counters = torch.zeros(len(positions) * hkv, dtype=torch.int32, device=DEV)
    qkv_before = qkv.clone()
    # one key tile per split at least, so that these short rows use several splits (and some stay idle)
    out = decode_attention_rope(qkv, cos, sin, pos, slots, k, v, hq, counters, window_left=window, softcap=softcap,
                                rope=rope, num_splits=splits, block_n=16, min_split_keys=16)
    ref = decode_attention_rope_ref(qkv, cos, sin, pos, slots, k_ref, v_ref, hq, window_left=window,
                                    softcap=softcap, rope=rope)
    assert torch.isfinite(out).all()
    # float32 on the GPU: tl.dot rounds its operands to tf32 (10 mantissa bits, as float16): float16's tolerance
    # (run 2 on the H200: 1.1e-3 at head dim 32, against the 1e-3 allowed before)
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 and not CUDA else 3e-3)
    assert torch.equal(qkv, qkv_before)
    assert not counters.any(), "the combine must leave its counters zeroed for the next call"
    for slot, p in zip(slots.tolist(), positions):  # this token's key and value, written where the next step reads
        assert rel_err(k[slot, p], k_ref[slot, p]) < 1e-6 and torch.equal(v[slot, p], v_ref[slot, p])


def _qk_norm_three_ways(dtype, hq, hkv, d, positions, rope, offset, splits, block_n):
    """The kernel with the q/k norm inside, the q/k norm kernel then the kernel, and the reference with the norm:
    ``(qkv unchanged, outputs, written keys)`` for each."""
    from quantkit.kernels.decoder_ops import qk_norm

    # the cache holds every position asked for (a position past its end is a write out of bounds)
    s_max = max(96, max(positions) + 1)
    qkv, cos, sin, pos, slots, k, v = _case(len(positions), hq, hkv, d, s_max, positions, dtype, seed=7)
    gen = torch.Generator().manual_seed(8)
    qw, kw = (torch.rand(d, generator=gen) + 0.5).to(DEV, dtype), (torch.rand(d, generator=gen) + 0.5).to(DEV, dtype)
    norm = (qw, kw, 1e-6, offset)
    counters = torch.zeros(len(positions) * hkv, dtype=torch.int32, device=DEV)
    before = qkv.clone()
    caches = [(k.clone(), v.clone()) for _ in range(3)]
    kw_args = dict(rope=rope, num_splits=splits, block_n=block_n, min_split_keys=block_n)
    fused = decode_attention_rope(qkv, cos, sin, pos, slots, *caches[0], hq, counters, qk_norm=norm, **kw_args)
    normed = qkv.clone()
    qk_norm(normed, qw, kw, hq, hkv, d, 1e-6, offset)
    apart = decode_attention_rope(normed, cos, sin, pos, slots, *caches[1], hq, counters, **kw_args)
    ref = decode_attention_rope_ref(qkv, cos, sin, pos, slots, *caches[2], hq, rope=rope, qk_norm=norm)
    keys = [torch.stack([c[0][slot, p] for slot, p in zip(slots.tolist(), positions)]) for c in caches]
    return torch.equal(qkv, before), (fused, apart, ref), keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rope,offset", [(True, 0.0), (True, 1.0), (False, 0.0)])
def test_qk_norm_inside_is_the_norm_kernel_then_the_attention(dtype, rope, offset):
    """qk_norm=(weights, eps, offset): the per-head q/k norm inside the kernel gives what decoder_ops.qk_norm then
    the kernel give (the same rounding of the normed values; the norm's sum may add in another order), the new
    key written normed and rotated, qkv untouched, and the reference agrees."""
    unchanged, (fused, apart, ref), keys = _qk_norm_three_ways(dtype, 4, 2, 16, [37, 5], rope, offset, 3, 16)
    tol = 1e-6 if dtype == torch.float32 and not CUDA else 3e-3
    assert unchanged and rel_err(fused, apart) < tol and rel_err(fused, ref) < max(tol, 1e-5)
    assert rel_err(keys[0], keys[1]) < tol and rel_err(keys[0], keys[2]) < max(tol, 1e-5)


def test_split_count_does_not_change_the_result():
    qkv, cos, sin, pos, slots, k, v = _case(1, 4, 2, 16, 96, [90], torch.float32, seed=3)
    counters = torch.zeros(2, dtype=torch.int32, device=DEV)
    outs = [decode_attention_rope(qkv, cos, sin, pos, slots, k.clone(), v.clone(), 4, counters, num_splits=s,
                                  block_n=16, min_split_keys=keys) for s, keys in ((1, None), (2, 16), (6, 16), (8, 32))]
    tol = 3e-3 if CUDA else 1e-5
    assert all(rel_err(out, outs[0]) < tol for out in outs[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("hq,hkv,d,positions,window,softcap", [
    (32, 8, 128, [0, 130, 2047, 700], -1, 0.0),   # Llama-3-8B heads, default splits
    (16, 8, 256, [300, 5], 64, 50.0),             # Gemma-2-like: head dim 256, window, soft-cap
    (9, 3, 64, [100], -1, 0.0),                   # SmolLM2: group 3 (masked tile rows)
])
def test_gpu_fused_decode_bf16(pdl, hq, hkv, d, positions, window, softcap):
    qkv, cos, sin, pos, slots, k, v = _case(len(positions), hq, hkv, d, 2049, positions, torch.bfloat16, seed=5)
    k_ref, v_ref = k.clone(), v.clone()
    counters = torch.zeros(len(positions) * hkv, dtype=torch.int32, device=DEV)
    for _ in range(3):  # repeated calls reuse the counters
        out = decode_attention_rope(qkv, cos, sin, pos, slots, k, v, hq, counters, window_left=window,
                                    softcap=softcap, pdl=pdl)
    ref = decode_attention_rope_ref(qkv, cos, sin, pos, slots, k_ref, v_ref, hq, window_left=window, softcap=softcap)
    assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-2
    assert not counters.any()


@pytest.mark.gpu
@pytest.mark.parametrize("positions", [[0, 700], [2047]])
def test_gpu_qk_norm_inside_at_the_qwen3_moe_heads(positions):
    """bf16 at Qwen3-30B-A3B's heads (32 q, 4 kv, head dim 128), the launcher's own splits and tiles."""
    unchanged, (fused, apart, ref), keys = _qk_norm_three_ways(torch.bfloat16, 32, 4, 128, positions, True, 0.0,
                                                               None, None)
    assert unchanged and rel_err(fused, apart) < 1e-2 and rel_err(fused, ref) < 1e-2
    assert rel_err(keys[0], keys[1]) < 1e-2
