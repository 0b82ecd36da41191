"""The general flash-decoding kernel (split-K with a second reduce launch), moved out of the library in session 19
(issue #23: the library keeps only kernels something selects; the runtime decodes through the fused
``decode_attention_rope``). Kept as the baseline the fused kernel is timed against, and for callers that need what
only it does: several new tokens per sequence (speculative decoding) and a q separate from the projection.

    python bench/experimental/decode_split_k.py [--out bench/results/decode_kernels.json]      (CUDA)
    TRITON_INTERPRET=1 python bench/experimental/decode_split_k.py --check                    (CPU, small sizes)

On CUDA it checks both kernels against ``decode_attention_ref`` and times them (CUDA-graph replays, median) on the
README decode rows and a few more. The fused kernel is given a cos/sin table of ones/zeros (RoPE the identity),
the last cached key and value as its new token's, so both compute the same attention.

    q:             (B, Sq, Hq, D)     Sq new tokens per sequence; Hq a multiple of Hkv
    k_cache:       (B, S_max, Hkv, D) (or (slots, S_max, Hkv, D) with ``cache_slots``)
    cache_seqlens: (B,) int32         valid keys per sequence, the Sq new tokens included

New token t of sequence b sits at position L_b - Sq + t and sees keys 0..L_b - Sq + t. One program takes all
G = Hq / Hkv query heads and all Sq tokens of a KV head as the rows of one tile (GQA costs no extra traffic), and
the keys of a sequence are split over NUM_SPLITS programs so a small batch fills the chip; each writes a partial
output normalised by its own sum plus its log-sum-exp, and the reduce kernel combines them exactly.
"""
import argparse
import datetime
import json
import math
import os
import platform

import torch
import triton
import triton.language as tl

from quantkit.kernels.decode_attention import _online_softmax_step, decode_attention_ref, decode_attention_rope


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, seqlens_ptr, slots_ptr, o_part_ptr, lse_part_ptr,
                         sm_scale, chunk, window_left, softcap,
                         stride_qb, stride_qs, stride_qh, stride_qd,
                         stride_kb, stride_kn, stride_kh, stride_kd,
                         stride_vb, stride_vn, stride_vh, stride_vd,
                         stride_ob, stride_oh, stride_os, stride_osp, stride_od,
                         stride_lb, stride_lh, stride_ls, stride_lsp,
                         SQ: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SLOTS: tl.constexpr,
                         HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    split = tl.program_id(0)
    b = tl.program_id(1)
    kv_head = tl.program_id(2)
    seqlen = tl.load(seqlens_ptr + b)
    # the cache row this query row reads (a slot of a cache shared by the batch, or row b itself)
    if HAS_SLOTS:
        cache_b = tl.load(slots_ptr + b).to(tl.int64)
    else:
        cache_b = b.to(tl.int64)

    # rows of the tile: (query head within the group, new token)
    offs_r = tl.arange(0, BLOCK_M)
    g = offs_r // SQ
    t = offs_r % SQ
    row_ok = offs_r < GROUP * SQ
    head = kv_head * GROUP + g
    pos = seqlen - SQ + t  # absolute position of each row's token: sees keys <= pos
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)

    q_ptrs = (q_ptr + b.to(tl.int64) * stride_qb + t[:, None] * stride_qs + head[:, None] * stride_qh
              + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)

    k_base = k_ptr + cache_b * stride_kb + kv_head * stride_kh
    v_base = v_ptr + cache_b * stride_vb + kv_head * stride_vh
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seqlen)
    if HAS_WINDOW:
        # keys before the earliest row's window are never visible: skip whole tiles of them
        lo = tl.maximum(lo, (tl.maximum(seqlen - SQ - window_left, 0) // BLOCK_N) * BLOCK_N)

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in tl.range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < hi
        k = tl.load(k_base + cols.to(tl.int64)[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=col_ok[:, None], other=0.0)
        v = tl.load(v_base + cols.to(tl.int64)[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=col_ok[:, None], other=0.0)
        # masking is cheap here (memory-bound), so every tile is masked: ragged end + causal
        keep = col_ok[None, :] & (cols[None, :] <= pos[:, None])
        if HAS_WINDOW:
            keep = keep & (cols[None, :] >= pos[:, None] - window_left)
        m_i, l_i, acc = _online_softmax_step(q, k, v, keep, m_i, l_i, acc, sm_scale, softcap, HAS_SOFTCAP)

    # partial result normalised by its own sum; lse (log2 units) = -inf marks an empty split
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
    o_ptrs = (o_part_ptr + b.to(tl.int64) * stride_ob + head[:, None] * stride_oh + t[:, None] * stride_os
              + split * stride_osp + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, acc, mask=row_ok[:, None])
    tl.store(lse_part_ptr + b * stride_lb + head * stride_lh + t * stride_ls + split * stride_lsp, lse,
             mask=row_ok)


@triton.jit
def _decode_reduce_kernel(o_part_ptr, lse_part_ptr, out_ptr, num_splits,
                          stride_ob, stride_oh, stride_os, stride_osp, stride_od,
                          stride_lb, stride_lh, stride_ls, stride_lsp,
                          stride_outb, stride_outs, stride_outh, stride_outd,
                          HEAD_DIM: tl.constexpr, SPLITS_P2: tl.constexpr):
    # one program per (batch, query head, new token): weight each split by exp2(lse - max)
    b = tl.program_id(0)
    head = tl.program_id(1)
    t = tl.program_id(2)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < num_splits
    lse = tl.load(lse_part_ptr + b * stride_lb + head * stride_lh + t * stride_ls + offs_s * stride_lsp,
                  mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m)  # empty splits weigh 0
    o = tl.load(o_part_ptr + b.to(tl.int64) * stride_ob + head * stride_oh + t * stride_os
                + offs_s[:, None] * stride_osp + offs_d[None, :] * stride_od, mask=s_ok[:, None], other=0.0)
    denom = tl.sum(w, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    o = tl.sum(o * w[:, None], 0) / denom
    tl.store(out_ptr + b.to(tl.int64) * stride_outb + t * stride_outs + head * stride_outh
             + offs_d * stride_outd,
             o.to(out_ptr.dtype.element_ty))


def _num_splits(batch, n_kv_heads, max_len, block_n, n_sms):
    # enough programs for ~2 waves, but each split keeps at least 4 key tiles of work
    want = triton.cdiv(2 * n_sms, batch * n_kv_heads)
    return max(1, min(want, triton.cdiv(max_len, 4 * block_n), 128))


def decode_attention(q, k_cache, v_cache, cache_seqlens, sm_scale=None, num_splits=None, block_n=None,
                     num_warps=4, cache_slots=None, window_left=-1, softcap=0.0):
    """Flash-decoding. q (B, Sq, Hq, D); k_cache, v_cache (B, S_max, Hkv, D), or (slots, S_max, Hkv, D)
    with ``cache_slots`` (B,) int32 naming the cache row of each query row (continuous batching);
    cache_seqlens (B,) int32 (keys valid per sequence, new tokens included). ``window_left >= 0``: a
    token at position p sees keys p - window_left .. p only (sliding window); ``softcap > 0``: logits
    ``softcap * tanh(s / softcap)``. -> (B, Sq, Hq, D). No host sync: safe inside a CUDA graph."""
    b, sq, n_heads, head_dim = q.shape
    _, s_max, n_kv_heads, _ = k_cache.shape
    assert n_heads % n_kv_heads == 0
    group = n_heads // n_kv_heads
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    on_gpu = q.is_cuda
    if block_n is None:
        block_n = 64 if on_gpu else 16
    if num_splits is None:
        n_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if on_gpu else 4
        num_splits = _num_splits(b, n_kv_heads, s_max, block_n, n_sms)
    # split length rounded to the tile, so splits never share a tile
    chunk = triton.cdiv(triton.cdiv(s_max, num_splits), block_n) * block_n
    block_m = max(16, triton.next_power_of_2(group * sq))
    o_part = torch.empty(b, n_heads, sq, num_splits, head_dim, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(b, n_heads, sq, num_splits, device=q.device, dtype=torch.float32)
    out = torch.empty_like(q)
    _decode_split_kernel[(num_splits, b, n_kv_heads)](
        q, k_cache, v_cache, cache_seqlens, cache_slots if cache_slots is not None else cache_seqlens,
        o_part, lse_part, sm_scale, chunk, int(window_left), float(softcap),
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *o_part.stride(), *lse_part.stride(),
        SQ=sq, GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_SLOTS=cache_slots is not None, HAS_WINDOW=window_left >= 0, HAS_SOFTCAP=softcap > 0,
        num_warps=num_warps)
    _decode_reduce_kernel[(b, n_heads, sq)](
        o_part, lse_part, out, num_splits, *o_part.stride(), *lse_part.stride(), *out.stride(),
        HEAD_DIM=head_dim, SPLITS_P2=triton.next_power_of_2(num_splits))
    return out


README_ROWS = [(1, 32768, 32, 8, 128), (8, 8192, 32, 8, 128), (64, 2048, 32, 8, 128), (16, 4096, 16, 16, 64)]
MORE_ROWS = [(4, 8192, 32, 8, 128), (32, 1024, 32, 8, 128), (1, 4096, 32, 8, 128), (128, 512, 32, 8, 128),
             (1, 512, 32, 8, 128), (1, 1024, 32, 8, 128), (1, 16384, 32, 8, 128), (8, 1024, 32, 8, 128),
             (1, 8192, 64, 8, 128), (1, 2048, 9, 3, 64)]

SWEEP_ROWS = [(2, 8192, 32, 8, 128), (2, 32768, 32, 8, 128), (16, 2048, 32, 8, 128), (4, 2048, 32, 8, 128),
              (1, 32768, 64, 8, 128), (1, 4096, 16, 8, 256)]


def fused_inputs(q, k_cache, v_cache, lens):
    """The fused kernel's arguments for the same attention: the last cached key/value become the new token's."""
    b, _, hq, d = q.shape
    hkv = k_cache.shape[2]
    pos = (lens - 1).long()
    rows = torch.arange(b, device=q.device)
    qkv = torch.cat([q[:, 0].reshape(b, hq * d), k_cache[rows, pos].reshape(b, hkv * d),
                     v_cache[rows, pos].reshape(b, hkv * d)], 1).contiguous()
    s_max = k_cache.shape[1]
    cos = torch.ones(s_max, d // 2, device=q.device)
    sin = torch.zeros(s_max, d // 2, device=q.device)
    slots = torch.arange(b, dtype=torch.int32, device=q.device)
    counters = torch.zeros(b * hkv, dtype=torch.int32, device=q.device)
    return (qkv, cos, sin, (lens - 1).to(torch.int32), slots, k_cache, v_cache, hq, counters)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_small():
    """Both kernels against the reference at interpreter sizes (ragged lengths, GQA, several new tokens)."""
    if os.environ.get("TRITON_INTERPRET") == "1":  # as tests/kernels/conftest.py: NumPy >= 2.4 loop bounds
        from triton.runtime import interpreter
        original = interpreter._patch_lang_tensor

        def patched(tensor, scope):
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        interpreter._patch_lang_tensor = patched
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    for sq, hq, hkv, lengths in [(1, 4, 2, [37, 100]), (3, 4, 1, [50, 9])]:
        q = torch.randn(len(lengths), sq, hq, 64, generator=gen).to(dev)
        k = torch.randn(len(lengths), 100, hkv, 64, generator=gen).to(dev)
        v = torch.randn_like(k)
        lens = torch.tensor(lengths, dtype=torch.int32, device=dev)
        ref = decode_attention_ref(q, k, v, lens)
        err = rel_err(decode_attention(q, k, v, lens, num_splits=3), ref)
        print(f"split-K sq={sq} hq={hq} hkv={hkv}: rel. err {err:.2e}")
        assert err < (3e-3 if dev == "cuda" else 1e-4)  # tl.dot on float32 is tf32 on the GPU
        if sq == 1:
            out = decode_attention_rope(*fused_inputs(q, k.clone(), v.clone(), lens)).view(q.shape)
            print(f"fused   sq=1 hq={hq} hkv={hkv}: rel. err {rel_err(out, ref):.2e}")
            assert rel_err(out, ref) < (3e-3 if dev == "cuda" else 1e-4)


def time_rows(rows, old_fused=None):
    """Each row: the split-K kernel, the fused one with its default splits and with the split-K kernel's count
    (two waves), and ``old_fused`` (another version's decode_attention_rope) when given; errors on row 0."""
    results = []
    for b, length, hq, hkv, d in rows:
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(b, length, hkv, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
        args = fused_inputs(q, kc, vc, lens)
        two_waves = _num_splits(b, hkv, length, 64, torch.cuda.get_device_properties(0).multi_processor_count)
        variants = {"split_k": lambda: decode_attention(q, kc, vc, lens),
                    "fused": lambda: decode_attention_rope(*args),
                    "fused_2waves": lambda: decode_attention_rope(*args, num_splits=two_waves)}
        if old_fused is not None:
            variants["fused_old"] = lambda: old_fused(*args)
        ref = decode_attention_ref(q[:1], kc[:1], vc[:1], lens[:1])
        row = {"batch": b, "cache_len": length, "hq": hq, "hkv": hkv, "head_dim": d}
        for name, fn in variants.items():
            row[f"{name}_rel_err"] = round(rel_err(fn().view(q.shape)[:1], ref), 5)
            ms = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
            row[f"{name}_us"] = round(ms * 1e3, 2)
        row["kv_TBps_fused"] = round(4 * b * length * hkv * d / row["fused_us"] / 1e6, 3)
        print(json.dumps(row), flush=True)
        results.append(row)
        del q, kc, vc, args
    return results


def sweep_splits(rows):
    """The fused kernel at each row with NUM_SPLITS at whole and rounded-down waves (1-4 programs a SM): which
    split count the default should give."""
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for b, length, hq, hkv, d in rows:
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(b, length, hkv, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
        args = fused_inputs(q, kc, vc, lens)
        units = b * hkv
        useful = triton.cdiv(length - 1, 256)  # a row uses at most this many splits (default min_split_keys)
        counts = sorted({max(1, min(c, useful, 128)) for w in (1, 2, 3, 4)
                         for c in (w * n_sms // units, triton.cdiv(w * n_sms, units))})
        row = {"batch": b, "cache_len": length, "hq": hq, "hkv": hkv, "head_dim": d, "units": units, "us": {}}
        for c in counts:
            ms = triton.testing.do_bench_cudagraph(lambda c=c: decode_attention_rope(*args, num_splits=c), rep=100,
                                                   return_mode="median")
            row["us"][c] = round(ms * 1e3, 2)
        row["best"] = min(row["us"], key=row["us"].get)
        print(json.dumps(row), flush=True)
        results.append(row)
        del q, kc, vc, args
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="correctness at small sizes only (CPU: TRITON_INTERPRET=1)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep-splits", action="store_true", help="only the fused kernel's split-count sweep")
    ap.add_argument("--old-fused", default=None, help="package of another version's kernels, e.g. main_kernels")
    args = ap.parse_args()
    check_small()
    if args.check or not torch.cuda.is_available():
        return
    meta = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    if args.sweep_splits:
        out = {"meta": meta, "splits_sweep": sweep_splits(README_ROWS + MORE_ROWS + SWEEP_ROWS)}
        with open(args.out or "decode_splits_sweep.json", "w") as f:
            json.dump(out, f, indent=1)
        return
    old = None
    if args.old_fused:
        import importlib
        old = importlib.import_module(f"{args.old_fused}.decode_attention").decode_attention_rope
    out = {"meta": meta, "readme_rows": time_rows(README_ROWS, old), "more_rows": time_rows(MORE_ROWS, old)}
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
