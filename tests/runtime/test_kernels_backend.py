"""The kernels backend's wiring (fused Triton kernels, attention_varlen, the fused decode attention with cache
slots, windows and soft-caps) against the reference backend on the same weights: Triton's interpreter on the CPU, float32."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.kernels.conftest import _fix_interpreter_index  # NumPy >= 2.4 and run-time loop bounds

    _fix_interpreter_index()

from quantkit.runtime.loader import load_runtime_model  # noqa: E402
from quantkit.runtime.model import KVCache  # noqa: E402
from tests.conftest import rel_err  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _both_backends(family, tiny_family):
    """The tiny ``family`` model on the reference and on the kernels backend, and the tolerance between them."""
    folder, _ = tiny_family(family)
    dtype = "bfloat16" if DEV == "cuda" else "float32"
    ref, _ = load_runtime_model(str(folder), device=DEV, dtype=dtype, backend="reference")
    fast, _ = load_runtime_model(str(folder), device=DEV, dtype=dtype, backend="kernels")
    return ref, fast, 2e-2 if DEV == "cuda" else 1e-4


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3", "gemma3_text"])  # the last two: q/k norms
def test_kernels_backend_matches_reference(family, tiny_family):
    ref, fast, tol = _both_backends(family, tiny_family)
    ids = torch.randint(0, ref.spec.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    assert rel_err(fast.forward_logits(ids), ref.forward_logits(ids)) < tol
    caches = [KVCache.allocate(m.spec, 3, 16, m.dtype, m.device) for m in (ref, fast)]
    prompt = ids[0, :7].tolist()
    outs = [m.prefill([prompt], [1], c) for m, c in zip((ref, fast), caches)]
    assert rel_err(outs[1], outs[0]) < tol
    for step in range(2):  # rows on slots 1 and 2 (the scratch slot, position 0): the padding rows of a bucket
        tokens = torch.tensor([ids[0, 7 + step].item(), 0], device=DEV)
        positions = torch.tensor([7 + step, 0], dtype=torch.int32, device=DEV)
        slots = torch.tensor([1, 2], dtype=torch.int32, device=DEV)
        outs = [m.decode(tokens, positions, slots, c) for m, c in zip((ref, fast), caches)]
        assert rel_err(outs[1][0], outs[0][0]) < tol


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_qk_norm_inside_the_decode_attention(family, tiny_family, monkeypatch):
    """QUANTKIT_DECODE_QK_NORM=attention: the decode step norms q and k inside the fused attention (no q/k norm
    call of its own at decode; prefill keeps it) and gives the separate norm's logits: bitwise on the reference
    backend, within float32 summation order on the kernels backend."""
    folder, _ = tiny_family(family)
    dtype = "bfloat16" if DEV == "cuda" else "float32"
    prompt = torch.randint(0, 256, (7,), generator=torch.Generator().manual_seed(6)).tolist()
    tokens = torch.tensor([11, 0], device=DEV)
    positions, slots = (torch.tensor(v, dtype=torch.int32, device=DEV) for v in ([7, 0], [1, 2]))
    for backend in ("reference", "kernels"):
        outs, norm_calls = [], []
        for switch in ("separate", "attention"):
            monkeypatch.setenv("QUANTKIT_DECODE_QK_NORM", switch)
            m, _ = load_runtime_model(str(folder), device=DEV, dtype=dtype, backend=backend)
            assert m.qk_norm_in_decode == (switch == "attention")
            cache = KVCache.allocate(m.spec, 3, 16, m.dtype, m.device)
            m.prefill([prompt], [1], cache)
            calls = []
            real = m.ops.qk_norm
            monkeypatch.setattr(m.ops, "qk_norm", lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
            outs.append(m.decode(tokens, positions, slots, cache)[0])
            norm_calls.append(len(calls))
        assert norm_calls == [m.spec.num_layers, 0]
        if backend == "reference":
            assert torch.equal(outs[0], outs[1])
        else:
            assert rel_err(outs[1], outs[0]) < (2e-2 if DEV == "cuda" else 1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_kernels_backend_chunked_prefill_matches_reference(family, tiny_family):
    """A prompt prefilled in chunks (attention_varlen with keys longer than queries, over the cache) gives the
    reference backend's logits for the same chunks."""
    ref, fast, tol = _both_backends(family, tiny_family)
    prompt = torch.randint(0, ref.spec.vocab_size, (13,), generator=torch.Generator().manual_seed(5)).tolist()
    outs = []
    for m in (ref, fast):
        cache = KVCache.allocate(m.spec, 3, 32, m.dtype, m.device)
        m.prefill([prompt[:6]], [1], cache)
        outs.append(m.prefill([prompt[6:], prompt[:4]], [1, 0], cache, [6, 0]))
    assert rel_err(outs[1], outs[0]) < tol


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fp8_kv_cache_on_both_backends(family, tiny_family):
    """An FP8 KV cache: prefill (whole and in chunks) and decode on the kernels backend give the reference
    backend's logits and cache (the same scales; codes within e4m3's rounding: the interpreter's conversion does
    not round to nearest, tests/kernels/test_fp8_quant.py, so on the CPU the logits agree to that rounding only),
    and both stay within e4m3's rounding of a 16-bit cache's logits."""
    ref, fast, tol = _both_backends(family, tiny_family)
    prompt = torch.randint(0, ref.spec.vocab_size, (13,), generator=torch.Generator().manual_seed(8)).tolist()
    logits, caches = {}, {}
    for name, m, kv in (("ref", ref, "fp8"), ("fast", fast, "fp8"), ("plain", ref, "auto")):
        cache = KVCache.allocate(m.spec, 3, 32, m.dtype, m.device, kv_dtype=kv)
        out = [m.prefill([prompt[:6]], [1], cache), m.prefill([prompt[6:10]], [1], cache, [6])]
        for step in range(3):
            tokens = torch.tensor([prompt[10 + step], 0], device=DEV)
            positions = torch.tensor([10 + step, 0], dtype=torch.int32, device=DEV)
            out.append(m.decode(tokens, positions, torch.tensor([1, 2], dtype=torch.int32, device=DEV), cache)[:1])
        logits[name], caches[name] = torch.cat(out), cache
        assert cache.fp8 == (kv == "fp8")
    assert rel_err(logits["fast"][0], logits["ref"][0]) < tol  # the first prefill attends in 16 bits
    assert rel_err(logits["fast"], logits["ref"]) < (tol if DEV == "cuda" else 0.05)
    first = (1, slice(0, 6))  # what the first prefill wrote: the same keys and values on both backends
    for i in range(ref.spec.num_layers):
        for got, want in zip(caches["fast"].scales(i), caches["ref"].scales(i)):
            assert rel_err(got[first], want[first]) < tol
        for j in (0, 1):
            got, want = (caches[n].entries(i, 1, 6, torch.float32)[j] for n in ("fast", "ref"))
            assert rel_err(got, want) < 0.05
    err = rel_err(logits["ref"], logits["plain"])
    assert torch.equal(logits["ref"][0], logits["plain"][0]) and 0 < err < 0.05, err


# What a decode step may run as PyTorch ops on the kernels backend besides its Triton kernels: allocations and
# views, the linears (16-bit ones stay cuBLAS; quantized ones are Triton), the embedding row, and a few per-step
# or per-layer casts and sums. Anything else (pow, mean, rsqrt, sigmoid, softmax, topk, add...) is a chain of
# launches that a fused kernel should run: Qwen3's q/k norms ran as ~20 such ops a layer, a third of a 30B-A3B
# batch-1 step, until this test's families went through it.
_FREE_OPS = {"empty", "empty_like", "new_empty", "reshape", "view", "as_strided", "detach", "alias", "_unsafe_view",
             "slice", "select", "t", "transpose", "expand", "unsqueeze", "squeeze", "permute", "contiguous"}
_PER_LAYER_OPS = {"to", "sum", "mul"}  # Gemma's embedding scale (mul), the tiled MoE's final sum and its casts


@pytest.mark.parametrize(("family", "linears_a_layer"), [("llama", 4), ("qwen3", 4), ("gemma3_text", 4),
                                                          ("qwen3_moe", 2), ("qwen2_moe", 4)])
def test_decode_step_runs_no_chains_of_pytorch_ops(family, linears_a_layer, tiny_family, tmp_path, monkeypatch):
    """The PyTorch ops of one decode step on the kernels backend (the Triton launches themselves made no-ops
    under the interpreter, so only the ops our Python code issues are counted): only the allowed ones, the
    linears a layer each family has (MoE: q/k/v, o, and Qwen2-MoE's shared expert's two; its gate is fused, and at
    decode the router's GEMM runs in the routing's launch: kernels/moe_router.py), and no per-layer op more than
    once a layer."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    if family.endswith("moe"):
        from tests.moe.moe_tiny import tiny_moe

        folder = tmp_path / family
        tiny_moe(family).save_pretrained(folder)
    else:
        folder, _ = tiny_family(family)
    model, _ = load_runtime_model(str(folder), device=DEV, dtype="float32", backend="kernels")
    cache = KVCache.allocate(model.spec, 2, 16, model.dtype, model.device)
    model.prefill([[1, 2, 3]], [0], cache)

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    if os.environ.get("TRITON_INTERPRET") == "1":
        import triton.runtime.interpreter as interpreter

        monkeypatch.setattr(interpreter.InterpretedFunction, "run", lambda self, *args, **kwargs: None)
    step = (torch.tensor([4], device=DEV), torch.tensor([3], dtype=torch.int32, device=DEV),
            torch.tensor([0], dtype=torch.int32, device=DEV))
    record = Record()
    with record:
        model.decode(*step, cache)
    layers = model.spec.num_layers
    ops = {op: n for op, n in record.ops.items() if op not in _FREE_OPS}
    assert ops.pop("linear") == linears_a_layer * layers + 1, record.ops  # + the head
    assert ops.pop("index", 0) <= 1, record.ops  # the embedding row
    assert set(ops) <= _PER_LAYER_OPS and all(n <= layers + 1 for n in ops.values()), record.ops


@pytest.mark.parametrize("quantized", [True, False])
def test_moe_rows_summed_by_the_next_norm(quantized, tmp_path, monkeypatch):
    """QUANTKIT_MOE_SUM=norm: the MoE block hands its unsummed expert rows (RowParts) to the next layer's add +
    RMSNorm and to the final norm, which sum them first. 4-bit experts at decode (the decode GEMV's float32 slices,
    summed in the order the sum's own launch takes): the same logits bit for bit; 16-bit experts (the tiled
    kernel's k rows, in slot order where torch's sum picks its own): within float32 rounding. Prefill too."""
    from tests.conftest import tiny_tokenizer
    from tests.moe.moe_tiny import tiny_moe

    tok = tiny_tokenizer()
    model = tiny_moe("qwen3_moe", vocab_size=len(tok))
    folder = tmp_path / "m"
    if quantized:
        from quantkit.checkpoint.save import save_quantized
        from tests.moe.test_moe_quantize import SCHEME
        from tests.moe.test_moe_quantize import quantized as quantize

        model, result = quantize("qwen3_moe", model=model)
        save_quantized(model, result.weights, folder, method="gptq", scheme=SCHEME, tokenizer=tok)
    else:
        model.save_pretrained(folder)
    dtype = "bfloat16" if DEV == "cuda" else "float32"
    prompt = torch.randint(3, 100, (6,), generator=torch.Generator().manual_seed(2)).tolist()
    outs, handed = {}, {}
    for switch in ("apart", "norm"):
        monkeypatch.setenv("QUANTKIT_MOE_SUM", switch)
        m, _ = load_runtime_model(str(folder), device=DEV, dtype=dtype, backend="kernels")
        assert m.moe_sum_in_norm == (switch == "norm")
        seen = []
        real = m.ops.add_rms_norm
        monkeypatch.setattr(m.ops, "add_rms_norm",
                            lambda x, *a, real=real: seen.append(type(x).__name__) or real(x, *a))
        cache = KVCache.allocate(m.spec, 2, 16, m.dtype, m.device)
        first = m.prefill([prompt], [0], cache)
        step = m.decode(torch.tensor([7], device=DEV), torch.tensor([6], dtype=torch.int32, device=DEV),
                        torch.tensor([0], dtype=torch.int32, device=DEV), cache)
        outs[switch], handed[switch] = (first, step), seen
    layers = m.spec.num_layers
    assert "RowParts" not in handed["apart"]
    # the 2nd layer's input norm and the final norm get parts, at prefill and at decode
    assert handed["norm"].count("RowParts") == 2 * layers
    (p0, d0), (p1, d1) = outs["apart"], outs["norm"]
    if quantized and DEV == "cpu":
        assert torch.equal(d1, d0)
    assert rel_err(d1, d0) < (1e-6 if DEV == "cpu" else 1e-2)
    assert rel_err(p1, p0) < (1e-6 if DEV == "cpu" else 1e-2)
