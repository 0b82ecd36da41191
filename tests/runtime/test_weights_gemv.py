"""The runtime's 16-bit linears and the decode GEMV: the backend decides whether they may take it."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.conftest import tiny_config


@pytest.mark.parametrize("backend", ["reference", "kernels"])
def test_backend_sets_the_gemv_flag(backend):
    """The kernels backend lets every linear (split parts included) take the GEMV; the reference backend keeps
    them on plain PyTorch."""
    from transformers import AutoModelForCausalLM

    from quantkit.runtime.weights import Linear
    from quantkit.tools.bench import runtime_from_hf

    hf = AutoModelForCausalLM.from_config(tiny_config("llama", 64)).eval()
    model = runtime_from_hf(hf, None, backend=backend)
    linears = model.weights.linears()
    assert len(linears) == 2 * 4 + 1 and all(isinstance(lin, Linear) for lin in linears)
    assert all(lin.gemv == (backend == "kernels") for lin in linears)


def test_linears_include_split_parts():
    from quantkit.runtime.weights import LayerWeights, Linear, ModelWeights

    def lin():
        return Linear(4, dense=torch.zeros(4, 4))

    split = Linear(8, parts=[lin(), lin()])
    layer = LayerWeights(qkv=split, o=lin(), gate_up=lin(), down=lin(), input_norm=None, post_attn_norm=None)
    weights = ModelWeights(embed=torch.zeros(4, 4), layers=[layer], final_norm=None, lm_head=lin())
    assert len(weights.linears()) == 7 and any(lin is split.parts[0] for lin in weights.linears())
