"""The custom ops (kernels/ops.py): QuantLinear inside torch.compile, through quantkit::w4a16_linear with the
reference behind it on the CPU, and transformers' static-cache generate with the kernels on CUDA."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quantkit.config import QuantScheme
from quantkit.primitives import compute_qparams, quantize
from quantkit.qlinear import QuantLinear
from quantkit.qtensor import QuantizedWeight
from tests.conftest import rel_err, tiny_llama_config

CUDA = torch.cuda.is_available()


def quantized(linear: nn.Linear, scheme: QuantScheme) -> QuantLinear:
    w = linear.weight.detach().float().cpu()
    scales, zeros, g_idx = compute_qparams(w, scheme.bits, scheme.group_size, scheme.sym)
    codes = quantize(w, scales, zeros, g_idx, scheme.bits)
    bias = None if linear.bias is None else linear.bias.detach().cpu()
    return QuantLinear.from_weight(QuantizedWeight.from_codes(codes, scales, zeros, g_idx, scheme, bias=bias))


def quantize_linears(model: nn.Module, scheme: QuantScheme) -> nn.Module:
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and "lm_head" not in f"{name}.{child_name}":
                setattr(module, child_name, quantized(child, scheme))
    return model


def test_ops_are_registered_with_fake_implementations():
    from quantkit.kernels import ops
    from quantkit.kernels.w4a16_weights import prepare_w4a16_weights

    layer = quantized(nn.Linear(256, 48, bias=True), QuantScheme(4, 64, False))
    w = prepare_w4a16_weights(layer.qweight, layer.qzeros, layer.scales, layer.g_idx, 4, 64, False)
    x = torch.randn(3, 256)
    args = (x, w.qweight, w.scales, w.zeros, w.g_idx, w.perm, w.pair_index, w.tile_counters, w.partial_sums,
            w.bits, w.group_size, layer.bias)
    torch.library.opcheck(torch.ops.quantkit.w4a16_linear.default, args)
    q, k = torch.randn(10, 4, 16), torch.randn(12, 2, 16)
    cu_q, cu_k = torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 5, 12], dtype=torch.int32)
    torch.library.opcheck(torch.ops.quantkit.attention_varlen.default, (q, k, k.clone(), cu_q, cu_k, 6, True))
    assert ops.w4a16_linear_call(x, w, layer.bias).shape == (3, 48)


class TinyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(128, 256)
        self.down = nn.Linear(256, 128, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.up(x)))


@pytest.mark.parametrize("scheme", [QuantScheme(4, 32, False), QuantScheme(8, -1, True)], ids=["4bit-g32", "8bit-pc"])
def test_quant_linear_compiles_through_the_custom_op_on_cpu(scheme):
    torch.manual_seed(0)
    model = quantize_linears(TinyMLP(), scheme).eval()
    x = torch.randn(2, 5, 128)
    seen = []

    def recording(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    with torch.no_grad():
        eager = model(x)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=recording, fullgraph=True)(x)
        torch._dynamo.reset()
        aot = torch.compile(model, backend="aot_eager", fullgraph=True)(x)  # through the fake implementation
    assert seen.count("quantkit.w4a16_linear.default") == 2
    assert rel_err(compiled, eager) < 1e-5 and rel_err(aot, eager) < 1e-5


def test_attention_op_compiles_on_cpu():
    from quantkit.kernels import ops
    from quantkit.kernels.attention import attention_ref

    q, k, v = torch.randn(10, 4, 16), torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    cu_q, cu_k = torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 5, 12], dtype=torch.int32)
    fn = torch.compile(lambda *a: ops.attention_varlen_op(*a, 6, True), backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    assert torch.allclose(fn(q, k, v, cu_q, cu_k), attention_ref(q, k, v, cu_q, cu_k, causal=True))


@pytest.mark.gpu
def test_static_cache_generate_with_quant_linear_gpu():
    # transformers' static cache compiles the forward; before the custom op inductor failed re-emitting the
    # Gluon kernel. Hidden 256 / intermediate 512: K multiples of 128, so the paired (Gluon on Hopper) kernels run.
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = tiny_llama_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    model = quantize_linears(LlamaForCausalLM(config), QuantScheme(4, 128, True)).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (1, 12), device="cuda")
    with torch.no_grad():
        eager = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        static = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static")
        logits = model(eager).logits
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)(eager).logits  # inductor around the custom op
    assert torch.equal(static, eager)
    assert rel_err(compiled, logits) < 1e-2
