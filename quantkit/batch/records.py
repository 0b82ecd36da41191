"""Result records: one JSON file per job (and one per unquantized model), written last and atomically.

A job is complete when its record says ``ok``, its settings equal the job's and its checkpoint folder
exists. A kill at any moment leaves either no record (the job is redone) or a whole one: the record is
written to a temporary file beside it and renamed into place.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RECORDS_DIR = "records"
BASELINES_DIR = "baselines"
CHECKPOINTS_DIR = "checkpoints"
CACHE_DIR = "cache"


@dataclass(frozen=True)
class JobResult:
    """What one job produced. ``status``: ``ok`` or ``failed`` (``error`` says why); ``reused`` when a
    previous run's complete record was taken instead of running again. ``perplexity`` maps each eval set
    to its perplexity; ``kld`` holds mean/p99 KL and the top-1 change rate against the unquantized model."""

    name: str
    status: str
    settings: dict[str, Any]
    eval: dict[str, Any] | None = None  # the EvalSpec it was measured with
    output: str | None = None
    seconds: float | None = None
    seconds_quantize: float | None = None
    peak_host_bytes: int | None = None
    peak_device_bytes: int | None = None
    size_bytes: int | None = None
    bits_per_weight: float | None = None
    perplexity: dict[str, float] = field(default_factory=dict)
    kld: dict[str, float] | None = None
    error: str | None = None
    reused: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("reused")
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], reused: bool = False) -> JobResult:
        known = {f for f in cls.__dataclass_fields__ if f != "reused"}
        return cls(**{k: v for k, v in data.items() if k in known}, reused=reused)


def write_json_atomic(path: Path, data: Any) -> None:
    """``path`` holds either its old content or all of ``data``, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=2)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def record_path(output_dir: Path, name: str) -> Path:
    return output_dir / RECORDS_DIR / f"{name}.json"


def checkpoint_path(output_dir: Path, name: str) -> Path:
    return output_dir / CHECKPOINTS_DIR / name


def read_record(path: Path) -> dict[str, Any] | None:
    """A record's content, or None when it is missing or unreadable (then the job is not complete)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def complete_result(output_dir: Path, name: str, settings: dict[str, Any],
                    eval_spec: dict[str, Any] | None = None) -> JobResult | None:
    """The previous result of a job when it finished with the same settings (and evaluation, when
    given) and its checkpoint is there."""
    data = read_record(record_path(output_dir, name))
    if data is None or data.get("status") != "ok" or data.get("settings") != settings:
        return None
    if eval_spec is not None and data.get("eval") != eval_spec:
        return None
    if not (checkpoint_path(output_dir, name) / "config.json").is_file():
        return None
    return JobResult.from_dict(data, reused=True)


def read_results(output_dir: Path) -> tuple[list[dict[str, Any]], list[JobResult]]:
    """(baseline records, job results) found in a batch output folder, jobs in the order they finished."""
    output_dir = Path(output_dir)
    baselines = [d for p in sorted((output_dir / BASELINES_DIR).glob("*.json")) if (d := read_record(p))]
    results = []
    for path in sorted((output_dir / RECORDS_DIR).glob("*.json"), key=lambda p: p.stat().st_mtime):
        data = read_record(path)
        if data is not None:
            results.append(JobResult.from_dict(data))
    return baselines, results


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def quantized_bits_per_weight(checkpoint: Path) -> float:
    """Stored bits per weight of the packed linears: packed values, scales, zero points and g_idx over
    the number of weights they encode (4-bit, asym, g128 with fp16 scales: about 4.16)."""
    from quantkit.checkpoint.fp8 import fp8_bits_per_weight, is_fp8_checkpoint
    from quantkit.checkpoint.read import index_tensors, packed_modules, read_config

    if is_fp8_checkpoint(checkpoint):
        return fp8_bits_per_weight(index_tensors(Path(checkpoint)))
    records = index_tensors(Path(checkpoint))
    _, settings = read_config(Path(checkpoint))
    stored_bits = weights = 0
    for module in packed_modules(records):
        qweight = records[f"{module}.qweight"]
        weights += qweight.numel * 32 // settings.bits
        for part in ("qweight", "qzeros", "scales", "g_idx"):
            record = records.get(f"{module}.{part}")
            if record is not None:
                stored_bits += record.numel * record.dtype.itemsize * 8
    return stored_bits / weights if weights else float("nan")
