"""FP8 jobs in a batch: a recipe names them (method = "fp8", options weights/activations/block), the runner
quantizes, records size and bits per weight, perplexity and KL divergence of the FP8 checkpoint."""

from __future__ import annotations

import pytest

from quantkit.batch.recipe import RecipeError, load_recipe
from quantkit.batch.runner import run_batch
from tests.batch.recipes import write_recipe

FP8_JOBS = '''
[[jobs]]
method = "fp8"
[[jobs]]
method = "fp8"
activations = "static"
name = "fp8-static"
'''


def test_fp8_jobs_run_and_are_recorded(tmp_path, tiny_llama_dir, tiny_text_file):
    plan = load_recipe(write_recipe(tmp_path / "r.toml", tiny_llama_dir, tiny_text_file, tmp_path / "out", FP8_JOBS))
    assert [job.method for job in plan.jobs] == ["fp8", "fp8"]
    assert [job.needs_calibration for job in plan.jobs] == [False, True]
    batch = run_batch(plan.jobs, plan.output, eval=plan.eval)
    assert not batch.failed
    for result in batch.results:
        assert 8.25 < result.bits_per_weight < 8.5  # e4m3 codes + a float32 scale per row of K = 64 or 128
        assert 0 < result.kld["mean_kld"] < 0.1 and result.perplexity[str(tiny_text_file)] > 1
    static = next(r for r in batch.results if r.name == "fp8-static")
    assert static.settings["calib"]["nsamples"] == 4


def test_bad_fp8_options_in_a_recipe_are_named(tmp_path, tiny_llama_dir, tiny_text_file):
    jobs = '[[jobs]]\nmethod = "fp8"\nweights = "rows"\n'
    with pytest.raises(RecipeError, match="--weights must be one of"):
        load_recipe(write_recipe(tmp_path / "r.toml", tiny_llama_dir, tiny_text_file, tmp_path / "out", jobs))
