"""The Python API's defaults: group size per model, calibration sized to the device, progress on its own."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest

from quantkit import api
from quantkit.config import QuantScheme
from quantkit.progress import LogProgress, format_duration, format_layer_line


@pytest.mark.parametrize("sizes,expected", [
    ([4096, 14336], 128),
    ([576, 1536], 64),  # SmolLM2-135M: 576 = 4.5 x 128
    ([96, 160], 32),
    ([100], 128),  # nothing divides: 128, and the run warns about partial groups
])
def test_choose_group_size(sizes, expected):
    assert api.choose_group_size(sizes) == expected


def test_auto_scheme_takes_the_methods_symmetry():
    assert api.AutoScheme().resolve("gptq", [576]) == QuantScheme(4, 64, True)
    assert api.AutoScheme().resolve("awq", [576]) == QuantScheme(4, 64, False)
    assert api.AutoScheme(bits=8, sym=False).resolve("gptq", [4096]) == QuantScheme(8, 128, False)


def test_default_calibration_is_sized_to_the_device():
    assert (api.default_calibration("gptq", "self", "cpu").nsamples,
            api.default_calibration("gptq", "self", "cpu").seqlen) == api.SELF_CALIB_CPU_SIZE
    gpu = api.default_calibration("gptq", "self", "cuda")
    assert (gpu.nsamples, gpu.seqlen) == (128, 2048)
    text = api.default_calibration("awq", "valid.txt", "cpu")
    assert (text.nsamples, text.seqlen) == (128, 512)
    given = api.default_calibration("gptq", "self", "cpu", nsamples=7, seqlen=99)
    assert (given.nsamples, given.seqlen) == (7, 99)


def test_build_method_applies_the_gptq_defaults_and_lets_each_be_turned_off():
    method = api.build_method("gptq", QuantScheme(4, 64, True))
    assert method.config.desc_act and method.config.static_groups and method.config.mse
    off = api.build_method("gptq", QuantScheme(4, 64, True), {"desc_act": False, "static_groups": False,
                                                             "mse": False})
    assert not (off.config.desc_act or off.config.static_groups or off.config.mse)


def test_gptq_mse_search_defaults_to_hessian_weights_squared_with_an_off_switch():
    """Issue 21: the range search weighted by H_jj, squared error (SmolLM2 asym g64 22.63 -> 22.17 on an
    H200, docs/quality.md); ``mse_weight="none"`` restores the unweighted |error|^2.4 search."""
    for sym in (True, False):
        config = api.build_method("gptq", QuantScheme(4, 64, sym)).config
        assert config.mse and config.mse_weight == "hessian" and config.search_norm == 2.0
    off = api.build_method("gptq", QuantScheme(4, 64, False), {"mse_weight": "none"}).config
    assert off.mse_weight == "none" and off.search_norm == 2.4


def test_gptq_on_an_asymmetric_grid_defaults_to_dynamic_groups():
    asym = api.build_method("gptq", QuantScheme(4, 64, False))
    assert asym.config.desc_act and not asym.config.static_groups and asym.config.mse
    assert api.default_options("gptq", QuantScheme(4, 64, False))["static_groups"] is False
    assert api.default_options("gptq", QuantScheme(4, 64, True))["static_groups"] is True
    assert api.build_method("gptq", QuantScheme(4, 64, False), {"static_groups": True}).config.static_groups
    assert api.default_options("awq", QuantScheme(4, 64, False)) == {}


def _event(n_linears: int = 7):
    stats = {f"model.layers.0.mlp.very_long_projection_name_{i}": {"err_rtn": 0.01 * (i + 1), "err_gptq": 0.002 * (i + 1)}
             for i in range(n_linears)}
    return SimpleNamespace(index=2, n_layers=30, seconds=4.12, result=SimpleNamespace(stats=stats, notes=[]),
                           peak_memory_bytes=3 << 30)


def test_layer_line_fits_80_columns_and_averages():
    line = format_layer_line(_event())
    assert len(line) <= 80
    assert line.startswith("layer  3/30") and "error 0.0400 -> 0.0080" in line and "worst" in line


def test_log_progress_reports_layers_and_calibration_eta(caplog):
    progress = LogProgress()
    with caplog.at_level(logging.INFO, logger="quantkit"):
        progress.on_layer(_event())
        for done in range(0, 101, 5):
            progress.on_calibration(done, 100)
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("layer  3/30") for m in messages)
    calib = [m for m in messages if m.startswith("self-calibration")]
    assert 5 <= len(calib) <= 12 and "left" in calib[-1]


def test_format_duration():
    assert format_duration(42) == "42 s"
    assert format_duration(125) == "2 min 05 s"
    assert format_duration(7260) == "2 h 01 min"


def test_python_api_shows_progress_when_asked_without_logging_setup(tiny_llama_dir, tmp_path):
    """A fresh interpreter (no logging configured): progress=True prints the layer lines on stderr."""
    code = (f"import quantkit\n"
            f"r = quantkit.quantize({str(tiny_llama_dir)!r}, {str(tmp_path / 'o')!r}, method='rtn', progress=True)\n"
            f"print(r.scheme.group_size)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", **_pythonpath_env()})
    assert proc.returncode == 0, proc.stderr
    assert "layer 1/2" in proc.stderr and "layer 2/2" in proc.stderr and "group size 64" in proc.stderr
    assert proc.stdout.strip() == "64"
    config = json.loads((tmp_path / "o" / "config.json").read_text())
    assert config["use_cache"] is True and config["quantization_config"]["sym"] is True


def _pythonpath_env() -> dict:
    import os

    keep = ("QUANTKIT_ROOT", "QUANTKIT_CACHE", "HOME", "PYTHONPATH")
    return {k: os.environ[k] for k in keep if k in os.environ}
