"""Other tools' checkpoint folders, built from one quantkit checkpoint by each tool's documented conventions.

Each folder holds the same quantized weights, so each must load to exactly the logits of the original:
AutoGPTQ (settings only in quantize_config.json, with or without quant_method), GPTQModel v1 and v2
(``format``/``checkpoint_format``, ``method``/``quant_method``), AutoAWQ GEMM (config.json, and the old
quant_config.json spellings). Contradictions and missing weights are refused, naming what is wrong.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantkit.checkpoint.read import open_checkpoint, validate_quant_config
from quantkit.checkpoint.save import inspect_checkpoint, load_quantized, save_quantized
from quantkit.config import QuantkitError, QuantScheme
from quantkit.pack import pack_awq, pack_rows, unpack_gptq
from tests.conftest import tiny_llama_config, tiny_tokenizer

SCHEME = QuantScheme(4, 32, sym=False)
GPTQMODEL_META = {"quantizer": ["gptqmodel:7.6.0"], "uri": "https://github.com/modelcloud/gptqmodel"}


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    """A quantkit GPTQ v1 checkpoint of a tiny random Llama (RTN, 4-bit asymmetric, g32)."""
    from transformers import LlamaForCausalLM

    from quantkit.calibrate.walker import walk
    from quantkit.methods.rtn import RTNMethod

    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=len(tokenizer)))
    weights = walk(model, RTNMethod(SCHEME), device="cpu").weights
    out = tmp_path_factory.mktemp("foreign") / "quantkit-v1"
    return save_quantized(model, weights, out, tokenizer=tokenizer, method="rtn", scheme=SCHEME)


def logits(path: Path) -> torch.Tensor:
    model, _ = load_quantized(path, dtype=torch.float32)
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def original_logits(original) -> torch.Tensor:
    return logits(original)


def derive(original: Path, tmp_path: Path, name: str, quantization_config: dict | None,
           files: dict[str, dict] | None = None) -> Path:
    """A copy of ``original`` with config.json's quantization_config replaced (None: removed) and
    settings files added."""
    out = tmp_path / name
    shutil.copytree(original, out)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config")
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config))
    for file_name, content in (files or {}).items():
        (out / file_name).write_text(json.dumps(content))
    return out


def rewrite_packed(folder: Path, convert) -> None:
    """Replace every packed linear's tensors by ``convert(name, tensors_of_that_linear)``."""
    file = folder / "model.safetensors"
    tensors = load_file(file)
    names = [k.removesuffix(".qweight") for k in tensors if k.endswith(".qweight")]
    for name in names:
        parts = {leaf: tensors.pop(f"{name}.{leaf}") for leaf in ("qweight", "qzeros", "scales", "g_idx")}
        tensors.update({f"{name}.{leaf}": t for leaf, t in convert(name, parts).items()})
    save_file(tensors, str(file), metadata={"format": "pt"})


def gptq_settings(**spelling) -> dict:
    return {"bits": 4, "group_size": 32, "desc_act": False, "sym": False, "static_groups": False,
            "true_sequential": True, "damp_percent": 0.05, **spelling}


def gptqmodel_settings(**spelling) -> dict:
    return {**gptq_settings(**spelling), "lm_head": False, "pack_dtype": "int32", "meta": GPTQMODEL_META}


def to_v2(name: str, parts: dict) -> dict:
    """GPTQModel v2: the same packing, zero points stored as they are (no minus one)."""
    in_features, out_features = parts["g_idx"].shape[0], parts["scales"].shape[1]
    _, zeros = unpack_gptq(parts["qweight"], parts["qzeros"], 4, in_features, out_features)  # [G, out]
    return {**parts, "qzeros": pack_rows(zeros.t().contiguous(), 4).t().contiguous()}


def to_awq_gemm(name: str, parts: dict) -> dict:
    """AutoAWQ GEMM: codes and zeros packed along the outputs in AWQ order, no g_idx."""
    in_features, out_features = parts["g_idx"].shape[0], parts["scales"].shape[1]
    codes, zeros = unpack_gptq(parts["qweight"], parts["qzeros"], 4, in_features, out_features)
    qweight, qzeros = pack_awq(codes, zeros)
    return {"qweight": qweight, "qzeros": qzeros, "scales": parts["scales"]}


AWQ_CONFIG = {"quant_method": "awq", "zero_point": True, "group_size": 32, "bits": 4, "version": "gemm",
              "modules_to_not_convert": None}
LAYOUTS = {
    # name: (config.json quantization_config, extra settings files, tensor conversion)
    "autogptq-quantize-config-only": (
        None, {"quantize_config.json": gptq_settings(quant_method="gptq", checkpoint_format="gptq",
                                                     model_file_base_name="model")}, None),
    "autogptq-old-no-method": (
        None, {"quantize_config.json": gptq_settings(model_file_base_name="gptq_model-4bit-32g")}, None),
    "gptqmodel-v1-both-files": (
        gptqmodel_settings(method="gptq", quant_method="gptq", format="gptq", checkpoint_format="gptq"),
        {"quantize_config.json": gptqmodel_settings(method="gptq", quant_method="gptq", format="gptq",
                                                    checkpoint_format="gptq")}, None),
    "gptqmodel-v1-format-method-only": (gptqmodel_settings(method="gptq", format="gptq"), None, None),
    "gptqmodel-v2-format": (gptqmodel_settings(method="gptq", quant_method="gptq", format="gptq_v2"), None, to_v2),
    "gptqmodel-v2-checkpoint-format-quantize-config-only": (
        None, {"quantize_config.json": gptqmodel_settings(quant_method="gptq", checkpoint_format="gptq_v2")}, to_v2),
    "autoawq-gemm": (AWQ_CONFIG, None, to_awq_gemm),
    "autoawq-gemm-old-quant-config": (
        AWQ_CONFIG, {"quant_config.json": {"zero_point": True, "q_group_size": 32, "w_bit": 4, "version": "GEMM"}},
        to_awq_gemm),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_loads_to_the_same_logits(original, original_logits, tmp_path, layout):
    config, files, convert = LAYOUTS[layout]
    folder = derive(original, tmp_path, layout, config, files)
    if convert is not None:
        rewrite_packed(folder, convert)
    base_name = (files or {}).get("quantize_config.json", {}).get("model_file_base_name", "model")
    (folder / "model.safetensors").rename(folder / f"{base_name}.safetensors")  # AutoGPTQ's file name
    assert torch.equal(logits(folder), original_logits)
    info = inspect_checkpoint(folder)
    assert (info.bits, info.group_size, info.sym, info.n_quantized) == (4, 32, False, 14)
    assert info.layout == {to_v2: "gptq_v2", to_awq_gemm: "awq_gemm", None: "gptq_v1"}[convert]
    # What readers that build their own model (the runtime) get: the original's v1 tensors, bit for bit.
    ours, theirs = open_checkpoint(original), open_checkpoint(folder)
    assert theirs.names == ours.names
    keys = sorted(ours.names)
    expected, got = ours.read(keys), theirs.read(keys)
    assert all(torch.equal(expected[k], got[k]) for k in keys)


def test_raw_tensor_readers_get_only_the_layout_they_take(original):
    settings = gptqmodel_settings(method="gptq", format="gptq_v2")
    with pytest.raises(QuantkitError, match="stores the gptq_v2 layout.*open_checkpoint"):
        validate_quant_config(settings, "config.json")
    assert validate_quant_config(settings, "config.json", layouts=("gptq_v1", "gptq_v2")).layout == "gptq_v2"


def test_quantkit_reads_its_own_awq_export(original, original_logits, tmp_path):
    model, _ = load_quantized(original, dtype=torch.float32)
    out = save_quantized(model, {}, tmp_path / "awq", method="rtn", scheme=SCHEME, layout="awq")
    assert torch.equal(logits(out), original_logits)


def test_a_zero_point_v1_cannot_hold_is_refused(original, tmp_path):
    folder = derive(original, tmp_path, "v2-zero", gptqmodel_settings(method="gptq", format="gptq_v2"))

    def zero_at_zero(name, parts):
        parts = to_v2(name, parts)
        parts["qzeros"][0, 0] = 0  # eight zero points of 0
        return parts

    rewrite_packed(folder, zero_at_zero)
    with pytest.raises(QuantkitError, match="a zero point is 0"):
        load_quantized(folder)


@pytest.mark.parametrize(("config", "files", "message"), [
    (gptq_settings(quant_method="gptq", checkpoint_format="gptq"),
     {"quantize_config.json": gptq_settings(quant_method="gptq", checkpoint_format="gptq", bits=8)},
     "quantize_config.json says bits=8, but .*config.json quantization_config says bits=4"),
    (gptq_settings(quant_method="gptq", checkpoint_format="gptq"),
     {"quantize_config.json": gptq_settings(format="gptq_v2")},
     "quantize_config.json says format='gptq_v2', but .*config.json quantization_config says "
     "checkpoint_format='gptq'"),
    (None, {"quantize_config.json": gptq_settings(quant_method="gptq", method="awq")},
     "quantize_config.json contradicts itself: quant_method='gptq' but method='awq'"),
    (AWQ_CONFIG, {"quant_config.json": {"zero_point": False, "q_group_size": 32, "w_bit": 4, "version": "GEMM"}},
     "quant_config.json says zero_point=False, but .*config.json quantization_config says zero_point=True"),
])
def test_contradicting_settings_are_refused_naming_both(original, tmp_path, config, files, message):
    folder = derive(original, tmp_path, "contradiction", config, files)
    for reader in (load_quantized, inspect_checkpoint):
        with pytest.raises(QuantkitError, match=message):
            reader(folder)


def test_settings_in_quantize_config_only_make_a_quantized_checkpoint(original, tmp_path):
    from quantkit.api import is_quantized_checkpoint

    config, files, _ = LAYOUTS["autogptq-quantize-config-only"]
    assert is_quantized_checkpoint(derive(original, tmp_path, "autogptq", config, files))
    assert not is_quantized_checkpoint(derive(original, tmp_path, "no-settings", None))


def test_dtype_auto_is_float32_on_the_cpu(original):
    from quantkit.api import load_any
    from quantkit.config import LoadConfig

    assert json.loads((original / "config.json").read_text())["dtype"] == "bfloat16"
    model, _ = load_any(str(original), LoadConfig(dtype="auto", device="cpu"))
    assert model.model.norm.weight.dtype == torch.float32
    model, _ = load_any(str(original), LoadConfig(dtype="bf16", device="cpu"))
    assert model.model.norm.weight.dtype == torch.bfloat16


def test_plain_load_refuses_missing_and_unexpected_weights(tiny_llama_dir, tmp_path):
    from quantkit.models.load import load_model

    folder = tmp_path / "plain"
    shutil.copytree(tiny_llama_dir, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors.pop("model.layers.1.mlp.down_proj.weight")
    tensors["model.layers.0.extra.weight"] = torch.ones(3)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(QuantkitError) as caught:
        load_model(str(folder))
    message = str(caught.value)
    assert "1 weight(s) missing from the files" in message and "model.layers.1.mlp.down_proj.weight" in message
    assert re.search(r"1 weight\(s\) in the files but not in the model: model\.layers\.0\.extra\.weight", message)


def quantkit_cli(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "quantkit.cli.app", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=600)


def test_cli_eval_of_a_folder_with_missing_weights_exits_2_naming_them(tiny_llama_dir, tiny_text_file, tmp_path):
    folder = tmp_path / "missing"
    shutil.copytree(tiny_llama_dir, folder)
    tensors = load_file(folder / "model.safetensors")
    for key in [k for k in tensors if k.startswith("model.layers.0.self_attn.")]:
        del tensors[key]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    proc = quantkit_cli("eval", "perplexity", folder, "--data", tiny_text_file, "--seqlen", "64", "--max-windows", "2")
    assert proc.returncode == 2, proc.stderr
    stderr = " ".join(proc.stderr.split())  # the console may wrap long lines
    assert "4 weight(s) missing from the files" in stderr and "model.layers.0.self_attn.k_proj.weight" in stderr
    assert "Traceback" not in proc.stderr


def test_cli_eval_reads_settings_from_quantize_config_json(original, tiny_text_file, tmp_path):
    """The issue's folder: quantization_config removed from config.json, quantize_config.json kept."""
    from quantkit.api import evaluate_perplexity
    from quantkit.config import LoadConfig

    config, files, _ = LAYOUTS["autogptq-quantize-config-only"]
    folder = derive(original, tmp_path, "autogptq", config, files)
    proc = quantkit_cli("eval", "perplexity", folder, "--data", tiny_text_file, "--seqlen", "64", "--max-windows",
                        "3", "--device", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr
    expected = evaluate_perplexity(str(original), data=str(tiny_text_file), seqlen=64, max_windows=3,
                                   load=LoadConfig(device="cpu"))
    assert json.loads(proc.stdout)["ppl"] == pytest.approx(expected.ppl, rel=1e-6)


@pytest.mark.parametrize("layout", ["autogptq-quantize-config-only", "gptqmodel-v2-format", "autoawq-gemm"])
def test_the_runtime_reads_each_layout_as_the_original(original, tmp_path, layout):
    """The serving runtime loads through the same reader: the same logits as from quantkit's own folder."""
    from quantkit.runtime.loader import load_runtime_model

    config, files, convert = LAYOUTS[layout]
    folder = derive(original, tmp_path, layout, config, files)
    if convert is not None:
        rewrite_packed(folder, convert)
    ids = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(1))
    ours, _ = load_runtime_model(str(original), device="cpu", dtype="float32", backend="reference")
    theirs, _ = load_runtime_model(str(folder), device="cpu", dtype="float32", backend="reference")
    assert theirs.quant == ours.quant
    assert torch.equal(theirs.forward_logits(ids), ours.forward_logits(ids))
