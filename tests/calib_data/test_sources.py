"""Calibration windows from local files and named hub sets (the hub is never contacted here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from quantkit.calib_data import sources, text
from quantkit.calib_data.sources import load_calibration, sample_windows
from quantkit.config import CalibConfig, QuantkitError
from tests.conftest import tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]
SHARED_VALID = REPO / ".." / "shared" / "data" / "wikitext2" / "valid.tokens.txt"

WORDS = ["the", "model", "reads", "text", "and", "predicts", "each", "next", "token", "while", "weights", "sit", "on", "a", "coarse", "grid"]


def _lines(n_lines: int, seed: int = 0) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(WORDS), (n_lines, 12), generator=gen).tolist()
    return [" ".join(WORDS[i] for i in row) for row in picks]


def _bos_tokenizer():
    """The shared tiny tokenizer, changed to put <s> in front of every text (like Llama's)."""
    from tokenizers import processors

    tokenizer = tiny_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)]
    )
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture()
def txt_file(tmp_path) -> Path:
    path = tmp_path / "calib.txt"
    path.write_text("\n".join(_lines(300)))
    return path


def _stream_contains(stream: list[int], window: list[int]) -> bool:
    n = len(window)
    return any(stream[i : i + n] == window for i in range(len(stream) - n + 1))


def test_txt_windows_are_seeded_slices_of_the_blank_line_joined_text(tokenizer, txt_file):
    config = CalibConfig(source=str(txt_file), nsamples=6, seqlen=32, seed=3)
    windows = load_calibration(config, tokenizer)
    assert windows.shape == (6, 32) and windows.dtype == torch.long
    joined = "\n\n".join(txt_file.read_text().split("\n"))
    stream = tokenizer(joined, add_special_tokens=False)["input_ids"]
    assert all(_stream_contains(stream, row) for row in windows.tolist())
    assert torch.equal(windows, load_calibration(config, tokenizer))
    other_seed = load_calibration(CalibConfig(source=str(txt_file), nsamples=6, seqlen=32, seed=4), tokenizer)
    assert not torch.equal(windows, other_seed)


def test_jsonl_uses_the_text_field(tokenizer, tmp_path):
    rows = [{"body": line, "id": i} for i, line in enumerate(_lines(200))]
    path = tmp_path / "calib.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n")
    windows = load_calibration(CalibConfig(source=str(path), nsamples=4, seqlen=16, text_field="body"), tokenizer)
    assert windows.shape == (4, 16)
    stream = tokenizer("\n\n".join(r["body"] for r in rows), add_special_tokens=False)["input_ids"]
    assert all(_stream_contains(stream, row) for row in windows.tolist())


def test_parquet_uses_the_text_field(tokenizer, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    lines = _lines(200)
    path = tmp_path / "calib.parquet"
    pq.write_table(pa.table({"content": lines, "n": list(range(200))}), path)
    windows = load_calibration(CalibConfig(source=str(path), nsamples=5, seqlen=20, text_field="content"), tokenizer)
    assert windows.shape == (5, 20)
    stream = tokenizer("\n\n".join(lines), add_special_tokens=False)["input_ids"]
    assert all(_stream_contains(stream, row) for row in windows.tolist())
    with pytest.raises(QuantkitError, match="no column 'text'.*content"):
        load_calibration(CalibConfig(source=str(path), nsamples=5, seqlen=20), tokenizer)


def test_windows_start_with_bos_when_the_tokenizer_adds_one(txt_file):
    bos_tokenizer = _bos_tokenizer()
    windows = load_calibration(CalibConfig(source=str(txt_file), nsamples=5, seqlen=24), bos_tokenizer)
    assert windows.shape == (5, 24)
    assert (windows[:, 0] == bos_tokenizer.bos_token_id).all()
    assert (windows[:, 1:] != bos_tokenizer.bos_token_id).all()


def test_sample_windows_bounds_and_bos():
    stream = torch.arange(100)
    windows = sample_windows(stream, nsamples=10, seqlen=10, seed=0, bos_token_id=-1)
    assert windows.shape == (10, 10) and (windows[:, 0] == -1).all()
    # consecutive text tokens, never past the end of the stream
    assert (windows[:, 2:] - windows[:, 1:-1] == 1).all() and windows.max() <= 99
    with pytest.raises(QuantkitError, match="has 100 tokens.*need 110.*--nsamples to 10 or less.*--seqlen to 9 or less"):
        sample_windows(stream, nsamples=11, seqlen=10, seed=0)


def test_text_too_short_says_how_many_tokens_and_what_to_lower(tokenizer, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("the model reads text\nand predicts")
    n_tokens = len(tokenizer("the model reads text\n\nand predicts", add_special_tokens=False)["input_ids"])
    with pytest.raises(QuantkitError, match=rf"has {n_tokens} tokens.*lower --seqlen"):
        load_calibration(CalibConfig(source=str(path), nsamples=4, seqlen=64), tokenizer)


@pytest.mark.parametrize("name", ["missing.txt", "missing.jsonl", "missing.parquet"])
def test_missing_file(tokenizer, tmp_path, name):
    with pytest.raises(QuantkitError, match="not found"):
        load_calibration(CalibConfig(source=str(tmp_path / name)), tokenizer)


def test_unknown_source_lists_the_choices(tokenizer):
    with pytest.raises(QuantkitError, match="unknown calibration source 'wikitext3'.*self.*c4.*jsonl"):
        load_calibration(CalibConfig(source="wikitext3"), tokenizer)


def test_foreign_suffix(tokenizer, tmp_path):
    path = tmp_path / "calib.csv"
    path.write_text("a,b\n")
    with pytest.raises(QuantkitError, match="supported file types"):
        load_calibration(CalibConfig(source=str(path)), tokenizer)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_text_file(tokenizer, tmp_path, content):
    path = tmp_path / "empty.txt"
    path.write_text(content)
    with pytest.raises(QuantkitError, match="holds no text"):
        load_calibration(CalibConfig(source=str(path)), tokenizer)


def test_jsonl_errors_name_the_line_and_field(tokenizer, tmp_path):
    path = tmp_path / "calib.jsonl"
    path.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(QuantkitError, match=r"calib.jsonl:2 has no field 'text' \(has: body\)"):
        load_calibration(CalibConfig(source=str(path)), tokenizer)
    path.write_text('{"text": ["not", "a", "string"]}\n')
    with pytest.raises(QuantkitError, match="holds list, not text"):
        load_calibration(CalibConfig(source=str(path)), tokenizer)
    path.write_text("{broken\n")
    with pytest.raises(QuantkitError, match="calib.jsonl:1 is not valid JSON"):
        load_calibration(CalibConfig(source=str(path)), tokenizer)


def test_self_needs_a_model(tokenizer):
    with pytest.raises(QuantkitError, match="no model"):
        load_calibration(CalibConfig(source="self"), tokenizer)


# ---------------------------------------------------------------- named sources, no network


def _forbid_hub_loading(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def fail(*args, **kwargs):
        raise AssertionError("load_dataset must not be called")

    monkeypatch.setattr(datasets, "load_dataset", fail)


@pytest.mark.parametrize("name", sorted(sources.NAMED_SOURCES))
def test_unreachable_hub_fails_fast_and_names_the_local_options(tokenizer, monkeypatch, name):
    _forbid_hub_loading(monkeypatch)
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(text, "hub_reachable", lambda timeout_s=text.HUB_PROBE_TIMEOUT_S: False)
    with pytest.raises(QuantkitError, match=rf"'{name}'.*--calib PATH.*\.parquet.*--calib self"):
        load_calibration(CalibConfig(source=name), tokenizer)


@pytest.mark.parametrize("var", ["HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"])
def test_offline_variable_set_after_import_never_reaches_the_hub(tokenizer, monkeypatch, var):
    _forbid_hub_loading(monkeypatch)
    monkeypatch.setattr(text, "hub_reachable", lambda *a, **k: pytest.fail("no probe in offline mode"))
    monkeypatch.setenv(var, "1")
    with pytest.raises(QuantkitError, match="offline mode.*--calib PATH.*--calib self"):
        load_calibration(CalibConfig(source="wikitext2"), tokenizer)


def test_offline_process_with_an_empty_cache_gets_the_local_file_hint(tmp_path):
    """A fresh process in offline mode, as a user runs the CLI: datasets looks only in its (empty)
    cache, and any attempt to open a socket fails the run."""
    pytest.importorskip("datasets")
    script = textwrap.dedent(
        """
        import socket, sys
        def no_network(*args, **kwargs):
            raise AssertionError("network touched")
        socket.socket.connect = no_network
        socket.create_connection = no_network
        from quantkit.calib_data.sources import load_calibration
        from quantkit.config import CalibConfig, QuantkitError
        from tests.conftest import tiny_tokenizer
        try:
            load_calibration(CalibConfig(source="wikitext2", nsamples=2, seqlen=16), tiny_tokenizer())
        except QuantkitError as err:
            print("QUANTKIT_ERROR", err)
        """
    )
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               HF_DATASETS_CACHE=str(tmp_path / "hf" / "datasets"), PYTHONPATH=str(REPO))
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert "network touched" not in proc.stderr
    assert "QUANTKIT_ERROR" in proc.stdout, proc.stderr[-2000:]
    assert "--calib PATH" in proc.stdout and "--calib self" in proc.stdout
    assert time.perf_counter() - started < 60


def test_missing_datasets_package_names_the_extra_and_local_options(tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(QuantkitError, match=r"quantkit\[data\].*--calib PATH.*--calib self"):
        load_calibration(CalibConfig(source="c4"), tokenizer)


def test_hub_probe_gives_up_within_its_timeout(monkeypatch):
    from quantkit import hub

    def hang(*args, **kwargs):
        time.sleep(2)
        raise TimeoutError("no answer")

    monkeypatch.setattr(hub.socket, "create_connection", hang)
    started = time.perf_counter()
    assert hub.hub_reachable(timeout_s=0.2) is False
    assert time.perf_counter() - started < 2

    def refuse(*args, **kwargs):
        raise ConnectionRefusedError("refused")

    monkeypatch.setattr(hub.socket, "create_connection", refuse)
    assert hub.hub_reachable(timeout_s=0.2) is False


class _FakeHub:
    """Stands in for ``datasets.load_dataset``: records the call and serves local rows."""

    def __init__(self, columns: dict):
        self.columns = columns
        self.calls: list[tuple] = []

    def __call__(self, path, name=None, *, split, data_files=None):
        import datasets

        self.calls.append((path, name, split, data_files))
        return datasets.Dataset.from_dict(self.columns)


def _serve(monkeypatch, columns: dict) -> _FakeHub:
    datasets = pytest.importorskip("datasets")
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(text, "hub_reachable", lambda *a, **k: True)
    fake = _FakeHub(columns)
    monkeypatch.setattr(datasets, "load_dataset", fake)
    return fake


def test_named_text_source_reads_its_split_and_joins_rows(tokenizer, monkeypatch):
    lines = _lines(100)
    fake = _serve(monkeypatch, {"text": lines})
    windows = load_calibration(CalibConfig(source="wikitext2", nsamples=3, seqlen=16), tokenizer)
    assert fake.calls == [("Salesforce/wikitext", "wikitext-2-raw-v1", "train", None)]
    stream = tokenizer("\n\n".join(lines), add_special_tokens=False)["input_ids"]
    assert windows.shape == (3, 16) and all(_stream_contains(stream, row) for row in windows.tolist())


def test_large_sources_read_only_a_prefix(tokenizer, monkeypatch):
    lines = _lines(2000)
    fake = _serve(monkeypatch, {"text": lines})
    config = CalibConfig(source="c4", nsamples=2, seqlen=16)
    token_ids = sources.load_source_tokens(config, tokenizer)
    assert fake.calls[0][:3] == ("allenai/c4", None, "validation") and "validation" in fake.calls[0][3]
    budget = config.nsamples * config.seqlen * sources.CHARS_PER_NEEDED_TOKEN
    n_docs = next(n for n in range(1, len(lines) + 1) if sum(map(len, lines[:n])) >= budget)
    assert n_docs < len(lines)
    expected = tokenizer("\n\n".join(lines[:n_docs]), add_special_tokens=False)["input_ids"]
    assert token_ids.tolist() == expected


def test_chat_source_is_rendered_through_the_chat_template(monkeypatch):
    conversations = [
        [{"role": "user", "content": " ".join(_lines(3, seed=i))}, {"role": "assistant", "content": "ok " * 10}]
        for i in range(40)
    ]
    fake = _serve(monkeypatch, {"messages": conversations, "prompt": ["p"] * 40})
    chat_tokenizer = tiny_tokenizer()
    chat_tokenizer.chat_template = "{% for m in messages %}<s>[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    token_ids = sources.load_source_tokens(CalibConfig(source="ultrachat", nsamples=2, seqlen=16), chat_tokenizer)
    assert fake.calls[0][:3] == ("HuggingFaceH4/ultrachat_200k", None, "test_sft")
    decoded = chat_tokenizer.decode(token_ids)
    assert decoded.startswith("[user] ")  # the template's leading BOS string is dropped
    assert "\n<s>[assistant] ok ok" in decoded
    chat_tokenizer.chat_template = None
    with pytest.raises(QuantkitError, match="chat template"):
        sources.load_source_tokens(CalibConfig(source="ultrachat", nsamples=2, seqlen=16), chat_tokenizer)


def test_shared_validation_text_gives_windows(tokenizer):
    if not SHARED_VALID.is_file():
        pytest.skip(f"shared WikiText-2 validation text not found at {SHARED_VALID.resolve()} (../shared beside the repo)")
    windows = load_calibration(CalibConfig(source=str(SHARED_VALID), nsamples=8, seqlen=128), tokenizer)
    assert windows.shape == (8, 128) and windows.max() < len(tokenizer)
