"""A tiny batch recipe: the session's random Llama, calibrated and evaluated on the tiny text file."""

from __future__ import annotations

from pathlib import Path


def write_recipe(path: Path, model: Path, text: Path, output: Path, jobs: str = "") -> Path:
    path.write_text(f'''
output = "{output}"
[models]
tiny = "{model}"
[defaults]
model = "tiny"
sym = false
group_size = 32
calib = "{text}"
nsamples = 4
seqlen = 32
device = "cpu"
dtype = "fp32"
[eval]
perplexity = ["{text}"]
seqlen = 32
max_windows = 3
kld_max_windows = 2
''' + (jobs or '''
[[grid]]
method = ["rtn", "gptq"]
bits = 4
[[jobs]]
method = "gptq"
bits = 3
'''))
    return path
