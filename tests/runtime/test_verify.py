"""``quantkit verify``: the pure logits comparison, and the command on a tiny random quantized Llama.

The end-to-end tests run twice over: through a stand-in for the runtime (transformers' decoder behind
the RUNTIME_SPEC function, so the pipeline, table and exit codes are tested without the runtime) and
through the real runtime (``quantkit.runtime.loader``; skipped, with the reason, where it is missing).
A corrupted path (one layer's scales scaled in the reference path only) must fail with exit 1.
"""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch

from quantkit.config import QuantkitError
from quantkit.tools import verify as verify_mod
from quantkit.tools.verify import Tolerance, compare_logits, default_tolerance

HAS_RUNTIME = importlib.util.find_spec("quantkit.runtime.loader") is not None
needs_runtime = pytest.mark.skipif(not HAS_RUNTIME, reason="quantkit.runtime.loader (the runtime engineer's "
                                   "loader, issue 22) is not in this tree yet")

# -- the pure core --------------------------------------------------------------------------------


def test_identical_logits_agree_exactly():
    logits = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(0))
    c = compare_logits(logits, logits.clone())
    assert c.n_positions == 15 and c.max_abs_err == c.mean_abs_err == c.rel_err == 0
    assert c.top1_agreement == c.top1_with_ties(Tolerance(1e-6)) == 1 and c.n_nonfinite == 0 and not c.flip_gaps
    assert c.problems(Tolerance(1e-6, 1.0)) == []


def test_errors_match_their_definitions():
    ref = torch.tensor([[1.0, 2.0, 3.0], [0.0, -1.0, 4.0]])
    test = ref + torch.tensor([[0.0, 0.5, 0.0], [0.125, 0.0, 0.0]])
    c = compare_logits(test.to(torch.bfloat16), ref)  # bf16 represents these exactly
    assert c.max_abs_err == pytest.approx(0.5) and c.mean_abs_err == pytest.approx(0.625 / 6)
    assert c.rel_err == pytest.approx((0.5**2 + 0.125**2) ** 0.5 / ref.norm().item(), rel=1e-6)
    assert c.top1_agreement == 1
    assert c.problems(Tolerance(max_rel_err=0.05))[0].startswith("relative error")


def test_top1_flip_forgiven_only_at_a_tie():
    ref = torch.tensor([[5.0, 4.9, 0.0], [5.0, 1.0, 0.0]])
    # Row 0: the paths swap two tokens 0.1 apart (2.5% of the row's RMS logit): a tie at 5% tolerance.
    # Row 1: a 4-logit gap (99% of the RMS): a real disagreement.
    test = torch.tensor([[4.9, 5.0, 0.0], [1.0, 5.0, 0.0]])
    c = compare_logits(test, ref)
    assert c.top1_agreement == 0 and len(c.flip_gaps) == 2
    assert c.top1_with_ties(Tolerance(max_rel_err=0.05)) == 0.5
    assert c.top1_with_ties(Tolerance(max_rel_err=0.01)) == 0.0  # 2.5% is no tie when 1% error is allowed
    assert any("top-1 agreement 50.0%" in p for p in c.problems(Tolerance(max_rel_err=0.05, min_top1=0.9)))


def test_nonfinite_and_shape_mismatch():
    ref = torch.zeros(2, 4)
    test = ref.clone()
    test[1, 2] = float("nan")
    c = compare_logits(test, ref + 1)
    assert c.n_nonfinite == 1 and "non-finite" in c.problems(Tolerance(1.0))[0]
    with pytest.raises(ValueError, match="same shape"):
        compare_logits(torch.zeros(2, 4), torch.zeros(2, 5))


def test_greedy_tokens_against_reference_argmax():
    from quantkit.tools.verify import compare_greedy

    ref = torch.tensor([[3.0, 1.0, 0.0], [1.0, 1.02, 0.0], [0.0, 0.0, 5.0]])
    exact = compare_greedy(torch.tensor([0, 1, 2]), ref)
    assert exact.n_exact == 3 and exact.first_disagreement is None and exact.agreement(Tolerance(1e-3)) == 1
    # Token 1 picks the runner-up 0.02 below the best (a tie at 5% tolerance), token 2 a clear loser.
    flips = compare_greedy(torch.tensor([0, 0, 0]), ref)
    assert flips.n_exact == 1 and flips.first_disagreement == 1 and len(flips.flip_gaps) == 2
    assert flips.agreement(Tolerance(0.05)) == pytest.approx(2 / 3)
    assert "first disagreement at generated token 1" in flips.problems(Tolerance(0.05, min_top1=0.9))[0]
    with pytest.raises(ValueError):
        compare_greedy(torch.tensor([0, 1]), ref)


def test_tolerances():
    assert default_tolerance(torch.float32).max_rel_err < default_tolerance(torch.float16).max_rel_err
    assert default_tolerance(torch.float16).max_rel_err < default_tolerance(torch.bfloat16).max_rel_err
    with pytest.raises(QuantkitError, match="--rtol"):
        Tolerance(max_rel_err=0)
    with pytest.raises(QuantkitError, match="--min-top1"):
        Tolerance(max_rel_err=1e-3, min_top1=1.5)


def test_read_prompts(tmp_path):
    file = tmp_path / "p.txt"
    file.write_text("first prompt\n\n  \nline one\\nline two\n")
    assert verify_mod.read_prompts(file) == ["first prompt", "line one\nline two"]
    file.write_text("\n\n")
    with pytest.raises(QuantkitError, match="no prompt"):
        verify_mod.read_prompts(file)
    with pytest.raises(QuantkitError, match="no such file"):
        verify_mod.read_prompts(tmp_path / "missing.txt")


# -- the command on a tiny quantized Llama ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_quantized_llama(tiny_llama_dir, tmp_path_factory):
    from quantkit import api
    from quantkit.config import LoadConfig, QuantScheme

    out = tmp_path_factory.mktemp("verify") / "rtn-w4g32"
    api.quantize(str(tiny_llama_dir), out, method="rtn", scheme=QuantScheme(4, 32, False), load=LoadConfig(device="cpu"))
    return out


def stand_in_loader(model, *, device="auto", dtype="auto", backend="auto", trust_remote_code=False, **_):
    """RUNTIME_SPEC's ``load_runtime_model`` played by transformers' decoder (read by the checkpoint
    module directly, so that a patch of ``api.load_quantized`` touches only the reference path)."""
    from quantkit.checkpoint.save import load_quantized

    net, tokenizer = load_quantized(model, device="cpu", dtype=torch.float32)
    runtime = SimpleNamespace(config=net.config, backend="reference",
                              forward_logits=lambda ids: net(input_ids=ids, use_cache=False).logits.float())
    return runtime, tokenizer


@pytest.fixture(params=["stand-in", pytest.param("runtime", marks=needs_runtime)])
def runtime_path(request, monkeypatch):
    """Extra CLI arguments for the path: the stand-in has no engine, so no greedy decode check."""
    if request.param == "stand-in":
        monkeypatch.setattr(verify_mod, "_runtime_loader", lambda: stand_in_loader)
        return ["--decode-tokens", "0"]
    return ["--decode-tokens", "12"]


def corrupt_reference_scales(monkeypatch):
    """Scale one layer's quantization scales by 1.5 in every model the checkpoint reader returns."""
    import quantkit.checkpoint.read as checkpoint_read

    original = checkpoint_read.load_quantized

    def corrupted(*args, **kwargs):
        net, tokenizer = original(*args, **kwargs)
        layer = net.get_submodule("model.layers.0.self_attn.v_proj")
        layer.scales.mul_(1.5)
        layer.invalidate_cache()
        return net, tokenizer

    monkeypatch.setattr(checkpoint_read, "load_quantized", corrupted)


def run_cli(*args):
    from typer.testing import CliRunner

    from quantkit.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args])


def test_verify_passes_on_agreeing_paths(tiny_quantized_llama, runtime_path):
    result = run_cli("verify", tiny_quantized_llama, "--device", "cpu", "--json", *runtime_path)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and [p["reference"] for p in report["paths"]] == ["transformers"]
    overall = report["paths"][0]["overall"]
    assert overall["n_positions"] == sum(report["prompt_tokens"]) > 0
    assert overall["rel_err"] < 1e-4 and overall["top1_agreement"] == 1.0
    decode = report["paths"][0]["decode"]
    if "12" in runtime_path:  # 12 greedy tokens for each of the 4 built-in prompts, through the real engine
        assert decode["n_tokens"] == 48 and decode["n_exact"] == 48 and decode["first_disagreement"] is None
    else:
        assert decode is None
    human = run_cli("verify", tiny_quantized_llama, "--device", "cpu", *runtime_path)
    assert human.exit_code == 0 and "verify passed" in human.output and "tolerance: rel err <= 1e-03" in human.output


def test_verify_fails_with_exit_1_on_corrupted_scales(tiny_quantized_llama, runtime_path, monkeypatch):
    corrupt_reference_scales(monkeypatch)
    result = run_cli("verify", tiny_quantized_llama, "--device", "cpu", *runtime_path)
    assert result.exit_code == 1, result.output
    assert "FAIL" in result.output and "verify failed against transformers: relative error" in result.output


def test_verify_prompts_file_and_base(tiny_quantized_llama, tiny_llama_dir, tiny_text_file, tmp_path, runtime_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the quick brown fox\nquantization rounds weights\n")
    result = run_cli("verify", tiny_quantized_llama, "--device", "cpu", "--prompts", prompts, "--base",
                     tiny_llama_dir, "--data", tiny_text_file, "--seqlen", "32", "--max-windows", "2", "--json", *runtime_path)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert len(report["prompt_tokens"]) == 2 and len(report["paths"][0]["per_prompt"]) == 2
    base = report["base"]
    assert base["n_windows"] == 2 and base["kld"]["n_tokens"] == 2 * 31
    # A random model is near-uniform either way; 4-bit RTN moves it a little, never to nothing.
    assert 0 < base["kld"]["mean_kld"] < 1 and 0.5 < base["ppl_quant"] / base["ppl_base"] < 2


def test_runtime_reference_on_the_reference_backend_is_noted(tiny_quantized_llama, monkeypatch):
    monkeypatch.setattr(verify_mod, "_runtime_loader", lambda: stand_in_loader)
    report = verify_mod.verify(str(tiny_quantized_llama), references=("runtime", "transformers"), device="cpu",
                               decode_tokens=0)
    assert report.passed and [p.reference for p in report.paths] == ["runtime", "transformers"]
    assert "compares them with themselves" in report.notes[0]


def test_verify_base_needs_local_data(tiny_quantized_llama, tiny_llama_dir):
    with pytest.raises(QuantkitError, match="--data"):
        verify_mod.verify(str(tiny_quantized_llama), base=str(tiny_llama_dir), device="cpu")
    with pytest.raises(QuantkitError, match="--reference"):
        verify_mod._choose_references(("nonsense",), "reference")
    with pytest.raises(QuantkitError, match="--decode-tokens"):
        verify_mod.verify(str(tiny_quantized_llama), decode_tokens=-1, device="cpu")
