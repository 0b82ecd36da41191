"""Where host memory goes in a streamed quantization: VmRSS / VmHWM at phase boundaries (wrapped functions).

    python bench/probe_stream_memory.py MODEL_DIR OUT_DIR rtn|gptq [--calib FILE]

Wraps the streaming path's functions (open, capture, layer read/finish, GPTQ solve and factor, save,
shard flush) and prints the resident size (VmRSS, with its file-backed part RssFile) and the high-water
mark (VmHWM) on entry and exit, in MiB. For finding the big items; the numbers are the process's own."""

from __future__ import annotations

import argparse
import functools
import sys
import time

T0 = time.perf_counter()


def status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) // 1024
    return out


def mark(label: str) -> None:
    s = status()
    print(f"[{time.perf_counter() - T0:7.1f}s] {label:<48} RSS {s['VmRSS']:6d} (file {s['RssFile']:5d})  "
          f"HWM {s['VmHWM']:6d} MiB", file=sys.stderr, flush=True)


def wrap(owner, name: str, label: str | None = None) -> None:
    fn = getattr(owner, name)
    label = label or f"{getattr(owner, '__name__', owner)}.{name}"

    @functools.wraps(fn)
    def inner(*args, **kwargs):
        mark(f"> {label}")
        try:
            return fn(*args, **kwargs)
        finally:
            mark(f"< {label}")

    setattr(owner, name, inner)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("output")
    p.add_argument("method", choices=("rtn", "gptq"))
    p.add_argument("--calib", default="../shared/data/wikitext2/valid.tokens.txt")
    p.add_argument("--nsamples", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=256)
    args = p.parse_args(argv)
    mark("start")
    import torch  # noqa: F401

    mark("torch imported")
    import transformers  # noqa: F401

    from quantkit import api, checkpoint, checkpoint_writer, lazy_model, walker
    from quantkit.config import CalibConfig, LoadConfig
    from quantkit.methods import gptq, gptq_method

    mark("quantkit imported")
    wrap(lazy_model, "open_streamed")
    wrap(walker, "capture_layer_inputs")
    wrap(lazy_model.SafetensorsLayers, "layer", "layer read")
    wrap(lazy_model.SafetensorsLayers, "finish", "layer finish")
    wrap(gptq_method, "gptq_quantize")
    wrap(gptq, "damped_inverse_factor")
    wrap(checkpoint, "save_quantized")
    wrap(checkpoint_writer.CheckpointWriter, "_flush", "shard flush")
    calib = CalibConfig(source=args.calib, nsamples=args.nsamples, seqlen=args.seqlen)
    report = api.quantize(args.model, args.output, method=args.method, calib=calib, progress=False, overwrite=True,
                          load=LoadConfig(device="cpu", stream="on"))
    mark("done")
    print(f"peak_host_memory_bytes {report.peak_host_memory_bytes / 2**20:.0f} MiB", file=sys.stderr)


if __name__ == "__main__":
    main()
