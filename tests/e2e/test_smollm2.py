"""End to end on the real model (SmolLM2-135M-Instruct, GGUF): RTN W4 g128, write, inspect, reload, perplexity.

Bounded: 3 windows of 512 tokens of the WikiText-2 test text, so it runs in about a minute on 2 cores.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(smollm2_folder):
    """The unquantized model, from the GGUF's weights saved once as a folder (the test quantizes from the GGUF
    itself: one GGUF load, ~15 s on 2 cores, not two)."""
    from quantkit.config import LoadConfig
    from quantkit.models.load import load_model

    return load_model(str(smollm2_folder), LoadConfig(dtype="float32", device="cpu"))


def test_rtn_g128_checkpoint_reloads_and_scores(smollm2, smollm2_gguf, wikitext_dir, tmp_path):
    from quantkit import api
    from quantkit.config import LoadConfig, QuantScheme
    from quantkit.eval.perplexity import load_eval_tokens, perplexity

    tokens = load_eval_tokens(str(wikitext_dir / "test.raw.txt"), smollm2.tokenizer)
    fp = perplexity(smollm2.model, tokens, seqlen=512, max_windows=3)

    out = tmp_path / "smollm2-rtn-g128"
    report = api.quantize(str(smollm2_gguf), out, method="rtn", scheme=QuantScheme(4, 128, sym=False),
                          load=LoadConfig(dtype="float32", device="cpu"))
    assert report.n_quantized == 30 * 7
    # 576-wide inputs at g128: every linear but down_proj (1536 = 12 x 128) has a partial last group.
    assert len(report.partial_group_layers) == 30 * 6

    info = api.inspect(out)
    assert info.bits == 4 and info.group_size == 128 and info.n_quantized == 210
    assert info.compression_ratio > 1.5

    model, tokenizer = api.load_quantized(out, dtype=torch.float32)
    quant = perplexity(model, tokens, seqlen=512, max_windows=3)
    assert quant.n_tokens == fp.n_tokens
    # W4 RTN costs a few points of perplexity on this model (MODELS.md: 19.86 -> 27.44 at 2048); never a blow-up.
    assert fp.ppl < quant.ppl < 1.8 * fp.ppl, (fp.ppl, quant.ppl)

