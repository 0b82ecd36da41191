"""Run jobs one after another: the Python API of batch quantization (the ``quantkit batch`` command and
recipes are a thin layer over :func:`run_batch`).

    from quantkit.batch import EvalSpec, Job, run_batch
    jobs = [Job(name=f"rtn-g{g}", model="m.gguf", scheme=QuantScheme(4, g)) for g in (32, 128)]
    results = run_batch(jobs, "runs/sweep", eval=EvalSpec(perplexity=("test.txt",)))

Each job: quantize into ``OUT/checkpoints/NAME`` (written to a temporary folder and renamed when
complete), reload it, measure perplexity and KL divergence, then write ``OUT/records/NAME.json`` last and
atomically. A job whose record is there, says ``ok`` and has the same settings is taken as it is
(``resume``); anything else is redone from the start. A failing job is recorded with its error and the
batch goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantkit.batch.context import ModelContext
from quantkit.batch.jobs import EvalSpec, Job
from quantkit.batch.records import (
    JobResult,
    checkpoint_path,
    complete_result,
    folder_bytes,
    quantized_bits_per_weight,
    record_path,
    write_json_atomic,
)
from quantkit.config import QuantkitError, resolve_device, resolve_dtype

log = logging.getLogger(__name__)


@dataclass
class BatchObserver:
    """Callbacks a caller may set to follow a batch (all optional)."""

    job_started: Callable[[int, int, Job], None] | None = None  # (k, n, job), k from 1
    job_finished: Callable[[int, int, JobResult], None] | None = None
    stage: Callable[[str], None] | None = None  # "calibration", "perplexity wikitext2", ...
    on_layer: Callable | None = None  # quantkit.calibrate.walker.LayerEvent, as the single commands show
    on_window: Callable | None = None  # (done, total, running value) of perplexity / KL windows

    def _stage(self, text: str) -> None:
        if self.stage is not None:
            self.stage(text)


class PeakHostMemory:
    """Highest resident set size of this process while the block runs (sampled every 20 ms, Linux
    /proc; elsewhere the process's lifetime peak from getrusage)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def _rss() -> int:
        try:
            with open("/proc/self/statm") as handle:
                import os

                return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            import resource
            import sys

            scale = 1 if sys.platform == "darwin" else 1024
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> PeakHostMemory:
        self.peak = self._rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())


@dataclass
class BatchResult:
    """All job results of a run, in job order."""

    results: list[JobResult] = field(default_factory=list)

    @property
    def failed(self) -> list[JobResult]:
        return [r for r in self.results if not r.ok]


def run_recipe(plan, *, resume: bool = True, observer: BatchObserver | None = None) -> BatchResult:
    """Run a validated :class:`~quantkit.batch.recipe.BatchPlan` and write its report beside the results."""
    from quantkit.batch.report import write_report

    result = run_batch(list(plan.jobs), plan.output, eval=plan.eval, resume=resume, observer=observer)
    write_report(plan.output)
    return result


def run_batch(jobs: list[Job], output_dir: str | Path, *, eval: EvalSpec | None = None, resume: bool = True,
              observer: BatchObserver | None = None) -> BatchResult:
    """Run ``jobs`` in order into ``output_dir``; see the module docstring. Returns every job's result
    (failed ones included); raises only for problems that concern the whole batch. Without ``eval`` jobs
    are only quantized and sized."""
    output_dir = Path(output_dir).expanduser()
    eval = eval if eval is not None else EvalSpec(kld=False)
    observer = observer or BatchObserver()
    names = [job.name for job in jobs]
    if len(set(names)) != len(names):
        raise QuantkitError("job names must be unique: they name the output folders")
    output_dir.mkdir(parents=True, exist_ok=True)
    from quantkit.batch.report import write_order

    write_order(output_dir, names)
    contexts: dict[tuple, ModelContext] = {}
    batch = BatchResult()
    for index, job in enumerate(jobs, start=1):
        if observer.job_started is not None:
            observer.job_started(index, len(jobs), job)
        previous = complete_result(output_dir, job.name, job.settings(), eval.to_dict()) if resume else None
        if previous is not None:
            result = previous
        else:
            key = (job.model, job.load)
            if key not in contexts:
                contexts[key] = ModelContext(job.model, job.load, output_dir, eval)
            result = _run_one(job, contexts[key], [j for j in jobs if (j.model, j.load) == key], output_dir,
                              eval, observer)
        batch.results.append(result)
        if observer.job_finished is not None:
            observer.job_finished(index, len(jobs), result)
    return batch


def _run_one(job: Job, context: ModelContext, model_jobs: list[Job], output_dir: Path, eval: EvalSpec,
             observer: BatchObserver) -> JobResult:
    record = record_path(output_dir, job.name)
    record.unlink(missing_ok=True)  # stale or failed: from here on the job is unfinished
    started = time.perf_counter()
    device = resolve_device(job.load.device)
    try:
        with PeakHostMemory() as host:
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            result = _measure(job, context, model_jobs, output_dir, eval, observer, device)
        peak_device = torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0
        result = dataclasses.replace(result, seconds=time.perf_counter() - started, peak_host_bytes=host.peak,
                                     peak_device_bytes=peak_device)
    except Exception as exc:  # recorded; the batch goes on (KeyboardInterrupt still stops it)
        log.error("job %s failed: %s: %s", job.name, type(exc).__name__, exc)
        log.debug("%s", traceback.format_exc())
        result = JobResult(name=job.name, status="failed", settings=job.settings(), eval=eval.to_dict(),
                           seconds=time.perf_counter() - started, error=f"{type(exc).__name__}: {exc}")
    write_json_atomic(record, result.to_dict())
    return result


def _measure(job: Job, context: ModelContext, model_jobs: list[Job], output_dir: Path, eval: EvalSpec,
             observer: BatchObserver, device: str) -> JobResult:
    from quantkit import api  # batch runs the public quantize per job, as the CLI does (see tests/test_import_graph.py)
    from quantkit.checkpoint.read import load_quantized
    from quantkit.eval.kld import model_kld
    from quantkit.eval.perplexity import perplexity

    observer._stage("shared inputs (calibration, eval text, unquantized baseline and KL reference)")
    context.prepare(model_jobs)
    calib_tokens = context.calibration(job.calib) if job.needs_calibration else None
    checkpoint = checkpoint_path(output_dir, job.name)
    observer._stage(f"quantize {job.method}")
    report = api.quantize(job.model, checkpoint, method=job.method, scheme=job.scheme,
                          method_options=job.method_options, calib=job.calib, load=job.load, overwrite=True,
                          batch_size=job.batch_size, on_layer=observer.on_layer,
                          quantize_lm_head=job.quantize_lm_head, calib_tokens=calib_tokens)
    # The unquantized reference ran in this dtype too (auto: float32 on the CPU, bfloat16 on CUDA).
    model, _ = load_quantized(checkpoint, device=device, dtype=resolve_dtype(job.load.dtype, device))
    ppl = {}
    for source in eval.perplexity:
        observer._stage(f"perplexity {source}")
        ppl[source] = perplexity(model, context.eval_tokens(source), seqlen=eval.seqlen,
                                 max_windows=eval.max_windows, bos_token_id=context.bos_token_id(), device=device,
                                 on_window=observer.on_window).ppl
    kld = None
    if eval.kld:
        observer._stage("KL divergence")
        kld = model_kld(context.reference(), model, context.kld_windows(), device=device,
                        on_window=observer.on_window).to_dict()
    return JobResult(name=job.name, status="ok", settings=job.settings(), eval=eval.to_dict(), output=str(checkpoint),
                     seconds_quantize=report.seconds_total, size_bytes=folder_bytes(checkpoint),
                     bits_per_weight=quantized_bits_per_weight(checkpoint), perplexity=ppl, kld=kld)
