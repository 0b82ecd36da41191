"""A model larger than the memory it may use: a random Llama-shaped checkpoint of 3 GB (bf16) on disk,
quantized from disk in a child process whose peak resident memory is bounded by a fraction of the checkpoint
(loading it whole would take twice its size: float32 on the CPU).

RTN quantizes the whole model and writes the sharded checkpoint; GPTQ (2 x 64 calibration tokens) runs its
first decoder layer (calibration capture, Hessians, solve, the packed layer handed to the writer) and is then
interrupted: every layer has the same shapes, so one layer shows its memory, and the interrupted run must
leave no output behind. A whole GPTQ pass over 2 GB takes tens of minutes on a 2-core CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Left out of the default run (pyproject addopts): ~13 minutes here. `pytest -m large tests/test_lazy_model_large.py`.
pytestmark = [pytest.mark.slow, pytest.mark.large]

# Llama-shaped layers (hidden 1024, MLP 4096, 16 heads of 64, 4 KV heads): 99 layers of 30.4 MB in bf16
# make 3.01 GB. The vocabulary is the tiny test tokenizer's, so the layers are the bulk.
# The bounds are what quantkit reaches today on the CPU, not yet the third issue 28 asks for. Measured
# (2026-12-02, /proc sampling): a process with torch and transformers' Llama imported holds ~400 MB before
# any weight; RTN adds one float32 layer plus its temporaries (~350 MB) and creeps ~3 MB a layer: peak
# 1061 MB = 0.37 of the checkpoint. GPTQ on the CPU keeps its per-layer working set (Hessians, Cholesky,
# stacked weights: ~1 GB for this layer) in host memory: peak 1629 MB = 0.54. On a GPU that working set
# is device memory.
RTN_BOUND, GPTQ_BOUND = 1 / 3, 1 / 3
SHAPE = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=99, num_attention_heads=16,
             num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False)
SHARD_BYTES = 512 * 2**20

_CHILD = r"""
import json, resource, sys, torch
from quantkit import api
from quantkit.config import LoadConfig, QuantScheme
model, out, method, stop_after = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

class Stop(Exception):
    pass

def on_layer(event):
    if stop_after and event.index + 1 == stop_after:
        raise Stop

tokens = torch.randint(0, 200, (2, 64), generator=torch.Generator().manual_seed(0))
options = {"desc_act": False, "static_groups": False, "mse": False} if method == "gptq" else None
result = {}
try:
    report = api.quantize(model, out, method=method, scheme=QuantScheme(4, 128, True), method_options=options,
                          load=LoadConfig(device="cpu", stream="on"), calib_tokens=tokens, on_layer=on_layer)
    result = report.to_dict()
except Stop:
    result = {"stopped_after": stop_after}
# The child's own peak (VmHWM). Not ru_maxrss: Linux carries it over exec, so it reports at least this test
# process's resident size when it started the child (~1.1 GB after writing the checkpoint).
result["ru_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
result["vm_hwm_bytes"] = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print("RESULT " + json.dumps(result))
"""


def write_llama_checkpoint(folder: Path) -> int:
    """A random bf16 Llama of SHAPE as sharded safetensors; returns the bytes on disk. One layer's tensors
    are drawn and copied into every layer (drawing 1e9 random numbers would dominate the test's time)."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    from quantkit.checkpoint.read import parameters_on_meta
    from tests.conftest import tiny_llama_config, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    config = tiny_llama_config(vocab_size=len(tokenizer), **SHAPE)
    config.torch_dtype = torch.bfloat16
    with parameters_on_meta():
        skeleton = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    drawn: dict[str, torch.Tensor] = {}

    def tensor_for(key: str, shape: torch.Size) -> torch.Tensor:
        generic = key.split(".", 3)[-1] if key.startswith("model.layers.") else key
        if generic not in drawn:
            ones = len(shape) == 1 and "norm" in key
            drawn[generic] = torch.ones(shape) if ones else torch.randn(shape, generator=generator) * 0.02
        return drawn[generic].to(torch.bfloat16)  # a new tensor each time: safetensors refuses shared storage

    shards, shard, size = [], {}, 0
    for key, param in skeleton.named_parameters():
        if shard and size + param.numel() * 2 > SHARD_BYTES:
            shards.append(list(shard))
            save_file(shard, str(folder / f"model-{len(shards):05d}.tmp"), metadata={"format": "pt"})
            shard, size = {}, 0
        shard[key] = tensor_for(key, param.shape)
        size += param.numel() * 2
    shards.append(list(shard))
    save_file(shard, str(folder / f"model-{len(shards):05d}.tmp"), metadata={"format": "pt"})
    weight_map = {}
    for i, keys in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (folder / f"model-{i + 1:05d}.tmp").rename(folder / name)
        weight_map.update(dict.fromkeys(keys, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def run_child(model: Path, out: Path, method: str, stop_after: int = 0) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(model), str(out), method, str(stop_after)],
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def llama_2gb(tmp_path_factory):
    import shutil

    folder = tmp_path_factory.mktemp("llama_2gb")
    size = write_llama_checkpoint(folder)
    yield folder, size
    shutil.rmtree(folder, ignore_errors=True)


def test_rtn_from_disk_stays_under_its_bound(llama_2gb, tmp_path):
    from quantkit.checkpoint.read import open_checkpoint

    folder, size = llama_2gb
    assert size >= 3e9
    report = run_child(folder, tmp_path / "rtn", "rtn")
    print(f"\nRTN from disk: checkpoint {size / 2**30:.2f} GiB, peak RSS {report['vm_hwm_bytes'] / 2**20:.0f} MiB "
          f"({100 * report['vm_hwm_bytes'] / size:.1f}%), {report['seconds']['total']:.1f} s "
          f"(ru_maxrss, the parent's size included: {report['ru_maxrss_bytes'] / 2**20:.0f} MiB)")
    assert report["streamed"] and report["n_quantized"] == SHAPE["num_hidden_layers"] * 7
    assert report["peak_host_memory_bytes"] <= report["vm_hwm_bytes"] < RTN_BOUND * size
    written = open_checkpoint(tmp_path / "rtn")  # headers, index and settings validated by quantkit's reader
    assert len({r.file for r in written.records.values()}) > 1 and len(written.geometry) == SHAPE["num_hidden_layers"] * 7


def test_gptq_from_disk_stays_under_its_bound(llama_2gb, tmp_path):
    folder, size = llama_2gb
    result = run_child(folder, tmp_path / "gptq", "gptq", stop_after=1)
    print(f"\nGPTQ from disk, first layer: peak RSS {result['vm_hwm_bytes'] / 2**20:.0f} MiB "
          f"({100 * result['vm_hwm_bytes'] / size:.1f}% of {size / 2**30:.2f} GiB; ru_maxrss, the parent's size "
          f"included: {result['ru_maxrss_bytes'] / 2**20:.0f} MiB)")
    assert result["stopped_after"] == 1
    assert result["vm_hwm_bytes"] < GPTQ_BOUND * size
    assert list(tmp_path.iterdir()) == []  # interrupted: no output folder, no temporary folder left
