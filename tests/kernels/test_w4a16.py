"""W4A16 GEMM: the Triton kernel and the reference against an independent dequantize-then-matmul.

On a CPU the kernel runs under TRITON_INTERPRET=1 (set by conftest.py) in float16 only: the
interpreter's bf16 tl.dot is wrong (Triton issue #11584). GPU tests (marker ``gpu``) cover bf16
and fp16 at shapes that are multiples of the group size but not of the block sizes.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys

import pytest
import torch

from quantkit.pack import pack_gptq
from quantkit.primitives import compute_qparams, dequantize, quantize
from tests.conftest import rel_err

CUDA = torch.cuda.is_available()


def _kernel_module():
    """quantkit.kernels.w4a16, imported after the interpreter switch (re-imported if needed)."""
    mod = importlib.import_module("quantkit.kernels.w4a16")
    if not CUDA and os.environ.get("TRITON_INTERPRET") == "1":
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(mod._w4a16_kernel, InterpretedFunction):
            mod = importlib.reload(sys.modules["quantkit.kernels.w4a16"])
    return mod


def as_config(path, fields):
    """The config dataclass of ``path`` ("gemv", "pairs", "tc", "gluon") from a dict of its fields."""
    from quantkit.kernels.w4a16_configs import config_from_dict

    return None if fields is None else config_from_dict(path, fields)


def make_layer(n, k, bits, group_size, sym, act_order, device="cpu", seed=0):
    """Random GPTQ tensors for an ``[n, k]`` weight, plus the float32 dequantized weight ``[n, k]``."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    g_idx = None
    if act_order:
        # GPTQ act-order: column perm[i] gets group i // group_size.
        perm = torch.randperm(k, generator=gen)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // group_size).to(torch.int32)
    scales, zeros, g_idx = compute_qparams(w, bits, group_size, sym, g_idx)
    codes = quantize(w, scales, zeros, g_idx, bits)
    qweight, qzeros = pack_gptq(codes, zeros, bits)
    w_deq = dequantize(codes, scales.half(), zeros, g_idx)  # the checkpoint stores fp16 scales
    tensors = dict(qweight=qweight, qzeros=qzeros, scales=scales.half(), g_idx=g_idx)
    return {name: t.to(device) for name, t in tensors.items()}, w_deq.to(device)


# (n, k, bits, group_size, sym, act_order, m, config)
CASES = [
    (96, 256, 4, 128, True, False, 1, dict(BLOCK_N=32, BLOCK_M=16, BLOCK_K=64)),
    (96, 256, 4, 64, False, False, 5, dict(BLOCK_N=64, BLOCK_M=16, BLOCK_K=128)),  # gather path
    (80, 256, 4, 32, False, False, 3, dict(BLOCK_N=32, BLOCK_M=16, BLOCK_K=64, SPLIT_K=2)),
    (64, 256, 4, -1, True, False, 17, dict(BLOCK_N=32, BLOCK_M=16, BLOCK_K=64)),  # prefill path
    (72, 576, 4, 128, False, False, 7, dict(BLOCK_N=32, BLOCK_M=16, BLOCK_K=128)),  # partial group
    (72, 576, 4, 128, True, False, 33, dict(BLOCK_N=64, BLOCK_M=32, BLOCK_K=64, GROUP_N=2)),
    (64, 256, 4, 64, True, True, 9, dict(BLOCK_N=32, BLOCK_M=16, BLOCK_K=64, SPLIT_K=3)),  # act-order
    (64, 256, 4, 64, False, True, 21, dict(BLOCK_N=32, BLOCK_M=32, BLOCK_K=32)),
    (64, 192, 8, 64, False, False, 2, dict(BLOCK_N=32, BLOCK_M=16, BLOCK_K=64)),  # 8-bit
    (72, 576, 4, 128, False, True, 19, dict(BLOCK_N=32, BLOCK_M=16, BLOCK_K=64, W_IS_A=False)),
    (64, 256, 4, 32, False, False, 40, dict(BLOCK_N=64, BLOCK_M=32, BLOCK_K=128, W_IS_A=False)),
    (64, 256, 4, 32, True, False, 23, dict(BLOCK_N=32, BLOCK_M=16, BLOCK_K=64, W_IS_A=False)),
]

# The decode GEMV (no tensor cores): (n, k, bits, group_size, sym, act_order, m, config)
GEMV_CASES = [
    (96, 256, 4, 128, True, False, 1, dict(BLOCK_N=32, BLOCK_K=64)),  # sym, M=1
    (80, 256, 4, 64, False, False, 1, dict(BLOCK_N=16, BLOCK_K=64)),  # asym, N tail
    (72, 576, 4, 128, False, False, 3, dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=2)),  # partial group
    (72, 576, 4, 128, True, False, 7, dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=4)),  # split-K, uneven
    (64, 256, 4, 64, False, True, 3, dict(BLOCK_N=32, BLOCK_K=32, SPLIT_K=3)),  # act-order asym
    (64, 256, 4, 64, True, True, 7, dict(BLOCK_N=16, BLOCK_K=64, PIPE=3)),  # act-order sym
    (64, 256, 4, 32, False, False, 16, dict(BLOCK_N=16, BLOCK_K=32)),  # g32, M=16
    (64, 256, 4, -1, True, False, 5, dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=2)),  # per channel
    (64, 192, 8, 64, False, False, 2, dict(BLOCK_N=32, BLOCK_K=64)),  # 8-bit
    (48, 128, 4, 32, False, False, 3, None),  # default interpreter config
    # Tiles spanning several groups (per-group scale inside the tile), incl. the K=576 partial group
    (72, 576, 4, 128, False, False, 3, dict(BLOCK_N=32, BLOCK_K=256)),  # asym, M=3, 2 groups/tile
    (72, 576, 4, 128, True, False, 1, dict(BLOCK_N=16, BLOCK_K=512, PIPE=2)),  # sym, M=1, tail tile
    (64, 256, 4, 32, False, True, 7, dict(BLOCK_N=16, BLOCK_K=128, SPLIT_K=2)),  # act-order asym, M=7
    (64, 256, 4, 64, True, True, 1, dict(BLOCK_N=32, BLOCK_K=256, PROGS_PER_SM=4)),  # act-order sym
    (64, 192, 8, 64, False, False, 3, dict(BLOCK_N=32, BLOCK_K=128)),  # 8-bit, masked 2nd group
    # Direct (one K split, stored in x's dtype, no float32 buffer)
    (72, 576, 4, 128, False, False, 3, dict(BLOCK_N=16, BLOCK_K=256, SPLIT_K=1, PIPE=3)),  # asym, partial group
    (64, 256, 4, 64, True, True, 1, dict(BLOCK_N=8, BLOCK_K=128, SPLIT_K=1)),  # act-order sym
    (64, 192, 8, 64, False, False, 2, dict(BLOCK_N=8, BLOCK_K=64, SPLIT_K=1, num_warps=2)),  # 8-bit
    # whole rows in one tile (16 groups), and a tile wider than K (576: 4 groups and a partial one, masked)
    (16, 2048, 4, 128, False, False, 1, dict(BLOCK_N=2, BLOCK_K=2048, SPLIT_K=1, num_warps=2)),
    (24, 576, 4, 128, True, False, 1, dict(BLOCK_N=4, BLOCK_K=1024, SPLIT_K=1)),
]


@pytest.mark.skipif(CUDA, reason="interpreter tests run on CPU-only machines")
@pytest.mark.parametrize("n,k,bits,gs,sym,act,m,config", CASES)
def test_kernel_interpreted(n, k, bits, gs, sym, act, m, config):
    mod = _kernel_module()
    tensors, w_deq = make_layer(n, k, bits, gs, sym, act, seed=n + k + m)
    w = mod.prepare_w4a16_weights(**tensors, bits=bits, group_size=gs, sym=sym)
    assert (w.perm is not None) == act
    assert (w.zeros is None) == sym
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).half()
    ref = x.double() @ w_deq.double().t()
    out = mod.w4a16_matmul(x, w, config=as_config("tc", config))
    assert out.shape == (m, n) and out.dtype == torch.float16
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 2e-3


@pytest.mark.skipif(CUDA, reason="interpreter tests run on CPU-only machines")
@pytest.mark.parametrize("n,k,bits,gs,sym,act,m,config", GEMV_CASES)
def test_gemv_interpreted(n, k, bits, gs, sym, act, m, config):
    mod = _kernel_module()
    tensors, w_deq = make_layer(n, k, bits, gs, sym, act, seed=n + k + m + 1)
    w = mod.prepare_w4a16_weights(**tensors, bits=bits, group_size=gs, sym=sym)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + 1)).half()
    ref = x.double() @ w_deq.double().t()
    if config is None:  # the interpreter's default GEMV config, through the plan's rules
        out = mod.w4a16_matmul(x, w)
    else:
        out = mod.w4a16_matmul(x, w, config=as_config("gemv", config))
    assert out.shape == (m, n) and out.dtype == torch.float16
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 2e-3


# The paired-nibble tensor-core kernel (4-bit, K a multiple of 128): (n, k, group_size, sym, act_order, m, config)
PAIRS_CASES = [
    (64, 256, 128, True, False, 3, dict(BLOCK_N=32, BLOCK_M=16)),  # sym, one group per tile
    (80, 384, 64, False, False, 5, dict(BLOCK_N=64, BLOCK_M=16, SPLIT_K=2)),  # per-word groups, N tail
    (64, 256, 32, False, True, 20, dict(BLOCK_N=32, BLOCK_M=32)),  # g32 act-order, M tail
    (64, 256, -1, True, False, 70, dict(BLOCK_N=32, BLOCK_M=64)),  # per channel, M > 64 (split: few tiles)
    (640, 256, 128, False, False, 300, dict(BLOCK_N=64, BLOCK_M=64)),  # enough 128x128 tiles: direct store
    (48, 512, 128, False, True, 9, dict(BLOCK_N=16, BLOCK_M=16, SPLIT_K=3)),  # act-order, uneven split
    (32, 128, 128, True, False, 1, None),  # default interpreter config, M = 1
]


@pytest.mark.skipif(CUDA, reason="interpreter tests run on CPU-only machines")
@pytest.mark.parametrize("n,k,gs,sym,act,m,config", PAIRS_CASES)
def test_pairs_interpreted(n, k, gs, sym, act, m, config):
    mod = _kernel_module()
    tensors, w_deq = make_layer(n, k, 4, gs, sym, act, seed=n + k + m + 2)
    w = mod.prepare_w4a16_weights(**tensors, bits=4, group_size=gs, sym=sym)
    assert w.pair_index is not None
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + 2)).half()
    ref = x.double() @ w_deq.double().t()
    out = mod.w4a16_matmul(x, w, config=as_config("pairs", config or dict(BLOCK_N=32, BLOCK_M=16)))
    assert out.shape == (m, n) and out.dtype == torch.float16
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 2e-3


def test_paired_nibble_index_is_a_permutation_that_pairs_codes():
    from quantkit.kernels.w4a16_configs import PAIR_TILE_K
    from quantkit.kernels.w4a16_weights import _paired_nibble_index

    k = 3 * PAIR_TILE_K
    idx = _paired_nibble_index(k)
    assert torch.equal(idx.sort().values, torch.arange(k))
    # In every tile, dot j's column 2w + h is code j + 4h of word w: original column 8w + j + 4h.
    tile = idx[PAIR_TILE_K:2 * PAIR_TILE_K] - PAIR_TILE_K
    words = PAIR_TILE_K // 8
    for j in range(4):
        for w in (0, 5, words - 1):
            for h in (0, 1):
                assert tile[j * 2 * words + 2 * w + h] == 8 * w + j + 4 * h


@pytest.mark.skipif(CUDA, reason="interpreter tests run on CPU-only machines")
@pytest.mark.parametrize("m,k,zero_numel", [(3, 256, 0), (2, 128, 5000), (5, 384, 7)])
def test_gather_columns_interpreted(m, k, zero_numel):
    mod = _kernel_module()
    g = torch.Generator().manual_seed(m * k)
    wide = torch.randn(m, 2 * k, generator=g).half()
    x = wide[:, ::2]  # not contiguous along K: gathered all the same
    index = torch.randperm(k, generator=g)
    zero = torch.full((zero_numel,), float("nan"))
    sums = torch.full((m, k // 128), float("nan"))
    xp = mod._gather_columns(x, index, zero, sums)
    assert torch.equal(xp, x[:, index]) and xp.is_contiguous()
    assert torch.equal(zero, torch.zeros(zero_numel))
    torch.testing.assert_close(sums, xp.float().view(m, k // 128, 128).sum(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(CUDA, reason="interpreter tests run on CPU-only machines")
def test_pairs_path_needs_4_bit_and_whole_tiles():
    mod = _kernel_module()
    t8, _ = make_layer(32, 256, 8, 64, False, False, seed=3)
    w8 = mod.prepare_w4a16_weights(**t8, bits=8, group_size=64, sym=False)
    t576, _ = make_layer(32, 576, 4, 64, False, False, seed=4)
    w576 = mod.prepare_w4a16_weights(**t576, bits=4, group_size=64, sym=False)
    for w in (w8, w576):
        assert w.pair_index is None
        assert mod._planned_choice(torch.randn(8, w.in_features).half(), w).kernel == "tc"
        with pytest.raises(ValueError, match="paired-nibble"):
            mod.w4a16_matmul(torch.randn(4, w.in_features).half(), w, config=as_config(
                "pairs", dict(BLOCK_N=32, BLOCK_M=16)))


@pytest.mark.skipif(CUDA, reason="interpreter tests run on CPU-only machines")
def test_default_path_is_gemv_for_small_m():
    mod = _kernel_module()
    tensors, w_deq = make_layer(32, 128, 4, 64, False, False, seed=11)
    w = mod.prepare_w4a16_weights(**tensors, bits=4, group_size=64, sym=False)
    x = torch.randn(2, 128).half()
    ref = x.double() @ w_deq.double().t()
    assert rel_err(mod.w4a16_matmul(x, w), ref) < 2e-3  # M=2 -> GEMV with its default config
    with pytest.raises(TypeError, match="config must be a GemvConfig"):
        mod.w4a16_matmul(x, w, config=dict(BLOCK_N=32, BLOCK_K=32))
    tensors, _ = make_layer(32, 192, 4, 48, False, False, seed=12)
    w48 = mod.prepare_w4a16_weights(**tensors, bits=4, group_size=48, sym=False)
    with pytest.raises(ValueError):  # BLOCK_K neither divides the group nor covers whole groups
        mod.w4a16_matmul(torch.randn(1, 192).half(), w48, config=as_config("gemv", dict(BLOCK_N=32, BLOCK_K=32)))


def test_gemv_split_k_has_no_empty_slices():
    mod = _kernel_module()
    for n_tiles, k_tiles in [(224, 16), (64, 56), (32, 4), (1, 1), (1000, 3), (7, 13)]:
        for pps in (4, 8, 16):
            split = mod._gemv_split_k(n_tiles, k_tiles, 132, pps)
            per = -(-k_tiles // split)
            assert 1 <= split <= k_tiles and (split - 1) * per < k_tiles  # the last slice is non-empty


@pytest.mark.parametrize("act", [False, True])
def test_reference_matches_dequantize(act):
    mod = _kernel_module()
    tensors, w_deq = make_layer(48, 576, 4, 128, False, act, seed=3)
    w = mod.prepare_w4a16_weights(**tensors, bits=4, group_size=128, sym=False)
    x = torch.randn(5, 576).half()
    ref = x.double() @ w_deq.double().t()
    assert rel_err(mod.w4a16_matmul_ref(x, w), ref) < 2e-3


def test_irregular_groups_fall_back_to_reference():
    mod = _kernel_module()
    from quantkit.kernels.dispatch import kernel_supports, w4a16_linear

    tensors, _ = make_layer(32, 128, 4, 32, True, False, seed=4)
    g_idx = tensors["g_idx"].clone()
    g_idx[:40] = 0  # a 40-row first group: not contiguous runs of one length
    w = mod.prepare_w4a16_weights(**{**tensors, "g_idx": g_idx}, bits=4, group_size=32, sym=True)
    assert w.group_size is None
    x = torch.randn(2, 3, 128).half()
    ok, reason = kernel_supports(x, w)
    assert not ok and reason
    bias = torch.randn(32).half()
    y = w4a16_linear(x, w, bias)
    assert y.shape == (2, 3, 32)
    ref = mod.w4a16_matmul_ref(x.reshape(6, 128), w).reshape(2, 3, 32) + bias
    assert torch.equal(y, ref)


@pytest.mark.skipif(CUDA, reason="interpreter tests run on CPU-only machines")
def test_front_door_runs_the_launchers_bound_at_load_bit_for_bit():
    """dispatch.w4a16_linear runs the launcher bound for the call's M bucket, and it computes exactly what the
    checked entry computes for the same choice; unbound buckets and float32 activations get the reference."""
    mod = _kernel_module()
    from quantkit.kernels import dispatch
    from quantkit.kernels.w4a16_select import M_BUCKETS

    n, k = 48, 256
    tensors, _ = make_layer(n, k, 4, 64, False, True, seed=6)  # act order: the launchers gather columns
    w = mod.prepare_w4a16_weights(**tensors, bits=4, group_size=64, sym=False)
    bound_buckets = M_BUCKETS[:5]  # 1 .. 16: the GEMV, then the paired-nibble kernel (the interpreter's tiles)
    choices = [mod._planned_choice(torch.empty(b, k).half(), w) for b in bound_buckets]
    assert {c.kernel for c in choices} == {"gemv", "pairs"}
    launchers = tuple(mod.bind_launcher(c, w.facts(), b) for b, c in zip(bound_buckets, choices))
    bound = dataclasses.replace(w, launchers=launchers + (None,) * (len(M_BUCKETS) - len(launchers)))
    gen = torch.Generator().manual_seed(7)
    for shape in ((1, 1, k), (2, 5, k)):  # buckets 1 and 16
        x = torch.randn(*shape, generator=gen).half()
        y = dispatch.w4a16_linear(x, bound)
        assert torch.equal(y, mod.w4a16_matmul(x.reshape(-1, k), w).reshape(*shape[:-1], n))
    x = torch.randn(40, k, generator=gen).half()  # bucket 64: no launcher bound
    assert torch.equal(dispatch.w4a16_linear(x, bound), mod.w4a16_matmul_ref(x, w))
    x = torch.randn(3, k, generator=gen)  # float32 activations: the reference
    assert torch.equal(dispatch.w4a16_linear(x, bound), mod.w4a16_matmul_ref(x, w))
    with pytest.raises(ValueError, match="features"):
        dispatch.w4a16_linear(torch.randn(3, k + 8).half(), bound)


def test_bad_inputs_are_rejected():
    mod = _kernel_module()
    tensors, _ = make_layer(32, 128, 4, 32, True, False, seed=5)
    w = mod.prepare_w4a16_weights(**tensors, bits=4, group_size=32, sym=True)
    with pytest.raises(ValueError):
        mod.w4a16_matmul(torch.randn(2, 64).half(), w)
    with pytest.raises(TypeError):
        mod.w4a16_matmul(torch.randn(2, 128), w)


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------
GPU_SHAPES = [  # (n, k, group_size, sym, act_order): multiples of the group, not of the blocks
    (4096 + 128, 4096 + 128, 128, True, False),
    (1408, 2880, 64, False, False),
    (1536, 576, 128, False, False),
    (1024, 2048, 128, True, True),
    (768, 1536, -1, False, False),
    (640, 1024, 32, True, False),
]


def _gpu_path_config(mod, m, gs):
    # Fixed configs keep the compile count small; the planned path has its own test below.
    # M 1/7: GEMV (one group per tile / tiles spanning groups); M 9 / 16: the split-K decode kernel with W as B / A;
    # 67: W as B; 334: W as A.
    if m == 1:
        bk = 64 if gs == -1 else min(64, gs)
        return "gemv", dict(BLOCK_N=64, BLOCK_K=bk, num_warps=4)
    if m == 7:
        return "gemv", dict(BLOCK_N=128, BLOCK_K=256, num_warps=8, PIPE=2)
    if m <= mod.DECODE_MAX_M:
        return "tc", dict(BLOCK_N=64, BLOCK_M=16, BLOCK_K=128, W_IS_A=m == 16,
                          num_warps=4, num_stages=4)
    return "tc", dict(BLOCK_N=128, BLOCK_M=64, BLOCK_K=64, W_IS_A=m % 2 == 0,
                      num_warps=4, num_stages=3)


def _run_gpu(mod, n, k, gs, sym, act, m, dtype, path, config):
    """The kernel on fresh random CUDA inputs, checked against float32 (rel. err < 1e-2)."""
    tensors, w_deq = make_layer(n, k, 4, gs, sym, act, device="cuda", seed=torch.seed() % 2**31)
    w = mod.prepare_w4a16_weights(**tensors, bits=4, group_size=gs, sym=sym)
    x = torch.randn(m, k, device="cuda").to(dtype)
    if isinstance(config, dict):
        config = as_config(path, config)
    out = mod.w4a16_matmul(x, w, config=config)
    assert out.dtype == dtype and out.shape == (m, n) and torch.isfinite(out).all()
    assert rel_err(out, x.float() @ w_deq.t()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n,k,gs,sym,act", GPU_SHAPES)
@pytest.mark.parametrize("m", [1, 7, 9, 16, 67, 334])
def test_kernel_gpu(n, k, gs, sym, act, m, dtype):
    mod = _kernel_module()
    path, config = _gpu_path_config(mod, m, gs)
    _run_gpu(mod, n, k, gs, sym, act, m, dtype, path, config)


def _shipped(kernel):
    """The configs of ``kernel`` the library can pick: the H200 table's and the rules' (w4a16_select)."""
    from quantkit.kernels.w4a16_select import M_BUCKETS, facts_of, load_table, select_w4a16

    configs = [e["config"] for e in load_table() if e["kernel"] == kernel]
    for n, k, gs in [(4096, 4096, 128), (1024, 1024, 128), (576, 576, 128), (8192, 28672, 32), (4096, 14336, -1)]:
        for arch in ("sm80", "sm90"):
            for bucket in M_BUCKETS:
                choice = select_w4a16(bucket, facts_of(n, k, 4, gs, True, False), arch)
                if choice.kernel == kernel:
                    configs.append(choice.config)
    return list(dict.fromkeys(configs))


def test_the_library_ships_configs_of_every_triton_family():
    assert _shipped("gemv") and _shipped("pairs") and _shipped("tc")
    assert any(c.SPLIT_K == 1 for c in _shipped("gemv")) and any(c.SPLIT_K != 1 for c in _shipped("gemv"))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,gs,sym,act", [GPU_SHAPES[0], GPU_SHAPES[1], GPU_SHAPES[3]])
@pytest.mark.parametrize("m", [1, 2])
def test_gemv_shipped_configs_gpu(n, k, gs, sym, act, m):
    # every GEMV config the library can pick, direct and split K, on shapes off its tiles
    from quantkit.kernels.w4a16_configs import kernel_group_size

    mod = _kernel_module()
    for config in _shipped("gemv"):
        if config.fits(m, kernel_group_size(gs, k)):
            _run_gpu(mod, n, k, gs, sym, act, m, torch.bfloat16, "gemv", config)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n,k,gs,sym,act", [s for s in GPU_SHAPES if s[1] % 128 == 0])
@pytest.mark.parametrize("m", [1, 5, 16, 40, 300])
def test_pairs_gpu(n, k, gs, sym, act, m, dtype):
    for config in _shipped("pairs"):
        if m <= config.BLOCK_M or config.BLOCK_M >= 128:
            _run_gpu(_kernel_module(), n, k, gs, sym, act, m, dtype, "pairs", config)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [3, 12, 100])
def test_dispatch_planned_gpu(m):
    mod = _kernel_module()
    from quantkit.kernels.dispatch import kernel_supports, prepare_w4a16, w4a16_linear

    n, k = 4096 + 128, 4096 + 128
    tensors, w_deq = make_layer(n, k, 4, 128, True, False, device="cuda", seed=torch.seed() % 2**31)
    w = prepare_w4a16(**tensors, bits=4, group_size=128, sym=True)
    assert w.launchers is not None and w.plan is not None
    x = torch.randn(2, m, k, device="cuda").bfloat16()
    bias = torch.randn(n, device="cuda").bfloat16()
    assert kernel_supports(x, w)[0]
    out = w4a16_linear(x, w, bias)
    ref = x.float() @ w_deq.t() + bias.float()
    assert out.shape == (2, m, n) and rel_err(out, ref) < 1e-2
    # the bound launcher is the plan's kernel: the checked entry, which looks the plan up, agrees
    checked = mod.w4a16_matmul(x.reshape(-1, k), w).reshape(2, m, n) + bias
    assert rel_err(out, checked) < 1e-3


# The Gluon kernel (Hopper). The tests run every config the library ships (the H200 table's and the rule
# defaults), so that a config a layer may be planned with is never untested: mma.sync decode (M <= 8 runs the
# mma's n = 8 tile, 9..16 the 16-row one) and wgmma prefill, one program per tile or stream-K. The tuner's other
# candidates (bench/tune_w4a16.py) are checked against the reference by the tuner before it times them.
def _gluon_configs():
    return [dataclasses.asdict(c) for c in _shipped("gluon")]


HOPPER = CUDA and torch.cuda.get_device_capability()[0] == 9
# test_gluon_every_config_gpu is parametrized by index (collection must not compile or import Gluon);
# test_every_config_slots_cover_the_candidates checks on the CPU that no shipped config is left out
EVERY_CONFIG_SLOTS = 32


def test_every_config_slots_cover_the_candidates():
    assert len(_gluon_configs()) <= EVERY_CONFIG_SLOTS, "raise EVERY_CONFIG_SLOTS"


def test_gluon_config_rejects_an_activation_box_it_cannot_swizzle():
    from quantkit.kernels.w4a16_gluon import GluonConfig

    with pytest.raises(ValueError, match="X_BOX_K must be 32 or 64"):
        GluonConfig(128, 16, 4, X_BOX_K=128)


def test_direct_gluon_configs_take_one_group_per_k_tile_and_up_to_8_rows():
    # the direct kernel's per-word group path, and its 16-row tiles, spill at the register caps its configs run at
    from quantkit.kernels.w4a16_configs import GluonConfig

    direct = [c for c in _shipped("gluon") if c.DIRECT]
    assert direct and not any(c.fits(1, 64) or c.fits(1, 32) for c in direct)
    assert all(c.fits(1, 128) and c.fits(8, 256) for c in direct)
    assert not any(c.fits(9, 128) for c in direct)
    with pytest.raises(ValueError, match="GATHER_X applies to DIRECT configs only"):
        GluonConfig(128, 16, 4, GATHER_X=True)
    with pytest.raises(ValueError, match="UNROLL is 1, or 2 for DIRECT configs"):
        GluonConfig(128, 16, 4, UNROLL=2)
    with pytest.raises(ValueError, match="UNROLL is 1, or 2 for DIRECT configs"):
        GluonConfig(128, 16, 1, DIRECT=True, UNROLL=3)


@pytest.mark.parametrize("k,gs,direct", [(256, 128, True), (512, -1, True), (256, 64, False), (576, 128, False)])
def test_direct_kernel_workspace_only_for_layers_it_takes(k, gs, direct):
    # whole K tiles per group and K a multiple of the tile: zeroed tile counters and DIRECT_MAX_M rows of sums
    from quantkit.kernels.w4a16_configs import DIRECT_MAX_M

    mod = _kernel_module()
    tensors, _ = make_layer(48, k, 4, gs, True, False)
    w = mod.prepare_w4a16_weights(**tensors, bits=4, group_size=gs, sym=True)
    assert (w.tile_counters is not None) == direct and (w.partial_sums is not None) == direct
    if direct:
        assert w.tile_counters.dtype == torch.int32 and w.tile_counters.shape == (48 // 16 + 1,)
        assert not w.tile_counters.any()
        assert w.partial_sums.dtype == torch.float32 and w.partial_sums.shape == (DIRECT_MAX_M * 48,)
        assert not w.partial_sums.any()


def test_gluon_configs_fit_the_h200():
    configs = _shipped("gluon")
    assert all(c.fits(c.BLOCK_M if c.WGMMA or c.BLOCK_M > 16 else 8, 128) for c in configs)
    assert all(c.WGMMA or c.BLOCK_M <= 64 for c in configs)


def _planned_gluon(m, n, k, gs):
    from quantkit.kernels.w4a16_select import facts_of, select_w4a16

    choice = select_w4a16(m, facts_of(n, k, 4, gs, True, False), "sm90")
    return choice.config if choice.kernel == "gluon" else None


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n,k,gs,sym,act", [s for s in GPU_SHAPES if s[1] % 128 == 0])
@pytest.mark.parametrize("m", [1, 6, 8, 13, 16, 17, 40, 64, 100, 300])
def test_gluon_gpu(n, k, gs, sym, act, m, dtype):
    config = _planned_gluon(m, n, k, gs)
    if config is None:
        pytest.skip("the plan gives this M to the GEMV")
    _run_gpu(_kernel_module(), n, k, gs, sym, act, m, dtype, "gluon", config)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("m", [1, 16, 29, 64, 128, 333, 1000])
@pytest.mark.parametrize("which", range(EVERY_CONFIG_SLOTS))
def test_gluon_every_config_gpu(which, m):
    # 4224 x 4224: 33 K tiles and 17-33 weight tiles, so stream-K runs start and end inside tiles; at
    # M = 1000 the 128-row tiles outnumber the SMs, so persistent programs take two tiles
    from quantkit.kernels.w4a16_configs import GluonConfig

    configs = _gluon_configs()
    if which >= len(configs) or not GluonConfig(**configs[which]).fits(m, 128):
        pytest.skip("config does not take this M")
    _run_gpu(_kernel_module(), 4096 + 128, 4096 + 128, 128, False, False, m, torch.bfloat16, "gluon",
             configs[which])


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("x_box_k", [32, 64])
@pytest.mark.parametrize("n,k,gs,sym,act", [(4096 + 128, 4096 + 128, 128, False, False), (1024, 2048, 128, True, True),
                                            (1408, 2880 - 64, 64, False, False), (65536 + 128, 256, 128, False, False)])
@pytest.mark.parametrize("m", [1, 13, 40, 300])
def test_gluon_x_box_gpu(x_box_k, n, k, gs, sym, act, m):
    # every candidate with either activation box: 32 columns (64-byte rows), or 64 (128-byte rows and swizzle;
    # each dot reads a column slice of a box, in the mma.sync path by ldmatrix, in the wgmma path through the
    # slice's shared-memory descriptor). 4224 x 4224 (33 K tiles) has stream-K runs that start and end inside
    # tiles; 65664 x 256 (2 K tiles, 513 weight tiles) has runs longer than a tile.
    from quantkit.kernels.w4a16_gluon import w4a16_gluon_matmul

    if k % 128:
        pytest.skip("the Gluon kernel takes whole 128-column tiles")
    mod = _kernel_module()
    tensors, w_deq = make_layer(n, k, 4, gs, sym, act, device="cuda", seed=torch.seed() % 2**31)
    w = mod.prepare_w4a16_weights(**tensors, bits=4, group_size=gs, sym=sym)
    x = torch.randn(m, k, device="cuda").bfloat16()
    ref = x.float() @ w_deq.t()
    for cfg in [c for c in _shipped("gluon") if c.fits(m, w.group_size)]:
        out = w4a16_gluon_matmul(x, w, dataclasses.replace(cfg, X_BOX_K=x_box_k))
        assert rel_err(out, ref) < 1e-2, cfg


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n,k,gs,sym,act", [(4096 + 128, 4096 + 128, 128, False, False), (1024, 2048, 128, True, True),
                                            (1408, 2816, 256, False, False), (768, 1536, -1, False, False),
                                            (65536 + 128, 256, 128, False, False), (256, 16384, 128, True, False)])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gluon_direct_gpu(n, k, gs, sym, act, m, dtype):
    # every direct-load candidate (operands loaded by every warp, relabelled into the mma operands): runs that start
    # and end inside tiles (4224 x 4224), runs longer than a tile (65664 x 256, 2 K tiles), tiles summed from 128
    # one-unit runs (256 x 16384); groups of two K tiles, per channel, act-order (through the gather; the others read
    # x as given, here rows with a stride, or through the gather with GATHER_X), asym, N not a multiple of the tile.
    # The layer's tile counters and partial-sum workspace are left zeroed: a second call, with a different M, sees
    # nothing of the first.
    from quantkit.kernels.w4a16_gluon import w4a16_gluon_matmul

    DIRECT_GLUON_CONFIGS = [c for c in _shipped("gluon") if c.DIRECT]
    mod = _kernel_module()
    tensors, w_deq = make_layer(n, k, 4, gs, sym, act, device="cuda", seed=torch.seed() % 2**31)
    w = mod.prepare_w4a16_weights(**tensors, bits=4, group_size=gs, sym=sym)
    x = torch.randn(m, k + 64, device="cuda").to(dtype)[:, 32:k + 32]
    ref = x.float() @ w_deq.t()
    assert DIRECT_GLUON_CONFIGS
    for cfg in DIRECT_GLUON_CONFIGS:
        if cfg.fits(m, w.group_size):
            out = w4a16_gluon_matmul(x, w, cfg)
            assert out.dtype == dtype and rel_err(out, ref) < 1e-2, cfg
            assert not w.tile_counters.any() and not w.partial_sums.any(), cfg
            assert rel_err(w4a16_gluon_matmul(x[:1], w, cfg), ref[:1]) < 1e-2, cfg
            assert not w.tile_counters.any() and not w.partial_sums.any(), cfg


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("m", [2, 40, 700])
def test_gluon_planned_gpu(m):
    _run_gpu(_kernel_module(), 2048, 1024, 64, False, True, m, torch.bfloat16, None, None)
