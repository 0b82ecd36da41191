"""The KV cache sized from a memory budget: parsing sizes, the slot arithmetic, and the engine built from it."""

from __future__ import annotations

import pytest
import torch

from quantkit.config import QuantkitError
from quantkit.runtime import kv_budget


def test_parse_memory():
    assert kv_budget.parse_memory("4GiB") == 4 << 30
    assert kv_budget.parse_memory("512 MiB") == 512 << 20
    assert kv_budget.parse_memory("2GB") == 2_000_000_000
    assert kv_budget.parse_memory("1.5g") == 1_500_000_000
    assert kv_budget.parse_memory("12345") == 12345
    for bad in ("lots", "4 GiBs", "-1GiB", "0"):
        with pytest.raises(QuantkitError, match="kv-cache-memory"):
            kv_budget.parse_memory(bad)


class _Spec:  # the four numbers plan() reads
    num_layers, num_kv_heads, head_dim = 30, 3, 64


def test_plan_counts_slots_from_the_budget():
    # SmolLM2-135M's shapes: 2 * 30 * 4096 * 3 * 64 * 4 bytes = 180 MiB a slot in float32, 90 MiB in bf16
    per = 2 * 30 * 4096 * 3 * 64
    p = kv_budget.plan(_Spec, 4096, torch.float32, "cpu", max_batch=32)  # the CPU default: 1 GiB
    assert p.slot_bytes == per * 4 and p.slots == (1 << 30) // (per * 4) - 1 == 4
    assert p.total_bytes <= 1 << 30 and "4 slots x 4096 tokens in float32" in p.describe()
    assert kv_budget.plan(_Spec, 4096, torch.bfloat16, "cpu", max_batch=32).slots == 10
    assert kv_budget.plan(_Spec, 4096, torch.bfloat16, "cpu", max_batch=3).slots == 3  # max_batch caps it
    # 512 tokens: 22.5 MiB a slot; 1 GiB holds 45, one of them the scratch slot
    assert kv_budget.plan(_Spec, 512, torch.float32, "cpu", max_batch=64, memory="1GiB").slots == 44
    with pytest.raises(QuantkitError, match="holds no sequence"):
        kv_budget.plan(_Spec, 4096, torch.float32, "cpu", max_batch=8, memory="200MiB")
    big = kv_budget.plan(_Spec, 1 << 20, torch.float32, "cpu", max_batch=8)  # the default never refuses
    assert big.slots == 1 and "raised to one" in big.budget_source
    with pytest.raises(QuantkitError, match="CUDA"):
        kv_budget.plan(_Spec, 4096, torch.float32, "cpu", max_batch=8, fraction=0.5)
    gpu = kv_budget.plan(_Spec, 4096, torch.bfloat16, "cuda", max_batch=1000, free_bytes=10 << 30)
    assert gpu.budget_bytes == int(0.8 * (10 << 30)) and gpu.slots == int(0.8 * (10 << 30)) // (per * 2) - 1


def test_an_fp8_cache_holds_about_twice_the_tokens():
    """e4m3 codes and a float32 scale a token and KV head: 1 + 4/64 bytes a value at head dim 64, against 2."""
    per = 2 * 30 * 4096 * 3
    bf16 = kv_budget.plan(_Spec, 4096, torch.bfloat16, "cpu", max_batch=1000, memory="4GiB")
    fp8 = kv_budget.plan(_Spec, 4096, torch.bfloat16, "cpu", max_batch=1000, memory="4GiB", kv_dtype="fp8")
    assert bf16.slot_bytes == per * 64 * 2 and fp8.slot_bytes == per * (64 + 4)
    assert fp8.slots == (4 << 30) // fp8.slot_bytes - 1 and fp8.slots >= 1.8 * bf16.slots
    assert "fp8" in fp8.describe()
    with pytest.raises(QuantkitError, match="--kv-cache-dtype"):
        kv_budget.plan(_Spec, 4096, torch.bfloat16, "cpu", max_batch=8, kv_dtype="int8")


def test_engine_slots_follow_the_budget(tiny_family):
    from quantkit.runtime.loader import load_engine

    folder, _ = tiny_family("llama")
    spec_bytes = 2 * 2 * 64 * 2 * 16 * 4  # layers, seq, kv heads, head dim, float32: one slot of 64 tokens
    engine = load_engine(str(folder), device="cpu", max_batch=16, max_seq_len=64, kv_cache_memory=5 * spec_bytes)
    assert engine.max_batch == 4 and engine.kv_plan.slots == 4
    assert engine.cache.nbytes() == 5 * spec_bytes <= engine.kv_plan.budget_bytes
    bf16 = load_engine(str(folder), device="cpu", dtype="bfloat16", max_batch=2, max_seq_len=64)
    assert bf16.cache.k[0].dtype == torch.bfloat16  # a 16-bit model keeps a 16-bit cache on the CPU
    fp8 = load_engine(str(folder), device="cpu", max_batch=16, max_seq_len=64, kv_cache_memory=5 * spec_bytes,
                      kv_cache_dtype="fp8")
    # 1 + 4/16 bytes a value at head dim 16 against float32's 4: the budget holds 16 slots, one the scratch slot
    assert fp8.cache.fp8 and fp8.cache.k[0].dtype == torch.float8_e4m3fn and fp8.max_batch == 15
    assert fp8.cache.nbytes() == (fp8.max_batch + 1) * fp8.kv_plan.slot_bytes <= fp8.kv_plan.budget_bytes


def test_serve_command_checks_budget_options_before_loading(tmp_path):
    from typer.testing import CliRunner

    from quantkit.cli.app import app

    runner = CliRunner()
    for args, message in ((["--kv-cache-memory", "lots"], "--kv-cache-memory"),
                          (["--kv-cache-fraction", "1.5"], "--kv-cache-fraction"),
                          (["--kv-cache-memory", "1GiB", "--kv-cache-fraction", "0.5"], "not both"),
                          (["--kv-cache-dtype", "int8"], "--kv-cache-dtype")):
        result = runner.invoke(app, ["serve", str(tmp_path / "no-such-model"), *args])
        assert isinstance(result.exception, QuantkitError) and message in str(result.exception), result.output
