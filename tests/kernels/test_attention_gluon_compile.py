"""The warp-specialized Gluon attention kernel compiled for sm_90 on the CPU: properties of its machine code.

Gluon has no interpreter, so the CPU cannot run this kernel; it can compile it (Triton ships ptxas and
nvdisasm). One compile, the fp8 causal default config (TMA-store epilogue, K scale staged by the producer),
with the launch's 16-divisibility attributes, pins what runs 10-11 measured:

* no round reads its K scale from global memory between issuing S = Q K^T and waiting for it (the load
  the short fp8 wgmma did not cover); the scale comes from shared memory;
* the output leaves through a TMA store;
* no spills beyond the one register (reloaded once per work tile) the fp8 causal build always had.

The default has the softmax row sums on the tensor core (rowsum_mma, a P @ ones wgmma a round): its wgmma
starts from zero every round, its ones tile is stored whole, and the row-sum FADDs are gone (against a
second compile with rowsum_mma off, which keeps the spill bound too).

The lazy O rescale (lazy_rescale, config entry 8; run 17), compiled at bf16 and fp8, causal: each consumer
warpgroup's round has one warp vote and a branch over exactly the HEAD_DIM / 2 FMULs of its O rescale, no
partition barrier more than the eager build, and no more spills.
"""

from __future__ import annotations

import json
import re

import pytest

# Run by the sm90 fixture (conftest.py) in a fresh interpreter. Arguments as attention_ws passes them for
# 8 x 2048 tokens, 16 heads.
_COMPILE = r"""
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from quantkit.kernels import attention_gluon_ws as ws
from quantkit.kernels.attention_fp8 import prepare_fp8
from quantkit.kernels.attention_gluon_common import make_descriptors as _make_descriptors

fp8, causal, out_path, config = json.loads(sys.argv[1])
d, tokens, heads = 128, 8 * 2048, 16
q = torch.randn(tokens, heads, d, dtype=torch.bfloat16)
k = torch.randn(tokens, heads, d, dtype=torch.bfloat16)
cu = torch.arange(0, tokens + 1, 2048, dtype=torch.int32)
out = torch.empty_like(q)
prep = prepare_fp8(q, k, k, cu_seqlens_k=cu) if fp8 else None
desc_q, desc_k, desc_v, qs, ks, vs = _make_descriptors(q, k, k, ws._HALF_M, 128, prep, out)
block_n, num_buf, persistent, pingpong, tma_store, stage_ks, rowsum_mma, lazy = ws._full_config(config, d, fp8, 2048)
desc_o = ws._output_descriptor(out) if tma_store else desc_q
args = dict(desc_q=desc_q, desc_k=desc_k, desc_v=desc_v, desc_o=desc_o, o_ptr=out, qs_ptr=qs, ks_ptr=ks,
            v_scale_ptr=vs, cu_seqlens_q_ptr=cu, cu_seqlens_k_ptr=cu, sm_scale=0.1, stride_om=heads * d,
            stride_oh=d, stride_qsm=heads, stride_ksn=heads, NUM_M_BLOCKS=16, N_SEQ=8, N_WORK=2048, SWIZZLE=128)
constexprs = dict(GROUP=1, HEAD_DIM=d, BLOCK_N=block_n, IS_CAUSAL=causal, IS_FP8=fp8, NUM_BUF=num_buf,
                  PINGPONG=pingpong, TMA_STORE=tma_store, STAGE_KS=stage_ks and fp8,
                  ROWSUM_MMA=rowsum_mma and fp8, LAZY_RESCALE=int(lazy), CONSUMER_REGS=ws.CONSUMER_REGS)
signature, attrs = {}, {}
for i, name in enumerate(ws._attn_fwd_ws.arg_names):
    if name in constexprs:
        signature[name] = "constexpr"
        continue
    a = args[name]
    signature[name] = mangle_type(a)
    if isinstance(a, torch.Tensor) or (isinstance(a, int) and a % 16 == 0):
        attrs[(i,)] = [["tt.divisibility", 16]]
src = GluonASTSource(fn=ws._attn_fwd_ws, signature=signature, constexprs=constexprs, attrs=attrs)
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": ws.MAXNREG})
open(out_path, "wb").write(kernel.asm["cubin"])
"""


def _sass(sm90, tmp_path_factory, config, fp8=True, causal=True) -> list[str]:
    cubin = str(tmp_path_factory.mktemp("gluon_attn") / "ws.cubin")
    sm90.compile(_COMPILE, json.dumps([fp8, causal, cubin, config]))
    return sm90.sass(cubin)


@pytest.fixture(scope="module")
def fp8_causal_sass(sm90, tmp_path_factory) -> list[str]:
    return _sass(sm90, tmp_path_factory, None)


@pytest.fixture(scope="module")
def fp8_causal_fp32_rowsum_sass(sm90, tmp_path_factory) -> list[str]:
    """The default fp8 causal config with the softmax row sums as fp32 adds (rowsum_mma off)."""
    return _sass(sm90, tmp_path_factory, [128, 4, True, False, True, True, False])


def test_k_scale_not_loaded_from_global_inside_a_round(fp8_causal_sass):
    # S issue: the first QGMMA of a round starts from zero (RZ, !UPT); its wait: the next WARPGROUP.DEPBAR
    rounds, inside = 0, False
    for line in fp8_causal_sass:
        if "QGMMA" in line and "RZ, !UPT" in line:
            rounds, inside = rounds + 1, True
        elif "WARPGROUP.DEPBAR" in line:
            inside = False
        assert not (inside and "LDG" in line), line
    assert rounds >= 4  # round 0 and the loop, both consumer warpgroups
    assert any("LDS" in line for line in fp8_causal_sass)


def test_output_goes_through_tma_store(fp8_causal_sass):
    assert any("UTMASTG" in line for line in fp8_causal_sass)


def test_at_most_one_spilled_register(fp8_causal_sass):
    assert sum("STL" in line for line in fp8_causal_sass) <= 1


def test_rowsum_wgmma_starts_from_zero_every_round(fp8_causal_sass):
    # P @ ones (N = 8): 4 k-steps of 32 a round, the first without the accumulator (RZ, !UPT), so the
    # fp8 wgmma sums one 128-key tile and the running sum stays on the CUDA cores in fp32
    steps = [line for line in fp8_causal_sass if "QGMMA.64x8x32" in line]
    assert len(steps) >= 8 and len(steps) % 4 == 0
    assert sum("RZ, !UPT" in line for line in steps) == len(steps) // 4


def test_rowsum_ones_tile_stored_byte_by_byte(fp8_causal_sass):
    # 8 x 128 e4m3 ones (0x38) by 128 threads: 8 one-byte stores each, of a register set to 0x38
    # (run 14b: converted 4 to a register, Triton 3.6 stored two unrelated bytes)
    stores = [line for line in fp8_causal_sass if "STS.U8" in line]
    assert len(stores) == 8
    regs = {re.search(r"\], (R\d+)", line).group(1) for line in stores}
    assert len(regs) == 1
    reg = regs.pop()
    assert any(re.search(rf"MOV\S* {reg}, .*0x38 ;", line) for line in fp8_causal_sass)


def test_rowsum_takes_the_row_sum_adds_off_the_cuda_cores(fp8_causal_sass, fp8_causal_fp32_rowsum_sass):
    fadd = [sum("FADD" in line for line in sass) for sass in (fp8_causal_fp32_rowsum_sass, fp8_causal_sass)]
    assert fadd[1] < 0.6 * fadd[0]  # 292 against 528 (both consumer warpgroups, masked and unmasked rounds)
    assert sum("STL" in line for line in fp8_causal_fp32_rowsum_sass) <= 1


# bf16 causal at 2048 tokens (ring 2, ping-pong, TMA store) with the O rescale eager / lazy (the default)
_BF16_CONFIG = [128, 2, True, True, True, False, False]
_FP8_CONFIG = [128, 4, True, False, True, True, True]  # the fp8 hd128 default


@pytest.fixture(scope="module")
def bf16_causal_sass(sm90, tmp_path_factory) -> list[str]:
    return _sass(sm90, tmp_path_factory, _BF16_CONFIG + [False], fp8=False)


@pytest.fixture(scope="module")
def bf16_causal_lazy_sass(sm90, tmp_path_factory) -> list[str]:
    return _sass(sm90, tmp_path_factory, None, fp8=False)  # the bf16 default at 2048 tokens: lazy_rescale on


@pytest.fixture(scope="module")
def fp8_causal_lazy_sass(sm90, tmp_path_factory) -> list[str]:
    return _sass(sm90, tmp_path_factory, _FP8_CONFIG + [True])


def _count(sass, op):
    return sum(re.search(rf"\b{op}\b", line) is not None for line in sass)


def _voted_rescales(sass) -> list[int]:
    """For each warp vote (VOTE.ANY Pn): the run of FMULs right after the next branch on !Pn."""
    runs = []
    for i, line in enumerate(sass):
        vote = re.search(r"VOTE\.ANY (P\d), \1 ;", line)
        if not vote:
            continue
        j = next(j for j in range(i + 1, len(sass)) if "BRA" in sass[j])
        assert f"@!{vote.group(1)} BRA" in sass[j], sass[j]
        k = j + 1
        while "FMUL" in sass[k]:
            k += 1
        runs.append(k - j - 1)
    return runs


def test_lazy_rescale_warp_vote_branches_over_the_o_rescale(bf16_causal_sass, bf16_causal_lazy_sass,
                                                            fp8_causal_lazy_sass):
    # one vote a round in each consumer warpgroup's loop, each skipping its 64 FMULs (head dim 128: 64 x 128
    # accumulator values over 128 threads); no barrier added
    assert _voted_rescales(bf16_causal_lazy_sass) == [64, 64]
    assert _voted_rescales(fp8_causal_lazy_sass) == [64, 64]
    assert _count(bf16_causal_lazy_sass, "BAR") == _count(bf16_causal_sass, "BAR")
    assert _count(bf16_causal_sass, "VOTE") == 0


def test_lazy_rescale_spills_no_more(bf16_causal_sass, bf16_causal_lazy_sass, fp8_causal_lazy_sass):
    assert sum("STL" in line for line in bf16_causal_sass) == 0
    assert sum("STL" in line for line in bf16_causal_lazy_sass) == 0
    assert sum("STL" in line for line in fp8_causal_lazy_sass) <= 1


# The FA3-ordered kernel (16-bit only; the selection's pick for short rows at head dim 128), causal, its default
# 64 x 64 tiles
_COMPILE_FA3 = r"""
import sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from quantkit.kernels import attention_gluon as g
from quantkit.kernels import attention_gluon_common
d, tokens, heads = 128, 4 * 512, 16
q = torch.randn(tokens, heads, d, dtype=torch.bfloat16)
cu = torch.arange(0, tokens + 1, 512, dtype=torch.int32)
out = torch.empty_like(q)
bm, bn, nw, nb = g._default_config(d)
desc_q, desc_k, desc_v, *_ = attention_gluon_common.make_descriptors(q, q, q, bm, bn, None, out)
args = dict(desc_q=desc_q, desc_k=desc_k, desc_v=desc_v, o_ptr=out, cu_seqlens_q_ptr=cu, cu_seqlens_k_ptr=cu,
            sm_scale=0.1, stride_om=heads * d, stride_oh=d, NUM_M_BLOCKS=8)
constexprs = dict(GROUP=1, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, IS_CAUSAL=True, NUM_BUF=nb, num_warps=nw)
signature, attrs = {}, {}
for i, name in enumerate(g._attn_fwd_gluon.arg_names):
    if name in constexprs:
        signature[name] = "constexpr"; continue
    a = args[name]
    signature[name] = mangle_type(a)
    if isinstance(a, torch.Tensor) or (isinstance(a, int) and a % 16 == 0):
        attrs[(i,)] = [["tt.divisibility", 16]]
src = GluonASTSource(fn=g._attn_fwd_gluon, signature=signature, constexprs=constexprs, attrs=attrs)
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": nw})
open(sys.argv[1], "wb").write(kernel.asm["cubin"])
"""


def test_fa3_ordered_kernel_compiles_16_bit_without_spills(sm90, tmp_path_factory):
    cubin = str(tmp_path_factory.mktemp("gluon_fa3") / "fa3.cubin")
    sm90.compile(_COMPILE_FA3, cubin)
    sass = sm90.sass(cubin)
    assert _count(sass, "HGMMA") > 0 and _count(sass, "QGMMA") == 0
    assert not any("STL" in line for line in sass)
