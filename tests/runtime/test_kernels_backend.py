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


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3", "gemma3_text"])  # the last two: q/k norms
def test_kernels_backend_matches_reference(family, tiny_family):
    folder, _ = tiny_family(family)
    dtype = "bfloat16" if DEV == "cuda" else "float32"
    ref, _ = load_runtime_model(str(folder), device=DEV, dtype=dtype, backend="reference")
    fast, _ = load_runtime_model(str(folder), device=DEV, dtype=dtype, backend="kernels")
    tol = 2e-2 if DEV == "cuda" else 1e-4
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


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_kernels_backend_chunked_prefill_matches_reference(family, tiny_family):
    """A prompt prefilled in chunks (attention_varlen with keys longer than queries, over the cache) gives the
    reference backend's logits for the same chunks."""
    folder, _ = tiny_family(family)
    dtype = "bfloat16" if DEV == "cuda" else "float32"
    ref, _ = load_runtime_model(str(folder), device=DEV, dtype=dtype, backend="reference")
    fast, _ = load_runtime_model(str(folder), device=DEV, dtype=dtype, backend="kernels")
    tol = 2e-2 if DEV == "cuda" else 1e-4
    prompt = torch.randint(0, ref.spec.vocab_size, (13,), generator=torch.Generator().manual_seed(5)).tolist()
    outs = []
    for m in (ref, fast):
        cache = KVCache.allocate(m.spec, 3, 32, m.dtype, m.device)
        m.prefill([prompt[:6]], [1], cache)
        outs.append(m.prefill([prompt[6:], prompt[:4]], [1, 0], cache, [6, 0]))
    assert rel_err(outs[1], outs[0]) < tol
