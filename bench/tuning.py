"""What the kernel tuners share (bench/tune_fp8_gemv.py, bench/tune_fp8_mma.py): the timer (CUDA-graph replays, or
the wall clock for a --smoke run on the CPU), the interpreter's patch for --smoke, and compiling every candidate
first in worker processes, so that the timed process finds them in Triton's disk cache."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time


def interpreter_fix() -> None:
    """Triton 3.6's interpreter under NumPy >= 2.4 (run-time loop bounds): the tests' patch."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.kernels.conftest import _fix_interpreter_index

    _fix_interpreter_index()


def timer(smoke: bool):
    """``(device, time_us(fn, replays))``: CUDA-graph replays with L2 evicted, or the wall clock of one call on the
    CPU (--smoke)."""
    if smoke:
        def wall_us(fn, replays):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6

        return "cpu", wall_us
    from gpu_timing import gpu_time_us, l2_evict_buffer

    flush = l2_evict_buffer("cuda")
    return "cuda", lambda fn, replays: gpu_time_us(fn, flush, calls=10, replays=replays)


def precompile_in_workers(tasks: list, compile_tasks, jobs: int, until: float, device: str, log) -> None:
    """``compile_tasks(share, device) -> compiled count`` (a module-level function of the tuner) over ``tasks``
    dealt out to ``jobs`` spawned processes, waiting until ``until`` at most (then the workers are stopped, so that
    none runs beside the timings, and the rest compile when first timed)."""
    if jobs <= 0 or not tasks:
        return
    t0 = time.time()
    try:
        pool = multiprocessing.get_context("spawn").Pool(jobs)
    except OSError as e:  # no semaphores (/dev/shm) on this machine
        log(f"no worker processes ({e}): each kernel compiles when first timed")
        return
    try:
        pending = [pool.apply_async(compile_tasks, (tasks[i::jobs], device)) for i in range(jobs) if tasks[i::jobs]]
        compiled, errors, late = 0, [], 0
        for job in pending:
            try:
                compiled += job.get(timeout=max(until - time.time(), 0.1))
            except multiprocessing.TimeoutError:
                late += 1
            except Exception as e:
                errors.append(repr(e)[:200])
        log(f"compiled {compiled} of {len(tasks)} kernels in {time.time() - t0:.1f} s with {jobs} processes"
            + (f"; {late} workers stopped at the time limit (the rest compile when timed)" if late else "")
            + (f"; worker errors: {errors}" if errors else ""))
    finally:
        pool.terminate()
        pool.join()
