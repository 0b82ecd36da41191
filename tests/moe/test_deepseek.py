"""DeepSeek-V2 (V2-Lite's plain q_proj, and V2's q LoRA) and V3 on tiny random models built from transformers
configs: records, every linear quantized, vLLM's names, reload, RTN fallback, AWQ keeps the routing, the
runtime's refusal."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

from quantkit.api import build_method
from quantkit.arch import arch_for, find_linears, sequential_groups
from quantkit.calibrate.walker import walk
from quantkit.checkpoint.read import index_tensors, load_quantized
from quantkit.checkpoint.save import save_quantized
from quantkit.config import QuantkitError
from quantkit.coverage import weight_coverage
from quantkit.methods.moe import MoECalibConfig
from quantkit.methods.moe_prepare import prepare_for_quantization
from tests.moe.moe_tiny import expected_deepseek_names, tiny_moe
from tests.moe.test_moe_quantize import SCHEME, calib_ids, quantized

VARIANTS = ["deepseek_v2", "deepseek_v2_qlora", "deepseek_v3"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_records_name_every_linear_and_every_scaling_group_folds(variant):
    from quantkit.methods.awq_method import _fold_problem
    from quantkit.methods.moe_awq import moe_scaling
    from quantkit.moe.experts import find_separate_experts
    from quantkit.moe.layout import prepare_moe_model

    model = tiny_moe(variant)
    ids = calib_ids(seed=3, n=2)
    with torch.no_grad():
        ref = model(ids).logits
        assert prepare_moe_model(model) == 1  # layer 0 is dense (first_k_dense_replace)
        assert torch.allclose(model(ids).logits, ref, atol=1e-6, rtol=0)  # the unfused experts compute the same
    spec = arch_for(model.config.model_type)
    named = {n for g in spec.sequential for n in g}
    for layer in model.model.layers:
        linears = find_linears(layer)
        assert {n for n in linears if ".experts." not in n} <= named  # nothing left to "module order"
        groups = sequential_groups(spec, {n: m for n, m in linears.items() if ".experts." not in n})
        attn = [g for g in groups if g[0].startswith("self_attn.")]
        q = ["self_attn.q_a_proj"] if model.config.q_lora_rank else ["self_attn.q_proj"]
        assert attn[0] == [*q, "self_attn.kv_a_proj_with_mqa"]  # both read input_layernorm's output
        assert attn[-1] == ["self_attn.o_proj"]
        blocks = find_separate_experts(layer)
        scaling = moe_scaling(spec, blocks) if blocks else spec.scaling
        folded = set()
        for g in scaling:
            consumers = tuple(n for n in g.linears if n in linears)
            if consumers:
                assert _fold_problem(layer, g, consumers) == "", (g.prev, consumers)
                folded.update(consumers)
        # every linear but o_proj has a scale (o_proj: no single op makes its input; see quantkit.arch)
        assert set(linears) - folded == {"self_attn.o_proj"}


def _check_checkpoint(model, result, out):
    packed, kept = expected_deepseek_names(model.config)
    assert set(result.weights) == packed  # every expert and every attention linear, nothing more
    assert weight_coverage(model, result.weights).unreached == ()  # no silent 16-bit
    names = set(index_tensors(out))
    assert {n.rsplit(".", 1)[0] for n in names if n.endswith((".qweight", ".qzeros", ".scales", ".g_idx"))} == packed
    assert {f"{p}.{leaf}" for p in packed for leaf in ("qweight", "qzeros", "scales", "g_idx")} <= names
    assert kept <= names and not any("gate_up_proj" in n or n.endswith("experts.down_proj") for n in names)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:  # the router as transformers keeps it: float32
        assert {f.get_slice(n).get_dtype() for n in kept} == {"F32"}
    loaded, _ = load_quantized(out, dtype=torch.float32)
    ids = calib_ids(seed=2, n=2)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("variant,method", [(v, m) for v in VARIANTS for m in ("rtn", "gptq", "awq")]
                         + [("deepseek_v2", "gptq-routed")])
def test_quantize_every_linear_save_reload_same_logits(variant, method, tmp_path):
    mode = "routed" if method.endswith("routed") else "all"
    model, result = quantized(variant, mode=mode, method=method.split("-")[0], model=tiny_moe(variant))
    out = save_quantized(model, result.weights, tmp_path / "q", method=method.split("-")[0], scheme=SCHEME)
    _check_checkpoint(model, result, out)
    if method == "awq":  # q_b_proj and kv_b_proj scaled through their norms, the experts through the MoE norm
        stats = result.layer_stats[1]["linears"]
        for name in ("self_attn.kv_b_proj", "self_attn.kv_a_proj_with_mqa", "mlp.experts.5.gate_proj",
                     "mlp.shared_experts.up_proj", "mlp.experts.2.down_proj"):
            assert "scale_err_awq" in stats[name], name


@pytest.mark.parametrize("mode", ["routed", "all"])
def test_expert_no_token_reaches(mode, caplog):
    model = tiny_moe("deepseek_v3")
    with torch.no_grad():  # V3's correction bias: expert 3 never wins a top-k slot
        model.model.layers[1].mlp.gate.e_score_correction_bias[3] = -1e4
    with caplog.at_level(logging.WARNING, logger="quantkit.methods.moe"):
        model, result = quantized("deepseek_v3", mode=mode, model=model)
    stats = result.layer_stats[1]["linears"]
    for lin in ("gate_proj", "up_proj", "down_proj"):
        assert f"model.layers.1.mlp.experts.3.{lin}" in result.weights
        s = stats[f"mlp.experts.3.{lin}"]
        assert s["routed_tokens"] == 0
        if mode == "routed":
            assert s["fallback_rtn"] == 1.0
        else:
            assert s["calib_tokens"] == 4 * 32 and "err_gptq" in s
    warned = [r.getMessage() for r in caplog.records if "round-to-nearest" in r.getMessage()]
    assert any("model.layers.1.mlp.experts.3:" in w and "0 routed" in w for w in warned) == (mode == "routed")


@pytest.mark.parametrize("model_type,layer", [("deepseek_v3", 1), ("qwen2_moe", 0)])
def test_awq_norm_scale_leaves_the_routing_alone(model_type, layer):
    """The MoE norm's scale is folded into the 16-bit router (and shared-expert gate) too: same router logits."""
    model = tiny_moe(model_type)
    block = model.model.layers[layer]
    gates = ["mlp.gate"] + (["mlp.shared_expert_gate"] if model_type == "qwen2_moe" else [])
    before = [block.post_attention_layernorm.weight.detach().clone()] + [
        block.get_submodule(g).weight.detach().clone() for g in gates]
    method = prepare_for_quantization(model, build_method("awq", SCHEME), MoECalibConfig())
    walk(model, method, device="cpu", token_ids=calib_ids(), batch_size=2)
    after = [block.post_attention_layernorm.weight.detach()] + [block.get_submodule(g).weight.detach() for g in gates]
    assert not torch.allclose(before[0], after[0])  # a scale was folded into the norm
    h = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    for w0, w1 in zip(before[1:], after[1:]):
        ref, got = F.linear(h * before[0], w0.float()), F.linear(h * after[0], w1.float())
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5)


def _rtn_checkpoint(tmp_path, variant="deepseek_v2"):
    model, result = quantized(variant, method="rtn")
    return save_quantized(model, result.weights, tmp_path / "q", method="rtn", scheme=SCHEME)


def test_runtime_refuses_mla_and_says_what_works(tmp_path):
    from quantkit.runtime.loader import load_runtime_model
    from quantkit.tools import bench_run
    from tests.test_cli import quantkit

    out = _rtn_checkpoint(tmp_path)
    for call in (lambda: load_runtime_model(str(out)), lambda: bench_run.run(str(out), shape=False)):
        with pytest.raises(QuantkitError, match="multi-head latent attention.*quantkit eval perplexity"):
            call()
    for args in (("generate", out, "hello"), ("verify", out)):
        proc = quantkit(*args, check_code=2)
        assert "multi-head latent attention" in proc.stderr and "quantkit eval" in proc.stderr
        assert "Traceback" not in proc.stderr


def test_cli_gptq_then_eval_through_transformers(tmp_path):
    from tests.conftest import tiny_tokenizer
    from tests.test_cli import quantkit

    tok = tiny_tokenizer()
    src = tmp_path / "src"
    tiny_moe("deepseek_v3", vocab_size=len(tok)).save_pretrained(src)
    tok.save_pretrained(src)
    text = tmp_path / "calib.txt"
    text.write_text("\n".join(f"the latent {i} keys and values share one low rank cache" for i in range(80)))
    proc = quantkit("gptq", src, "-o", tmp_path / "q", "--group-size", "32", "--calib", text, "--nsamples", "4",
                    "--seqlen", "32", "--json", "--device", "cpu")
    report = json.loads(proc.stdout)
    assert report["unquantized"] == [] and report["n_quantized"] == 8 + 5 + 3 + 3 * 8
    assert len(report["expert_tokens"]["model.layers.1"]["routed"]) == 8
    ppl = json.loads(quantkit("eval", "perplexity", tmp_path / "q", "--data", text, "--seqlen", "32",
                              "--max-windows", "2", "--json").stdout)
    assert 1.0 < ppl["ppl"] < 1e4


def test_streamed_equals_whole_router_float32(tmp_path):
    """Layer by layer from the files (a bfloat16 source, router included): the same bytes as in memory, where
    transformers holds the router in float32; both write it in float32."""
    from safetensors.torch import load_file

    from quantkit import api
    from quantkit.config import LoadConfig
    from tests.conftest import tiny_tokenizer

    tok = tiny_tokenizer()
    tiny_moe("deepseek_v3", vocab_size=len(tok)).to(torch.bfloat16).save_pretrained(tmp_path / "src")
    tok.save_pretrained(tmp_path / "src")
    calib = torch.randint(3, 200, (4, 32), generator=torch.Generator().manual_seed(0))
    outs = {}
    for stream in ("on", "off"):
        report = api.quantize(str(tmp_path / "src"), tmp_path / stream, method="gptq", scheme=SCHEME,
                              calib_tokens=calib, load=LoadConfig(stream=stream, device="cpu"), progress=False)
        assert report.streamed == (stream == "on") and report.unquantized == [] and report.n_quantized == 40
        outs[stream] = load_file(str(tmp_path / stream / "model.safetensors"))
    assert outs["on"].keys() == outs["off"].keys()
    for key, t in outs["off"].items():
        assert torch.equal(outs["on"][key], t), key
    assert outs["on"]["model.layers.1.mlp.gate.weight"].dtype == torch.float32
