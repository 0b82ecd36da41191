"""Starting ranks: torchrun for ``--gpus N``, the process group from torchrun's environment, failures.

``launch`` runs ``python -m torch.distributed.run --nproc-per-node N`` on a module or script with
the caller's arguments, on a free local port, with no restarts (a failed rank ends the run: torchrun
stops the others), NVLink multicast off (``NCCL_NVLS_ENABLE=0``) and the other ranks' output in log
files. Each rank that raises writes a one-line report (``report_failure``); when torchrun exits
non-zero, ``launch`` raises a ``QuantkitError`` that names the failed ranks and their errors (or says
that a rank died without one: killed), so the run ends with one clear message on the launching side.

``setup`` is what each rank calls: it reads RANK / WORLD_SIZE / LOCAL_RANK, checks them against
``--gpus``, initializes the process group (NCCL on CUDA, gloo on the CPU) with a timeout, and
returns the communicator and the rank's device.

The end of a run: every quantization ends with a barrier (``teardown``), so the ranks leave it
together; the group lives on for the next call in the process and is destroyed at exit (an ``atexit``
handler, which runs while the interpreter is whole). Destroyed then, not during interpreter
finalization: the backend's worker threads free the last collectives' tensors, and a thread that takes
the GIL to free a Python-owned tensor once finalization has begun is ended by ``pthread_exit``, whose
unwinding through a C++ destructor calls ``std::terminate`` (SIGABRT, "terminate called without an
active exception"). ``setup`` therefore makes sure nothing else keeps the group alive past that handler
(``_import_group_default_users``).
"""

from __future__ import annotations

import atexit
import datetime
import functools
import gc
import logging
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

from quantkit.config import QuantkitError
from quantkit.distributed.comm import LOCAL, Communicator, TorchComm

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")

REPORT_DIR_ENV = "QUANTKIT_DIST_REPORT_DIR"
TIMEOUT_ENV = "QUANTKIT_DIST_TIMEOUT"
# Longest a rank waits in one collective before the run is declared dead. A rank waits while another
# solves its share of a layer (minutes for a 70B down_proj on one GPU): generous by default.
DEFAULT_TIMEOUT_S = 1800.0


def under_torchrun() -> bool:
    """True inside a process started by torchrun (or anything that sets its variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def needs_launch(gpus: int | None) -> bool:
    """True when ``--gpus N > 1`` was asked outside torchrun: the caller must ``launch`` itself."""
    if gpus is not None and gpus < 1:
        raise QuantkitError(f"--gpus must be at least 1, got {gpus}")
    return gpus is not None and gpus > 1 and not under_torchrun()


def is_secondary_rank() -> bool:
    """True in every torchrun rank but global rank 0 (which alone prints and writes)."""
    return under_torchrun() and os.environ.get("RANK", "0") != "0"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(entry: list[str], args: list[str], nproc: int, log_dir: str) -> list[str]:
    """The torchrun command line: ``entry`` is ``["-m", "module"]`` or ``["script.py"]``."""
    quiet = ",".join(f"{r}:3" for r in range(1, nproc))  # ranks 1.. write into log_dir, rank 0 to the console
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "--max-restarts", "0",
            "--monitor-interval", "0.2", "--log-dir", log_dir, *(["--redirects", quiet] if quiet else []),
            *entry, *args]


def launch(entry: list[str], args: list[str], nproc: int, *, timeout_s: float | None = None,
           env: dict[str, str] | None = None) -> None:
    """Run ``entry args`` on ``nproc`` local ranks through torchrun; raise ``QuantkitError`` if any failed.

    ``timeout_s`` bounds the whole run (None: no bound besides the collectives' own timeout).
    """
    with tempfile.TemporaryDirectory(prefix="quantkit-dist-") as tmp:
        reports = Path(tmp) / "reports"
        reports.mkdir()
        full_env = {**os.environ, **(env or {}), REPORT_DIR_ENV: str(reports), "NCCL_NVLS_ENABLE": "0"}
        cmd = torchrun_command(entry, args, nproc, str(Path(tmp) / "logs"))
        log.info("launching %d ranks: %s", nproc, " ".join(cmd))
        try:
            proc = subprocess.run(cmd, env=full_env, timeout=timeout_s)
        except subprocess.TimeoutExpired as err:
            raise QuantkitError(f"the {nproc}-rank run did not finish within {timeout_s:g} s and was stopped") from err
        if proc.returncode != 0:
            raise QuantkitError(_failure_message(reports, Path(tmp) / "logs", nproc, proc.returncode))


def _failure_message(reports: Path, logs: Path, nproc: int, returncode: int) -> str:
    found = {int(p.stem.removeprefix("rank")): p.read_text().strip() for p in sorted(reports.glob("rank*.txt"))}
    # A rank's own error first; "a collective failed" only says that some other rank died.
    own = {r: t for r, t in found.items() if not t.startswith("DistributedError")}
    lines = [f"the {nproc}-rank run failed (torchrun exit code {returncode}); nothing was written."]
    for rank, text in sorted(own.items()) + sorted((r, t) for r, t in found.items() if r not in own):
        lines.append(f"  rank {rank}: {text}")
    if not own:
        silent = [r for r in range(nproc) if r not in found]
        lines.append(f"  rank(s) {silent or '?'} died without an error report: killed (out of memory? a signal?) "
                     "or failed outside quantkit.api (see the stderr tail)")
        for stderr in sorted(logs.glob("**/stderr.log")):
            tail = stderr.read_text(errors="replace").strip().splitlines()[-3:]
            if tail:
                lines.append(f"  local rank {stderr.parent.name} stderr: " + " | ".join(tail))
    return "\n".join(lines)


def report_failure(rank: int, err: BaseException) -> None:
    """Write this rank's error where ``launch`` looks for it (no-op outside ``launch``).

    Errors that only say a collective failed (another rank died first) are written too, but they
    come after the first rank's own report in the launcher's message."""
    folder = os.environ.get(REPORT_DIR_ENV)
    if not folder:
        return
    text = f"{type(err).__name__}: {str(err).strip()}"
    try:
        (Path(folder) / f"rank{rank}.txt").write_text(text[:2000])
    except OSError:
        pass


def reports_rank_failures(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorator: an exception leaving ``fn`` in a launched rank is reported (``report_failure``), then re-raised."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except BaseException as err:
            report_failure(int(os.environ.get("RANK", "0")), err)
            raise

    return wrapper


def setup(gpus: int | None, device: str) -> tuple[Communicator, str]:
    """The communicator and this rank's device: ``LOCAL`` and ``device`` outside torchrun."""
    if not under_torchrun():
        if gpus is not None and gpus > 1:
            raise QuantkitError(f"--gpus {gpus} runs under torchrun: the quantkit CLI launches it itself; from "
                                f"Python, start your script with `torchrun --nproc-per-node {gpus}`")
        return LOCAL, device
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if gpus is not None and gpus != world:
        raise QuantkitError(f"--gpus {gpus} but torchrun started {world} ranks: drop --gpus or make them agree")
    if world == 1:
        return LOCAL, device
    import torch
    import torch.distributed as dist

    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off, whoever launched us
    if device.startswith("cuda"):
        backend = os.environ.get("QUANTKIT_DIST_BACKEND", "nccl")
        n_gpus = torch.cuda.device_count()
        if backend == "gloo" and 0 < n_gpus <= local:  # a correctness run: several ranks may share a GPU
            local %= n_gpus
        if n_gpus <= local:
            raise QuantkitError(f"rank {rank} needs GPU {local}, but {n_gpus} are visible")
        device = f"cuda:{local}"
        torch.cuda.set_device(device)
    else:
        backend = "gloo"
    timeout = datetime.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
    owns_group = not dist.is_initialized()
    if owns_group:
        _import_group_default_users()
        dist.init_process_group(backend, timeout=timeout)
        atexit.register(_destroy_at_exit)
    return TorchComm(rank, world, dist.get_backend(), owns_group), device


def teardown(comm: Communicator) -> None:
    """End of one quantization: the ranks leave it together. The process group stays for the next
    call in this process (torch cannot set up a second one on torchrun's store: the new group would
    read the old one's addresses) and is destroyed when the process exits (``setup`` arranges it)."""
    comm.barrier()


def _import_group_default_users() -> None:
    """Import, before the process group exists, the modules that bind it at import time.

    ``torch.distributed.nn.functional`` declares its collectives with ``group=group.WORLD`` as a
    default argument, evaluated when it is imported; transformers imports it while it loads a model,
    that is after ``init_process_group``. Those defaults then hold the default group, so
    ``destroy_process_group`` at exit leaves it (and gloo's worker threads) alive until interpreter
    finalization, where a worker freeing the last collective's tensors aborts the process (see the
    module docstring). Imported first, the defaults are None (the default group at call time).
    """
    try:
        import torch.distributed.nn.functional  # noqa: F401
    except ImportError:  # a torch build without it: nothing binds the group then
        pass


def _destroy_at_exit() -> None:
    """Destroy the process group while the interpreter is whole: its backend's threads are joined here,
    so none of them frees a Python-owned tensor after finalization has begun. No barrier: a rank whose
    peer died must not wait on it (the last quantization already ended with one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()  # a group kept by cyclic garbage (a traceback's frames) is freed now, not at finalization


def launch_cli(command: str, gpus: int) -> None:
    """Run this process's own ``quantkit`` command line again on ``gpus`` ranks (``--gpus`` included:
    the ranks see torchrun's environment and do not launch again)."""
    args = sys.argv[1:]
    if command not in args:
        raise QuantkitError(f"cannot relaunch `quantkit {command}` from this command line {args}: run it under "
                            f"`torchrun --nproc-per-node {gpus} -m quantkit.cli.app {command} ...` instead")
    launch(["-m", "quantkit.cli.app"], args, gpus)
