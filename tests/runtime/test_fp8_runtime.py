"""FP8 in the runtime: the CPU emulation against a float64 model of the arithmetic, the loaded FP8 checkpoint
against the transformers model the reader builds, the engine's greedy decode, and the GPU path (marked gpu)."""

from __future__ import annotations

import pytest
import torch

from quantkit.fp8_linear import FP8Linear, fp8_linear, fp8_linear_ref, prepare_fp8_linear
from quantkit.methods.fp8 import FP8Config, fp8_quantize_weight
from quantkit.primitives import FP8_E4M3_MAX


def e4m3_f64(v: torch.Tensor) -> torch.Tensor:
    """e4m3fn rounding in float64 from the format's definition (3 mantissa bits, exponent >= -6, ties to even)."""
    v = v.double().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    exp = torch.floor(torch.log2(torch.where(v != 0, v.abs(), torch.ones_like(v)))).clamp_min(-6)
    quantum = torch.pow(2.0, exp - 3)
    return (torch.round(v / quantum) * quantum).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)


def linear_f64(x, w, weights: str, input_scale=None, block=(32, 32)) -> torch.Tensor:
    """W8A8 in float64: weight scales and codes recomputed independently, activations per token (or static); with
    block weights per token and run of ``block[1]`` columns (what the checkpoint declares and vLLM computes)."""
    w = w.double()
    if weights == "channel":
        sw = w.abs().amax(dim=1, keepdim=True) / 448
    elif weights == "tensor":
        sw = w.abs().amax() / 448
    else:
        sw = torch.empty_like(w)
        for i in range(0, w.shape[0], block[0]):
            for j in range(0, w.shape[1], block[1]):
                sw[i:i + block[0], j:j + block[1]] = w[i:i + block[0], j:j + block[1]].abs().amax() / 448
    sw = sw.float().clamp_min(torch.finfo(torch.float32).tiny).double()  # float32 scales, never zero
    x = x.double()
    if weights == "block":
        sx = torch.empty_like(x)
        for j in range(0, x.shape[1], block[1]):
            sx[:, j:j + block[1]] = (x[:, j:j + block[1]].abs().amax(dim=1, keepdim=True) / 448).float().double()
    else:
        sx = (x.abs().amax(dim=1, keepdim=True) / 448).float().double() if input_scale is None \
            else input_scale.double()
    return (e4m3_f64(x / sx) * sx) @ (e4m3_f64(w / sw) * sw).T


@pytest.mark.parametrize("weights,static", [("channel", False), ("channel", True), ("tensor", False),
                                            ("tensor", True), ("block", False)])  # block: dynamic only
def test_cpu_emulation_matches_float64(weights, static):
    torch.manual_seed(0)
    w = torch.randn(96, 160) * torch.logspace(-1, 1, 96).unsqueeze(1)
    # K = 160 is five blocks of 32: columns of very different sizes, so per-group activation scales matter
    x = torch.randn(7, 160) * torch.logspace(-2, 2, 7).unsqueeze(1) * torch.logspace(-1, 1, 160)
    input_scale = torch.tensor([0.02]) if static else None
    rec, _ = fp8_quantize_weight(w, FP8Config(weights=weights, block=(32, 32)), input_scale=input_scale)
    prepared = prepare_fp8_linear(rec.weight, rec.weight_scale, weights, block=rec.block, input_scale=input_scale)
    got = fp8_linear_ref(x, prepared)
    want = linear_f64(x, w, weights, input_scale)
    # same roundings; only float32 accumulation over K=160 separates them
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-6


def test_module_keeps_codes_and_float32_scales_when_cast():
    torch.manual_seed(0)
    rec, _ = fp8_quantize_weight(torch.randn(32, 48), FP8Config())
    m = FP8Linear(48, 32, "channel")
    m._buffers.update(weight=rec.weight, weight_scale=rec.weight_scale)
    m.to(torch.bfloat16)
    assert m.weight.dtype == torch.float8_e4m3fn and m.weight_scale.dtype == torch.float32
    x = torch.randn(3, 48, dtype=torch.bfloat16)
    assert m(x).dtype == torch.bfloat16


@pytest.fixture(scope="module")
def fp8_llama(tmp_path_factory):
    from quantkit.config import LoadConfig
    from quantkit.fp8_api import quantize_fp8
    from tests.runtime.conftest import save_tiny

    src = tmp_path_factory.mktemp("fp8_src")
    save_tiny("llama", src)
    out = tmp_path_factory.mktemp("fp8_q") / "fp8"
    quantize_fp8(str(src), out, load=LoadConfig(device="cpu"))
    return out


def test_runtime_logits_equal_the_readers_model(fp8_llama, monkeypatch):
    from quantkit.api import load_any
    from quantkit.config import LoadConfig
    from quantkit.runtime.loader import load_runtime_model

    # the prefill attention stays 16-bit unless the A/B switch asks for fp8="auto"
    assert load_runtime_model(str(fp8_llama), device="cpu", dtype="float32")[0].prefill_fp8 is False
    monkeypatch.setenv("QUANTKIT_PREFILL_FP8_ATTENTION", "auto")
    runtime, _ = load_runtime_model(str(fp8_llama), device="cpu", dtype="float32")
    monkeypatch.delenv("QUANTKIT_PREFILL_FP8_ATTENTION")
    assert all(lin.fp8 is not None for layer in runtime.weights.layers for lin in (layer.qkv, layer.down))
    assert runtime.weights.layers[0].qkv.fp8.path == "reference" and runtime.prefill_fp8 == "auto"
    hf, _ = load_any(str(fp8_llama), LoadConfig(device="cpu"))
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    got = runtime.forward_logits(ids)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5  # fused q/k/v and gate/up: another summation order


def test_engine_greedy_equals_transformers_generate(fp8_llama):
    from quantkit.api import load_any
    from quantkit.config import LoadConfig
    from quantkit.runtime.loader import load_engine
    from quantkit.runtime.types import SamplingParams

    hf, _ = load_any(str(fp8_llama), LoadConfig(device="cpu"))
    engine = load_engine(str(fp8_llama), device="cpu", max_batch=1, max_seq_len=32)
    prompt = [7, 1, 200, 33]
    engine.add_request(prompt, SamplingParams(max_tokens=10, ignore_eos=True))
    tokens = []
    while engine.has_work():
        tokens += [e.token_id for e in engine.step() if e.token_id is not None]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0,
                               eos_token_id=None)[0, len(prompt):].tolist()
    assert tokens == expected


def test_dequantized_runtime_holds_the_same_weights_in_16_bits(fp8_llama):
    from quantkit.runtime.loader import load_runtime_model

    runtime, _ = load_runtime_model(str(fp8_llama), device="cpu", dtype="float32", dequantize=True)
    assert runtime.weights.layers[0].qkv.fp8 is None and runtime.weights.layers[0].qkv.dense is not None


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 8, 32, 2048])  # 1 and 4: the FP8 GEMV; the others: torch._scaled_mm
@pytest.mark.parametrize("static", [False, True])
def test_scaled_mm_path_matches_the_emulation(m, static):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9+")
    torch.manual_seed(0)
    w = torch.randn(4096, 1024, device="cuda") * 0.02
    input_scale = torch.tensor([0.01], device="cuda") if static else None
    rec, _ = fp8_quantize_weight(w, FP8Config(), bias=torch.randn(4096, device="cuda"), input_scale=input_scale)
    fast = prepare_fp8_linear(rec.weight, rec.weight_scale, "channel", input_scale=input_scale,
                              bias=rec.bias.bfloat16(), device="cuda")
    assert fast.path == "scaled_mm" and fast.gemv, fast.reason
    ref = prepare_fp8_linear(rec.weight, rec.weight_scale, "channel", input_scale=input_scale,
                             bias=rec.bias.bfloat16(), device="cuda", backend="reference")
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    got, want = fp8_linear(x, fast), fp8_linear_ref(x, ref)
    # the same quantized operands; bf16 output rounding and accumulation order apart
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2


def test_block_weights_quantize_activations_per_group_not_per_token():
    """A block checkpoint's activations are scaled per token and 128 columns: one huge column in the first block
    must not coarsen the rounding of the others (it would with one scale per token)."""
    torch.manual_seed(0)
    w = torch.randn(128, 256)
    w[:, :128] = 0.0  # the first block's outputs vanish: what is left is the second block's rounding
    x = torch.randn(3, 256)
    x[:, 0] = 1e6  # 448 / 1e6 puts the ordinary columns below e4m3's smallest subnormal on a per-token scale
    rec, _ = fp8_quantize_weight(w, FP8Config(weights="block", block=(128, 128)))
    block = prepare_fp8_linear(rec.weight, rec.weight_scale, "block", block=rec.block)
    assert block.path == "reference" and block.act_group == 128
    exact = x.double() @ rec.dequantize().double().T
    got = fp8_linear_ref(x, block).double()
    # one scale per token rounds the 255 ordinary columns on the huge one's scale: to zero
    sx = x.abs().amax(dim=1, keepdim=True) / 448
    per_token = (x / sx).to(torch.float8_e4m3fn).double() * sx.double() @ rec.dequantize().double().T
    assert (got - exact).norm() < 0.1 * (per_token - exact).norm()
    assert ((got - linear_f64(x, w, "block", block=(128, 128))).norm() / exact.norm()).item() < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 64, 1024])
def test_block_scaled_mm_path_matches_the_emulation(m):
    """Block 128x128 weights on Hopper: torch's block-scaled GEMM (the layout its probe found) against the float32
    emulation of the same rounding; skipped with the probe's reason where torch offers no such GEMM."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("torch's block-scaled FP8 GEMM needs compute capability 9.0")
    torch.manual_seed(0)
    w = torch.randn(1024, 768, device="cuda") * torch.logspace(-2, 0, 1024, device="cuda").unsqueeze(1)
    rec, _ = fp8_quantize_weight(w, FP8Config(weights="block", block=(128, 128)))
    fast = prepare_fp8_linear(rec.weight, rec.weight_scale, "block", block=rec.block, device="cuda")
    if fast.path != "scaled_mm_block":
        pytest.skip(fast.reason)
    ref = prepare_fp8_linear(rec.weight, rec.weight_scale, "block", block=rec.block, device="cuda",
                             backend="reference")
    x = torch.randn(m, 768, device="cuda", dtype=torch.bfloat16) * torch.logspace(-1, 1, 768, device="cuda")
    got, want = fp8_linear(x, fast), fp8_linear_ref(x, ref)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2


@pytest.mark.gpu
def test_fp8_linear_captures_in_a_cuda_graph():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9+")
    torch.manual_seed(0)
    rec, _ = fp8_quantize_weight(torch.randn(512, 256, device="cuda"), FP8Config())
    w = prepare_fp8_linear(rec.weight, rec.weight_scale, "channel", device="cuda")
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    eager = fp8_linear(x, w)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fp8_linear(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, fp8_linear(x, w)) and not torch.equal(out, eager)


# e4m3 rounds each activation to one of 8 steps per octave, so two implementations whose 16-bit arithmetic differs
# in the last bits round some activations to neighbouring codes, and the model's output moves by far more than the
# 16-bit difference. Measured: 6x in bfloat16 on the CPU (test below: 7.2e-3 -> 4.3e-2 on this 2-layer model), 6.2x
# on a random Llama-3-8B shape on one H100 (quantkit bench: 5.3 % -> 33 %). The bound still catches a wrong
# weight scale in the runtime's linears alone: 5 % too large gives 8.1e-2 on the CPU test, 20 % gives 0.21.
FP8_AMPLIFICATION_BOUND = 10


def _tiny_llama(device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    with torch.device(device):
        return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def _runtime_error_16_then_fp8(hf, ids, backend: str) -> tuple[float, float]:
    """The runtime's logits error against transformers on ``hf`` in 16 bits, then after FP8 quantization in place."""
    from quantkit.tools import bench

    errors = []
    for quantize in (False, True):
        if quantize:
            bench.quantize_fp8_in_place(hf)
        runtime = bench.runtime_from_hf(hf, None, backend=backend, max_positions=4096)
        with torch.inference_mode():
            ref = hf(ids).logits
        errors.append(_rel(runtime.forward_logits(ids), ref))
        del runtime
    return errors[0], errors[1]


def test_fp8_runtime_against_transformers_within_the_rounding_amplification():
    """bfloat16 on the CPU (reference backend): the FP8 runtime's logits against the transformers FP8 model stay
    within FP8_AMPLIFICATION_BOUND times the 16-bit runtime's error against transformers on the same weights."""
    hf = _tiny_llama("cpu")
    ids = torch.randint(0, 1024, (1, 64))
    e16, e8 = _runtime_error_16_then_fp8(hf, ids, "reference")
    assert 0 < e16 < 2e-2, e16  # the 16-bit runtime is close, and not bitwise the same (else nothing is measured)
    assert e8 < FP8_AMPLIFICATION_BOUND * e16, (e16, e8)


@pytest.mark.gpu
def test_fp8_model_on_the_kernels_backend_with_graphs_and_fp8_prefill():
    """A Llama-shaped FP8 model (head dim 128) on the kernels backend: logits against the transformers FP8 model,
    greedy decode under CUDA graphs against the prefill path, and a 2048-token prefill whose attention may run in
    FP8 (fp8="auto", opt-in since 2026-12-06) against the same prefill in 16 bits (the default)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9+")
    from quantkit.runtime.engine import Engine
    from quantkit.tools import bench

    hf = _tiny_llama("cuda")
    ids = torch.randint(0, 1024, (1, 64), device="cuda")
    e16, e8 = _runtime_error_16_then_fp8(hf, ids, "kernels")
    # the first GPU run (H200) failed an absolute 3e-2 here; bfloat16 on the CPU gives 4.3e-2 (test above)
    assert e8 < max(3e-2, FP8_AMPLIFICATION_BOUND * e16), (e16, e8)
    runtime = bench.runtime_from_hf(hf, None, max_positions=4096)
    assert runtime.prefill_fp8 is False and runtime.weights.layers[0].qkv.fp8.path == "scaled_mm"
    assert runtime.weights.layers[0].qkv.fp8.gemv  # the stacked q/k/v keeps its parts' decode GEMV
    engine = Engine(runtime, None, max_batch=2, max_seq_len=256, cuda_graphs=True, graph_buckets=(1, 2))
    agreement = bench.greedy_agreement(engine)
    assert agreement["first_mismatch"] is None or agreement["gap_at_mismatch"] < 0.05, agreement
    long = torch.randint(0, 1024, (1, 2048), device="cuda")
    runtime.prefill_fp8 = "auto"  # what QUANTKIT_PREFILL_FP8_ATTENTION=auto asks for
    fp8_logits = runtime.forward_logits(long)
    runtime.prefill_fp8 = False
    bf16_logits = runtime.forward_logits(long)
    assert ((fp8_logits - bf16_logits).norm() / bf16_logits.norm()).item() < 5e-2


@pytest.mark.parametrize("switch", ["auto", "unfused", "fused", "mma", "0"])
def test_fused_qkv_takes_the_decode_path_of_its_parts(monkeypatch, switch):
    """q/k/v (and gate/up) stacked into one FP8 linear keep every decode choice their parts were prepared with: the
    GEMV at M <= 4 (or the one-launch or tensor-core one, or none), codes in, counters for the whole height. (The
    stacked record was once built from the weights alone, so the 8B bench's q/k/v and gate/up ran
    torch._scaled_mm at batch 1.) The CPU cannot run the scaled_mm path: it is forced here and only prepared."""
    import quantkit.fp8_linear as fp8_linear_module
    from quantkit.runtime.fp8_weights import fused_fp8_linear

    monkeypatch.setattr(fp8_linear_module, "scaled_mm_supported", lambda device, n, k: (True, "forced"))
    monkeypatch.setenv("QUANTKIT_FP8_GEMV", switch)
    monkeypatch.setenv("QUANTKIT_FP8_FUSED_QUANT", "1")
    get = {}
    for name, n in (("q", 64), ("k", 32), ("v", 32)):
        get[f"{name}.weight"] = (torch.randn(n, 48) * 100).to(torch.float8_e4m3fn)
        get[f"{name}.weight_scale"] = torch.rand(n, 1) + 0.5
        get[f"{name}.bias"] = torch.randn(n)
    single = fused_fp8_linear({k: v for k, v in get.items() if k.startswith("q.")}, ["q"], torch.float32, "cpu", "auto")
    fused = fused_fp8_linear(get, ["q", "k", "v"], torch.float32, "cpu", "auto")
    w = fused.fp8
    assert not fused.parts and w.path == "scaled_mm" and w.out_features == 128
    for flag in ("gemv", "gemv_fused", "gemv_max_m", "gemv_mma", "codes_in", "reason"):
        assert getattr(w, flag) == getattr(single.fp8, flag), flag
    with_mma = switch in ("auto", "mma")
    assert w.gemv == (switch not in ("0", "mma")) and w.gemv_mma == with_mma and w.codes_in
    assert (w.mma_counters is not None and w.mma_counters.numel() >= 128 // 16) == with_mma
    assert torch.equal(w.weight.view(torch.uint8), torch.cat([get[f"{n}.weight"] for n in "qkv"]).view(torch.uint8))
    assert torch.equal(w.scale, torch.cat([get[f"{n}.weight_scale"] for n in "qkv"]).reshape(1, 128))
    assert torch.equal(fused.bias, torch.cat([get[f"{n}.bias"] for n in "qkv"]))


def test_fused_activation_quantization_on_the_reference_backend(monkeypatch):
    """QUANTKIT_FP8_FUSED_QUANT=1 on the CPU's reference backend: the norm and activation producers hand the FP8
    linears their codes (q/k/v, gate/up and down take codes, o does not: attention writes its input), and the
    logits are bitwise those of the linears quantizing for themselves."""
    from quantkit.tools import bench

    hf = _tiny_llama("cpu")
    bench.quantize_fp8_in_place(hf)
    ids = torch.randint(0, 1024, (2, 16))
    logits, calls = {}, {}
    for fused in ("0", "1"):
        monkeypatch.setenv("QUANTKIT_FP8_FUSED_QUANT", fused)
        runtime = bench.runtime_from_hf(hf, None, backend="reference", max_positions=4096)
        layer = runtime.weights.layers[0]
        assert [lin.takes_fp8_codes for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)] == [fused == "1"] * 4
        seen = []
        for name in ("add_rms_norm_fp8", "act_mul_fp8"):
            real = getattr(runtime.ops, name)
            monkeypatch.setattr(runtime.ops, name, lambda *a, real=real, name=name, **k: seen.append(name) or real(*a, **k))
        with torch.inference_mode():
            logits[fused] = runtime.forward_logits(ids)
        calls[fused] = seen
    assert torch.equal(logits["0"], logits["1"])
    assert calls["0"] == [] and calls["1"] == ["add_rms_norm_fp8", "add_rms_norm_fp8", "act_mul_fp8"] * 2


@pytest.mark.gpu
@pytest.mark.parametrize("gemv", ["unfused", "mma"])
def test_fused_activation_quantization_changes_nothing_but_launches(monkeypatch, gemv):
    """QUANTKIT_FP8_FUSED_QUANT=1 (the norm and activation kernels write the FP8 linears' codes): the same logits
    bit for bit as the quantization kernel in front of each linear, at prefill (64 tokens: _scaled_mm) and on a
    decode batch of 1 and 4 under each decode GEMM; fewer kernel launches a decode step."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the FP8 decode paths are timed and served on Hopper")

    monkeypatch.setenv("QUANTKIT_FP8_GEMV", gemv)
    hf = _tiny_llama("cuda")
    results = _logits_and_launches_under(monkeypatch, hf, "QUANTKIT_FP8_FUSED_QUANT", ("0", "1"),
                                         lambda rt, fused: rt.weights.layers[0].qkv.takes_fp8_codes == (fused == "1"))
    for a, b in zip(results["0"][0], results["1"][0]):
        assert torch.equal(a, b)
    assert results["1"][1] < results["0"][1], results


def _logits_and_launches_under(monkeypatch, hf, variable: str, values: tuple, prepared_as) -> dict:
    """``{value: ([prefill logits of 64 tokens, decode logits of 1 row, of 4 rows], launches of a 1-row forward)}``
    of the FP8 runtime built from ``hf`` (quantized to FP8 in place) under each value of the environment
    ``variable``; ``prepared_as(runtime, value)`` checks the switch took effect."""
    from quantkit.tools import bench

    bench.quantize_fp8_in_place(hf)
    ids = torch.randint(0, 1024, (1, 64), device="cuda")
    results = {}
    for value in values:
        monkeypatch.setenv(variable, value)
        runtime = bench.runtime_from_hf(hf, None, max_positions=4096)
        assert prepared_as(runtime, value)
        with torch.inference_mode():
            logits = [runtime.forward_logits(ids)] + [runtime.forward_logits(ids[:, :m].reshape(m, 1))
                                                      for m in (1, 4)]
            kernels = bench.kernel_times(lambda rt=runtime: rt.forward_logits(ids[:, :1]))["launches"]
        results[value] = (logits, kernels)
        del runtime
    return results


@pytest.mark.gpu
def test_quantizing_o_inside_its_gemv_changes_one_row_and_launches_only(monkeypatch):
    """QUANTKIT_FP8_GEMV_QUANT=inside: o's 16-bit input at one row goes to the one-launch GEMV (the same codes and
    scales; only the float32 summation order differs from the GEMV on codes) and one launch a layer goes; prefill
    and a decode batch of 4 stay bit for bit the same."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the FP8 decode paths are timed and served on Hopper")
    hf = _tiny_llama("cuda")
    results = _logits_and_launches_under(monkeypatch, hf, "QUANTKIT_FP8_GEMV_QUANT", ("apart", "inside"),
                                         lambda rt, quant: rt.weights.layers[0].o.fp8.gemv_fused == (quant == "inside"))
    (prefill, one, four), (prefill2, one2, four2) = results["apart"][0], results["inside"][0]
    assert torch.equal(prefill, prefill2) and torch.equal(four, four2)
    assert ((one2.float() - one.float()).norm() / one.float().norm()).item() < 2e-2
    assert results["inside"][1] == results["apart"][1] - hf.config.num_hidden_layers, results


def test_block_gemm_operands_pad_rows_and_k_blocks_to_four():
    """torch's block-scaled FP8 GEMM (quantkit/fp8_block.py) gets activation rows padded to a multiple of 4 (zero
    codes, unit scales, M-major scales) and weight scales with their K blocks padded to a multiple of 4, passed
    transposed: the layout other callers of torch's function use. The CPU checks the shapes, strides and that the
    padding adds nothing; the GPU probe checks the product against the emulation."""
    from quantkit.fp8_block import _WEIGHT_LAYOUTS, padded_rows

    qx = (torch.randn(3, 384) * 50).to(torch.float8_e4m3fn)
    sx = torch.rand(3, 3) + 0.5
    pq, ps = padded_rows(qx, sx)
    assert pq.shape == (4, 384) and ps.shape == (4, 3) and ps.stride() == (1, 4)
    assert torch.equal(pq[:3].view(torch.uint8), qx.view(torch.uint8)) and not pq[3].float().any()
    assert torch.equal(ps[:3], sx) and torch.equal(ps[3], torch.ones(3))
    same, same_s = padded_rows(pq, ps)
    assert same.shape == (4, 384) and same_s.stride() == (1, 4)
    as_is, as_is_s = padded_rows(qx, sx, 1)  # the probe's fallback: rows as they are, scales still M-major
    assert as_is.shape == (3, 384) and as_is_s.stride() == (1, 3) and torch.equal(as_is_s, sx)
    first = next(iter(_WEIGHT_LAYOUTS))
    assert "padded to 4" in first
    ws = torch.rand(2, 3)  # [N/128, K/128]
    laid = _WEIGHT_LAYOUTS[first](ws)
    assert laid.shape == (4, 2) and laid.stride() == (1, 4)
    assert torch.equal(laid[:3], ws.t()) and not laid[3].any()


def test_fp8_linear_row_limits_are_the_kernels_own():
    """fp8_linear restates the decode kernels' row limits so that choosing a path imports no Triton; they must
    not drift from the kernels'."""
    from quantkit import fp8_linear
    from quantkit.kernels import gemv, gemv_fp8_mma

    assert fp8_linear.GEMV_MAX_M == gemv.MAX_M
    assert fp8_linear.MMA_MAX_M == gemv_fp8_mma.MAX_M
