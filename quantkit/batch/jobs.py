"""What a batch runs: one frozen :class:`Job` per quantization, one :class:`EvalSpec` for all of them."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from quantkit.config import CalibConfig, LoadConfig, QuantkitError, QuantScheme

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]*$")


@dataclass(frozen=True)
class EvalSpec:
    """How every job of a batch is measured.

    ``perplexity``: evaluation sets (``wikitext2`` or local files), each scored on at most ``max_windows``
    windows of ``seqlen``. ``kld``: compare next-token distributions against the unquantized model on
    ``kld_max_windows`` windows of ``kld_data`` (default: the first perplexity set)."""

    perplexity: tuple[str, ...] = ()
    seqlen: int = 512
    max_windows: int | None = 8
    kld: bool = True
    kld_data: str | None = None
    kld_max_windows: int = 4
    bos: str = "auto"
    text_field: str = "text"

    def __post_init__(self) -> None:
        object.__setattr__(self, "perplexity", tuple(self.perplexity))
        if self.seqlen < 2:
            raise QuantkitError(f"eval seqlen must be at least 2, got {self.seqlen}")
        if self.max_windows is not None and self.max_windows < 1:
            raise QuantkitError(f"eval max_windows must be at least 1, got {self.max_windows}")
        if self.kld_max_windows < 1:
            raise QuantkitError(f"eval kld_max_windows must be at least 1, got {self.kld_max_windows}")
        if self.bos not in ("auto", "on", "off"):
            raise QuantkitError(f"eval bos must be auto, on or off, got {self.bos!r}")
        if self.kld and self.kld_source is None:
            raise QuantkitError("eval kld needs text: set kld_data or at least one perplexity set (or kld = false)")

    @property
    def kld_source(self) -> str | None:
        return self.kld_data or (self.perplexity[0] if self.perplexity else None)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "perplexity": list(self.perplexity)}


@dataclass(frozen=True)
class Job:
    """One quantization: the arguments of :func:`quantkit.api.quantize`, under a unique ``name``
    (its folder name in the batch output)."""

    name: str
    model: str
    method: str = "rtn"
    scheme: QuantScheme = QuantScheme()
    method_options: dict[str, Any] = field(default_factory=dict, hash=False)
    calib: CalibConfig = CalibConfig()
    load: LoadConfig = LoadConfig()
    batch_size: int = 8
    quantize_lm_head: bool = False

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise QuantkitError(f"job name {self.name!r}: use letters, digits and . _ = + - (it names a folder)")
        object.__setattr__(self, "method_options", dict(self.method_options))
        if self.batch_size < 1:
            raise QuantkitError(f"job {self.name}: batch_size must be at least 1, got {self.batch_size}")

    @property
    def needs_calibration(self) -> bool:
        if self.method == "fp8":  # only static activation scales are calibrated
            return self.method_options.get("activations", "dynamic") == "static"
        return self.method != "rtn"

    def settings(self) -> dict[str, Any]:
        """Everything that decides the checkpoint, as JSON (a record whose settings differ is stale)."""
        out: dict[str, Any] = {
            "model": self.model, "method": self.method, "bits": self.scheme.bits,
            "group_size": self.scheme.group_size, "sym": self.scheme.sym,
            "options": dict(sorted(self.method_options.items())),
            "load": asdict(self.load), "batch_size": self.batch_size, "quantize_lm_head": self.quantize_lm_head,
        }
        if self.needs_calibration:
            out["calib"] = asdict(self.calib)
        return out


def default_job_name(model_label: str, method: str, scheme: QuantScheme, options: dict[str, Any]) -> str:
    """``MODEL-METHOD-wBITS-gGROUP-SYM`` plus ``-key=value`` for each method option set."""
    group = "gch" if scheme.group_size == -1 else f"g{scheme.group_size}"
    parts = [model_label, method, f"w{scheme.bits}", group, "sym" if scheme.sym else "asym"]
    parts += [f"{key}={_short(value)}" for key, value in sorted(options.items())]
    return "-".join(parts)


def _short(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return re.sub(r"[^A-Za-z0-9._+-]", "_", str(value))
