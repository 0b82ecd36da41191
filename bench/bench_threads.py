"""CPU thread settings on a busy machine: GPTQ and `quantkit generate` with another CPU-bound process running.

Question (issue #37): on a small CPU where another process keeps cores busy, which thread count should
the CLI use? This script starts a second CPU-bound process (a torch matmul loop, ended when the script
ends and at most after --busy-max-seconds) and then, in the same process tree, runs the real CLI for each
thread setting:

  new-default  no OMP_NUM_THREADS, no --threads: quantkit.threads chooses (free cores, spin-wait off when busy)
  omp1         OMP_NUM_THREADS=1
  torch        --threads N with N = torch's own default in a fresh process (the old behaviour)

For each: `quantkit gptq MODEL --calib FILE --nsamples --seqlen`, stopped (Ctrl-C, which leaves nothing
behind) after --layers decoder layers (0: the whole model), giving seconds per layer from the CLI's
per-layer lines; and `quantkit generate MODEL PROMPT --json`, giving decode tokens/s. Prints a table
and writes JSON (host, versions, date, command, rows) to bench/runs/bench_threads_<date>.json or --out.

Numbers only mean something on the machine they are measured on; say whether it was shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("QUANTKIT_CACHE", Path.home() / ".cache" / "quantkit"))
DEFAULT_MODEL = CACHE / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CALIB = REPO.parent / "shared" / "data" / "wikitext2" / "valid.tokens.txt"
VARIANTS = ("new-default", "omp1", "torch")
LAYER_LINE = re.compile(r"^layer\s+(\d+)/(\d+)\s+([\d.]+)s")
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "QUANTKIT_THREADS")

BUSY_LOOP = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
end = time.monotonic() + float(sys.argv[2])
a = torch.randn(512, 512)
while time.monotonic() < end:
    a = torch.tanh(a @ a)
"""


def torch_default_threads() -> int:
    """torch.get_num_threads() in a fresh process with no thread variables set (the old CLI default)."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def variant_env(variant: str, torch_threads: int) -> tuple[dict[str, str], list[str]]:
    """(environment, extra CLI arguments) of one thread setting."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env["HF_HUB_OFFLINE"] = "1"
    if variant == "omp1":
        env["OMP_NUM_THREADS"] = "1"
        return env, []
    if variant == "torch":
        return env, ["--threads", str(torch_threads)]
    return env, []


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "quantkit.cli.app", *args]


def run_gptq(model: str, calib: str, nsamples: int, seqlen: int, layers: int, env: dict, extra: list[str],
             timeout: float) -> dict:
    """Seconds per decoder layer (the CLI's own per-layer times) and the start-up before the first layer."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = cli("gptq", model, "-o", f"{tmp}/out", "--calib", calib, "--nsamples", str(nsamples), "--seqlen",
                  str(seqlen), *extra)
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=REPO)
        per_layer, first_at, threads_line, n_layers, tail = [], None, "", None, []
        try:
            for line in proc.stdout:
                tail = (tail + [line.rstrip()])[-20:]
                if line.startswith("threads:"):
                    threads_line = line.strip()
                match = LAYER_LINE.match(line)
                if match:
                    first_at = first_at or time.perf_counter() - started
                    per_layer.append(float(match.group(3)))
                    n_layers = int(match.group(2))
                    if layers and len(per_layer) >= layers:
                        proc.send_signal(signal.SIGINT)  # the CLI stops and removes its partial output
                        break
                if time.perf_counter() - started > timeout:
                    proc.kill()
                    break
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    if not per_layer:
        raise RuntimeError(f"gptq gave no layer line (exit {proc.returncode}):\n" + "\n".join(tail))
    return {"threads_line": threads_line, "layers_timed": len(per_layer), "n_layers": n_layers,
            "s_per_layer": sum(per_layer) / len(per_layer), "layer_seconds": per_layer,
            "s_before_first_layer": first_at, "command": shlex.join(cmd)}


def run_generate(model: str, max_tokens: int, env: dict, extra: list[str], timeout: float) -> dict:
    cmd = cli("generate", model, "The capital of France is", "--max-tokens", str(max_tokens), "--ignore-eos",
              "--json", *extra)
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"generate failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    threads_line = next((line for line in proc.stderr.splitlines() if line.startswith("threads:")), "")
    return {"threads_line": threads_line, "decode_tps": result["decode_tps"], "prefill_tps": result["prefill_tps"],
            "tokens": len(result["token_ids"]), "wall_s": wall, "command": shlex.join(cmd)}


def host_facts() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"hostname": platform.node(), "cpu": model, "cpu_count": os.cpu_count(), "usable_cores": usable,
            "loadavg_at_start": Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists()
            else None}


def versions() -> dict:
    import torch
    import transformers

    from quantkit.version import __version__

    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "quantkit": __version__, "commit": git.stdout.strip() or None}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="model for both commands (default: SmolLM2 GGUF)")
    parser.add_argument("--calib", default=str(DEFAULT_CALIB), help="calibration text file")
    parser.add_argument("--nsamples", type=int, default=8, help="calibration windows (C1 is 128)")
    parser.add_argument("--seqlen", type=int, default=256, help="tokens per window (C1 is 512)")
    parser.add_argument("--layers", type=int, default=3, help="decoder layers to time, then stop (0: all)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens `generate` decodes")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    parser.add_argument("--skip", choices=("gptq", "generate"), action="append", default=[], help="leave one out")
    parser.add_argument("--busy-threads", type=int, default=1, help="threads of the busy process (0: none)")
    parser.add_argument("--busy-max-seconds", type=float, default=3600, help="the busy process stops by then")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per command at most")
    parser.add_argument("--out", default=None, help="JSON path (default bench/runs/bench_threads_<date>.json)")
    args = parser.parse_args(argv)
    bad = set(args.variants.split(",")) - set(VARIANTS)
    if bad:
        parser.error(f"unknown variants {sorted(bad)}; choose from {VARIANTS}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch_threads = torch_default_threads()
    busy = None
    if args.busy_threads > 0:
        busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(args.busy_threads), str(args.busy_max_seconds)])
        time.sleep(2.0)  # busy before the first command samples the load
    rows = []
    try:
        for variant in args.variants.split(","):
            env, extra = variant_env(variant, torch_threads)
            row = {"variant": variant}
            if "gptq" not in args.skip:
                row["gptq"] = run_gptq(args.model, args.calib, args.nsamples, args.seqlen, args.layers, env, extra,
                                       args.timeout)
            if "generate" not in args.skip:
                row["generate"] = run_generate(args.model, args.max_tokens, env, extra, args.timeout)
            rows.append(row)
            print(f"  {variant}: done", file=sys.stderr, flush=True)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    print(f"\nbusy process: {args.busy_threads} thread(s); torch's default here: {torch_threads} threads")
    print(f"{'variant':<12} {'threads chosen':<48} {'gptq s/layer':>13} {'generate tok/s':>15}")
    for row in rows:
        g, gen = row.get("gptq"), row.get("generate")
        line = (g or gen or {}).get("threads_line", "")
        chosen = line.split(";")[0].removeprefix("threads: ")[:48]  # "1 (2 usable cores, 1.9 busy ...)"
        print(f"{row['variant']:<12} {chosen:<48} {g['s_per_layer'] if g else float('nan'):>13.2f} "
              f"{gen['decode_tps'] if gen else float('nan'):>15.1f}")
    date = datetime.now(timezone.utc)
    out = Path(args.out) if args.out else REPO / "bench" / "runs" / f"bench_threads_{date:%Y-%m-%d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "what": "GPTQ seconds per layer and generate decode tok/s under each CPU thread setting, with a second "
                "CPU-bound process running (issue #37)",
        "host": host_facts(), "versions": versions(), "date": date.isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]), "settings": vars(args),
        "torch_default_threads": torch_threads, "rows": rows,
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
