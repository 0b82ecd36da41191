"""The Gluon W4A16 kernel compiled for sm_90 on the CPU: properties of its machine code.

Gluon has no interpreter, so the CPU cannot run this kernel; it can compile it (Triton ships ptxas and
nvdisasm). These tests pin what the design relies on and what went wrong once:

* the wgmma chain is drained (``WARPGROUP.DEPBAR.LE gsb0, 0x0``) before the accumulator is read: H200
  run 9 lost the last dot of every tile when ptxas placed the conversions above the drain;
* ptxas does not serialize the wgmmas (its C7514 notice);
* the decode loop's A operand comes out of the packed words by register renaming (no shared-memory
  round trip) and with no packed zero-point subtraction, and the main configs do not spill;
* programmatic dependent launch: the kernel waits for the gather (``griddepcontrol.wait``);
* the direct-load decode kernel reads its words in 16-byte loads straight into the mma.sync operands (no
  shared memory) and does not spill.
"""

from __future__ import annotations

import json
import re

import pytest

# Run by the sm90 fixture (conftest.py) in a fresh interpreter.
_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from quantkit.kernels.w4a16_gluon import GluonConfig, _w4a16_gluon_kernel

block_n, block_m, num_buf, num_warps, wgmma, group_size, x_box_k, out = json.loads(sys.argv[1])
cfg = GluonConfig(block_n, block_m, num_buf, num_warps, WGMMA=wgmma, STREAM_K=not wgmma, CTAS_PER_SM=1 if wgmma else 3,
                  X_BOX_K=x_box_k)
smem = ("NVMMASharedLayout(swizzle_byte_width={}, element_bitwidth={}, rank=2, transposed=False, "
        "fp4_padded=False, cga_layout=[])")
signature = {
    "desc_w": f"tensordesc<i32[{block_n}, 16],{smem.format(64, 32)}>",
    "desc_x": f"tensordesc<bf16[{block_m}, {x_box_k}],{smem.format(2 * x_box_k, 16)}>",
    "scales_ptr": "*fp16", "zeros_ptr": "*u8", "xsum_ptr": "*fp32", "c_ptr": "*bf16", "ws_ptr": "*fp32", "tile_units_ptr": "*i32",
    "M": "i32", "N": "i32", "k_tiles": "i32", "tiles_n": "i32", "tiles_m": "i32", "stride_sg": "i32", "stride_zg": "i32",
}
constexprs = dict(GROUP_SIZE=group_size, HAS_ZEROS=False, BLOCK_N=block_n, BLOCK_M=block_m, GROUP_N=8,
                  NUM_BUF=num_buf, WGMMA=wgmma, ATOMIC_OUT=not wgmma, PERSISTENT=False, num_warps=num_warps)
signature |= {name: "constexpr" for name in constexprs}
src = GluonASTSource(fn=_w4a16_gluon_kernel, signature=signature, constexprs=constexprs, attrs={})
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "maxnreg": cfg.maxnreg()})
open(out + ".cubin", "wb").write(kernel.asm["cubin"])
open(out + ".ptx", "w").write(kernel.asm["ptx"])
"""


_COMPILE_DIRECT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from quantkit.kernels.w4a16_gluon import GluonConfig, _w4a16_direct_kernel

block_n, block_m, num_warps, ctas, group_size, has_zeros, gathered, unroll, out = json.loads(sys.argv[1])
cfg = GluonConfig(block_n, block_m, 1, num_warps, ctas, DIRECT=True)
signature = {
    "w_ptr": "*i32", "x_ptr": "*bf16", "scales_ptr": "*fp16", "zeros_ptr": "*u8", "xsum_ptr": "*fp32", "c_ptr": "*bf16",
    "ws_ptr": "*fp32", "counters_ptr": "*i32", "M": "i32", "N": "i32", "k_tiles": "i32", "tiles_n": "i32",
    "stride_wn": "i32", "stride_xm": "i32", "stride_sg": "i32", "stride_zg": "i32",
}
names = list(signature)
# what the launcher's specialization sees: 16-byte aligned pointers, strides that are multiples of 16
aligned = [n for n in names if n.endswith("_ptr")] + ["N", "stride_wn", "stride_xm", "stride_sg", "stride_zg"]
attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
constexprs = dict(GROUP_SIZE=group_size, HAS_ZEROS=has_zeros, BLOCK_N=block_n, BLOCK_M=block_m, GATHERED=gathered,
                  UNROLL=unroll, num_warps=num_warps)
signature |= {name: "constexpr" for name in constexprs}
src = GluonASTSource(fn=_w4a16_direct_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "maxnreg": cfg.maxnreg()})
open(out + ".cubin", "wb").write(kernel.asm["cubin"])
open(out + ".ptx", "w").write(kernel.asm["ptx"])
"""


class _Compiled:
    def __init__(self, prefix: str, tools):
        self.cubin, self.ptx, self.tools = prefix + ".cubin", prefix + ".ptx", tools


def _compile(sm90, tmp_path_factory, block_n, block_m, num_buf, num_warps, wgmma, group_size=128,
             x_box_k=32) -> _Compiled:
    prefix = str(tmp_path_factory.mktemp("gluon") / "kernel")
    sm90.compile(_COMPILE, json.dumps([block_n, block_m, num_buf, num_warps, wgmma, group_size, x_box_k, prefix]))
    return _Compiled(prefix, sm90)


def _sass(kernel: _Compiled) -> list[str]:
    return kernel.tools.sass(kernel.cubin)


def _ptxas_notices(kernel: _Compiled) -> str:
    return kernel.tools.ptxas_notices(kernel.ptx)


@pytest.fixture(scope="module")
def prefill_kernel(sm90, tmp_path_factory):
    return _compile(sm90, tmp_path_factory, 128, 128, 5, 8, wgmma=True)


@pytest.fixture(scope="module")
def decode_kernel(sm90, tmp_path_factory):
    return _compile(sm90, tmp_path_factory, 128, 16, 6, 4, wgmma=False, x_box_k=64)  # a ring decode config (a tuner candidate)


def test_wgmma_chain_is_drained_before_the_accumulator_is_read(prefill_kernel):
    sass = _sass(prefill_kernel)
    last_mma = max(i for i, line in enumerate(sass) if "HGMMA" in line)
    acc_base = int(re.search(r"HGMMA\.\S+ R(\d+),", sass[last_mma]).group(1))
    acc_regs = {f"R{r}" for r in range(acc_base, acc_base + 64)}  # 64 x 128 fp32 per warpgroup: 64 registers
    first_read = next(i for i in range(last_mma + 1, len(sass))
                      if "F2FP" in sass[i] and acc_regs & set(re.findall(r"R\d+", sass[i].split(",", 1)[1])))
    assert any("WARPGROUP.DEPBAR.LE gsb0, 0x0" in line for line in sass[last_mma:first_read])


def test_wgmmas_overlap_and_nothing_spills(prefill_kernel):
    notices = _ptxas_notices(prefill_kernel)
    assert "C7514" not in notices and "C7515" not in notices  # "wgmma ... serialized"
    assert " 0 bytes spill stores" in notices
    sass = "\n".join(_sass(prefill_kernel))
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass  # one wgmma group stays in flight in the loop


def test_decode_dequant_stays_in_registers(decode_kernel):
    sass = _sass(decode_kernel)
    ops = [re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line).group(1) for line in sass]
    assert sum(op.startswith("HMMA") for op in ops) == 32  # 2 blocks x 4 dots x 2 k16 x 2 n8 per thread
    # the only shared-memory stores are the barrier bookkeeping and the broadcast of the tile counter: no
    # layout change goes through shared memory
    assert sum(op.startswith("STS") for op in ops) <= 3
    assert not any(op.startswith("SHFL") for op in ops)
    assert " 0 bytes spill stores" in _ptxas_notices(decode_kernel)
    # one group per K tile: the zero point comes off the accumulated tile (_magic_pairs), so the decode
    # loop has no packed subtraction per code pair (64 per unit and thread before; a quarter of the loop)
    assert sum(op.startswith("HADD2.BF16") or op.startswith("HFMA2.BF16") for op in ops) == 0


@pytest.mark.parametrize("wgmma", [False, True], ids=["decode", "prefill"])
def test_64_column_activation_boxes_halve_the_activation_loads(sm90, tmp_path_factory, wgmma):
    # X_BOX_K = 64: two TMA loads of activations a unit instead of four, and the dots read column slices
    # of the 128-byte-swizzled boxes with no extra shared-memory traffic or spills
    shape = (128, 128, 5, 8) if wgmma else (128, 16, 6, 4)
    narrow, wide = (_compile(sm90, tmp_path_factory, *shape, wgmma=wgmma, x_box_k=x) for x in (32, 64))
    narrow_sass, wide_sass = ("\n".join(_sass(c)) for c in (narrow, wide))
    assert wide_sass.count("UTMALDG") < narrow_sass.count("UTMALDG")
    for op in ("HGMMA", "LDSM", "HMMA"):
        assert wide_sass.count(op) == narrow_sass.count(op), op
    notices = _ptxas_notices(wide)
    assert " 0 bytes spill stores" in notices and "C7512" not in notices and "C7514" not in notices


def test_waits_for_the_gather_before_reading_what_it_wrote(decode_kernel, prefill_kernel):
    # launched with PDL after the gather: the producer's first activation load and the consumers' first
    # read of the tile sums and the workspace must come after griddepcontrol.wait (ACQBULK in the SASS)
    for kernel in (decode_kernel, prefill_kernel):
        ptx = open(kernel.ptx).read()
        assert ptx.count("griddepcontrol.wait") >= 2  # the producer and the consumers
        assert "ACQBULK" in "\n".join(_sass(kernel))


def test_decode_tile_fixup_orders_sums_before_the_counter(decode_kernel):
    # stream-K: partial sums go to the float32 workspace, then one thread adds to the tile's unit count;
    # the program that completes it reads the workspace back. The sums must be fenced device-wide before
    # the count, and the read must come from L2 (another SM's atomics are not in this SM's L1).
    sass = _sass(decode_kernel)
    sums = [i for i, line in enumerate(sass) if re.search(r"(ATOMG|REDG?)\.E\.ADD\.F32", line)]
    count = next(i for i, line in enumerate(sass) if re.search(r"ATOMG\.E\.ADD\.STRONG\.GPU PT, R\d+", line))
    assert sums and max(sums) < count
    between = sass[max(sums):count]
    barrier = next(i for i, line in enumerate(between) if "BAR.SYNC" in line)
    # barrier first, then the counting thread's fence; a fence in every thread before the barrier gave
    # wrong sums on the H200 (see _flush)
    assert any("MEMBAR.ALL.GPU" in line for line in between[barrier:])
    assert not any("MEMBAR" in line for line in between[:barrier])
    assert any("LDG.E.STRONG.GPU" in line for line in sass[count:])


@pytest.mark.parametrize("has_zeros", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("gathered", [False, True], ids=["raw_x", "gathered_x"])
def test_direct_decode_loads_operands_into_registers(sm90, tmp_path_factory, has_zeros, gathered):
    from quantkit.kernels.w4a16_select import load_table

    group_size, block_m = 128, 8
    # every direct config the shipped table holds
    configs = {(c.BLOCK_N, c.num_warps, c.CTAS_PER_SM, c.UNROLL): c for c in (e["config"] for e in load_table())
               if getattr(c, "DIRECT", False) and c.fits(block_m, group_size)}
    assert configs
    for cfg in configs.values():  # (GATHER_X picks the kernel's GATHERED, parametrized here)
        prefix = str(tmp_path_factory.mktemp("direct") / "kernel")
        sm90.compile(_COMPILE_DIRECT, json.dumps([cfg.BLOCK_N, block_m, cfg.num_warps, cfg.CTAS_PER_SM, group_size,
                                                  has_zeros, gathered, cfg.UNROLL, prefix]))
        kernel = _Compiled(prefix, sm90)
        assert " 0 bytes spill stores" in _ptxas_notices(kernel), cfg
        sass = _sass(kernel)
        ops = [re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line).group(1) for line in sass]
        # one unit's operands are read before the loop, and each of the loop's UNROLL units reads the next one's
        reads_of_units = 1 + cfg.UNROLL
        # the words in 16-byte loads: two rows of each 16-row block a thread
        rows_per_warp = cfg.BLOCK_N // cfg.num_warps
        assert ops.count("LDG.E.128") >= reads_of_units * (rows_per_warp // 16) * 2, cfg
        # no operand goes through shared memory: the only shared access is the broadcast of the tile counter, at each
        # of the loop's UNROLL flush sites
        assert not any(op.startswith(("LDSM", "LDS.", "STS.")) for op in ops), cfg
        assert ops.count("LDS") + ops.count("STS") <= 2 * cfg.UNROLL, cfg
        # the caller's activations: each thread's 64 contiguous bytes a row in 16-byte loads, and the K tile's sums
        # reduced across the four threads of a row and handed to the accumulator layout in shuffles (two a reduction
        # and two a hand-over a unit read); the gathered ones take no shuffle
        shuffles = sum(op.startswith("SHFL") for op in ops)
        assert shuffles == (0 if gathered else 4 * reads_of_units), cfg
        assert ops.count("LDG.E.128") >= reads_of_units * ((rows_per_warp // 16) * 2 + (0 if gathered else 4)), cfg
        assert "griddepcontrol.wait" in open(kernel.ptx).read()
        # partial tiles (_flush with RESET), at each flush site: float32 reductions into the layer's workspace, a
        # barrier, the counting thread's fence and count, then the last run's reads from L2, its output stores, and
        # the reset of the workspace tile and the counter (stores of zero): no zeroing launch before the next call
        counts = [i for i, op in enumerate(ops) if op == "ATOMG.E.ADD.STRONG.GPU"]
        sums = [i for i, op in enumerate(ops) if op.startswith("REDG.E.ADD.F32")]
        reads = [i for i, op in enumerate(ops) if op == "LDG.E.STRONG.GPU"]
        resets = [line for line in sass if re.search(r"STG\.E desc\[\w+\]\[R\d+\.64(\+0x\w+)?\], RZ", line)]
        per_site = rows_per_warp // 16 * 4  # a 16 x 8 accumulator block: 4 sums a thread
        assert len(counts) == cfg.UNROLL and len(sums) == len(reads) == cfg.UNROLL * per_site, cfg
        assert len(resets) == cfg.UNROLL * (per_site + 1), cfg
        for start, count, end in zip([0] + counts, counts, counts[1:] + [len(ops)]):
            site_sums = [i for i in sums if start < i < count]
            barrier = ops.index("BAR.SYNC.DEFER_BLOCKING", max(site_sums))
            assert len(site_sums) == per_site and barrier < ops.index("MEMBAR.ALL.GPU", barrier) < count, cfg
            assert len([i for i in reads if count < i < end]) == per_site, cfg
