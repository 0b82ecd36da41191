"""The FP8 KV cache (e4m3 codes and one float32 scale a token and KV head) in the two kernels that write it and the
one that reads it at decode, against their plain-PyTorch references: TRITON_INTERPRET=1 on the CPU in float32 and
float16, bf16 on the GPU (``-m gpu``)."""

import pytest
import torch

# tests/kernels/conftest.py sets TRITON_INTERPRET=1 without CUDA (before these imports)
from quantkit.kernels import decoder_ops, decoder_ops_ref  # noqa: E402
from quantkit.kernels.decode_attention import decode_attention_rope, decode_attention_rope_ref  # noqa: E402
from quantkit.kernels.fp8_quant_ref import dequantize_kv_ref, quantize_kv_ref  # noqa: E402
from tests.conftest import rel_err  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _fp8_cache(slots, s_max, hkv, d, gen, filled_to=None):
    """An FP8 cache of random entries up to ``filled_to[slot]`` (NaN codes past it: nothing may read them)."""
    x = torch.randn(slots, s_max, hkv, d, generator=gen) * torch.rand(slots, s_max, hkv, 1, generator=gen) * 4
    codes, scale = quantize_kv_ref(x)
    if filled_to is not None:
        for slot, p in filled_to.items():
            codes[slot, p:] = float("nan")
            scale[slot, p:] = float("nan")
    return codes.to(DEV), scale.to(DEV)


def assert_kernel_codes(codes: torch.Tensor, x: torch.Tensor) -> None:
    """``codes [..., D]`` are bitwise what the per-token quantization kernel gives on ``x [..., D]`` (one row a
    vector): on a GPU that is torch's rounding; the interpreter's e4m3 conversion does not round to nearest
    (tests/kernels/test_fp8_quant.py), so on the CPU only a kernel's codes can be compared bit for bit."""
    from quantkit.kernels.fp8_quant import quantize_per_token

    want, _ = quantize_per_token(x.reshape(-1, x.shape[-1]).contiguous())
    assert torch.equal(codes.reshape(want.shape).view(torch.uint8), want.view(torch.uint8))


def test_quantize_kv_ref_scales_each_vector_by_its_absmax():
    x = torch.randn(3, 5, 2, 16) * torch.tensor([1e-3, 1.0, 300.0]).view(3, 1, 1, 1)
    codes, scale = quantize_kv_ref(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (3, 5, 2) and scale.dtype == torch.float32
    assert torch.equal(codes.float().abs().amax(-1), torch.full((3, 5, 2), 448.0))  # each vector's absmax is 448
    back = dequantize_kv_ref(codes, scale, torch.float32)
    assert rel_err(back, x) < 0.04  # e4m3's 3-bit mantissa: ~2.6 % relative error
    zero_codes, zero_scale = quantize_kv_ref(torch.zeros(2, 8))
    assert (zero_scale > 0).all() and not zero_codes.float().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_cache_writes_fp8_entries_as_the_reference(dtype):
    """The prefill's RoPE + cache write into an FP8 cache: q/k rotated in place as with a 16-bit cache, and the
    cache's codes and scales bitwise the reference's."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, m = 4, 2, 16, 5
    qkv = (torch.randn(m, (hq + 2 * hkv) * d, generator=g) * 3).to(DEV, dtype)
    angles = torch.rand(32, d // 2, generator=g) * 6
    cos, sin = angles.cos().to(DEV), angles.sin().to(DEV)
    positions = torch.tensor([0, 3, 7, 31, 2], dtype=torch.int32, device=DEV)
    slots = torch.tensor([1, 1, 0, 2, 3], dtype=torch.int32, device=DEV)
    caches = [torch.zeros(4, 32, hkv, d, dtype=torch.float8_e4m3fn, device=DEV) for _ in range(4)]
    scales = [torch.zeros(4, 32, hkv, dtype=torch.float32, device=DEV) for _ in range(4)]
    expected = qkv.clone()
    decoder_ops_ref.rope_cache_ref(expected, cos, sin, positions, hq, hkv, d, caches[0], caches[1], slots,
                                   scales[0], scales[1])
    decoder_ops.rope_cache(qkv, cos, sin, positions, hq, hkv, d, caches[2], caches[3], slots, scales[2], scales[3])
    assert rel_err(qkv, expected) < (1e-6 if dtype == torch.float32 else 2e-3)
    rows, at = slots.long(), positions.long()
    k_rows = expected[:, hq * d:(hq + hkv) * d].reshape(m, hkv, d)  # the rotated keys, as the model rounds them
    v_rows = expected[:, (hq + hkv) * d:].reshape(m, hkv, d)
    for (ref, got), x in zip(((0, 2), (1, 3)), (k_rows, v_rows)):
        assert scales[ref].abs().sum() > 0
        if dtype == torch.float16 or not CUDA or ref == 1:  # a GPU's float32 rotation may differ in the last bit
            assert torch.equal(scales[got], scales[ref])
            assert_kernel_codes(caches[got][rows, at], x)
        assert rel_err(dequantize_kv_ref(caches[got], scales[got], torch.float32),
                       dequantize_kv_ref(caches[ref], scales[ref], torch.float32)) < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hkv,d,positions,splits,qk_norm", [
    (4, 2, 16, [0, 37], 3, False),    # the first token of a sequence (no cached key) beside a longer one
    (8, 2, 32, [70], 4, False),       # GQA group 4, every split busy, the combine
    (4, 1, 16, [50], 1, False),       # one split: no combine
    (4, 2, 16, [45, 9], 2, True),     # the q/k norm inside
])
def test_decode_reads_and_writes_an_fp8_cache_as_the_reference(dtype, hq, hkv, d, positions, splits, qk_norm):
    """Decode attention over an FP8 cache: the output as the reference's (cached entries read as codes x scale in
    the model's dtype, the new token attended as projected), the new token's codes and scale bitwise the
    reference's, nothing read past each row's position (NaN there), qkv unchanged."""
    if dtype == torch.float16 and not CUDA and splits > 2:
        pytest.skip("one float16 case per shape family is enough on the interpreter")
    gen = torch.Generator().manual_seed(sum(positions) + 1)
    b, slots, s_max = len(positions), len(positions) + 1, 96
    qkv = (torch.randn(b, (hq + 2 * hkv) * d, generator=gen) * 2).to(DEV, dtype)
    row_slots = torch.randperm(slots, generator=gen)[:b]
    k, ks = _fp8_cache(slots, s_max, hkv, d, gen, dict(zip(row_slots.tolist(), positions)))
    v, vs = _fp8_cache(slots, s_max, hkv, d, gen, dict(zip(row_slots.tolist(), positions)))
    angles = torch.rand(s_max, d // 2, generator=gen) * 6.0
    cos, sin = angles.cos().to(DEV), angles.sin().to(DEV)
    pos = torch.tensor(positions, dtype=torch.int32, device=DEV)
    rows = row_slots.to(DEV, torch.int32)
    norm = None
    if qk_norm:
        qw, kw = (torch.rand(d, generator=gen) + 0.5).to(DEV, dtype), (torch.rand(d, generator=gen) + 0.5).to(DEV, dtype)
        norm = (qw, kw, 1e-6, 0.0)
    ref_cache = [t.clone() for t in (k, v, ks, vs)]
    counters = torch.zeros(b * hkv, dtype=torch.int32, device=DEV)
    before = qkv.clone()
    out = decode_attention_rope(qkv, cos, sin, pos, rows, k, v, hq, counters, num_splits=splits, block_n=16,
                                min_split_keys=16, qk_norm=norm, k_scale=ks, v_scale=vs)
    ref = decode_attention_rope_ref(qkv, cos, sin, pos, rows, ref_cache[0], ref_cache[1], hq, qk_norm=norm,
                                    k_scale=ref_cache[2], v_scale=ref_cache[3])
    assert torch.isfinite(out).all() and torch.equal(qkv, before) and not counters.any()
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 and not CUDA else 3e-3)
    rotated = qkv.clone()  # the new keys as the reference rounds them: q/k norm, then RoPE
    if qk_norm:
        decoder_ops_ref.qk_norm_ref(rotated, qw, kw, hq, hkv, d, 1e-6, 0.0)
    decoder_ops_ref.rope_cache_ref(rotated, cos, sin, pos, hq, hkv, d)
    k_new, v_new = (rotated[:, (hq + j * hkv) * d:(hq + (j + 1) * hkv) * d].reshape(b, hkv, d) for j in (0, 1))
    for i, (slot, p) in enumerate(zip(row_slots.tolist(), positions)):
        assert torch.equal(vs[slot, p], ref_cache[3][slot, p])
        assert_kernel_codes(v[slot, p][None], v_new[i][None])
        assert rel_err(ks[slot, p], ref_cache[2][slot, p]) < 1e-6  # the rotated key: float32 sums may differ
        if dtype == torch.float16 or not CUDA:
            assert_kernel_codes(k[slot, p][None], k_new[i][None])


def test_an_fp8_cache_attends_close_to_a_16_bit_one():
    """The same keys and values cached in 16 bits and in FP8: the outputs differ by e4m3's rounding, not more."""
    gen = torch.Generator().manual_seed(11)
    hq, hkv, d, p = 8, 2, 32, 60
    qkv = torch.randn(1, (hq + 2 * hkv) * d, generator=gen).to(DEV, torch.float32)
    x_k, x_v = torch.randn(2, 96, hkv, d, generator=gen), torch.randn(2, 96, hkv, d, generator=gen)
    angles = torch.rand(96, d // 2, generator=gen) * 6.0
    cos, sin = angles.cos().to(DEV), angles.sin().to(DEV)
    pos, rows = torch.tensor([p], dtype=torch.int32, device=DEV), torch.tensor([1], dtype=torch.int32, device=DEV)
    counters = torch.zeros(hkv, dtype=torch.int32, device=DEV)
    plain = decode_attention_rope(qkv, cos, sin, pos, rows, x_k.to(DEV), x_v.to(DEV), hq, counters, block_n=16)
    (k, ks), (v, vs) = quantize_kv_ref(x_k), quantize_kv_ref(x_v)
    fp8 = decode_attention_rope(qkv, cos, sin, pos, rows, k.to(DEV), v.to(DEV), hq, counters, block_n=16,
                                k_scale=ks.to(DEV), v_scale=vs.to(DEV))
    err = rel_err(fp8, plain)
    assert 1e-4 < err < 0.05, err


@pytest.mark.gpu
@pytest.mark.parametrize("positions", [[1], [300, 17, 2000]])
def test_gpu_fp8_cache_at_the_qwen3_moe_heads(positions):
    """bf16 at Qwen3-30B-A3B's heads (32 q, 4 KV, head dim 128) with the launcher's own tiles and split count:
    the kernel against the reference, and from a CUDA graph replay the same bits."""
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, s_max = 32, 4, 128, 2048 + 64
    b, slots = len(positions), len(positions) + 1
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=gen).to("cuda", torch.bfloat16)
    k, ks = _fp8_cache(slots, s_max, hkv, d, gen)
    v, vs = _fp8_cache(slots, s_max, hkv, d, gen)
    angles = torch.rand(s_max, d // 2, generator=gen) * 6.0
    cos, sin = angles.cos().cuda(), angles.sin().cuda()
    pos = torch.tensor(positions, dtype=torch.int32, device="cuda")
    rows = torch.arange(b, dtype=torch.int32, device="cuda")
    ref_cache = [t.clone() for t in (k, v, ks, vs)]
    counters = torch.zeros(b * hkv, dtype=torch.int32, device="cuda")
    out = decode_attention_rope(qkv, cos, sin, pos, rows, k, v, hq, counters, k_scale=ks, v_scale=vs, pdl=True)
    ref = decode_attention_rope_ref(qkv, cos, sin, pos, rows, ref_cache[0], ref_cache[1], hq,
                                    k_scale=ref_cache[2], v_scale=ref_cache[3])
    assert rel_err(out, ref) < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        again = decode_attention_rope(qkv, cos, sin, pos, rows, k, v, hq, counters, k_scale=ks, v_scale=vs,
                                      pdl=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(again, out) and not counters.any()


@pytest.mark.parametrize("qk_norm", [False, True])
def test_decode_attention_on_an_fp8_cache_compiles_for_sm90_without_spills(sm90, tmp_path, qk_norm):
    """The fused decode attention at Qwen3-30B-A3B's heads (group 8, head dim 128, the launcher's tiles) reading
    an FP8 cache: no spills, and the new token's codes made by round-to-nearest conversions."""
    signature = {"qkv_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i32", "slots_ptr": "*i32",
                 "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "o_part_ptr": "*fp32", "lse_part_ptr": "*fp32",
                 "out_ptr": "*bf16", "counter_ptr": "*i32", "qw_ptr": "*fp32", "kw_ptr": "*fp32", "sm_scale": "fp32",
                 "window_left": "i32", "softcap": "fp32", "norm_eps": "fp32", "norm_offset": "fp32",
                 "stride_qkv": "i32", "stride_cos": "i32", "stride_kb": "i32", "stride_kn": "i32", "stride_kh": "i32",
                 "stride_out": "i32", "ks_ptr": "*fp32", "vs_ptr": "*fp32", "stride_sb": "i32", "stride_sn": "i32"}
    constexprs = dict(N_HEADS=32, N_KV=4, GROUP=8, HALF=64, NUM_SPLITS=16, MIN_SPLIT_KEYS=256, BLOCK_M=16,
                      BLOCK_N=64, ROPE=True, HAS_WINDOW=False, HAS_SOFTCAP=False, PDL=True, GROUP_P2=8, SPLITS_P2=16,
                      SPLIT_BLOCK=8, QK_NORM=qk_norm, FP8_KV=True)
    aligned = [name for name, ty in signature.items() if ty.startswith("*")] + [
        "stride_qkv", "stride_cos", "stride_kb", "stride_kn", "stride_kh", "stride_out", "stride_sb"]
    ptx = sm90.triton_ptx(str(tmp_path / "decode_fp8kv.ptx"), "quantkit.kernels.decode_attention",
                          "_decode_rope_kernel", signature, constexprs, num_warps=4, aligned=tuple(aligned))
    notices = sm90.ptxas_notices(ptx)
    assert "0 bytes spill stores" in notices, notices
    assert "cvt.rn.satfinite.e4m3x2.f32" in open(ptx).read()  # the new token's codes, rounded to nearest


def test_rope_cache_into_an_fp8_cache_compiles_for_sm90(sm90, tmp_path):
    signature = {"qkv_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i32", "slot_ptr": "*i32",
                 "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "stride_t": "i32", "stride_cos": "i32",
                 "stride_cs": "i32", "stride_cn": "i32", "stride_ch": "i32", "ks_ptr": "*fp32", "vs_ptr": "*fp32",
                 "stride_ss": "i32", "stride_sn": "i32"}
    constexprs = dict(N_HEADS=32, N_KV=4, HALF=64, WRITE_CACHE=True, FP8_KV=True)
    ptx = sm90.triton_ptx(str(tmp_path / "rope_fp8kv.ptx"), "quantkit.kernels.decoder_ops", "_rope_cache_kernel",
                          signature, constexprs, num_warps=1)
    assert "0 bytes spill stores" in sm90.ptxas_notices(ptx)
