"""explain / `quantkit inspect --kernels`: the kernel and config each quantized linear runs at M = 1, 16, 2048."""

from __future__ import annotations

import json

from quantkit.kernels.w4a16_select import facts_of, select_w4a16
from quantkit.tools.kernel_plan import explain, explain_attention
from tests.test_cli import quantkit


def test_explain_layers_given_as_tuples_follows_the_selection():
    rows = explain([("mlp.down_proj", 4096, 14336, 4, 128, True, False), ("odd", 1536, 576, 8, -1, False, False)])
    assert [(r.name, r.m) for r in rows] == [(n, m) for n in ("mlp.down_proj", "odd") for m in (1, 16, 2048)]
    for r in rows:
        choice = select_w4a16(r.m, facts_of(r.out_features, r.in_features, r.bits, r.group_size, True, False), "sm90")
        assert r.kernel == choice.kernel and r.reason == choice.reason
    assert {r.kernel for r in rows[:3]} == {"gluon"} and {r.kernel for r in rows[4:]} == {"tc"}
    assert all(r.config for r in rows)
    assert [r.kernel for r in explain([("x", 4096, 4096, 4, 128, True, False)], ms=(16,), arch="sm80")] == ["pairs"]


def test_explain_a_checkpoint_and_the_cli(tiny_llama_dir, tmp_path):
    import quantkit as qk
    from quantkit import QuantScheme

    out = tmp_path / "rtn"
    qk.quantize(str(tiny_llama_dir), out, method="rtn", scheme=QuantScheme(bits=4, group_size=32, sym=False))
    rows = explain(out)
    assert len(rows) == 14 * 3 and {r.m for r in rows} == {1, 16, 2048}
    info = json.loads(quantkit("inspect", out, "--kernels", "--json").stdout)
    # The CLI shows the linears as the runtime runs them: q/k/v and gate/up fused, 4 GEMMs a layer.
    from quantkit.kernel_rows import runtime_layers

    runtime_rows = explain(runtime_layers(out))
    assert len(runtime_rows) == 2 * 4 * 3
    assert [(k["name"], k["m"], k["kernel"]) for k in info["kernels"]] == [(r.name, r.m, r.kernel)
                                                                            for r in runtime_rows]
    attention = explain_attention(out)
    assert [(a["phase"], a["tokens"], a["kernel"]) for a in info["attention_kernels"]] == [
        (r.phase, r.tokens, r.kernel) for r in attention]
    text = quantkit("inspect", out, "--kernels").stdout
    assert "attention kernels" in text and "decode_rope" in text


def test_explain_a_model_of_quant_linears():
    from quantkit.config import QuantScheme
    from tests.kernels.test_ops import TinyMLP, quantize_linears

    model = quantize_linears(TinyMLP(), QuantScheme(4, 32, False))
    rows = explain(model, ms=(1, 2048))
    assert [(r.name, r.out_features, r.in_features, r.m) for r in rows] == [
        ("up", 256, 128, 1), ("up", 256, 128, 2048), ("down", 128, 256, 1), ("down", 128, 256, 2048)]
    assert rows == explain([("up", 256, 128, 4, 32, False, False), ("down", 128, 256, 4, 32, False, False)],
                           ms=(1, 2048))


def test_explain_attention_follows_the_selection_per_kind_of_layer():
    """Prefill takes the selection's kernel for the model's head dim, window and soft-cap at each prompt length
    (the FA3-ordered kernel only for short causal rows); a model mixing window and full layers gets a row each."""
    from transformers import Gemma2Config, LlamaConfig

    llama = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=2,
                        intermediate_size=64)
    rows = explain_attention(llama, prompts=(256, 512, 2048))
    assert [(r.phase, r.tokens, r.kernel) for r in rows] == [
        ("prefill", 256, "gluon"), ("prefill", 512, "gluon_ws"), ("prefill", 2048, "gluon_ws"),
        ("decode", 1, "decode_rope")]
    assert [r.kernel for r in explain_attention(llama, arch="sm80")][:2] == ["triton", "triton"]
    gemma = Gemma2Config(num_hidden_layers=4, hidden_size=256, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=128)
    rows = explain_attention(gemma, prompts=(2048,))
    assert {r.layers for r in rows} == {"sliding", "full"}
    prefill = [r for r in rows if r.phase == "prefill"]
    assert all(r.kernel == "triton" and "soft-cap" in r.reason for r in prefill)  # Gemma 2 soft-caps its logits
