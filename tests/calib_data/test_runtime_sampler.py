"""Self-generated calibration on quantkit's runtime (``calib_data.runtime_sampler``), on the CPU.

The runtime's reference backend decodes a tiny random Llama eagerly; the CUDA path differs only in the
backend (kernels) and the graph replay of the same step. What is checked: samples of the right shape and
range, starting with the start token, each sampled token inside the top-k / top-p set of the transformers
model's own distribution at its position (the runtime computes the same model), one result per seed, the
cache keyed apart from the transformers sampler's, and which sampler ``auto`` picks, with its reason.
"""

from __future__ import annotations

import pytest
import torch

from quantkit.calib_data import runtime_sampler
from quantkit.calib_data.runtime_sampler import batch_for_memory, choose_sampler, runtime_blocker
from quantkit.calib_data.self_generated import generate_calibration, start_token_id
from quantkit.config import QuantkitError
from tests.conftest import tiny_llama_config

TOP_K, TOP_P = 50, 0.95


def _allowed(logits: torch.Tensor) -> torch.Tensor:
    """Boolean ``[..., V]``: the tokens ``sample_next`` can draw (top-k, then the top-p prefix), with a
    little slack at the top-p edge for float differences between the runtime and transformers."""
    probs = torch.softmax(logits.float(), dim=-1)
    top, ids = torch.topk(probs, TOP_K, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    before = torch.cumsum(top, dim=-1) - top
    keep = before < TOP_P + 1e-4
    allowed = torch.zeros_like(probs, dtype=torch.bool)
    return allowed.scatter(-1, ids, keep)


def test_runtime_samples_are_valid_and_deterministic(model, tokenizer, tmp_path):
    progress = []
    samples = generate_calibration(model, tokenizer, nsamples=5, seqlen=24, seed=0, sampler="runtime",
                                   cache_dir=tmp_path / "a", on_progress=lambda d, t: progress.append((d, t)))
    assert samples.shape == (5, 24) and samples.dtype == torch.long and samples.device.type == "cpu"
    assert (samples[:, 0] == start_token_id(tokenizer, model.config)).all()
    assert 0 <= samples.min() and samples.max() < len(tokenizer)
    assert len({tuple(r) for r in samples.tolist()}) == 5
    assert progress[-1] == (5 * 23, 5 * 23) and [d for d, _ in progress] == sorted(d for d, _ in progress)
    with torch.no_grad():
        logits = model(input_ids=samples).logits  # [5, 24, V]: position t predicts token t + 1
    allowed = _allowed(logits[:, :-1])
    assert allowed.gather(-1, samples[:, 1:, None]).all()
    again = generate_calibration(model, tokenizer, nsamples=5, seqlen=24, seed=0, sampler="runtime",
                                 cache_dir=tmp_path / "b")
    assert torch.equal(samples, again)
    other = generate_calibration(model, tokenizer, nsamples=5, seqlen=24, seed=1, sampler="runtime",
                                 cache_dir=tmp_path / "b")
    assert not torch.equal(samples, other)


def test_runtime_batches_give_the_whole_set(model):
    """Fewer sequences at once than asked for: the batches are concatenated in order."""
    out = runtime_sampler.sample_on_runtime(
        model, 1, nsamples=5, seqlen=10, seed=3, batch_size=2, temperature=1.0, top_k=TOP_K, top_p=TOP_P,
        device=torch.device("cpu"), backend="reference", cuda_graphs=False)
    assert out.shape == (5, 10) and (out[:, 0] == 1).all()


def test_runtime_cache_hit_and_separate_keys(model, tokenizer, tmp_path, monkeypatch):
    first = generate_calibration(model, tokenizer, nsamples=3, seqlen=12, seed=0, sampler="runtime", cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.pt"))) == 1

    def fail(*args, **kwargs):
        raise AssertionError("a cache hit must not sample")

    monkeypatch.setattr(runtime_sampler, "sample_on_runtime", fail)
    hit = generate_calibration(model, tokenizer, nsamples=3, seqlen=12, seed=0, sampler="runtime", cache_dir=tmp_path)
    assert torch.equal(hit, first)
    # the transformers sampler's samples are another entry, even with the same batch size
    generate_calibration(model, tokenizer, nsamples=3, seqlen=12, seed=0, batch_size=3, sampler="transformers",
                         cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.pt"))) == 2


def test_auto_selection_and_reasons(model, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    choice = choose_sampler(model, 4, 16)
    assert not choice.runtime and choice.device.type == "cpu" and choice.reason == "no CUDA device"
    forced = choose_sampler(model, 4, 16, "runtime")
    assert forced.runtime and forced.device.type == "cpu" and forced.batch == 4
    assert not choose_sampler(model, 4, 16, "transformers").runtime
    cuda = torch.device("cuda", 0)
    assert "16-bit" in runtime_blocker(model, cuda)  # float32 weights: the kernels take bf16/fp16
    assert runtime_blocker(model.to(torch.bfloat16), cuda) is None
    assert runtime_blocker(model, torch.device("cpu")) is None


def test_unsupported_family_falls_back(monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64)).eval()
    assert "model_type is 'gpt2'" in runtime_blocker(gpt2, torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(QuantkitError, match="cannot run on quantkit's runtime"):
        choose_sampler(gpt2, 2, 8, "runtime")


def test_batch_for_memory():
    gib = 2**30
    # an 8B model's 2048-token KV cache is 256 MiB a sequence (+ 3 MiB of logits): with 6 GiB kept free,
    # 128 fit in 100 GiB and 15 in 10 GiB
    per_seq = 2 * 32 * 2048 * 8 * 128 * 2
    assert batch_for_memory(100 * gib, per_seq, 128256, 128) == 128
    assert batch_for_memory(10 * gib, per_seq, 128256, 128) == 15
    assert batch_for_memory(0, per_seq, 128256, 128) == 1


@pytest.mark.gpu
def test_cuda_graph_sampler_valid_and_deterministic(tokenizer, tmp_path):
    """On CUDA ``auto`` takes the runtime (kernels backend, one captured step); the samples stay inside
    the transformers model's top-k / top-p sets and repeat per seed."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=len(tokenizer), max_position_embeddings=128))
    model = model.to(torch.bfloat16).eval()
    choice = choose_sampler(model, 6, 40)
    assert choice.runtime and choice.device.type == "cuda" and choice.batch == 6
    first = generate_calibration(model, tokenizer, nsamples=6, seqlen=40, seed=0, cache_dir=tmp_path / "a")
    again = generate_calibration(model, tokenizer, nsamples=6, seqlen=40, seed=0, cache_dir=tmp_path / "b")
    assert torch.equal(first, again) and first.shape == (6, 40)
    with torch.no_grad():
        logits = model.float()(input_ids=first).logits
    inside = _allowed(logits[:, :-1]).gather(-1, first[:, 1:, None])
    assert inside.float().mean() > 0.99  # bf16 kernels against the float32 model: a near-edge token may differ
