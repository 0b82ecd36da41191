"""A quantkit checkpoint through plain ``AutoModelForCausalLM.from_pretrained`` (docs/serving.md, "Other engines").

transformers' GPTQ path needs ``optimum`` and, without CUDA, ``gptqmodel`` (its CPU kernel computes in
16 bits): both are optional and heavy, so this test skips with the reason when they are absent.
"""

from __future__ import annotations

import importlib.util

import pytest

MISSING = [name for name in ("optimum", "gptqmodel") if importlib.util.find_spec(name) is None]


@pytest.mark.skipif(bool(MISSING), reason=f"transformers loads GPTQ checkpoints through optimum + gptqmodel; "
                    f"not installed here: {', '.join(MISSING)}")
def test_transformers_loads_the_checkpoint_and_matches_quantkit(tiny_llama_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from quantkit import api
    from quantkit.config import QuantScheme

    out = tmp_path / "rtn"
    api.quantize(str(tiny_llama_dir), out, method="rtn", scheme=QuantScheme(4, 64, True), progress=False)
    ids = torch.randint(0, 200, (1, 24))
    ours, _ = api.load_quantized(out, dtype=torch.float16)
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float16, device_map="cpu")
    assert theirs.config.use_cache is True
    with torch.no_grad():
        a = ours(ids).logits.float()
        b = theirs(ids).logits.float()
    assert torch.allclose(a, b, atol=5e-2, rtol=5e-2), (a - b).abs().max()
