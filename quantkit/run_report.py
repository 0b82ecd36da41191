"""What every quantization run reports, whatever its format (INT4 :class:`quantkit.api.QuantizeReport`, FP8
:class:`quantkit.fp8_api.FP8Report`): where it wrote, how many linears, the time of each phase, peak memory, and
whether the model was streamed from disk. Each format's report adds its own fields and builds its ``--json``
object from these parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True)
class RunReport:
    """The fields both quantization reports share (keyword-only, so each report adds its own in any order)."""

    output: str
    method: str
    n_quantized: int
    seconds_total: float
    seconds_load: float
    seconds_calibration: float
    seconds_quantize: float
    seconds_save: float
    peak_memory_bytes: int  # device (accelerator) memory; 0 on the CPU
    peak_host_memory_bytes: int = 0  # the process's resident-memory high-water mark (VmHWM on Linux)
    streamed: bool = False  # decoder layers read from disk one at a time (quantkit.models.lazy)
    layer_stats: list[dict[str, Any]] = field(repr=False)

    def seconds(self) -> dict[str, float]:
        """The phases' times, the ``seconds`` object of the JSON report."""
        return {"total": self.seconds_total, "load": self.seconds_load, "calibration": self.seconds_calibration,
                "quantize": self.seconds_quantize, "save": self.seconds_save}

    def memory(self) -> dict[str, Any]:
        """Peak device and host memory and the loading mode, as the JSON report names them."""
        return {"peak_device_memory_bytes": self.peak_memory_bytes,
                "peak_host_memory_bytes": self.peak_host_memory_bytes, "streamed": self.streamed}
