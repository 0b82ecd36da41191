"""Perplexity against a naive full-logits computation, on tiny models built in-process."""

from __future__ import annotations

import math
from dataclasses import FrozenInstanceError
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from quantkit.calib_data import text
from quantkit.config import QuantkitError
from quantkit.eval import perplexity as perplexity_module
from quantkit.eval.perplexity import load_eval_tokens, needs_bos, perplexity
from tests.conftest import tiny_llama_config, tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]
SHARED_TEST_TEXT = REPO / ".." / "shared" / "data" / "wikitext2" / "test.raw.txt"
VOCAB = 256


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(vocab_size=VOCAB)).eval()


@pytest.fixture(scope="module")
def token_ids():
    return torch.randint(2, VOCAB, (400,), generator=torch.Generator().manual_seed(0))


def naive_perplexity(model, token_ids, seqlen, max_windows=None, bos_token_id=None):
    """Written independently of the library: full logits, log-softmax, mean over every target."""
    text_len = seqlen - (bos_token_id is not None)
    n_windows = len(token_ids) // text_len
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    nlls = []
    with torch.no_grad():
        for i in range(n_windows):
            window = token_ids[i * text_len : (i + 1) * text_len].tolist()
            if bos_token_id is not None:
                window = [bos_token_id] + window
            ids = torch.tensor([window])
            log_probs = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
            for pos in range(len(window) - 1):
                nlls.append(-log_probs[pos, window[pos + 1]].item())
    return math.exp(sum(nlls) / len(nlls)), len(nlls), n_windows


@pytest.mark.parametrize("bos_token_id", [None, 1])
def test_matches_the_naive_computation(llama, token_ids, bos_token_id):
    result = perplexity(llama, token_ids, seqlen=64, bos_token_id=bos_token_id)
    expected_ppl, expected_scored, expected_windows = naive_perplexity(llama, token_ids, 64, bos_token_id=bos_token_id)
    assert result.ppl == pytest.approx(expected_ppl, rel=1e-5)
    assert (result.n_tokens, result.n_windows) == (expected_scored, expected_windows)
    assert result.mean_nll == pytest.approx(math.log(expected_ppl), rel=1e-5)
    assert result.bos_prepended is (bos_token_id is not None) and result.seqlen == 64 and result.seconds > 0


def test_bos_windows_hold_one_text_token_less(llama):
    ids = torch.arange(2, 102)  # 100 text tokens
    plain = perplexity(llama, ids, seqlen=10)
    with_bos = perplexity(llama, ids, seqlen=10, bos_token_id=1)
    assert (plain.n_windows, plain.n_tokens) == (10, 90)
    assert (with_bos.n_windows, with_bos.n_tokens) == (11, 99)  # 100 // 9 windows, 9 targets each
    assert plain.ppl != pytest.approx(with_bos.ppl)


def test_logits_are_chunked_without_changing_the_result(llama, token_ids, monkeypatch):
    whole = perplexity(llama, token_ids, seqlen=128)
    seen_chunks = []
    original = perplexity_module._head_logits

    def recording(model, head, hidden):
        seen_chunks.append(hidden.shape[0])
        return original(model, head, hidden)

    monkeypatch.setattr(perplexity_module, "LOGIT_CHUNK_ELEMENTS", 40 * VOCAB)
    monkeypatch.setattr(perplexity_module, "_head_logits", recording)
    chunked = perplexity(llama, token_ids, seqlen=128)
    assert max(seen_chunks) == 40 and sum(seen_chunks) == chunked.n_tokens + 16  # + the one head check
    assert chunked.ppl == pytest.approx(whole.ppl, rel=1e-6)


def test_max_windows_and_the_progress_callback(llama, token_ids):
    calls = []
    result = perplexity(llama, token_ids, seqlen=32, max_windows=3, on_window=lambda *args: calls.append(args))
    assert result.n_windows == 3 and result.n_tokens == 3 * 31
    assert [(done, total) for done, total, _ in calls] == [(1, 3), (2, 3), (3, 3)]
    assert calls[-1][2] == pytest.approx(result.ppl)
    assert result.ppl == pytest.approx(naive_perplexity(llama, token_ids, 32, max_windows=3)[0], rel=1e-5)
    with pytest.raises(FrozenInstanceError):
        result.ppl = 1.0


def test_text_shorter_than_a_window_is_a_user_error(llama):
    with pytest.raises(QuantkitError, match="has 20 tokens, fewer than one window of 63"):
        perplexity(llama, torch.arange(20), seqlen=64, bos_token_id=1)
    with pytest.raises(QuantkitError, match="--max-windows"):
        perplexity(llama, torch.arange(200), seqlen=64, max_windows=0)


class _NextTokenOracle(nn.Module):
    """A causal LM for the sequence t -> (t + 1) % V: its head maps token t's one-hot to (t + 1)."""

    def __init__(self, vocab: int, confidence: float = 60.0):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab, model_type="oracle")
        self.embed = nn.Embedding(vocab, vocab, _weight=torch.eye(vocab))
        self.head = nn.Linear(vocab, vocab, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(torch.roll(torch.eye(vocab), 1, dims=0) * confidence)

    def get_decoder(self):
        return lambda input_ids, use_cache=False: SimpleNamespace(last_hidden_state=self.embed(input_ids))

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, use_cache=False):
        return SimpleNamespace(logits=self.head(self.embed(input_ids)))


def test_a_perfect_predictor_scores_one():
    oracle = _NextTokenOracle(VOCAB)
    ids = torch.arange(1000) % VOCAB
    result = perplexity(oracle, ids, seqlen=100)
    assert result.ppl == pytest.approx(1.0, abs=1e-6) and result.n_tokens == 10 * 99
    shuffled = ids[torch.randperm(1000, generator=torch.Generator().manual_seed(0))]
    assert perplexity(oracle, shuffled, seqlen=100).ppl > 1000


def test_gemma_soft_capping_matches_the_model_logits():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, final_logit_softcapping=2.0)
    gemma = Gemma2ForCausalLM(config).eval()
    ids = torch.randint(0, VOCAB, (96,), generator=torch.Generator().manual_seed(1))
    expected = naive_perplexity(gemma, ids, 48, bos_token_id=2)[0]
    assert perplexity(gemma, ids, seqlen=48, bos_token_id=2).ppl == pytest.approx(expected, rel=1e-5)


def test_unknown_logit_post_processing_is_caught(token_ids):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config(vocab_size=VOCAB)).eval()
    model.config.final_logit_softcapping = 0.01  # our path would cap; Llama's own forward does not
    with pytest.raises(RuntimeError, match="differ from the model's own"):
        perplexity(model, token_ids, seqlen=32)


# ---------------------------------------------------------------- tokens and BOS


def _bos_adding(tokenizer):
    from tokenizers import processors

    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)]
    )
    return tokenizer


def test_needs_bos_follows_the_tokenizer():
    assert needs_bos(tiny_tokenizer()) is False  # has a BOS token but does not add it (like SmolLM2)
    assert needs_bos(_bos_adding(tiny_tokenizer())) is True  # like Llama 2/3
    assert needs_bos(tiny_tokenizer(), SimpleNamespace(model_type="gemma2")) is True
    assert needs_bos(SimpleNamespace(bos_token_id=None)) is False


def test_local_txt_follows_the_blank_line_protocol(tmp_path):
    tokenizer = tiny_tokenizer()
    raw = " = Title = \n\n the fox jumps over the dog . \n quantization rounds weights \n"
    path = tmp_path / "test.raw.txt"
    path.write_text(raw)
    expected = tokenizer("\n\n".join(raw.split("\n")), add_special_tokens=False)["input_ids"]
    assert load_eval_tokens(path, tokenizer).tolist() == expected
    assert load_eval_tokens(path, _bos_adding(tiny_tokenizer())).tolist() == expected  # never a BOS inside


def test_local_jsonl_and_errors(tmp_path):
    tokenizer = tiny_tokenizer()
    path = tmp_path / "eval.jsonl"
    path.write_text('{"content": "the fox"}\n{"content": "the dog"}\n')
    expected = tokenizer("the fox\n\nthe dog", add_special_tokens=False)["input_ids"]
    assert load_eval_tokens(path, tokenizer, text_field="content").tolist() == expected
    with pytest.raises(QuantkitError, match="no field 'text'"):
        load_eval_tokens(path, tokenizer)
    with pytest.raises(QuantkitError, match="not found"):
        load_eval_tokens(tmp_path / "absent.txt", tokenizer)
    with pytest.raises(QuantkitError, match="unknown evaluation source 'wikitext9'"):
        load_eval_tokens("wikitext9", tokenizer)


def test_named_source_without_network_names_the_local_file_option(monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("the hub must not be contacted"))
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(text, "hub_reachable", lambda *a, **k: False)
    with pytest.raises(QuantkitError, match="'wikitext2'.*--calib PATH|'wikitext2'.*local file"):
        load_eval_tokens("wikitext2", tiny_tokenizer())


def test_named_wikitext2_reads_the_raw_test_split(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load_dataset(path, name=None, *, split, data_files=None):
        calls.append((path, name, split))
        return datasets.Dataset.from_dict({"text": [" = A = \n", "", " the fox . \n"]})

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(text, "hub_reachable", lambda *a, **k: True)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    tokenizer = tiny_tokenizer()
    ids = load_eval_tokens("wikitext2", tokenizer)
    assert calls == [("Salesforce/wikitext", "wikitext-2-raw-v1", "test")]
    assert ids.tolist() == tokenizer(" = A = \n\n\n\n\n the fox . \n", add_special_tokens=False)["input_ids"]


def test_shared_wikitext_test_text_joins_lines_with_blank_lines():
    if not SHARED_TEST_TEXT.is_file():
        pytest.skip(f"shared WikiText-2 test text not found at {SHARED_TEST_TEXT.resolve()} (../shared beside the repo)")
    documents = text.read_documents(SHARED_TEST_TEXT)
    raw = SHARED_TEST_TEXT.read_text(encoding="utf-8")
    assert len(documents) == raw.count("\n") + 1
    assert text.join_documents(documents) == "\n\n".join(raw.split("\n"))
