"""Serving benchmark: decode and prefill throughput of the runtime, int4 against bf16 in one run.

Models come from a checkpoint (the bf16 model is the same checkpoint dequantized) or, with a shape
name, from random weights built on the device: a transformers model in bf16 whose decoder linears are
then swapped for :class:`QuantLinear` s with random GPTQ tensors (so plain transformers ``generate``
runs on exactly the weights the runtime serves). Timings are CUDA-synchronized wall clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from quantkit.runtime.engine import Engine
from quantkit.runtime.model import RuntimeModel
from quantkit.runtime.spec import hf_config, spec_from_config
from quantkit.runtime.types import SamplingParams
from quantkit.runtime.weights import QuantInfo, load_weights

log = logging.getLogger(__name__)

SHAPES = {
    "llama3-8b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        rope_theta=500000.0,
    ),
    # Mixture-of-Experts: built from tensor names and shapes, not through transformers (tools/random_moe.py)
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    "smollm2-135m": dict(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    ),
}
LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def sync_time(fn: Callable[[], object], repeat: int = 1) -> float:
    """Seconds per call of ``fn`` (best of ``repeat``), the device synchronized around each."""
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth(device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written), best of 5."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * nbytes / sync_time(lambda: dst.copy_(src), repeat=5) / 1e9


def random_hf_model(shape: str, device, dtype=torch.bfloat16):
    """A transformers model of ``shape`` with random weights, built on the device."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config(SHAPES[shape])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def quantize_randomly(model, group_size: int = 128, seed: int = 0) -> QuantInfo:
    """Swap every decoder linear of ``model`` for a QuantLinear with random 4-bit GPTQ tensors (sym, g128)."""
    from quantkit.qlinear import QuantLinear
    from quantkit.qtensor import QuantizedWeight

    gen = torch.Generator(device=model.device).manual_seed(seed)
    dev = model.device
    for layer in model.model.layers:
        for path in LINEARS:
            parent_name, name = path.split(".")
            parent = getattr(layer, parent_name)
            lin = getattr(parent, name)
            k, n = lin.in_features, lin.out_features
            groups = (k + group_size - 1) // group_size
            qw = QuantizedWeight(
                qweight=torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device=dev, generator=gen),
                qzeros=torch.full((groups, n // 8), 0x77777777, dtype=torch.int32, device=dev),  # zero 8, stored 7
                scales=(torch.rand(groups, n, device=dev, generator=gen) * 2e-3 / k**0.5 * 64).to(torch.float16),
                g_idx=(torch.arange(k, device=dev) // group_size).to(torch.int32),
                bits=4,
                group_size=group_size,
                sym=True,
                in_features=k,
                out_features=n,
            )
            setattr(parent, name, QuantLinear.from_weight(qw))
    return QuantInfo(4, group_size, True)


def quantize_fp8_in_place(model, weights: str = "channel") -> None:
    """Round every decoder linear of ``model`` to FP8 e4m3 (``quantkit.methods.fp8``, per-channel scales by default)
    and swap it for an FP8Linear: the model ``quantkit fp8`` would write, built on the device in seconds."""
    from quantkit.fp8_api import install_fp8_linears
    from quantkit.fp8_weight import FP8Config, fp8_quantize_weight

    config = FP8Config(weights=weights)
    for layer in model.model.layers:
        records = {}
        for path in LINEARS:
            lin = layer.get_submodule(path)
            records[path], _ = fp8_quantize_weight(lin.weight.data, config, bias=lin.bias)
        install_fp8_linears(layer, records)
        del records
    torch.cuda.empty_cache()


def runtime_from_hf(
    model, quant: QuantInfo | None, *, backend: str = "kernels", max_positions: int = 4096
) -> RuntimeModel:
    """A RuntimeModel over a transformers model's tensors (shared where no fusion copies them)."""
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)

    def source(keys):
        return {k: state[k] for k in keys if k in state}

    cfg = model.config
    spec = spec_from_config(cfg)
    weights = load_weights(source, set(state), spec, quant, model.dtype, model.device, packed_kernel=quant is not None)
    return RuntimeModel(
        spec,
        cfg,
        weights,
        backend=backend,
        dtype=model.dtype,
        device=model.device,
        max_positions=max_positions,
        name=cfg.model_type,
    )


DECODE_CONTEXT = 128  # prompt tokens before the timed decode steps, by default


def positions_needed(prefill_tokens: int, steps: int, context: int = DECODE_CONTEXT) -> int:
    """The sequence length a bench engine holds: the prefill test's prompt (and its first new token), or a decode
    row's ``context`` prompt tokens and its steps."""
    return max(prefill_tokens + 1, context + steps + 2)


def decode_tps(engine: Engine, batch: int, steps: int, prompt_len: int = DECODE_CONTEXT, seed: int = 0) -> float:
    """Decode tokens/s of ``batch`` greedy requests of ``prompt_len`` random tokens, ``steps`` decode steps each."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model.spec.vocab_size
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(), params)
    # Every prompt in one prefill step, so that all rows decode from the same step to the same last one: with the
    # engine's chunked prefill (2048 tokens a step on CUDA) 32 x 128 tokens took two steps, the first half of the
    # rows decoded one step alone and ended one step early, and two half-full steps cost batch 32 ~2% of its rate.
    chunk, engine.prefill_chunk = engine.prefill_chunk, max(engine.prefill_chunk, batch * prompt_len)
    try:
        engine.step()  # the prefill
    finally:
        engine.prefill_chunk = chunk
    before = (engine.stats.decode_tokens, engine.stats.decode_seconds)
    while engine.has_work():
        engine.step()
    return (engine.stats.decode_tokens - before[0]) / (engine.stats.decode_seconds - before[1])


def prefill_tps(engine: Engine, n_tokens: int = 2048) -> float:
    prompt = torch.randint(0, engine.model.spec.vocab_size, (n_tokens,)).tolist()
    seconds = sync_time(lambda: engine.model.prefill([prompt], [0], engine.cache), repeat=3)
    return n_tokens / seconds


def hf_generate_tps(model, prompt_len: int = 128, new_tokens: int = 17) -> dict:
    """transformers ``generate`` (greedy, its default dynamic cache): prefill and decode tokens/s."""
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len), device=model.device)

    def run(n):
        return sync_time(
            lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0), repeat=1
        )

    with torch.inference_mode():
        run(2)  # warm-up
        one, many = run(1), run(new_tokens)
    return {"prefill_tps": prompt_len / one, "decode_tps": (new_tokens - 1) / (many - one)}


def graph_time(fn: Callable[[], object], replays: int = 20) -> float:
    """Seconds per replay of ``fn`` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return sync_time(lambda: [graph.replay() for _ in range(replays)], repeat=3) / replays


def time_split(engine: Engine, context: int = DECODE_CONTEXT) -> dict:
    """Per-token time of one batch-1 decode step by part: each part captured alone in a graph with the step's
    shapes (linears; attention with RoPE and the cache write; norms and activation), the whole step's replay, and
    the engine's host share (computed by the caller)."""
    model, cache, s = engine.model, engine.cache, engine.model.spec
    dev, w = model.device, model.weights
    h = torch.randn(1, s.hidden_size, device=dev, dtype=model.dtype)
    q_in = torch.randn(1, s.q_size, device=dev, dtype=model.dtype)
    mid = torch.randn(1, s.intermediate_size, device=dev, dtype=model.dtype)
    gate_up = torch.randn(1, 2 * s.intermediate_size, device=dev, dtype=model.dtype)
    qkv = torch.randn(1, s.q_size + 2 * s.kv_size, device=dev, dtype=model.dtype)
    pos = torch.full((1,), context, dtype=torch.int32, device=dev)
    slot = torch.zeros(1, dtype=torch.int32, device=dev)
    o = model.ops

    def linears():  # MoE layers: the routed experts (routing and align included) and any shared expert
        for lw in w.layers:
            lw.qkv(h), lw.o(q_in)
            if lw.moe is not None:
                lw.moe(h, o.act_mul)
            else:
                lw.gate_up(h), lw.down(mid)
        w.lm_head(h)

    def attention():
        for i in range(s.num_layers):
            cos, sin = model.layer_rope[i]
            k_scale, v_scale = cache.scales(i)
            o.decode_attention_rope(qkv, cos, sin, pos, slot, cache.k[i], cache.v[i], s.num_heads, cache.counters,
                                    s.softmax_scale, s.window_left(i), s.attn_softcap, k_scale=k_scale,
                                    v_scale=v_scale)

    def small_ops():  # with Qwen3's / OLMoE's q and k norms (in place on a scratch qkv row)
        for lw in w.layers:
            o.add_rms_norm(h, h, lw.input_norm, s.rms_eps, s.norm_offset)
            if s.qk_norm:
                model.qk_norm(qkv, lw)
            o.add_rms_norm(h, h, lw.post_attn_norm, s.rms_eps, s.norm_offset)
            if lw.moe is None:  # a MoE block's activation is inside its kernel (counted in "linears")
                o.act_mul(gate_up, s.activation)
        o.add_rms_norm(h, h, w.final_norm, s.rms_eps, s.norm_offset)

    def fp8_activation_quant():  # what the FP8 linears spend quantizing their inputs (one launch each)
        from quantkit.kernels.fp8_quant import quantize_per_token

        for lw in w.layers:
            quantize_per_token(h), quantize_per_token(q_in)
            if lw.moe is None:
                quantize_per_token(h), quantize_per_token(mid)

    tokens = torch.zeros(1, dtype=torch.long, device=dev)
    parts = {
        "linears": graph_time(linears),
        "attention_rope_kv": graph_time(attention),
        "norms_act": graph_time(small_ops),
        "decode_step_graph": graph_time(lambda: model.decode(tokens, pos, slot, cache)),
    }
    parts["other_in_graph"] = (
        parts["decode_step_graph"] - parts["linears"] - parts["attention_rope_kv"] - parts["norms_act"]
    )
    # inside "linears": the share the GEMMs do not take, where a separate kernel quantizes (not the fused FP8 GEMV)
    if any(lin.fp8 is not None and not (lin.fp8.gemv and lin.fp8.gemv_fused) for lin in w.linears()):
        parts["fp8_activation_quant_in_linears"] = graph_time(fp8_activation_quant)
    return {k: v * 1e3 for k, v in parts.items()}  # milliseconds


def kernel_times(fn: Callable[[], object], device_type: str = "cuda", top: int = 12) -> dict:
    """What one call of ``fn`` runs on the device, kernel by kernel, from torch's profiler (after one call to warm
    up): ``{"kernels": [{"name", "calls", "us"}, ...] (the ``top`` by time, names cut at 80 characters),
    "launches": n, "sum_us": total}``. Kernel durations only: set beside a graph replay's time, the difference is
    what launches and the gaps between them cost. ``device_type`` "cpu" profiles the CPU ops instead (the CPU
    test; nested ops are counted each there)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device_type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU]) as prof:
        fn()
        sync()
    want = DeviceType.CUDA if on_cuda else DeviceType.CPU
    by_name: dict[str, list[float]] = {}
    for evt in prof.events():
        if evt.device_type == want:
            by_name.setdefault(evt.name[:80], []).append(evt.time_range.elapsed_us())
    rows = sorted(({"name": n, "calls": len(v), "us": sum(v)} for n, v in by_name.items()), key=lambda r: -r["us"])
    return {"kernels": rows[:top], "launches": sum(r["calls"] for r in rows), "sum_us": sum(r["us"] for r in rows)}


def step_kernels(engine: Engine, context: int = DECODE_CONTEXT) -> dict:
    """``kernel_times`` of one batch-1 decode step run eagerly (as ``time_split``'s whole step, without its graph)."""
    model, cache = engine.model, engine.cache
    dev = model.device
    tokens = torch.zeros(1, dtype=torch.long, device=dev)
    pos = torch.full((1,), context, dtype=torch.int32, device=dev)
    slot = torch.zeros(1, dtype=torch.int32, device=dev)
    return kernel_times(lambda: model.decode(tokens, pos, slot, cache), dev.type)


def prefill_split(engine: Engine, n_tokens: int = 2048) -> dict:
    """Milliseconds of one ``n_tokens``-token prefill at batch 1 by part: the whole prefill, every layer's linears
    at the prefill's shapes, layer 0's four linears alone (which one falls short), the FP8 activation quantization
    where a separate kernel does it, every layer's attention, and the rest (norms, RoPE, cache writes, the head)."""
    model, s = engine.model, engine.model.spec
    dev, w = model.device, model.weights

    def rand(width: int) -> torch.Tensor:
        return torch.randn(n_tokens, width, device=dev, dtype=model.dtype)

    h, q_in, mid, qkv = rand(s.hidden_size), rand(s.q_size), rand(s.intermediate_size), rand(s.q_size + 2 * s.kv_size)
    prompt = torch.randint(0, s.vocab_size, (n_tokens,)).tolist()
    parts = {"prefill": sync_time(lambda: model.prefill([prompt], [0], engine.cache), repeat=3)}
    if all(lw.moe is None for lw in w.layers):
        def linears():
            for lw in w.layers:
                lw.qkv(h), lw.o(q_in), lw.gate_up(h), lw.down(mid)

        parts["linears"] = sync_time(linears, repeat=3)
        lw0 = w.layers[0]
        shapes = (("qkv", lw0.qkv, h), ("o", lw0.o, q_in), ("gate_up", lw0.gate_up, h), ("down", lw0.down, mid))
        for name, lin, x in shapes:
            parts[f"layer0_{name}"] = sync_time(lambda lin=lin, x=x: lin(x), repeat=5)
        if any(lin.fp8 is not None for lin in w.linears()):
            from quantkit.kernels.fp8_quant import quantize_per_token

            def activation_quant():
                for _ in w.layers:
                    quantize_per_token(h), quantize_per_token(q_in), quantize_per_token(h), quantize_per_token(mid)

            parts["fp8_activation_quant_in_linears"] = sync_time(activation_quant, repeat=3)
    cu = torch.tensor([0, n_tokens], dtype=torch.int32, device=dev)
    attend = model.prefill_attend(cu, n_tokens, kv_aligned=n_tokens % 32 == 0)
    parts["attention"] = sync_time(lambda: [attend(i, qkv) for i in range(s.num_layers)], repeat=3)
    if "linears" in parts:
        parts["other"] = parts["prefill"] - parts["linears"] - parts["attention"]
    return {k: v * 1e3 for k, v in parts.items()}


def greedy_agreement(engine: Engine, n_prompt: int = 32, n_new: int = 24, seed: int = 1) -> dict:
    """Greedy tokens of the engine's decode (CUDA graphs, the pipeline, the fused decode kernel) against the argmax
    of the prefill path's logits over the same sequence (attention_varlen and the unfused RoPE/cache kernel): the
    first mismatch, the logit gap there, and the smallest top-2 gap (how close to a tie random weights come)."""
    model = engine.model
    prompt = torch.randint(0, model.spec.vocab_size, (n_prompt,), generator=torch.Generator().manual_seed(seed))
    engine.add_request(prompt.tolist(), SamplingParams(max_tokens=n_new, ignore_eos=True))
    tokens = []
    while engine.has_work():
        tokens += [e.token_id for e in engine.step() if e.token_id is not None]
    seq = torch.tensor([prompt.tolist() + tokens], device=model.device)
    logits = model.forward_logits(seq)[0, n_prompt - 1 : -1].float()
    expected = logits.argmax(-1).tolist()
    first = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
    gap = None if first is None else (logits[first, expected[first]] - logits[first, tokens[first]]).item()
    top2 = logits.topk(2, dim=-1).values
    return {
        "tokens": len(tokens),
        "first_mismatch": first,
        "gap_at_mismatch": gap,
        "min_top2_gap": (top2[:, 0] - top2[:, 1]).min().item(),
    }


def linear_kernels(model: RuntimeModel, batches: tuple[int, ...]) -> dict:
    """``{linear: {batch: kernel}}`` for the first decoder layer's linears (its routed experts on a MoE layer) and
    the lm_head: the kernel the dispatch code picks at each decode batch size (FP8: ``fp8_linear.fp8_kernel``,
    "+codes" where a fused producer hands it quantized rows; INT4: the W4A16 plan's choice; 16-bit: the GEMV or
    cuBLAS; split linears: their parts joined by "+"). A record thus says which kernels its numbers are of (an FP8
    record once timed q/k/v on _scaled_mm)."""
    from quantkit.fp8_linear import fp8_kernel
    from quantkit.kernels.device_info import gpu_arch, gpu_card
    from quantkit.kernels.dispatch import dense_kernel
    from quantkit.kernels.w4a16_select import plan_w4a16

    def label(lin, m: int, fed_codes: bool) -> str:
        if lin.parts:
            return " + ".join(label(p, m, False) for p in lin.parts)
        if lin.fp8 is not None:
            codes = fed_codes and lin.takes_fp8_codes
            return fp8_kernel(lin.fp8, m, codes=codes) + ("+codes" if codes else "")
        if lin.packed is not None:
            dev = lin.packed.qweight.device
            plan = plan_w4a16(lin.packed.facts(), gpu_arch(dev), gpu_card(dev))
            return "reference" if plan is None else plan.choice(m).label()
        return dense_kernel(m, lin.dense) if lin.gemv else "torch"  # the reference backend: plain F.linear

    layer = model.weights.layers[0]
    named = {"qkv": (layer.qkv, True), "o": (layer.o, False), "gate_up": (layer.gate_up, True),
             "down": (layer.down, True), "lm_head": (model.weights.lm_head, False)}
    kernels = {name: {str(b): label(lin, b, fed) for b in batches} for name, (lin, fed) in named.items()
               if lin is not None}
    if layer.moe is not None:  # the routed experts: MoELayer.kernel_label
        kernels["experts"] = {str(b): layer.moe.kernel_label(b) for b in batches}
    return kernels


def bench_runtime(
    model: RuntimeModel, batches: tuple[int, ...], steps: int, prefill_tokens: int, split: bool = False,
    context: int = DECODE_CONTEXT, kv_cache_dtype: str = "auto",
) -> dict:
    """Decode tokens/s per batch size (each row decoding after a prompt of ``context`` tokens), prefill tokens/s,
    peak memory and weight bytes for one RuntimeModel; the KV cache in ``kv_cache_dtype`` ("auto": the model's
    dtype, or "fp8")."""
    torch.cuda.reset_peak_memory_stats()
    max_batch = max(batches)
    engine = Engine(
        model,
        None,
        max_batch=max_batch,
        max_seq_len=positions_needed(prefill_tokens, steps, context),
        cuda_graphs=True,
        graph_buckets=batches,
        kv_cache_dtype=kv_cache_dtype,
    )
    result = {
        "weight_bytes_per_token": model.weights.nbytes(),
        "decode_context": context,
        "kv_cache_dtype": kv_cache_dtype,
        "kv_cache_bytes": engine.cache.nbytes(),
        "linear_kernels": linear_kernels(model, batches),
        "decode_tps": {},
    }
    for b in batches:
        result["decode_tps"][str(b)] = decode_tps(engine, b, steps if b == 1 else max(16, steps // 2), context)
        log.info("decode batch %d: %.1f tok/s", b, result["decode_tps"][str(b)])
    result["greedy_vs_prefill"] = greedy_agreement(engine)
    log.info("greedy decode against the prefill path: %s", result["greedy_vs_prefill"])
    result["prefill_tps"] = prefill_tps(engine, prefill_tokens)
    if split and 1 in batches:
        ms = time_split(engine, context)  # at the decode rows' context: "host" below is the difference
        # the engine's whole batch-1 step (sampling and Python included) from the decode run above
        ms["engine_step_wall"] = 1e3 / result["decode_tps"]["1"]
        ms["host"] = ms["engine_step_wall"] - ms["decode_step_graph"]
        result["time_split_ms"] = ms
        result["prefill_split_ms"] = prefill_split(engine, prefill_tokens)
        try:  # the step kernel by kernel (the profiler may be unavailable: the numbers above stand without it)
            result["step_kernels"] = step_kernels(engine, context)
        except Exception as exc:  # noqa: BLE001
            log.warning("per-kernel profile of the decode step failed: %s: %s", type(exc).__name__, exc)
    result["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    del engine
    return result
