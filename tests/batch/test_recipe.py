from __future__ import annotations

import os
import subprocess
import sys

import pytest

from quantkit.batch.recipe import RecipeError, load_recipe


def test_grid_and_jobs_expand_in_order(tiny_recipe):
    plan = load_recipe(tiny_recipe)
    assert [j.name for j in plan.jobs] == ["tiny-rtn-w4-g32-asym", "tiny-gptq-w4-g32-asym", "tiny-gptq-w3-g32-asym"]
    gptq = plan.jobs[1]
    assert gptq.scheme.bits == 4 and gptq.scheme.group_size == 32 and not gptq.scheme.sym
    assert gptq.calib.nsamples == 4 and gptq.calib.seqlen == 32 and gptq.load.dtype == "float32"
    assert plan.eval.kld_source == plan.eval.perplexity[0] and plan.eval.max_windows == 3
    assert plan.output == tiny_recipe.parent / "out"


def test_environment_overrides_model_path(tmp_path, tiny_llama_dir, tiny_text_file, monkeypatch):
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'''output = "${{OUT_DIR:-{tmp_path}/default}}"
[defaults]
model = "${{TINY_MODEL:-/nowhere/model.gguf}}"
[eval]
kld = false
[[jobs]]
method = "rtn"
''')
    with pytest.raises(RecipeError, match="/nowhere/model.gguf not found"):
        load_recipe(recipe)
    monkeypatch.setenv("TINY_MODEL", str(tiny_llama_dir))
    monkeypatch.setenv("OUT_DIR", str(tmp_path / "elsewhere"))
    plan = load_recipe(recipe)
    assert plan.jobs[0].model == str(tiny_llama_dir) and plan.output == tmp_path / "elsewhere"


BAD_TOML = '''output = "{out}"
[defaults]
sym = false
colour = "blue"

[eval]
kld = false

[[jobs]]
method = "rtn"
model = "/no/such/model.gguf"

[[jobs]]
method = "gptq"
model = "{model}"
group_size = 100
desc_act = true
'''

BAD_YAML = '''output: {out}
defaults:
  sym: false
  colour: blue
eval:
  kld: false
jobs:
  - method: rtn
    model: /no/such/model.gguf
  - method: gptq
    model: {model}
    group_size: 100
    desc_act: true
'''


@pytest.mark.parametrize("suffix, text, lines", [(".toml", BAD_TOML, (4, 11, 16)), (".yaml", BAD_YAML, (4, 9, 12))])
def test_every_problem_is_reported_with_job_field_and_line(tmp_path, tiny_llama_dir, suffix, text, lines):
    recipe = tmp_path / f"bad{suffix}"
    recipe.write_text(text.format(out=tmp_path / "out", model=tiny_llama_dir))
    with pytest.raises(RecipeError) as info:
        load_recipe(recipe)
    problems = info.value.problems
    assert len(problems) == 3, problems
    unknown, missing, group = problems
    assert unknown.startswith(f"defaults, field 'colour' (line {lines[0]})") and "unknown field" in unknown
    assert missing.startswith(f"jobs[0], field 'model' (line {lines[1]})") and "/no/such/model.gguf not found" in missing
    assert group.startswith(f"jobs[1], field 'group_size' (line {lines[2]})") and "--group-size 100" in group


def test_option_of_another_method_is_named(tmp_path, tiny_llama_dir):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"output: {tmp_path}/o\neval: {{kld: false}}\njobs:\n  - {{model: {tiny_llama_dir}, method: awq, damp: 0.1}}\n"
                      f"  - {{model: {tiny_llama_dir}, method: sgd}}\n  - {{model: {tiny_llama_dir}, method: rtn, bits: four}}\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(recipe)
    text = "\n".join(info.value.problems)
    assert "'damp'" in text and "not an option of awq (it belongs to gptq)" in text
    assert "unknown method 'sgd'" in text and "expected an integer, got 'four'" in text


def test_duplicate_job_names_are_refused(tmp_path, tiny_llama_dir):
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'output = "{tmp_path}/o"\n[eval]\nkld = false\n[defaults]\nmodel = "{tiny_llama_dir}"\n'
                      '[[jobs]]\nmethod = "rtn"\n[[jobs]]\nmethod = "rtn"\n')
    with pytest.raises(RecipeError, match="two jobs are named"):
        load_recipe(recipe)


def test_cli_bad_recipe_exits_2_and_writes_nothing(tmp_path, tiny_llama_dir):
    recipe = tmp_path / "bad.toml"
    recipe.write_text(BAD_TOML.format(out=tmp_path / "out", model=tiny_llama_dir))
    proc = subprocess.run([sys.executable, "-m", "quantkit.cli.app", "batch", str(recipe)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    for needle in ("'colour'", "/no/such/model.gguf not found", "--group-size 100"):
        assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_cli_dry_run_lists_jobs_and_folders_and_writes_nothing(tiny_recipe):
    proc = subprocess.run([sys.executable, "-m", "quantkit.cli.app", "batch", str(tiny_recipe), "--dry-run"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    assert "3 jobs into" in proc.stdout
    for name in ("tiny-rtn-w4-g32-asym", "tiny-gptq-w4-g32-asym", "tiny-gptq-w3-g32-asym"):
        assert f"checkpoints/{name}" in proc.stdout
    assert not (tiny_recipe.parent / "out").exists()
