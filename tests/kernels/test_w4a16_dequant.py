"""Dequantize-then-cuBLAS (kernels/w4a16_dequant.py): the 16-bit weight the Triton kernel writes against the
independent float dequantization, and the GEMM through ``w4a16_matmul`` with a ``DequantConfig``; the selection
names it only for a cell measured at exactly that shape and bucket. CPU: Triton's interpreter (conftest sets it);
GPU (marker ``gpu``): bf16 and fp16 at a prefill size."""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels.w4a16_configs import DequantConfig, config_from_dict, config_label
from quantkit.kernels.w4a16_select import _measured_exact, facts_of, load_table, select_w4a16
from tests.conftest import rel_err
from tests.kernels.test_w4a16 import CUDA, _kernel_module, make_layer

# (n, k, bits, group_size, sym, act_order, config)
CASES = [
    (96, 256, 4, 128, True, False, DequantConfig(32, 64)),
    (80, 256, 4, 64, False, False, DequantConfig(16, 128)),  # asym, N tail
    (72, 576, 4, 128, False, False, DequantConfig(32, 256)),  # partial last group, K tail
    (64, 256, 4, -1, True, False, DequantConfig(32, 64)),  # per channel
    (64, 256, 4, 64, False, True, DequantConfig(32, 64)),  # act-order: K in the kernel's order, x gathered
    (64, 192, 8, 64, False, False, DequantConfig(32, 64)),  # 8-bit codes
]


@pytest.mark.skipif(CUDA, reason="interpreter tests run on CPU-only machines")
@pytest.mark.parametrize("n,k,bits,gs,sym,act,config", CASES)
def test_dequantized_weight_and_gemm_interpreted(n, k, bits, gs, sym, act, config):
    mod = _kernel_module()
    from quantkit.kernels.w4a16_dequant import w4a16_dequantize

    tensors, w_deq = make_layer(n, k, bits, gs, sym, act, seed=n + k)
    w = mod.prepare_w4a16_weights(**tensors, bits=bits, group_size=gs, sym=sym)
    weight = w4a16_dequantize(w, torch.float32, config)
    want = w_deq if w.perm is None else w_deq[:, w.perm]  # the kernel's column order
    assert weight.shape == (n, k) and torch.equal(weight, want.float())
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(k)).half()
    out = mod.w4a16_matmul(x, w, config=config)
    assert out.shape == (5, n) and out.dtype == torch.float16
    assert rel_err(out, x.double() @ w_deq.double().t()) < 2e-3


def test_configs_round_trip_and_a_dequant_entry_serves_only_its_cell():
    cfg = config_from_dict("dequant", {"BLOCK_N": 128, "BLOCK_K": 512, "num_warps": 8})
    assert cfg == DequantConfig(128, 512, 8) and config_label(cfg).startswith("DequantConfig(128x512")
    with pytest.raises(ValueError):
        DequantConfig(64, 100)
    # measured cells only for the card they were measured on (the H100's at 4096 rows): the H200 keeps its picks
    assert all(e.get("card") for e in load_table() if e["kernel"] == "dequant")
    facts = facts_of(28672, 8192, 4, 128, True, False)
    table = [dict(n=28672, k=8192, m=1024, kernel="dequant", config=DequantConfig(), source="test")]
    today = select_w4a16(1024, facts, "sm90")
    picked = _measured_exact(1024, facts, "sm90", None, table, today)
    assert picked.kernel == "dequant" and picked.config == DequantConfig() and picked.fallback is None
    assert _measured_exact(4096, facts, "sm90", None, table, today) is None  # another bucket
    assert _measured_exact(1024, facts_of(8192, 28672, 4, 128, True, False), "sm90", None, table, today) is None
    # an entry measured on one card serves that card only
    on_one = [dict(table[0], card="NVIDIA H100 80GB HBM3")]
    assert _measured_exact(1024, facts, "sm90", "NVIDIA H100 80GB HBM3", on_one, today).kernel == "dequant"
    assert _measured_exact(1024, facts, "sm90", "NVIDIA H200", on_one, today) is None
    assert _measured_exact(1024, facts, "sm90", None, on_one, today) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sym,act", [(True, False), (False, True)])
def test_dequant_gemm_on_the_gpu(dtype, sym, act):
    mod = _kernel_module()
    tensors, w_deq = make_layer(1024, 768, 4, 128, sym, act, device="cuda")
    w = mod.prepare_w4a16_weights(**tensors, bits=4, group_size=128, sym=sym)
    x = torch.randn(300, 768, device="cuda", dtype=dtype)
    out = mod.w4a16_matmul(x, w, config=DequantConfig())
    assert rel_err(out, x.double() @ w_deq.double().t()) < 1e-2
