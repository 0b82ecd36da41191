"""bench/bench_serve_coldstart.py's list of kernels compiled after the server said ready: read from the new
entries of its Triton cache folder."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_serve_coldstart", REPO / "bench" / "bench_serve_coldstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(cache: Path, entry: str, name: str) -> None:
    folder = cache / entry
    folder.mkdir(parents=True)
    for suffix in (".cubin", ".json", ".ptx"):  # one compilation writes several files: counted once
        (folder / f"{name}{suffix}").write_text("")
    (folder / f"__grp__{name}.json").write_text("")


def test_kernels_compiled_after_ready_are_named_and_counted(tmp_path):
    bench = _bench()
    _compile(tmp_path, "a1", "_gemv_kernel")
    _compile(tmp_path, "b2", "_attn_fwd_gluon")
    ready = bench.compiled_kernels(tmp_path)
    assert ready == {("a1", "_gemv_kernel"), ("b2", "_attn_fwd_gluon")}
    _compile(tmp_path, "c3", "_gemv_kernel")  # the same kernel, another specialization (M=3)
    _compile(tmp_path, "d4", "_w4a16_kernel")
    assert bench.new_kernels(ready, bench.compiled_kernels(tmp_path)) == {"_gemv_kernel": 1, "_w4a16_kernel": 1}
    assert bench.new_kernels(ready, ready) == {}
    assert bench.compiled_kernels(tmp_path / "missing") == set()
