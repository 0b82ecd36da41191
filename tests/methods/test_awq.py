"""AWQ: folding keeps the function, the searches do what they claim, the AWQ layout round-trips."""

from __future__ import annotations

import pytest
import torch
import transformers

from quantkit.arch import arch_for
from quantkit.calibrate.walker import walk
from quantkit.checkpoint.layouts import awq_quantization_config, export_awq_layout
from quantkit.config import QuantkitError, QuantScheme
from quantkit.methods.awq import (
    AWQConfig,
    GroupScale,
    LayerRecord,
    clipped_rtn,
    fake_quantize_scaled,
    search_clip,
    search_scale,
    tie_repeats,
)
from quantkit.methods.awq_method import AWQMethod, _fold_problem, _gqa_tie, apply_group_scale, apply_layer_record
from quantkit.methods.rtn import RTNMethod, rtn_quantize
from quantkit.pack import unpack_awq
from quantkit.primitives import dequantize
from quantkit.qtensor import QuantizedWeight

ASYM64 = QuantScheme(bits=4, group_size=32, sym=False)


@pytest.fixture(autouse=True)
def one_thread():
    # Small tensors on a shared 2-core machine run several times faster on one thread.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_COMMON = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
               "num_attention_heads": 4, "max_position_embeddings": 64, "tie_word_embeddings": False}
_GEMMA = {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16}
ARCHS = [
    ("LlamaConfig", "LlamaForCausalLM", 2, {}),
    ("LlamaConfig", "LlamaForCausalLM", 4, {}),
    ("MistralConfig", "MistralForCausalLM", 2, {"sliding_window": None}),
    ("Qwen2Config", "Qwen2ForCausalLM", 4, {}),  # biases on q/k/v: v -> o must scale the bias too
    ("Qwen2Config", "Qwen2ForCausalLM", 2, {}),
    ("Qwen3Config", "Qwen3ForCausalLM", 2, {"head_dim": 16}),
    ("Qwen3Config", "Qwen3ForCausalLM", 4, {"head_dim": 16}),
    ("GemmaConfig", "GemmaForCausalLM", 2, {"head_dim": 16}),
    ("Gemma2Config", "Gemma2ForCausalLM", 4, _GEMMA),
    ("Gemma3TextConfig", "Gemma3ForCausalLM", 2, _GEMMA),
    ("Gemma3TextConfig", "Gemma3ForCausalLM", 4, _GEMMA),
]


def _tiny(config_name: str, model_name: str, kv_heads: int, extra: dict, seed: int = 0):
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(num_key_value_heads=kv_heads, **_COMMON, **extra)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a missed fold shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model


def _rel_logit_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"{a[0]}-kv{a[2]}")
def test_folded_model_computes_the_same_function(arch):
    model = _tiny(*arch)
    spec = arch_for(model.config.model_type)
    ids = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        ref = model(ids).logits
    gqa = arch[2] < model.config.num_attention_heads
    tied = 0
    for layer in model.model.layers:
        for g in spec.scaling:
            problem = _fold_problem(layer, g, g.linears)
            tie = None
            if g.prev_kind == "linear" and g.prev.endswith("v_proj"):
                # GQA: o reads repeated v heads, so a free v -> o scale is refused; a tied one folds.
                assert bool(problem) == gqa
                tie = _gqa_tie(layer, g, g.linears) if gqa else None
                assert (tie is not None) == gqa
                tied += tie is not None
            else:
                assert problem == ""
            n_in = layer.get_submodule(g.linears[0]).in_features
            s = tie_repeats(torch.exp(torch.randn(n_in)), tie)  # scales over about two orders of magnitude
            apply_group_scale(layer, GroupScale(g.prev, g.prev_kind, g.linears, s, 0.5, tie), spec.norm_offset)
    with torch.no_grad():
        out = model(ids).logits
    assert _rel_logit_diff(out, ref) < 1e-3
    assert tied == (2 if gqa else 0)


def test_scaling_without_the_fold_changes_the_function():
    """The check above can fail: scaling the consumers alone moves the logits far."""
    model = _tiny(*ARCHS[0])
    ids = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        ref = model(ids).logits
        q = model.model.layers[0].self_attn.q_proj
        q.weight.mul_(torch.exp(torch.randn(q.in_features)).view(1, -1))
        assert _rel_logit_diff(model(ids).logits, ref) > 1e-2


def _salient_problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, 128, generator=g)
    x[:, :4] *= 40.0  # a few channels meet large activations
    w = torch.randn(96, 128, generator=g)
    return x, w


def test_scale_search_protects_salient_channels():
    x, w = _salient_problem()
    target = x @ w.t()
    res = search_scale(x.abs().mean(0), [w], lambda ws: x @ ws[0].t(), target, ASYM64, AWQConfig())
    assert res.alpha > 0
    # Recompute both errors independently of the search's own bookkeeping.
    rtn = rtn_quantize(w, ASYM64)
    w_rtn = (rtn.codes - rtn.zeros.t().repeat_interleave(32, 1)) * rtn.scales.t().repeat_interleave(32, 1)
    err_rtn = (x @ w_rtn.t() - target).pow(2).mean()
    err_awq = (x @ fake_quantize_scaled(w, res.scales, ASYM64).t() - target).pow(2).mean()
    assert err_awq < 0.8 * err_rtn
    assert res.error_best == pytest.approx(float(err_awq), rel=1e-4)


def _group_errors(w, x, clip_min, clip_max, scheme):
    """Summed partial-product MSE over groups, recomputed from scratch."""
    r = rtn_quantize(w, scheme) if clip_min is None else clipped_rtn(w, clip_min, clip_max, scheme)
    gi = r.g_idx.long()
    wq = (r.codes - r.zeros.t()[:, gi]) * r.scales.t()[:, gi]
    total = 0.0
    for g in range(int(gi.max()) + 1):
        cols = gi == g
        total += float((x[:, cols] @ wq[:, cols].t() - x[:, cols] @ w[:, cols].t()).pow(2).mean(0).sum())
    return total


@pytest.mark.parametrize("seed,in_features,scheme", [
    (0, 128, QuantScheme(4, 32, False)),
    (1, 80, QuantScheme(4, 32, False)),  # partial last group
    (2, 96, QuantScheme(4, 32, True)),
    (3, 64, QuantScheme(3, -1, False)),
])
def test_clip_search_never_increases_the_error(seed, in_features, scheme):
    g = torch.Generator().manual_seed(seed)
    w = torch.distributions.StudentT(3.0).sample((48, in_features))  # heavy tails: clipping pays
    x = torch.randn(256, in_features, generator=g)
    res = search_clip(w, x, scheme, AWQConfig())
    before = _group_errors(w, x, None, None, scheme)
    after = _group_errors(w, x, res.clip_min, res.clip_max, scheme)
    assert after <= before * (1 + 1e-5)
    assert after < 0.98 * before  # and it did clip something
    assert res.error_after == pytest.approx(after, rel=1e-3)
    assert res.error_before == pytest.approx(before, rel=1e-3)


@pytest.mark.parametrize("scheme", [QuantScheme(4, 32, False), QuantScheme(4, 32, True)])
def test_clip_search_picks_what_scoring_on_the_tokens_picks(scheme):
    """The batched search scores candidates through the inputs' Gram matrix; scoring each ratio on the
    tokens themselves (the definition, one ratio at a time) picks the same ratio for every (group, row)
    and the same summed errors. Small chunks: several blocks of rows."""
    g = torch.Generator().manual_seed(7)
    w = torch.distributions.StudentT(3.0).sample((40, 80)) * 0.02
    x = torch.randn(200, 80, generator=g) * torch.rand(80, generator=g) * 3
    config = AWQConfig(clip_grid=8)
    res = search_clip(w, x, scheme, config, chunk_elements=8 * 3 * 32 * 7)  # 7 rows a block
    gs, G = 32, 3
    xg = torch.nn.functional.pad(x.double(), (0, G * gs - 80)).view(-1, G, gs)  # [n, G, gs]
    wg = torch.nn.functional.pad(w.double(), (0, G * gs - 80)).view(-1, G, gs)  # [out, G, gs]
    wmin, wmax = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    if scheme.sym:
        wmax = torch.maximum(-wmin, wmax)
        wmin = -wmax
    errs = []
    for i in range(config.clip_grid):
        ratio = 1.0 - config.max_shrink * i / config.clip_grid
        qr = clipped_rtn(w, (wmin * ratio).t().float(), (wmax * ratio).t().float(), scheme)
        d = torch.nn.functional.pad(dequantize(qr.codes, qr.scales, qr.zeros, qr.g_idx).double() - w.double(),
                                    (0, G * gs - 80)).view(-1, G, gs)
        errs.append(torch.einsum("ngk,ogk->ngo", xg, d).pow(2).mean(0))  # [G, out]
    errs = torch.stack(errs)  # [R, G, out]
    best = errs.argmin(0)
    ratios = torch.tensor([1.0 - config.max_shrink * i / config.clip_grid for i in range(config.clip_grid)])
    torch.testing.assert_close(res.clip_max, (wmax.t() * ratios[best]).float())
    assert res.error_before == pytest.approx(float(errs[0].sum()), rel=1e-4)
    assert res.error_after == pytest.approx(float(errs.min(0).values.sum()), rel=1e-4)


def _qweight(out_features=64, in_features=128, scheme=ASYM64, bias=True):
    w = torch.randn(out_features, in_features)
    r = rtn_quantize(w, scheme)
    b = torch.randn(out_features) if bias else None
    return QuantizedWeight.from_codes(r.codes, r.scales, r.zeros, r.g_idx, scheme, bias=b)


def test_awq_layout_round_trips_through_unpack_awq():
    qw = _qweight()
    tensors = export_awq_layout({"model.layers.0.mlp.up_proj": qw})
    prefix = "model.layers.0.mlp.up_proj"
    assert tensors[f"{prefix}.qweight"].shape == (128, 8) and tensors[f"{prefix}.qweight"].dtype == torch.int32
    assert tensors[f"{prefix}.qzeros"].shape == (4, 8)
    codes, zeros = unpack_awq(tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"])
    ref_codes, ref_zeros = qw.unpack()
    assert torch.equal(codes, ref_codes) and torch.equal(zeros, ref_zeros)
    scales = tensors[f"{prefix}.scales"].float()
    gi = torch.arange(128) // 32
    w = (codes - zeros.t()[:, gi]) * scales.t()[:, gi]
    assert torch.equal(w, qw.dequantize())
    assert torch.equal(tensors[f"{prefix}.bias"], qw.bias)


@pytest.mark.parametrize("scheme,in_features,out_features", [
    (QuantScheme(4, 32, True), 128, 64),  # symmetric
    (QuantScheme(8, 32, False), 128, 64),  # 8 bits
    (QuantScheme(4, 32, False), 80, 64),  # partial last group
    (QuantScheme(4, -1, False), 128, 64),  # per channel
])
def test_awq_layout_refuses_what_it_cannot_hold(scheme, in_features, out_features):
    with pytest.raises(QuantkitError, match="--format awq"):
        export_awq_layout({"x": _qweight(out_features, in_features, scheme)})


def test_awq_config_keys_read_by_transformers():
    d = awq_quantization_config(QuantScheme(4, 64, False))
    assert d["quant_method"] == "awq" and d["version"] == "gemm" and d["zero_point"] is True
    assert d["bits"] == d["w_bit"] == 4 and d["group_size"] == d["q_group_size"] == 64
    cfg = transformers.AwqConfig.from_dict(dict(d))
    assert cfg.bits == 4 and cfg.group_size == 64 and cfg.zero_point
    with pytest.raises(QuantkitError):
        awq_quantization_config(QuantScheme(4, 64, True))


@pytest.mark.parametrize("bad", [{"grid": 0}, {"max_shrink": 1.0}, {"propagate": "int"}, {"clip_tokens": 0},
                                 {"search_samples": -1}])
def test_config_is_validated(bad):
    with pytest.raises(QuantkitError):
        AWQConfig(**bad)


def _salient_llama(seed=0):
    model = _tiny(*ARCHS[0], seed=seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[:3] *= 25.0
            layer.post_attention_layernorm.weight[5:8] *= 25.0
    return model


@pytest.mark.parametrize("config", [AWQConfig(), AWQConfig(gptq=True), AWQConfig(propagate="quantized", clip=False),
                                    AWQConfig(gqa_tied_vo=False)],
                         ids=["awq", "awq+gptq", "quantized-propagation-noclip", "gqa-vo-skipped"])
def test_walk_awq_logits_closer_to_fp_than_rtn(config):
    torch.manual_seed(1)
    calib, evaluation = torch.randint(0, 128, (16, 32)), torch.randint(0, 128, (4, 32))
    model = _salient_llama()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref = model(evaluation).logits
    walk(model, RTNMethod(ASYM64), device="cpu")
    with torch.no_grad():
        err_rtn = (model(evaluation).logits - ref).norm() / ref.norm()
    model.load_state_dict(state)
    method = AWQMethod(ASYM64, config)
    result = walk(model, method, device="cpu", token_ids=calib, batch_size=4)
    with torch.no_grad():
        err_awq = (model(evaluation).logits - ref).norm() / ref.norm()
    assert err_awq < 0.8 * err_rtn
    assert len(result.weights) == 2 * 7
    vo_skipped = any("v_proj" in note for note in result.layer_stats[0]["notes"])
    assert vo_skipped != config.gqa_tied_vo  # GQA: v -> o skipped unless tied
    assert ("alpha" in result.layer_stats[0]["linears"]["self_attn.o_proj"]) == config.gqa_tied_vo


def test_token_wise_search_calls_are_merged_into_one(monkeypatch):
    """The strided tokens a token-wise site (the MLP, up -> down) takes from each batch are scored as one call:
    the same scales and errors as scoring batch by batch (attention keeps its windows)."""
    from quantkit.methods import awq_method

    calib = torch.randint(0, 128, (16, 32), generator=torch.Generator().manual_seed(4))
    config = AWQConfig(grid=6, clip=False, search_tokens=64)  # 512 tokens: a stride of 8 over 4 batches

    def run(merge: bool):
        calls = {}
        real = awq_method._merge_token_calls

        def merged(site):
            if merge:
                real(site)
            calls[site.linears] = len(site.calls)

        monkeypatch.setattr(awq_method, "_merge_token_calls", merged)
        method = AWQMethod(ASYM64, config)
        result = walk(_salient_llama(seed=5), method, device="cpu", token_ids=calib, batch_size=4)
        return calls, result.layer_stats[0]["linears"]

    calls, stats = run(merge=True)
    calls_apart, stats_apart = run(merge=False)
    assert calls[("mlp.gate_proj", "mlp.up_proj")] == calls[("mlp.down_proj",)] == 1
    assert calls_apart[("mlp.gate_proj", "mlp.up_proj")] == 4
    for name in ("mlp.gate_proj", "mlp.down_proj", "self_attn.q_proj"):
        assert stats[name]["alpha"] == stats_apart[name]["alpha"]
        assert stats[name]["scale_err_awq"] == pytest.approx(stats_apart[name]["scale_err_awq"], rel=1e-5)


def test_saved_record_reapplies_to_the_same_weights():
    torch.manual_seed(2)
    calib = torch.randint(0, 128, (8, 32))
    model = _salient_llama(seed=3)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    method = AWQMethod(ASYM64, AWQConfig(grid=5, clip_grid=5, propagate="quantized", gqa_tied_vo=True))
    result = walk(model, method, device="cpu", token_ids=calib, batch_size=4)

    fresh = _salient_llama(seed=3)
    fresh.load_state_dict(state)
    prefix = "model.layers.0"
    tensors, meta = method.records[prefix].state_dict()
    record = LayerRecord.from_state_dict(tensors, meta)
    assert [g.prev for g in record.scales] == ["input_layernorm", "self_attn.v_proj", "post_attention_layernorm",
                                               "mlp.up_proj"]
    assert record.scales[1].tie == (2, 16)
    layer = fresh.model.layers[0]
    apply_layer_record(layer, record, norm_offset=0.0)
    assert "self_attn.q_proj" not in record.clips and "mlp.down_proj" in record.clips
    for name in ("self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj", "mlp.gate_proj"):
        w = layer.get_submodule(name).weight.data
        r = rtn_quantize(w, ASYM64) if name not in record.clips else clipped_rtn(w, *record.clips[name], ASYM64)
        assert torch.equal(r.codes, result.weights[f"{prefix}.{name}"].unpack()[0])
    # The folded norm is what the walked model holds too.
    assert torch.allclose(layer.input_layernorm.weight, model.model.layers[0].input_layernorm.weight)
