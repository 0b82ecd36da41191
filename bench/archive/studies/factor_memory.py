"""Peak memory of GPTQ's two float64 factorizations (``gptq._inverse_factor`` and ``_inverse_factor_in_place``).

On the CPU the in-place variant lowers the extra peak (n = 6144: 710 -> 529 MiB of resident memory); in
the 2026-12-02 H200 call an 8B GPTQ walk using it peaked one float64 down_proj matrix higher (8.78 vs
7.25 GiB), so accelerators keep ``_inverse_factor``. This prints, for each variant, the peak allocated
above what was live before the call (CUDA: ``max_memory_allocated``; CPU: ``VmHWM``, one variant per
process), and the time, at down_proj's size, to find where the device path allocates:

    python bench/factor_memory.py --n 14336            # cuda, both variants (~10 s)
    python bench/factor_memory.py --n 6144 --device cpu --variant in_place
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=14336)
    p.add_argument("--device", default="cuda")
    p.add_argument("--variant", choices=("both", "two_matrix", "in_place"), default="both")
    args = p.parse_args()
    from quantkit.methods.gptq import _inverse_factor, _inverse_factor_in_place

    dev = torch.device(args.device)
    n = args.n
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n + 512, n, device=dev, generator=g)
    H = x.t() @ x / n
    del x
    order = torch.argsort(torch.diagonal(H), descending=True).flip(0)
    idx = torch.arange(n, device=dev)
    shift = 0.01 * float(torch.diagonal(H).double().mean())
    fp64 = n * n * 8 / 2**30
    variants = {"two_matrix": _inverse_factor, "in_place": _inverse_factor_in_place}
    for name, fn in variants.items():
        if args.variant not in ("both", name):
            continue
        if dev.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            base = _hwm()
        t0 = time.perf_counter()
        U = fn(H, order, idx, shift)
        if dev.type == "cuda":
            torch.cuda.synchronize()
            extra = (torch.cuda.max_memory_allocated() - base) / 2**30
        else:
            extra = (_hwm() - base) / 2**30
        print(f"{name:<11} n={n}: peak {extra:.2f} GiB above the inputs ({extra / fp64:.2f} float64 n x n), "
              f"{time.perf_counter() - t0:.2f} s, ok={U is not None}", flush=True)
        del U


def _hwm() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))


if __name__ == "__main__":
    main()
