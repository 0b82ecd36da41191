"""Checkpoint writer and reader on a tiny random Llama built in-process (no downloads, < 10 s)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

import quantkit.checkpoint.writer as checkpoint_writer
from quantkit.arch import find_decoder_layers, find_linears
from quantkit.checkpoint.save import inspect_checkpoint, load_quantized, save_quantized
from quantkit.config import QuantkitError, QuantScheme
from quantkit.primitives import compute_qparams, default_g_idx, quantize
from quantkit.qlinear import QuantLinear
from quantkit.qtensor import QuantizedWeight

REPO = Path(__file__).resolve().parents[1]
LINEARS_PER_LAYER = 7


def tiny_llama(hidden=64, intermediate=128, tie=True, dtype=torch.float32, seed=0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=tie,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    # Put every float on the 16-bit grid the writer stores, so the reload is exact in float32.
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16 if dtype == torch.float32 else dtype).to(dtype)
    return model


def rtn_quantize(
    model, scheme: QuantScheme, skip=lambda name: False, act_order=False
) -> dict[str, QuantizedWeight]:
    """Min/max round-to-nearest of every decoder linear; the model keeps the dequantized weights."""
    prefix, layers = find_decoder_layers(model)
    weights = {}
    for i, layer in enumerate(layers):
        shared_g_idx = {}  # act-order: linears with one input share one g_idx tensor, as GPTQ does
        for rel, linear in find_linears(layer).items():
            name = f"{prefix}.{i}.{rel}"
            if skip(name):
                continue
            w = linear.weight.detach().float()
            g_idx = None
            if act_order:  # a fixed permutation of the contiguous grouping, as act-order writes it
                if w.shape[1] not in shared_g_idx:
                    perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(i))
                    shared_g_idx[w.shape[1]] = default_g_idx(w.shape[1], scheme.group_size)[perm]
                g_idx = shared_g_idx[w.shape[1]]
            scales, zeros, g_idx = compute_qparams(w, scheme.bits, scheme.group_size, scheme.sym, g_idx=g_idx)
            codes = quantize(w, scales, zeros, g_idx, scheme.bits)
            qw = QuantizedWeight.from_codes(codes, scales, zeros, g_idx, scheme)
            linear.weight.data = qw.dequantize().to(linear.weight.dtype)
            weights[name] = qw
    return weights


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 256)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def logits(model, seed=0) -> torch.Tensor:
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits.float()


def saved(tmp_path, scheme=None, name="ckpt", model=None, **kwargs):
    scheme = scheme or QuantScheme(4, 32, False)
    model = model if model is not None else tiny_llama()
    weights = rtn_quantize(model, scheme, **{k: kwargs.pop(k) for k in ("skip", "act_order") if k in kwargs})
    kwargs.setdefault("method", "rtn")
    out = save_quantized(model, weights, tmp_path / name, scheme=scheme, **kwargs)
    return model, weights, out


def quant_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


# -- round trips ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bits", "group_size", "sym", "hidden", "intermediate"),
    [
        (4, 32, False, 64, 128),
        (4, 128, True, 64, 128),  # group larger than the 64 inputs of most layers: one partial group
        (4, 64, True, 96, 160),  # 96 and 160 inputs at g64: partial last groups everywhere
        (8, -1, True, 64, 128),
        (3, 32, False, 64, 128),
        (2, 64, False, 64, 128),
    ],
)
def test_round_trip_logits_match_in_memory_model(tmp_path, bits, group_size, sym, hidden, intermediate):
    model = tiny_llama(hidden, intermediate)
    scheme = QuantScheme(bits, group_size, sym)
    _, weights, out = saved(tmp_path, scheme, model=model, tokenizer=tiny_tokenizer())
    loaded, tokenizer = load_quantized(out, dtype=torch.float32)
    assert sum(isinstance(m, QuantLinear) for m in loaded.modules()) == len(weights) == 2 * LINEARS_PER_LAYER
    assert torch.allclose(logits(loaded), logits(model), atol=1e-5, rtol=0)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert tokenizer is not None and tokenizer("w5 w9")["input_ids"] == [5, 9]
    packed = loaded.get_submodule("model.layers.1.mlp.down_proj")
    assert torch.equal(packed.qweight, weights["model.layers.1.mlp.down_proj"].qweight)


def test_act_order_round_trip_sets_desc_act(tmp_path):
    model, weights, out = saved(tmp_path, QuantScheme(4, 32, True), act_order=True)
    assert all(qw.act_order for qw in weights.values())
    q, k = weights["model.layers.0.self_attn.q_proj"], weights["model.layers.0.self_attn.k_proj"]
    assert q.g_idx.data_ptr() == k.g_idx.data_ptr()  # shared storage must still be writable
    assert quant_config(out)["desc_act"] is True
    loaded, _ = load_quantized(out, dtype=torch.float32)
    assert torch.allclose(logits(loaded), logits(model), atol=1e-5, rtol=0)


def test_loaded_checkpoint_can_be_saved_again(tmp_path):
    _, _, out = saved(tmp_path)
    loaded, _ = load_quantized(out)
    again = save_quantized(loaded, {}, tmp_path / "again", method="rtn", scheme=QuantScheme(4, 32, False))
    first, second = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_file_contents_dtypes_and_tied_embeddings(tmp_path):
    _, _, out = saved(tmp_path)
    tensors = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors
    assert not any(k.endswith("proj.weight") for k in tensors)
    name = "model.layers.0.self_attn.k_proj"
    assert tensors[f"{name}.qweight"].dtype == torch.int32 and tensors[f"{name}.qweight"].shape == (8, 32)
    assert tensors[f"{name}.qzeros"].dtype == torch.int32 and tensors[f"{name}.qzeros"].shape == (2, 4)
    assert tensors[f"{name}.scales"].dtype == torch.float16 and tensors[f"{name}.scales"].shape == (2, 32)
    assert tensors[f"{name}.g_idx"].dtype == torch.int32 and tensors[f"{name}.g_idx"].shape == (64,)
    assert tensors["model.norm.weight"].dtype == torch.bfloat16  # auto: bf16 for a float32 model
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        metadata = f.metadata()
    assert metadata["format"] == "pt" and metadata["quantkit_layout"] == "gptq_v1" and metadata["bits"] == "4"
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    assert (out / "generation_config.json").is_file()


def test_untied_float16_model_keeps_its_dtype_and_lm_head(tmp_path):
    model = tiny_llama(tie=False, dtype=torch.float16)
    _, _, out = saved(tmp_path, model=model)
    tensors = load_file(out / "model.safetensors")
    assert tensors["lm_head.weight"].dtype == torch.float16
    loaded, _ = load_quantized(out)  # dtype from the checkpoint
    assert loaded.lm_head.weight.dtype == torch.float16
    assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_sharded_checkpoint(tmp_path):
    model, _, out = saved(tmp_path, max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (out / "model.safetensors").exists()
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    stored = {}
    for name in files:
        shard = load_file(out / name)
        assert sum(t.numel() * t.element_size() for t in shard.values()) <= 40_000 or len(shard) == 1
        stored.update({k: name for k in shard})
    assert stored == index["weight_map"]
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for name in files for t in load_file(out / name).values()
    )
    loaded, _ = load_quantized(out, dtype=torch.float32)
    assert torch.allclose(logits(loaded), logits(model), atol=1e-5, rtol=0)
    assert inspect_checkpoint(out).n_files == len(files)


# -- quantization_config --------------------------------------------------------------------------


def vllm_treats_as_packed(qc: dict, name: str) -> bool:
    """vLLM's rule (gptq_utils.is_layer_gptq_quantized + get_dynamic_override), for unfused names."""
    for pattern in qc.get("dynamic", {}):
        if pattern.startswith("-:") and re.match(pattern[2:], name):
            return False
    entries = [e for group in qc["modules_in_block_to_quantize"] for e in group]
    return any(entry in name for entry in entries)


def optimum_treats_as_packed(qc: dict, name: str) -> bool:
    """optimum's GPTQQuantizer.convert_model rule: block linears whose name ends with an entry."""
    entries = [entry for group in qc["modules_in_block_to_quantize"] for entry in group]
    return name.startswith(qc["block_name_to_quantize"] + ".") and any(name.endswith(e) for e in entries)


def test_quantization_config_for_gptq_readers(tmp_path):
    _, weights, out = saved(
        tmp_path, extra={"calibration": {"source": "self", "nsamples": 4}, "damp_percent": 0.01}
    )
    qc = quant_config(out)
    assert {k: qc[k] for k in ("quant_method", "bits", "group_size", "sym", "desc_act", "checkpoint_format")} == {
        "quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": False,
        "checkpoint_format": "gptq",
    }  # fmt: skip
    assert qc["lm_head"] is False and qc["static_groups"] is False and qc["damp_percent"] == 0.01
    assert qc["block_name_to_quantize"] == "model.layers" and "dynamic" not in qc
    assert qc["modules_in_block_to_quantize"] == [
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        ["self_attn.o_proj"],
        ["mlp.gate_proj", "mlp.up_proj"],
        ["mlp.down_proj"],
    ]
    assert qc["meta"]["quantizer"] == ["quantkit:0.1.0"]
    assert qc["quantkit"]["method"] == "rtn" and qc["quantkit"]["calibration"]["nsamples"] == 4
    assert qc["quantkit"]["unquantized_linears"] == ["lm_head"]
    for name in weights:
        assert vllm_treats_as_packed(qc, name) and optimum_treats_as_packed(qc, name)


@pytest.mark.parametrize("layer_only", [None, 0])
def test_unquantized_block_linears_are_declared(tmp_path, layer_only):
    prefix = "model.layers." if layer_only is None else f"model.layers.{layer_only}."

    def skip(name):
        return name.startswith(prefix) and name.endswith("mlp.down_proj")

    model, weights, out = saved(tmp_path, skip=skip)
    qc = quant_config(out)
    names = [f"model.layers.{i}.{rel}" for i in range(2) for rel in find_linears(model.model.layers[i])]
    for name in names:
        assert vllm_treats_as_packed(qc, name) == (name in weights), name
        assert optimum_treats_as_packed(qc, name) == (name in weights), name
    assert sorted(qc["quantkit"]["unquantized_linears"]) == sorted(
        [n for n in names if n not in weights] + ["lm_head"]
    )
    loaded, _ = load_quantized(out, dtype=torch.float32)
    assert isinstance(loaded.get_submodule("model.layers.0.mlp.down_proj"), torch.nn.Linear)
    assert torch.allclose(logits(loaded), logits(model), atol=1e-5, rtol=0)


# -- safe writing -----------------------------------------------------------------------------------


def test_existing_output_is_refused_without_overwrite(tmp_path):
    _, _, out = saved(tmp_path)
    with pytest.raises(QuantkitError, match="--overwrite"):
        saved(tmp_path, method="gptq")
    assert quant_config(out)["quantkit"]["method"] == "rtn"
    saved(tmp_path, method="gptq", overwrite=True)
    assert quant_config(out)["quantkit"]["method"] == "gptq"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    (tmp_path / "empty").mkdir()
    saved(tmp_path, name="empty")  # an empty folder made ahead of time is not an existing checkpoint


@pytest.mark.parametrize("existing", [False, True])
def test_failed_write_leaves_no_complete_looking_folder(tmp_path, monkeypatch, existing):
    if existing:
        saved(tmp_path)
    calls = []

    def failing_write(path, tensors, metadata):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        save_file(tensors, str(path), metadata=metadata)

    monkeypatch.setattr(checkpoint_writer, "_write_shard", failing_write)
    with pytest.raises(OSError, match="simulated"):
        saved(tmp_path, method="gptq", overwrite=True, max_shard_bytes=40_000)
    assert len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == (["ckpt"] if existing else [])
    if existing:  # the previous checkpoint is untouched and still loads
        assert quant_config(tmp_path / "ckpt")["quantkit"]["method"] == "rtn"
        load_quantized(tmp_path / "ckpt")


# -- the reader rejects damaged and foreign checkpoints --------------------------------------------


@pytest.fixture
def good(tmp_path):
    return saved(tmp_path)[2]


def edit_config(path: Path, **changes):
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(config))


def rewrite_tensors(path: Path, edit):
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"quant_method": "awq", "version": "gemm", "checkpoint_format": None}, "g_idx is stored"),  # GPTQ tensors labelled AWQ
        ({"quant_method": "compressed-tensors"}, "llm-compressor checkpoint (compressed-tensors)"),
        ({"checkpoint_format": "marlin"}, "repacked for the Marlin kernel"),
        ({"quant_method": "bitsandbytes"}, "a bitsandbytes checkpoint"),
        ({"quant_method": "exl2"}, "ExLlamaV2 (EXL2)"),
        ({"quant_method": "awq", "version": "gemv", "checkpoint_format": None}, "AutoAWQ GEMV-layout"),
        ({"quant_method": "awq", "version": "gemm"}, "checkpoint_format='gptq' but version='gemm'"),
        ({"pack_dtype": "int16"}, "pack_dtype='int16'"),
        ({"format": "gptq_v2"}, "checkpoint_format='gptq' but format='gptq_v2'"),
        ({"method": "awq"}, "quant_method='gptq' but method='awq'"),
        ({"bits": 3}, "says bits=3, but the tensors of model.layers.0.mlp.down_proj hold 4 bits"),
        ({"group_size": 64}, "says group_size=64, but model.layers.0.mlp.down_proj stores 4 groups"),
        ({"bits": 5}, "bits=5"),
        ({"group_size": 0}, "group_size=0"),
        ({"dynamic": {"+:.*down_proj": {"bits": 8}}}, "one scheme"),
    ],
)
def test_reader_rejects_foreign_configs(good, changes, message):
    edit_config(good, **changes)
    for reader in (load_quantized, inspect_checkpoint):
        with pytest.raises(QuantkitError, match=re.escape(message)):
            reader(good)


def test_reader_rejects_missing_files(good, tmp_path):
    with pytest.raises(QuantkitError, match="not a folder"):
        load_quantized(tmp_path / "nowhere")
    (good / "model.safetensors").unlink()
    with pytest.raises(QuantkitError, match="weights are missing"):
        load_quantized(good)
    (good / "config.json").unlink()
    with pytest.raises(QuantkitError, match="no config.json"):
        load_quantized(good)


def test_reader_rejects_unquantized_model(good):
    config = json.loads((good / "config.json").read_text())
    del config["quantization_config"]
    (good / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantkitError, match="unquantized model"):
        load_quantized(good)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.pop("model.layers.1.mlp.up_proj.scales"),
            "lacks tensor model.layers.1.mlp.up_proj.scales",
        ),
        (lambda t: t.pop("model.norm.weight"), "lacks tensor model.norm.weight"),
        (
            lambda t: t.update(
                {"model.layers.0.mlp.up_proj.qweight": torch.zeros(4, 128, dtype=torch.int32)}
            ),
            "model.layers.0.mlp.up_proj.qweight in model.safetensors has shape [4, 128]",
        ),
        (
            lambda t: t.update({"model.layers.0.self_attn.q_proj.scales": torch.ones(2, 64)}),
            "model.layers.0.self_attn.q_proj.scales is torch.float32",
        ),
        (
            lambda t: t.update({"model.layers.0.extra.weight": torch.ones(2)}),
            "unexpected tensor model.layers.0.extra",
        ),
        (
            lambda t: t.update({"model.norm.qweight": torch.ones(2, 8, dtype=torch.int32)}),
            "no linear layer model.norm",
        ),
    ],
)
def test_reader_rejects_bad_tensors(good, edit, message):
    rewrite_tensors(good, edit)
    with pytest.raises(QuantkitError, match=re.escape(message)):
        load_quantized(good)


def test_reader_rejects_truncated_file(good):
    file = good / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])
    for reader in (load_quantized, inspect_checkpoint):
        with pytest.raises(QuantkitError, match="truncated"):
            reader(good)
    file.write_bytes(data[:5])
    with pytest.raises(QuantkitError, match="truncated"):
        load_quantized(good)


def test_reader_rejects_missing_shard(tmp_path):
    _, _, out = saved(tmp_path, max_shard_bytes=40_000)
    sorted(out.glob("model-*-of-*.safetensors"))[1].unlink()
    with pytest.raises(QuantkitError, match="listed in model.safetensors.index.json but missing"):
        load_quantized(out)


# -- inspection -------------------------------------------------------------------------------------


def test_inspect_numbers(tmp_path):
    model = tiny_llama(96, 160)
    _, weights, out = saved(
        tmp_path, QuantScheme(4, 64, True), model=model, extra={"calibration": {"nsamples": 8}}
    )
    info = inspect_checkpoint(out)
    assert (info.quant_method, info.method, info.bits, info.group_size, info.sym, info.desc_act) == (
        "gptq", "rtn", 4, 64, True, False,
    )  # fmt: skip
    assert info.n_quantized == 14 and {row[0] for row in info.quantized} == set(weights)
    shapes = {n: (i, o, g) for n, i, o, g in info.quantized}
    assert shapes["model.layers.0.mlp.down_proj"] == (160, 96, 3)  # 64 + 64 + 32
    assert shapes["model.layers.0.self_attn.k_proj"] == (96, 48, 2)
    assert set(info.partial_group_layers) == set(weights)  # 96 and 160 are not multiples of 64
    assert info.unquantized_modules == ("model.embed_tokens",) and info.tied_embeddings
    assert info.size_on_disk_bytes == (out / "model.safetensors").stat().st_size
    linear_elements = sum(qw.in_features * qw.out_features for qw in weights.values())
    other_elements = 256 * 96 + 2 * 2 * 96 + 96  # embeddings, two norms per layer, final norm
    assert info.equivalent_16bit_bytes == 2 * (linear_elements + other_elements)
    assert info.compression_ratio == pytest.approx(info.equivalent_16bit_bytes / info.size_on_disk_bytes)
    assert 1.5 < info.compression_ratio < 4
    assert info.calibration == {"nsamples": 8}
    as_json = json.loads(json.dumps(info.to_dict()))
    assert as_json["n_quantized"] == 14 and as_json["size_on_disk"] == info.size_on_disk_bytes
    assert as_json["quantized"][0].keys() == {"name", "in_features", "out_features", "n_groups"}


# -- an independent reader --------------------------------------------------------------------------


def _gptqmodel_importable() -> bool:
    try:
        import gptqmodel  # noqa: F401
    except Exception:  # noqa: BLE001  (a broken install counts as absent)
        return False
    return True


@pytest.mark.skipif(
    not _gptqmodel_importable(),
    reason="gptqmodel is not installed here (it pins its own torch); run bench/verify_independent_reader.py "
    "from a venv with gptqmodel==7.6.0 instead, see that script's docstring",
)
def test_gptqmodel_reads_our_checkpoint_like_we_do(tmp_path):
    result = tmp_path / "result.json"
    env = {**os.environ, "GPTQMODEL_CPU_WORKERS": "2"}
    cmd = [
        sys.executable,
        str(REPO / "bench/verify_independent_reader.py"),
        "--make-tiny",
        str(tmp_path / "tiny"),
    ]
    subprocess.run([*cmd, "--json", str(result)], check=True, env=env, timeout=600)
    report = json.loads(result.read_text())
    ours = report["quantkit_vs_fp32"]["max_abs"]
    # Both read float16 weights that are bit-identical if the layout agrees: GPTQModel may differ from
    # the float32 reference by at most twice what our own float16 forward does.
    assert report["gptqmodel_vs_fp32"]["max_abs"] <= 2 * ours + 1e-6
    assert report["gptqmodel_vs_quantkit"]["argmax_agree"] == 1.0
