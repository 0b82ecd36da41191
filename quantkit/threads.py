"""How many CPU threads PyTorch should use: no more than the cores nobody else keeps busy.

PyTorch starts one intra-op thread per core it sees. When another process already keeps some of those
cores busy, its threads and ours take turns on the same cores, and every parallel region waits for the
slowest, descheduled thread: on a 2-core machine with one other busy process, GPTQ ran 30-50x slower
with torch's default than with one thread (issue #37, docs/threads.md). The default chosen here is

    threads = cores this process may run on (sched_getaffinity) - cores busy with other work, at least 1

with the busy cores read from ``/proc/stat`` over a short interval (the part of each usable core that was
not idle). When other work is found, OpenMP's spin-waiting is switched off as well (``OMP_WAIT_POLICY=
PASSIVE``): a waiting thread then sleeps instead of burning the core another process needs.

An explicit choice always wins: ``--threads N``, else ``OMP_NUM_THREADS``. Both environment variables
must be set before torch is imported (the CLI imports torch lazily, inside each command); when torch is
already loaded, :func:`apply` also calls ``torch.set_num_threads``. No torch import here.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

# How long /proc/stat is sampled: long enough to see a busy core (jiffies are 10 ms), short for start-up.
SAMPLE_SECONDS = 0.1
# A core counts as busy with other work from this share of non-idle time on (rounded to whole cores).
BUSY_ROUNDING = 0.5


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count, where it came from (``option``, ``env`` or ``auto``), and a line saying why."""

    threads: int
    source: str
    passive_wait: bool
    reason: str


def usable_cores() -> list[int]:
    """The CPUs this process may run on (its affinity mask; all CPUs where that is not known)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def read_proc_stat(path: str = "/proc/stat") -> dict[int, tuple[int, int]]:
    """Per CPU: (idle jiffies incl. iowait, total jiffies) from a ``/proc/stat`` snapshot; {} without one."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    out: dict[int, tuple[int, int]] = {}
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        values = [int(v) for v in rest.split()[:8]]  # user nice system idle iowait irq softirq steal
        if len(values) >= 5:
            out[int(name[3:])] = (values[3] + values[4], sum(values))
    return out


def busy_cores(cores: list[int], before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]]) -> float | None:
    """Sum over ``cores`` of the non-idle share of each core between two snapshots (None: no readings)."""
    busy, seen = 0.0, False
    for cpu in cores:
        if cpu not in before or cpu not in after:
            continue
        idle = after[cpu][0] - before[cpu][0]
        total = after[cpu][1] - before[cpu][1]
        if total > 0:
            busy += 1.0 - idle / total
            seen = True
    return busy if seen else None


def measure_busy_cores(cores: list[int], read: Callable[[], dict] = read_proc_stat,
                       sleep: Callable[[float], None] = time.sleep, seconds: float = SAMPLE_SECONDS) -> float | None:
    """Cores kept busy by other processes now (this process is idle while it samples), or None."""
    before = read()
    if not before:
        return None
    sleep(seconds)
    return busy_cores(cores, before, read())


def choose(*, option: int | None, env: dict[str, str], n_usable: int, busy: float | None) -> ThreadChoice:
    """The thread count from an explicit option, ``OMP_NUM_THREADS``, or the free cores (pure: readings in)."""
    if option is not None:
        if option < 1:
            from quantkit.errors import QuantkitError

            raise QuantkitError(f"--threads must be at least 1, got {option}")
        return ThreadChoice(option, "option", False, f"threads: {option} (--threads)")
    raw = env.get("OMP_NUM_THREADS", "").strip()
    if raw:
        try:
            n = int(raw.split(",")[0])
        except ValueError:
            n = 0
        if n >= 1:
            return ThreadChoice(n, "env", False, f"threads: {n} (OMP_NUM_THREADS)")
    if busy is None:
        return ThreadChoice(n_usable, "auto", False, f"threads: {n_usable} ({n_usable} usable cores; their load "
                            "could not be read; --threads N or OMP_NUM_THREADS sets another)")
    taken = min(n_usable, int(busy + BUSY_ROUNDING))  # whole cores busy with other work (rounded)
    threads = max(1, n_usable - taken)
    passive = taken > 0
    why = f"{n_usable} usable cores, {busy:.1f} busy with other processes"
    if passive:
        why += ", OpenMP spin-waiting off"
    return ThreadChoice(threads, "auto", passive, f"threads: {threads} ({why}; --threads N or OMP_NUM_THREADS "
                        "sets another)")


def decide(option: int | None = None, env: dict[str, str] | None = None) -> ThreadChoice:
    """:func:`choose` with this machine's readings (samples ``/proc/stat`` only when it must)."""
    env = dict(os.environ) if env is None else env
    cores = usable_cores()
    busy = None
    if option is None and not env.get("OMP_NUM_THREADS", "").strip():
        busy = measure_busy_cores(cores)
    return choose(option=option, env=env, n_usable=len(cores), busy=busy)


def apply(choice: ThreadChoice, environ: dict | None = None) -> None:
    """Make ``choice`` take effect: the environment for torch (and child processes) and, when torch is
    already imported, ``torch.set_num_threads``."""
    environ = os.environ if environ is None else environ
    environ["OMP_NUM_THREADS"] = str(choice.threads)
    environ.setdefault("MKL_NUM_THREADS", str(choice.threads))
    if choice.passive_wait:
        environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "set_num_threads"):
        torch.set_num_threads(choice.threads)
