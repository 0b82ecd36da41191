"""FP8 checkpoints in the compressed-tensors layout: what vLLM's loader reads, reloading, and other tools' files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quantkit.api import load_any
from quantkit.checkpoint.fp8 import is_fp8_checkpoint
from quantkit.config import LoadConfig, QuantkitError
from quantkit.fp8_api import install_fp8_linears, quantize_fp8
from quantkit.methods.fp8 import FP8Config

CPU = LoadConfig(device="cpu")


def tensors(folder: Path) -> dict[str, tuple[torch.dtype, tuple]]:
    out = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for k in f.keys():
                t = f.get_tensor(k)
                out[k] = (t.dtype, tuple(t.shape))
    return out


def vllm_expected_scale_shape(strategy: str, out_f: int, in_f: int, block) -> list[tuple]:
    """Shapes vLLM's create_fp8_scale_parameter makes for one (unfused) linear, and what its loaders accept."""
    if strategy == "channel":
        return [(out_f, 1)]
    if strategy == "tensor":
        return [(1,), ()]  # one value per shard, loaded from a scalar or a [1]
    return [(math.ceil(out_f / block[0]), math.ceil(in_f / block[1]))]


def check_vllm_layout(folder: Path, model_linears: dict[str, tuple[int, int]]) -> dict:
    """The checks vLLM's CompressedTensorsConfig makes (from_config, _is_fp8_w8a8, create_weights) on our files."""
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["format"] == "float-quantized"  # an activation-quantization format (is_activation_quantization_format)
    (group,) = qc["config_groups"].values()
    assert group["targets"] == ["Linear"]
    w, a = group["weights"], group["input_activations"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["dynamic"]) == (8, "float", True, False)
    assert w["strategy"] in ("tensor", "channel", "block")
    assert (a["num_bits"], a["type"]) == (8, "float")
    assert a["dynamic"] or (a["symmetric"] and a["strategy"] == "tensor")  # _is_fp8_w8a8's activation rule
    if w["strategy"] == "block":
        assert len(w["block_structure"]) == 2 and a["dynamic"]
    stored = tensors(folder)
    for name, (out_f, in_f) in model_linears.items():
        if name in qc["ignore"]:
            assert stored[f"{name}.weight"][0] in (torch.bfloat16, torch.float16)
            assert f"{name}.weight_scale" not in stored
            continue
        assert stored[f"{name}.weight"] == (torch.float8_e4m3fn, (out_f, in_f))
        dtype, shape = stored[f"{name}.weight_scale"]
        assert dtype == torch.float32 and shape in vllm_expected_scale_shape(w["strategy"], out_f, in_f,
                                                                             w["block_structure"])
        if not a["dynamic"]:
            assert stored[f"{name}.input_scale"] == (torch.float32, (1,))
        else:
            assert f"{name}.input_scale" not in stored
    return qc


def linears(model) -> dict[str, tuple[int, int]]:
    return {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)


@pytest.mark.parametrize("weights,calib", [("channel", None), ("tensor", None), ("block", None), ("channel", "file")])
def test_layout_is_what_vllm_reads(tiny_llama_dir, tiny_model, tiny_text_file, tmp_path, weights, calib):
    from quantkit.config import CalibConfig

    config = FP8Config(weights=weights, block=(32, 32), activations="static" if calib else "dynamic")
    calib_cfg = CalibConfig(str(tiny_text_file), nsamples=4, seqlen=32) if calib else None
    quantize_fp8(str(tiny_llama_dir), tmp_path / "out", config=config, calib=calib_cfg, load=CPU)
    qc = check_vllm_layout(tmp_path / "out", linears(tiny_model))
    assert qc["ignore"] == ["lm_head"]
    assert is_fp8_checkpoint(tmp_path / "out")


def test_config_validates_with_the_compressed_tensors_package(tiny_llama_dir, tmp_path):
    ct = pytest.importorskip("compressed_tensors.quantization", reason="compressed-tensors (needs pydantic)")
    quantize_fp8(str(tiny_llama_dir), tmp_path / "out", config=FP8Config(), load=CPU)
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    parsed = ct.QuantizationConfig.model_validate(qc)
    args = parsed.config_groups["group_0"]
    assert args.weights.strategy == "channel" and args.input_activations.strategy == "token"
    assert args.input_activations.dynamic is True and parsed.format == "float-quantized"


@pytest.mark.parametrize("weights,static", [("channel", False), ("block", False), ("tensor", True)])
def test_reload_gives_the_in_memory_models_logits(tiny_llama_dir, tiny_text_file, tmp_path, weights, static):
    from quantkit.calibrate.walker import walk
    from quantkit.config import CalibConfig
    from quantkit.methods.fp8 import FP8Method
    from quantkit.models.load import load_model

    config = FP8Config(weights=weights, block=(32, 32), activations="static" if static else "dynamic")
    calib = CalibConfig(str(tiny_text_file), nsamples=4, seqlen=32)
    tokens = torch.randint(0, 250, (4, 32), generator=torch.Generator().manual_seed(3)) if static else None
    quantize_fp8(str(tiny_llama_dir), tmp_path / "out", config=config, calib=calib, load=CPU, calib_tokens=tokens)
    loaded = load_model(str(tiny_llama_dir), CPU)
    result = walk(loaded.model, FP8Method(config), device="cpu", token_ids=tokens)
    if static:
        assert all(w.input_scale is not None for w in result.weights.values())
    in_memory = install_fp8_linears(loaded.model, result.weights)
    for param in in_memory.parameters():  # the 16-bit tensors as the checkpoint stores them (bfloat16)
        param.data = param.data.bfloat16().float()
    reloaded, _ = load_any(str(tmp_path / "out"), CPU)
    ids = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = in_memory(ids).logits, reloaded(ids).logits
    assert torch.equal(a, b)


def test_streamed_write_equals_the_whole_model_write(tiny_llama_dir, tmp_path):
    quantize_fp8(str(tiny_llama_dir), tmp_path / "whole", load=LoadConfig(device="cpu", stream="off"))
    report = quantize_fp8(str(tiny_llama_dir), tmp_path / "streamed", load=LoadConfig(device="cpu", stream="on"))
    assert report.streamed
    for key in tensors(tmp_path / "whole"):
        with safe_open(str(tmp_path / "whole" / "model.safetensors"), "pt") as a, \
                safe_open(str(tmp_path / "streamed" / "model.safetensors"), "pt") as b:
            assert torch.equal(a.get_tensor(key).float(), b.get_tensor(key).float()), key


def foreign_checkpoint(tiny_model, tokenizer_dir: Path, folder: Path) -> torch.nn.Module:
    """An FP8_DYNAMIC checkpoint as llm-compressor writes it, built by hand from the spec: tied-off lm_head in
    ignore, per-group format, a version, a recipe file, kv-cache scales with their scheme, shards with an index."""
    from quantkit.primitives import fp8_scale, quantize_fp8

    folder.mkdir()
    state = {}
    for key, t in tiny_model.state_dict().items():
        module = key.rpartition(".")[0]
        if key.endswith(".weight") and module.split(".")[-1].endswith("proj"):
            s = fp8_scale(t.abs().amax(dim=1, keepdim=True))
            state[key] = quantize_fp8(t, s)
            state[f"{module}.weight_scale"] = s
        else:
            state[key] = t.to(torch.bfloat16)
    for i in range(tiny_model.config.num_hidden_layers):  # FP8 KV-cache scales, which quantkit does not use
        for proj in ("k_proj", "v_proj"):
            state[f"model.layers.{i}.self_attn.{proj}.output_scale"] = torch.tensor([0.02])
    keys = sorted(state)
    half = len(keys) // 2
    shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    for name, part in shards.items():
        save_file({k: state[k].contiguous() for k in part}, str(folder / name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": {k: n for n, part in shards.items() for k in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    args = dict(num_bits=8, type="float", symmetric=True, group_size=None, block_structure=None, actorder=None,
                observer_kwargs={})
    config = tiny_model.config.to_dict()
    config["quantization_config"] = {
        "config_groups": {"group_0": {
            "format": "float-quantized", "targets": ["Linear"], "output_activations": None,
            "weights": {**args, "strategy": "channel", "dynamic": False, "observer": "minmax"},
            "input_activations": {**args, "strategy": "token", "dynamic": True, "observer": None}}},
        "format": "float-quantized", "global_compression_ratio": None, "ignore": ["lm_head"],
        "kv_cache_scheme": {**args, "strategy": "tensor", "dynamic": False, "observer": "minmax"},
        "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {},
        "transform_config": {}, "version": "0.10.3.a20250710"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "recipe.yaml").write_text("default_stage:\n  default_modifiers:\n    QuantizationModifier:\n"
                                        "      targets: [Linear]\n      ignore: [lm_head]\n      scheme: FP8_DYNAMIC\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            (folder / name).write_bytes((tokenizer_dir / name).read_bytes())
    return tiny_model


def test_reads_another_tools_checkpoint(tiny_llama_dir, tiny_model, tmp_path):
    foreign_checkpoint(tiny_model, tiny_llama_dir, tmp_path / "foreign")
    ours = tmp_path / "ours"
    quantize_fp8(str(tiny_llama_dir), ours, load=CPU)
    theirs, tok = load_any(str(tmp_path / "foreign"), CPU)
    mine, _ = load_any(str(ours), CPU)
    assert tok is not None
    ids = torch.randint(0, 250, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # the same rounding of the same float32 weights; only the 16-bit copies (bf16 both) are shared
        assert torch.allclose(theirs(ids).logits, mine(ids).logits, atol=1e-5, rtol=1e-5)


def test_damaged_foreign_checkpoints_are_refused(tiny_llama_dir, tiny_model, tmp_path):
    folder = tmp_path / "bad"
    foreign_checkpoint(tiny_model, tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "group"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantkitError, match="weight strategy 'group'"):
        load_any(str(folder), CPU)
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantkitError, match="weight_scale is torch.float32"):
        load_any(str(folder), CPU)  # [out, 1] scales under a per-tensor declaration
