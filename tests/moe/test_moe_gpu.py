"""On a GPU: the fused MoE kernel compiled (bf16) against its reference, and the runtime's kernels backend on a
tiny MoE checkpoint against its reference backend."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.parametrize("m", [1, 8, 33, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_moe_compiled_matches_reference(m, dtype):
    from quantkit.config import QuantScheme
    from quantkit.kernels.moe_w4a16 import fused_moe, fused_moe_ref, stack_quantized
    from quantkit.methods.rtn import rtn_quantize
    from quantkit.qtensor import QuantizedWeight

    g = torch.Generator().manual_seed(0)
    scheme = QuantScheme(4, 128, True)
    trios = []
    for _ in range(16):
        trio = []
        for rows, cols in ((256, 512), (256, 512), (512, 256)):
            r = rtn_quantize(torch.randn(rows, cols, generator=g) / cols**0.5, scheme)
            trio.append(QuantizedWeight.from_codes(r.codes, r.scales, r.zeros, r.g_idx, scheme))
        trios.append(tuple(trio))
    ex = stack_quantized(trios, dtype, "cuda")
    x = torch.randn(m, 512, generator=g).to("cuda", dtype)
    w, ids = torch.topk(torch.randn(m, 16, generator=g).softmax(-1), 4, dim=-1)
    w, ids = (w / w.sum(-1, keepdim=True)).cuda(), ids.cuda()
    out = fused_moe(x, w, ids, ex)
    ref = fused_moe_ref(x.float(), w, ids, ex)
    naive = fused_moe_ref(x, w, ids, ex)  # the reference in the same 16-bit dtype: the tolerance's yardstick
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    err16 = ((naive.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err <= max(2 * err16, 1e-2)


def test_runtime_kernels_backend_matches_reference(tmp_path):
    from quantkit.checkpoint.save import save_quantized
    from quantkit.runtime.loader import load_runtime_model
    from tests.conftest import tiny_tokenizer
    from tests.moe.moe_tiny import tiny_moe
    from tests.moe.test_moe_quantize import SCHEME, quantized

    tok = tiny_tokenizer()
    model, result = quantized("qwen2_moe", model=tiny_moe("qwen2_moe", vocab_size=len(tok)))
    out = save_quantized(model, result.weights, tmp_path / "q", method="gptq", scheme=SCHEME, tokenizer=tok)
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(1))
    fast, _ = load_runtime_model(str(out), device="cuda", dtype="float16", backend="kernels")
    ref, _ = load_runtime_model(str(out), device="cuda", dtype="float32", backend="reference")
    a, b = fast.forward_logits(ids).float(), ref.forward_logits(ids).float()
    assert ((a - b).norm() / b.norm()).item() < 2e-2
