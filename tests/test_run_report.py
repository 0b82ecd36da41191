"""The two quantization reports (INT4 ``QuantizeReport``, FP8 ``FP8Report``): the fields they share and the JSON
objects the CLI's ``--json`` prints, key for key and in order."""

from __future__ import annotations

from quantkit.api import QuantizeReport
from quantkit.config import QuantScheme
from quantkit.fp8_api import FP8Report
from quantkit.fp8_weight import FP8Config

RUN = dict(output="/out", n_quantized=7, seconds_total=10.0, seconds_load=1.0, seconds_calibration=2.0,
           seconds_quantize=3.0, seconds_save=4.0, peak_memory_bytes=5, peak_host_memory_bytes=6, streamed=True,
           layer_stats=[{"layer": 0}])
SECONDS = {"total": 10.0, "load": 1.0, "calibration": 2.0, "quantize": 3.0, "save": 4.0}


def test_int4_report_json():
    report = QuantizeReport(**RUN, method="gptq", scheme=QuantScheme(4, 32, False), partial_group_layers=["a"],
                            engine_kernels={"vllm": "x"}, options={"damp": 0.01}, unquantized=["b"],
                            compression_ratio=3.14159)
    d = report.to_dict()
    assert d == {"output": "/out", "method": "gptq", "bits": 4, "group_size": 32, "sym": False, "n_quantized": 7,
                 "seconds": SECONDS, "peak_memory_bytes": 5, "peak_device_memory_bytes": 5,
                 "peak_host_memory_bytes": 6, "streamed": True, "partial_group_layers": ["a"],
                 "engine_kernels": {"vllm": "x"}, "options": {"damp": 0.01}, "unquantized": ["b"],
                 "expert_tokens": d["expert_tokens"], "compression_ratio": 3.1416}
    assert list(d) == ["output", "method", "bits", "group_size", "sym", "n_quantized", "seconds", "peak_memory_bytes",
                       "peak_device_memory_bytes", "peak_host_memory_bytes", "streamed", "partial_group_layers",
                       "engine_kernels", "options", "unquantized", "expert_tokens", "compression_ratio"]
    assert "layer_stats" not in repr(report)
    # optional fields keep their defaults
    short = QuantizeReport(**{k: v for k, v in RUN.items() if k not in ("peak_host_memory_bytes", "streamed")},
                           method="rtn", scheme=QuantScheme(), partial_group_layers=[])
    assert (short.peak_host_memory_bytes, short.streamed, short.unquantized, short.options) == (0, False, [], {})


def test_fp8_report_json():
    report = FP8Report(**RUN, config=FP8Config("block", "dynamic", (64, 64)), ignored=["lm_head"],
                       unquantized=["model.layers.0.mlp.experts.gate_up_proj"], compression_ratio=1.5)
    d = report.to_dict()
    assert report.method == "fp8"
    # unquantized / compression_ratio: the coverage of the run (MoE experts once went unreported), as QuantizeReport
    assert d == {"output": "/out", "method": "fp8", "weights": "block", "activations": "dynamic", "block": [64, 64],
                 "n_quantized": 7, "ignored": ["lm_head"], "unquantized": ["model.layers.0.mlp.experts.gate_up_proj"],
                 "compression_ratio": 1.5, "seconds": SECONDS, "peak_device_memory_bytes": 5,
                 "peak_host_memory_bytes": 6, "streamed": True,
                 "engines": {"vllm": "CompressedTensorsW8A8Fp8", "sglang": "CompressedTensorsW8A8Fp8"}}
    assert list(d) == ["output", "method", "weights", "activations", "block", "n_quantized", "ignored", "unquantized",
                       "compression_ratio", "seconds", "peak_device_memory_bytes", "peak_host_memory_bytes", "streamed",
                       "engines"]
    assert "layer_stats" not in repr(report)
