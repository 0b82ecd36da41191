"""Two gloo ranks on the CPU: the same checkpoint as one process; a failed rank ends the run cleanly.

Each test starts torchrun with 2 processes on a tiny Llama (seconds of work; most of the time is
two Python processes importing torch and transformers).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quantkit.config import QuantkitError
from quantkit.distributed.launch import launch
from quantkit.pack import unpack_gptq
from quantkit.primitives import dequantize

WORKER = Path(__file__).with_name("_rank_worker.py")
sys.path.insert(0, str(WORKER.parent))
from _rank_worker import CASES, MOE_CASES, quantize_case  # noqa: E402

# Collectives give up after this long: a rank waiting on a dead peer ends well inside the test's bound.
ENV = {"QUANTKIT_DIST_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}
BOUND_S = 300


def _run(model: Path, text: Path, out: Path, mode: str, env: dict[str, str] | None = None) -> None:
    launch([str(WORKER)], [str(model), str(text), str(out), mode], 2, timeout_s=BOUND_S, env={**ENV, **(env or {})})


def _codes(t: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[out, in]`` and dequantized float32 weight of linear ``name`` in a GPTQ-layout file."""
    scales = t[f"{name}.scales"].float()
    g_idx = t[f"{name}.g_idx"]
    codes, zeros = unpack_gptq(t[f"{name}.qweight"], t[f"{name}.qzeros"], 4, g_idx.numel(), scales.shape[1])
    return codes, dequantize(codes, scales, zeros, g_idx)


def test_two_ranks_write_the_checkpoint_one_process_writes(tiny_llama_dir, tiny_text_file, tmp_path):
    """GPTQ (true-sequential with stacks cut by rows between the ranks, act-order, all Hessians at once)
    and AWQ: every tensor equal, except where the order of floating-point sums differs.

    The ranks sum Hessians and activation statistics over their own windows and then add the two
    partial sums; one process adds window after window. The results differ in the last bits, which
    can flip a code that sits on a rounding midpoint (and GPTQ then pushes a slightly different error
    on). So: codes may differ in at most 1 % of positions, dequantized weights by at most 3 % (relative
    Frobenius norm), and everything else (g_idx, embeddings, norms, the config) must be equal.
    """
    _run(tiny_llama_dir, tiny_text_file, tmp_path / "two", "ok")
    _compare_one_and_two(tiny_llama_dir, tiny_text_file, tmp_path, "cpu")


@pytest.mark.gpu
def test_two_gloo_ranks_sharing_one_gpu_equal_one_process(tiny_llama_dir, tiny_text_file, tmp_path):
    """The same cases with the work on one CUDA device that both ranks share (gloo stages the
    collectives through host memory): the same checkpoint as one process on that device, within the
    tolerance of the CPU test above (the same reason: the order of the sums)."""
    _run(tiny_llama_dir, tiny_text_file, tmp_path / "two", "ok",
         env={"QUANTKIT_TEST_DEVICE": "cuda", "QUANTKIT_DIST_BACKEND": "gloo"})
    _compare_one_and_two(tiny_llama_dir, tiny_text_file, tmp_path, "cuda")


def test_two_ranks_quantize_moe_experts_as_one_process(tiny_text_file, tmp_path):
    """A tiny Qwen2-MoE (8 experts, top-2, a shared expert) under 2 ranks: GPTQ with every token through every
    expert and with routed tokens only (where an expert token floor sends some experts to RTN: the ranks must
    count every rank's tokens to agree with one process on which), and AWQ: the checkpoint one process writes,
    within the tolerance above. In routed mode some experts see fewer tokens than their 64 input features, so
    their Hessians are singular but for the damping, and the last bits of the sums move more codes there: up
    to 2 % of codes and 5 % of the weight (an expert sent to RTN by one run and solved by the other would
    differ in far more)."""
    from tests.conftest import tiny_tokenizer
    from tests.moe.moe_tiny import tiny_moe

    tokenizer = tiny_tokenizer()
    folder = tmp_path / "moe_model"
    tiny_moe("qwen2_moe", vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _run(folder, tiny_text_file, tmp_path / "two", "moe")
    _compare_one_and_two(folder, tiny_text_file, tmp_path, "cpu", cases=MOE_CASES, n_linears=2 * (4 + 3 + 3 * 8),
                         tolerance={"moe_routed": (0.02, 0.05)})


def _assert_group_destroyed_before_finalization(two: Path, backend_thread: str) -> None:
    """Each rank's process group is really destroyed by quantkit's exit handler: its backend's threads (named
    ``backend_thread``, seen while the group worked) are gone before the interpreter finalizes. A group kept alive
    past that handler (transformers imports ``torch.distributed.nn.functional``, whose default arguments bind
    the group) is destroyed during finalization, where a gloo worker freeing a tensor aborts the rank (SIGABRT)."""
    for rank in range(2):
        seen = json.loads((two / f"threads_rank{rank}.json").read_text())
        if seen["during"] is None:
            continue  # no /proc: thread names cannot be read here
        assert any(backend_thread in name for name in seen["during"]), (rank, seen)
        assert not any(backend_thread in name for name in seen["exit"]), (rank, seen)


def _compare_one_and_two(tiny_llama_dir: Path, tiny_text_file: Path, tmp_path: Path, device: str, cases=CASES,
                         n_linears: int = 14, tolerance: dict | None = None) -> None:
    assert json.loads((tmp_path / "two" / "ranks.json").read_text()) == {"world_size": 2}
    _assert_group_destroyed_before_finalization(tmp_path / "two", "gloo")
    exact = []
    for name in cases:
        quantize_case(str(tiny_llama_dir), str(tiny_text_file), str(tmp_path / "one" / name), name, device=device)
        one = load_file(tmp_path / "one" / name / "model.safetensors")
        two = load_file(tmp_path / "two" / name / "model.safetensors")
        assert one.keys() == two.keys()
        linears = sorted(k.removesuffix(".qweight") for k in one if k.endswith(".qweight"))
        assert len(linears) == n_linears
        codes_tol, weight_tol = (tolerance or {}).get(name, (0.01, 0.03))
        for lin in linears:
            c1, w1 = _codes(one, lin)
            c2, w2 = _codes(two, lin)
            assert (c1 != c2).float().mean() <= codes_tol, (name, lin)
            assert (w1 - w2).norm() <= weight_tol * w1.norm(), (name, lin)
            assert torch.equal(one[f"{lin}.g_idx"], two[f"{lin}.g_idx"]), (name, lin)
        packed = {f"{lin}.{s}" for lin in linears for s in ("qweight", "qzeros", "scales", "g_idx")}
        for key in one.keys() - packed:
            assert torch.equal(one[key], two[key]), (name, key)
        exact.append(all(torch.equal(one[k], two[k]) for k in one))
        cfg1, cfg2 = (json.loads((tmp_path / d / name / "config.json").read_text()) for d in ("one", "two"))
        for cfg in (cfg1, cfg2):
            cfg["quantization_config"]["quantkit"].pop("layer_seconds")  # wall time, the one thing that differs
        assert cfg1 == cfg2
    print("bitwise equal per case:", dict(zip(cases, exact)))


@pytest.mark.parametrize("mode, says", [("raise", "RuntimeError: injected failure on rank 1"),
                                        ("kill", "died without an error report")])
def test_a_failed_rank_ends_the_run_with_a_clear_error_and_no_output(tiny_llama_dir, tiny_text_file, tmp_path,
                                                                    mode, says):
    t0 = time.perf_counter()
    with pytest.raises(QuantkitError) as info:
        _run(tiny_llama_dir, tiny_text_file, tmp_path, mode)
    assert time.perf_counter() - t0 < BOUND_S
    message = str(info.value)
    assert "2-rank run failed" in message and says in message, message
    if mode == "raise":  # the rank that failed is named before any rank that only saw a collective fail
        assert message.splitlines()[1].startswith("  rank 1: RuntimeError"), message
    assert not (tmp_path / "gptq").exists()  # nothing that looks like a checkpoint
