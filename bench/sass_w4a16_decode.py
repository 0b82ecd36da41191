"""What the sm_90 machine code of the W4A16 decode kernels says about bytes in flight (CPU only, no GPU).

    python bench/sass_w4a16_decode.py [--out bench/runs/sass_w4a16_decode.json] [--keep DIR]

Compiles, for sm_90 on this machine, the kernels the selection table picks at M = 1 for the Llama-3-8B layers
(the Gluon ring and direct kernels, with Triton's ptxas) and the CUDA C++ decode GEMV
(``kernels/w4a16_cuda.py``, with nvcc where present), and reads their SASS: registers, shared memory and spills,
the resulting warps per SM, the widths of the global loads, the atomics of the split-K output path, and for the
main loop the bytes of global loads a thread has issued and not yet waited for at each wait on a load
scoreboard (the wait mask of each instruction's control bits: a use of a loaded register waits for *all* loads
on that scoreboard). Little's law then bounds what the SM can stream: bytes in flight per SM / latency.

Control bits of an sm_90 instruction (bits 105-125 of the 128-bit word, the layout CuAssembler documents):
stall 4 bits, yield 1, write scoreboard 3 (7: none), read scoreboard 3, wait mask 6, reuse 4.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REGS_PER_SM, MAX_WARPS_PER_SM, SMEM_PER_SM = 65536, 64, 228 * 1024

# The selection table's M = 1 picks for the four 8B layers (tests pin the table; this lists them for the compile)
CASES = {
    "ring 256x8 NUM_BUF=4 CTAS_PER_SM=2 X_BOX_K=64 (28672x8192, 8192x28672)":
        ("ring", dict(BLOCK_N=256, BLOCK_M=16, NUM_BUF=4, CTAS_PER_SM=2, X_BOX_K=64), 8),
    "direct 256x8 8 warps CTAS_PER_SM=2 GATHER_X (14336x4096)":
        ("direct", dict(BLOCK_N=256, BLOCK_M=16, NUM_BUF=1, num_warps=8, CTAS_PER_SM=2, DIRECT=True, GATHER_X=True),
         8),
    "direct 128x8 4 warps CTAS_PER_SM=4 (4096x4096)":
        ("direct", dict(BLOCK_N=128, BLOCK_M=16, NUM_BUF=1, CTAS_PER_SM=4, DIRECT=True), 8),
}

_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from quantkit.kernels.w4a16_configs import GluonConfig
from quantkit.kernels.w4a16_gluon import _w4a16_gluon_kernel, _w4a16_direct_kernel
kind, fields, block_m, out = json.loads(sys.argv[1])
cfg = GluonConfig(**fields)
if kind == "ring":
    smem = ("NVMMASharedLayout(swizzle_byte_width={}, element_bitwidth={}, rank=2, transposed=False, "
            "fp4_padded=False, cga_layout=[])")
    sig = {"desc_w": f"tensordesc<i32[{cfg.BLOCK_N}, 16],{smem.format(64, 32)}>",
           "desc_x": f"tensordesc<bf16[{block_m}, {cfg.X_BOX_K}],{smem.format(2 * cfg.X_BOX_K, 16)}>",
           "scales_ptr": "*fp16", "zeros_ptr": "*u8", "xsum_ptr": "*fp32", "c_ptr": "*bf16", "ws_ptr": "*fp32",
           "tile_units_ptr": "*i32", "M": "i32", "N": "i32", "k_tiles": "i32", "tiles_n": "i32", "tiles_m": "i32",
           "stride_sg": "i32", "stride_zg": "i32"}
    cx = dict(GROUP_SIZE=128, HAS_ZEROS=False, BLOCK_N=cfg.BLOCK_N, BLOCK_M=block_m, GROUP_N=8, NUM_BUF=cfg.NUM_BUF,
              WGMMA=False, ATOMIC_OUT=True, PERSISTENT=False, num_warps=cfg.num_warps)
    fn, attrs = _w4a16_gluon_kernel, {}
else:
    sig = {"w_ptr": "*i32", "x_ptr": "*bf16", "scales_ptr": "*fp16", "zeros_ptr": "*u8", "xsum_ptr": "*fp32",
           "c_ptr": "*bf16", "ws_ptr": "*fp32", "counters_ptr": "*i32", "M": "i32", "N": "i32", "k_tiles": "i32",
           "tiles_n": "i32", "stride_wn": "i32", "stride_xm": "i32", "stride_sg": "i32", "stride_zg": "i32"}
    names = list(sig)
    aligned = [n for n in names if n.endswith("_ptr")] + ["N", "stride_wn", "stride_xm", "stride_sg", "stride_zg"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    cx = dict(GROUP_SIZE=128, HAS_ZEROS=False, BLOCK_N=cfg.BLOCK_N, BLOCK_M=block_m, GATHERED=cfg.GATHER_X,
              UNROLL=cfg.UNROLL, num_warps=cfg.num_warps)
    fn = _w4a16_direct_kernel
sig |= {name: "constexpr" for name in cx}
k = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": cfg.num_warps, "maxnreg": cfg.maxnreg()})
open(out, "wb").write(k.asm["cubin"])
"""

_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);\s*/\* (0x[0-9a-f]{16}) \*/")
_HI = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")


def tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def parse_sass(cubin: Path) -> dict[str, list[dict]]:
    """Per kernel function: instructions with address, text, opcode and decoded control bits."""
    text = subprocess.run([tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    funcs, cur, pending = {}, None, None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = _INSN.search(line)
        if m and cur is not None:
            body = m.group(2).strip()
            op = re.sub(r"^@!?U?P\w+\s+", "", body).split()[0]
            pending = dict(addr=int(m.group(1), 16), text=body, op=op)
            cur.append(pending)
            continue
        m = _HI.match(line)
        if m and pending is not None:
            ctrl = int(m.group(1), 16) >> 41
            pending.update(stall=ctrl & 0xF, wbar=(ctrl >> 5) & 7, rbar=(ctrl >> 8) & 7, wait=(ctrl >> 11) & 0x3F)
            pending = None
    return funcs


def resources(cubin: Path) -> dict[str, dict]:
    out = subprocess.run([tool("cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    res, name = {}, None
    for line in out.splitlines():
        m = re.search(r"Function (\S+):", line)
        if m:
            name = m.group(1)
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)
        if m and name:
            res[name] = dict(regs=int(m.group(1)), stack=int(m.group(2)), smem=int(m.group(3)),
                             local=int(m.group(4)))
    return res


def load_bytes(ins: dict) -> int:
    """Bytes a global load moves per thread (LDG.E.128 16, .64 8, default 4, .U16 2, .U8 1)."""
    t = ins["text"]
    for tag, b in ((".128", 16), (".64", 8), (".U16", 2), (".S16", 2), (".U8", 1), (".S8", 1)):
        if tag in t.split()[0] or tag in t:
            return b
    return 4


def loops(insns: list[dict]) -> list[tuple[int, int]]:
    """(first, last) instruction indexes of every backward branch's body."""
    index = {ins["addr"]: i for i, ins in enumerate(insns)}
    out = []
    for i, ins in enumerate(insns):
        if ins["op"] == "BRA":
            m = re.search(r"0x([0-9a-f]+)", ins["text"])
            if m and int(m.group(1), 16) in index and int(m.group(1), 16) <= ins["addr"]:
                out.append((index[int(m.group(1), 16)], i))
    return out


def cold(body: list[dict]) -> set[int]:
    """Indexes of the body's instructions a conditional forward branch skips when the region holds the split-K
    output path (atomics, barriers, the workspace reads): taken once a tile, not once a K tile."""
    index = {ins["addr"]: i for i, ins in enumerate(body)}
    out = set()
    for i, ins in enumerate(body):
        m = re.search(r"0x([0-9a-f]+)", ins["text"]) if ins["op"] == "BRA" and ins["text"].startswith("@") else None
        if m and int(m.group(1), 16) in index and index[int(m.group(1), 16)] > i:
            region = range(i + 1, index[int(m.group(1), 16)])
            if any(body[j]["op"].startswith(("RED", "ATOM", "BAR")) or ".STRONG" in body[j]["op"] for j in region):
                out.update(region)
    return out


def in_flight(body: list[dict]) -> dict:
    """Run the loop body twice (steady state) tracking the global-load bytes a thread has outstanding per
    scoreboard; at every instruction whose wait mask covers a scoreboard holding loads, record the bytes then
    outstanding (all scoreboards) and retire those on it. The split-K output path's loads (``.STRONG``, taken
    once a tile) are left out; ``DEPBAR`` (partial waits) is not modelled."""
    outstanding = {}  # scoreboard -> bytes
    waits = []
    for rep in range(2):
        for ins in body:
            hit = [s for s in range(6) if ins.get("wait", 0) >> s & 1 and outstanding.get(s)]
            if hit:
                if rep == 1:
                    waits.append(dict(at=ins["addr"], op=ins["op"], bytes_outstanding=sum(outstanding.values()),
                                      bytes_retired=sum(outstanding[s] for s in hit)))
                for s in hit:
                    outstanding[s] = 0
            if ins["op"].startswith("LDG") and ".STRONG" not in ins["op"] and ins.get("wbar", 7) != 7:
                outstanding[ins["wbar"]] = outstanding.get(ins["wbar"], 0) + load_bytes(ins)
    return dict(waits=waits, peak_bytes=max((w["bytes_outstanding"] for w in waits), default=0))


def analyse(cubin: Path, threads_per_cta: int, ctas_per_sm: int | None) -> list[dict]:
    funcs, res = parse_sass(cubin), resources(cubin)
    out = []
    for name, insns in funcs.items():
        r = res.get(name, {})
        ops = [i["op"] for i in insns]
        ldg = {}
        for i in insns:
            if i["op"].startswith("LDG"):
                ldg[i["op"]] = ldg.get(i["op"], 0) + 1
        regs = r.get("regs", 0)
        warp_regs = -(-regs * 32 // 256) * 256  # registers are allocated per warp in units of 256
        cta_warps = threads_per_cta // 32
        by_regs = REGS_PER_SM // max(warp_regs * cta_warps, 1)
        by_smem = SMEM_PER_SM // max(r.get("smem", 0) + 1024, 1)
        fit = min(by_regs, by_smem, MAX_WARPS_PER_SM // cta_warps, 32)
        resident = min(fit, ctas_per_sm) if ctas_per_sm else fit
        main = None
        for lo, hi in loops(insns):
            body = insns[lo:hi + 1]
            loads = [i for i in body if i["op"].startswith("LDG") and ".STRONG" not in i["op"]]
            if loads and (main is None or len(loads) > main["ldg"]):
                f = in_flight(body)
                main = dict(instructions=len(body), hot_instructions=len(body) - len(cold(body)), ldg=len(loads),
                            ldg_bytes=sum(load_bytes(i) for i in loads),
                            ldg_widths={op: sum(i["op"] == op for i in loads) for op in {i["op"] for i in loads}},
                            scoreboards={i["wbar"] for i in loads if i.get("wbar", 7) != 7},
                            hmma=sum(i["op"].startswith("HMMA") for i in body),
                            waits_on_loads=len(f["waits"]), peak_outstanding_bytes=f["peak_bytes"],
                            waits=f["waits"][:8])
                main["scoreboards"] = sorted(main["scoreboards"])
        out.append(dict(function=name, **r, threads_per_cta=threads_per_cta, ctas_per_sm=resident,
                        warps_per_sm=resident * cta_warps, ldg_all=ldg,
                        utmaldg=sum(o.startswith("UTMALDG") for o in ops),
                        atomics={o: ops.count(o) for o in set(ops) if o.startswith(("RED", "ATOM"))},
                        spill_local=sum(o.startswith(("STL", "LDL")) for o in ops), main_loop=main))
    return out


def compile_gluon(kind: str, fields: dict, block_m: int, cubin: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps([kind, fields, block_m, str(cubin)])], env=env,
                          capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])


def in_flight_per_sm(a: dict) -> int:
    """Bytes of global loads an SM holds outstanding at the main loop's peak: a thread's, times its warps."""
    return (a["main_loop"] or {}).get("peak_outstanding_bytes", 0) * 32 * a["warps_per_sm"]


def write_record(out: str | None, stem: str, results: list[dict]) -> Path:
    """The results as JSON at ``out`` (default bench/runs/<stem>_<date>.json), with the date and Triton's version."""
    import triton

    now = datetime.datetime.now(datetime.timezone.utc)
    path = Path(out or f"bench/runs/{stem}_{now:%Y%m%d_%H%M}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(date=now.isoformat(timespec="seconds"), target="sm_90 (compiled on the CPU)",
                                    triton=triton.__version__, results=results), indent=1, default=str))
    print(f"wrote {path}")
    return path


def summarize(label: str, a: dict) -> str:
    ml = a["main_loop"] or {}
    per_sm = in_flight_per_sm(a)
    return (f"{label}\n  {a['function'][:60]}: {a.get('regs')} regs, smem {a.get('smem')} B, spills {a['spill_local']}, "
            f"{a['warps_per_sm']} warps/SM ({a['ctas_per_sm']} CTAs x {a['threads_per_cta'] // 32})\n"
            f"  loads {a['ldg_all']} UTMALDG {a['utmaldg']} atomics {a['atomics']}\n"
            f"  main loop: {ml.get('instructions')} instr ({ml.get('hot_instructions')} outside the output path), LDG {ml.get('ldg_widths')} = {ml.get('ldg_bytes')} B/thread, "
            f"HMMA {ml.get('hmma')}, load scoreboards {ml.get('scoreboards')}, {ml.get('waits_on_loads')} waits; "
            f"peak outstanding {ml.get('peak_outstanding_bytes')} B/thread -> <= {per_sm / 1024:.1f} KB/SM")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON path (default bench/runs/sass_w4a16_decode_<date>.json)")
    ap.add_argument("--keep", default=None, help="also write each cubin and its SASS into this folder")
    ap.add_argument("--skip-cuda", action="store_true", help="leave out the CUDA C++ kernel (no nvcc needed)")
    args = ap.parse_args(argv)
    if not Path(tool("cuobjdump")).exists():
        print("sass_w4a16_decode: this triton build ships no cuobjdump/ptxas", file=sys.stderr)
        return 2
    work = Path(args.keep or tempfile.mkdtemp(prefix="sass_w4a16_"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    jobs = [(label, kind, fields, bm) for label, (kind, fields, bm) in CASES.items()]
    for i, (label, kind, fields, bm) in enumerate(jobs):
        cubin = work / f"gluon_{i}.cubin"
        compile_gluon(kind, fields, bm, cubin)
        threads = 32 * (fields.get("num_warps", 4) + (0 if kind == "direct" else 4))
        for a in analyse(cubin, threads, fields.get("CTAS_PER_SM", 1)):
            results.append(dict(case=label, **a))
            print(f"[{i + 1}/{len(jobs)}] " + summarize(label, a), flush=True)
    if not args.skip_cuda:
        from quantkit.kernels import w4a16_cuda

        for cfg in w4a16_cuda.SASS_CONFIGS:
            cubin = work / f"cuda_R{cfg.R}_U{cfg.U}_W{cfg.W}.cubin"
            log = w4a16_cuda.compile_cubin(cubin, cfg)
            if log is None:
                print("CUDA C++ kernel: no nvcc here, left out", flush=True)
                break
            for a in analyse(cubin, 32 * cfg.W, None):
                results.append(dict(case=f"cuda R={cfg.R} U={cfg.U} W={cfg.W}", **a))
                print(summarize(f"cuda R={cfg.R} U={cfg.U} W={cfg.W} (M <= 8)", a), flush=True)
    if args.keep:
        for cubin in work.glob("*.cubin"):
            sass = subprocess.run([tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True).stdout
            cubin.with_suffix(".sass").write_text(sass)
    else:
        shutil.rmtree(work, ignore_errors=True)
    write_record(args.out, "sass_w4a16_decode", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
