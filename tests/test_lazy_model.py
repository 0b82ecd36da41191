"""Streaming a safetensors model layer by layer (quantkit.models.lazy): the same checkpoint as loading it whole,
layers read only when asked and released after, shards written as layers finish, the choice of path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import quantkit.models.lazy as lazy_model
from quantkit import api
from quantkit.config import CalibConfig, LoadConfig, QuantkitError


def checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            out.update({key: handle.get_tensor(key) for key in handle.keys()})
    return out


def quantize(model: Path, out: Path, method: str, stream: str, calib_file: Path, **kwargs) -> api.QuantizeReport:
    calib = CalibConfig(source=str(calib_file), nsamples=4, seqlen=32)
    return api.quantize(str(model), out, method=method, calib=calib, progress=False,
                        load=LoadConfig(device="cpu", stream=stream), **kwargs)


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_streamed_checkpoint_equals_whole_load(tiny_llama_dir, tiny_text_file, tmp_path, method):
    whole = quantize(tiny_llama_dir, tmp_path / "whole", method, "off", tiny_text_file)
    streamed = quantize(tiny_llama_dir, tmp_path / "streamed", method, "on", tiny_text_file)
    assert (whole.streamed, streamed.streamed) == (False, True)
    assert streamed.n_quantized == whole.n_quantized == 14
    a, b = checkpoint_tensors(tmp_path / "whole"), checkpoint_tensors(tmp_path / "streamed")
    assert sorted(a) == sorted(b)
    assert [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])] == []
    config_a, config_b = (json.loads((tmp_path / n / "config.json").read_text()) for n in ("whole", "streamed"))
    for config in (config_a, config_b):
        config["quantization_config"]["quantkit"].pop("layer_seconds")
    assert config_a == config_b
    assert streamed.peak_host_memory_bytes > 2**20 and streamed.to_dict()["peak_host_memory_bytes"] > 2**20
    assert streamed.to_dict()["streamed"] is True and "peak_device_memory_bytes" in streamed.to_dict()


@pytest.mark.parametrize("tied", [False, True])
def test_streamed_output_head_quantization_equals_whole_load(tiny_llama_dir, tiny_text_file, tmp_path, tied):
    """--quantize-lm-head with the model streamed (as auto does on a GPU) writes what the whole model writes, with
    the embeddings tied to the head or not (a tied head is untied and quantized, the embeddings stay 16-bit)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from tests.conftest import tiny_llama_config

    torch.manual_seed(0)  # 264 rows: the head's zero points pack 8 to a word (the tokenizer's 258 would not)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=264, tie_word_embeddings=tied))
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(model_dir)
    whole = quantize(model_dir, tmp_path / "whole", "gptq", "off", tiny_text_file, quantize_lm_head=True)
    streamed = quantize(model_dir, tmp_path / "streamed", "gptq", "on", tiny_text_file, quantize_lm_head=True)
    assert streamed.streamed and streamed.n_quantized == whole.n_quantized == 15
    a, b = checkpoint_tensors(tmp_path / "whole"), checkpoint_tensors(tmp_path / "streamed")
    assert sorted(a) == sorted(b) and any(k.startswith("lm_head.") and k.endswith("qweight") for k in a)
    assert [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])] == []


def test_a_head_that_cannot_pack_is_refused_before_the_model_loads(tiny_llama_dir, tiny_text_file, tmp_path,
                                                                     monkeypatch):
    import quantkit.models.lazy as lazy

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the check")

    monkeypatch.setattr(lazy, "open_model", no_load)
    with pytest.raises(QuantkitError, match="258 rows.*multiple of 8.*drop --quantize-lm-head"):
        quantize(tiny_llama_dir, tmp_path / "out", "gptq", "auto", tiny_text_file, quantize_lm_head=True)
    assert not (tmp_path / "out").exists()


def test_a_head_that_cannot_pack_is_refused_before_the_walk_when_config_json_cannot_say(
        tiny_llama_dir, tiny_text_file, tmp_path, monkeypatch):
    """GGUF files have no config.json to read the vocabulary from: the loaded head is checked before any layer."""
    from quantkit import preflight

    monkeypatch.setattr(preflight, "vocab_size", lambda spec: None)
    walked = []
    monkeypatch.setattr(api, "walk", lambda *a, **k: walked.append(1))
    with pytest.raises(QuantkitError, match="258 rows"):
        quantize(tiny_llama_dir, tmp_path / "out", "gptq", "off", tiny_text_file, quantize_lm_head=True)
    assert walked == [] and not (tmp_path / "out").exists()


def test_streamed_layers_shard_as_they_finish_and_load(tiny_llama_dir, tiny_text_file, tmp_path, monkeypatch):
    from quantkit.checkpoint.read import load_quantized

    monkeypatch.setattr(lazy_model, "MIN_STREAM_SHARD_BYTES", 40_000)  # the tiny model's layers are ~60 KB packed
    quantize(tiny_llama_dir, tmp_path / "whole", "gptq", "off", tiny_text_file)
    quantize(tiny_llama_dir, tmp_path / "streamed", "gptq", "on", tiny_text_file)
    files = sorted(p.name for p in (tmp_path / "streamed").glob("*.safetensors"))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "streamed" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files
    a, b = checkpoint_tensors(tmp_path / "whole"), checkpoint_tensors(tmp_path / "streamed")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(0, 200, (1, 16))
    logits = [load_quantized(tmp_path / n, dtype="float32")[0](ids).logits for n in ("whole", "streamed")]
    assert torch.equal(logits[0], logits[1])


def test_layers_are_read_when_asked_and_released_after(tiny_llama_dir):
    from quantkit.api import build_method
    from quantkit.calibrate.walker import walk
    from quantkit.config import QuantScheme

    loaded, source = lazy_model.open_streamed(str(tiny_llama_dir), LoadConfig(device="cpu"))
    layers = list(source.layers)
    assert all(p.is_meta for layer in layers for p in layer.parameters())
    # the embedding and the output head are not held: read for the calibration capture only / copied at save
    assert loaded.model.model.embed_tokens.weight.is_meta and loaded.model.lm_head.weight.is_meta
    assert not loaded.model.model.norm.weight.is_meta
    from safetensors.torch import load_file

    table = load_file(str(tiny_llama_dir / "model.safetensors"))["model.embed_tokens.weight"]
    ids = torch.tensor([[5, 1, 200, 5], [0, 1, 7, 255]])
    with source.input_embeddings():  # only the rows of the ids asked for are read, and cast on the way out
        out = loaded.model.model.embed_tokens(ids)
        assert out.dtype == torch.float32 and torch.equal(out, table.float()[ids])
        assert loaded.model.model.embed_tokens.weight.is_meta  # between calls nothing is held
    assert loaded.model.model.embed_tokens.weight.is_meta
    seen = []

    def on_finish(prefix, layer, weights):
        # the layer is materialized while it is handed over; the others are not
        assert not any(p.is_meta for p in layer.parameters())
        assert all(p.is_meta for other in layers if other is not layer for p in other.parameters())
        seen.append((prefix, sorted(weights)))

    source.on_finish = on_finish
    result = walk(loaded.model, build_method("rtn", QuantScheme(4, 32, True)), device="cpu", source=source)
    assert [prefix for prefix, _ in seen] == ["model.layers.0", "model.layers.1"]
    assert "self_attn.q_proj" in seen[0][1]
    assert all(p.is_meta for layer in layers for p in layer.parameters())
    # the walk keeps shells: sizes and g_idx, no packed data
    shell = result.weights["model.layers.0.mlp.down_proj"]
    assert shell.qweight.is_meta and not shell.g_idx.is_meta and shell.in_features == 128
    with pytest.raises(RuntimeError, match="already read"):
        source.layer(0)


def test_failed_streamed_run_leaves_no_output(tiny_llama_dir, tiny_text_file, tmp_path, monkeypatch):
    monkeypatch.setattr(lazy_model, "MIN_STREAM_SHARD_BYTES", 40_000)  # so shards are on disk when it fails

    def fail_after_first(event):
        if event.index == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        quantize(tiny_llama_dir, tmp_path / "out", "rtn", "on", tiny_text_file, on_layer=fail_after_first)
    assert list(tmp_path.iterdir()) == []


def test_plan_loading(tiny_llama_dir, tmp_path, monkeypatch):
    plan = lazy_model.plan_loading(str(tiny_llama_dir), LoadConfig(device="cpu"), self_calibration=False)
    assert not plan.stream and "GiB available" in plan.reason
    monkeypatch.setattr(lazy_model, "available_memory_bytes", lambda: 100_000)  # a model "larger than memory"
    plan = lazy_model.plan_loading(str(tiny_llama_dir), LoadConfig(device="cpu"), self_calibration=False)
    assert plan.stream and "streamed" in plan.reason
    # self-generated calibration and GGUF files need the whole model: auto loads it, on refuses
    assert not lazy_model.plan_loading(str(tiny_llama_dir), LoadConfig(), self_calibration=True).stream
    with pytest.raises(QuantkitError, match="--calib"):
        lazy_model.plan_loading(str(tiny_llama_dir), LoadConfig(stream="on"), self_calibration=True)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert not lazy_model.plan_loading(str(gguf), LoadConfig(), self_calibration=False).stream
    with pytest.raises(QuantkitError, match="safetensors"):
        lazy_model.plan_loading(str(gguf), LoadConfig(stream="on"), self_calibration=False)
    assert not lazy_model.plan_loading(str(tiny_llama_dir), LoadConfig(stream="off"), self_calibration=False).stream
    with pytest.raises(QuantkitError, match="--stream"):
        LoadConfig(stream="yes")


def test_plan_loading_streams_a_local_folder_whenever_the_walk_runs_on_a_gpu(tiny_llama_dir, tmp_path, monkeypatch):
    """On a GPU, auto streams a local safetensors folder even when it fits (the load leaves the critical path);
    what cannot stream still loads whole, and --stream off still wins."""
    monkeypatch.setattr(lazy_model, "resolve_device", lambda device: "cuda:0")
    monkeypatch.setattr(lazy_model, "available_memory_bytes", lambda: 2**50)  # fits many times over
    plan = lazy_model.plan_loading(str(tiny_llama_dir), LoadConfig(), self_calibration=False)
    assert plan.stream and "cuda:0" in plan.reason
    assert not lazy_model.plan_loading(str(tiny_llama_dir), LoadConfig(), self_calibration=True).stream
    assert not lazy_model.plan_loading(str(tiny_llama_dir), LoadConfig(stream="off"), self_calibration=False).stream
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert not lazy_model.plan_loading(str(gguf), LoadConfig(), self_calibration=False).stream
    assert not lazy_model.plan_loading(str(tiny_llama_dir), LoadConfig(), self_calibration=False, world_size=2).stream


def test_streaming_refuses_files_that_do_not_match_the_config(tiny_llama_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(QuantkitError, match="up_proj"):
        lazy_model.open_streamed(str(broken), LoadConfig(device="cpu"))


def test_cli_stream_flag_and_memory_in_json(tiny_llama_dir, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    base = [sys.executable, "-m", "quantkit.cli.app", "rtn", str(tiny_llama_dir), "--stream", "on"]
    proc = subprocess.run([*base, "-o", str(tmp_path / "a"), "--json"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["streamed"] is True and report["peak_host_memory_bytes"] > 50 * 2**20
    assert "streamed from disk" not in proc.stdout  # the choice is logged on stderr, the JSON stays clean
    assert "--stream on" in proc.stderr
    human = subprocess.run([*base, "-o", str(tmp_path / "b")], capture_output=True, text=True, env=env, timeout=300)
    assert human.returncode == 0, human.stderr
    assert "peak host memory" in human.stdout and "streamed from disk" in human.stdout


def test_auto_falls_back_to_the_whole_load_when_the_files_cannot_be_streamed(tiny_llama_dir, monkeypatch):
    def refuse(spec, load):
        raise QuantkitError("the files name their tensors differently")

    monkeypatch.setattr(lazy_model, "open_streamed", refuse)
    plan = lazy_model.LoadPlan(True, "streamed from disk")
    loaded, source = lazy_model.open_model(str(tiny_llama_dir), LoadConfig(device="cpu"), plan)
    assert source is None and not any(p.is_meta for p in loaded.model.parameters())
    with pytest.raises(QuantkitError, match="differently"):
        lazy_model.open_model(str(tiny_llama_dir), LoadConfig(device="cpu", stream="on"), plan)


def test_bound_host_heap_takes_on_glibc():
    """Streaming fixes glibc's mmap threshold (freed layer temporaries leave the process at once); the call
    reports whether the C library took the setting (glibc on Linux; elsewhere it is a no-op)."""
    import sys

    from quantkit.models.lazy import _libc, bound_host_heap

    took = bound_host_heap()
    assert took == (_libc() is not None)
    if sys.platform.startswith("linux") and _libc() is not None:
        assert took
