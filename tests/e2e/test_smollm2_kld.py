"""KL divergence on the real model (SmolLM2-135M-Instruct, its GGUF's weights saved as a folder): zero against
itself; RTN g128 moves the next-token distributions further than GPTQ g128. Bounded: 2 windows of 512 tokens of
WikiText-2 test, GPTQ calibrated on 8 windows of 512 of WikiText-2 validation."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_kld_zero_against_itself_and_rtn_above_gptq(smollm2_folder, wikitext_dir, tmp_path):
    from quantkit import api
    from quantkit.config import CalibConfig, LoadConfig, QuantScheme

    load = LoadConfig(dtype="float32", device="cpu")
    text = str(wikitext_dir / "test.raw.txt")
    same = api.evaluate_kld(str(smollm2_folder), str(smollm2_folder), data=text, seqlen=512, max_windows=2, load=load)
    assert same.stats.mean_kld == 0.0 and same.stats.top1_changed == 0.0 and same.stats.n_tokens == 1024

    scheme = QuantScheme(4, 128, sym=False)
    calib = CalibConfig(source=str(wikitext_dir / "valid.tokens.txt"), nsamples=8, seqlen=512)
    kld = {}
    for method in ("rtn", "gptq"):
        out = tmp_path / method
        api.quantize(str(smollm2_folder), out, method=method, scheme=scheme, calib=calib, load=load)
        kld[method] = api.evaluate_kld(str(smollm2_folder), str(out), data=text, seqlen=512, max_windows=2,
                                       load=load).stats
    assert 0 < kld["gptq"].mean_kld < kld["rtn"].mean_kld, kld
    assert kld["gptq"].top1_changed <= kld["rtn"].top1_changed, kld
