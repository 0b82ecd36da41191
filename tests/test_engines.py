"""The table of which vLLM / SGLang kernel serves which checkpoint (docs/serving.md, "Other engines")."""

from __future__ import annotations

import pytest

from quantkit.checkpoint.engines import CheckpointTraits, describe, engine_kernels


@pytest.mark.parametrize("group_size,vllm", [
    (128, "Machete on Hopper, Marlin elsewhere"),
    (64, "Machete on Hopper, Marlin elsewhere"),
    (-1, "Machete on Hopper, Marlin elsewhere"),
    (32, "gptq_marlin: Marlin"),  # Machete takes -1/64/128 only
])
def test_symmetric_gptq_gets_marlin_or_machete(group_size, vllm):
    kernels = engine_kernels(CheckpointTraits(bits=4, group_size=group_size, sym=True))
    assert vllm in kernels["vLLM"]
    assert kernels["SGLang"] == "gptq_marlin: Marlin"


def test_act_order_is_served_by_marlin_and_said():
    kernels = engine_kernels(CheckpointTraits(bits=4, group_size=128, sym=True, act_order=True))
    assert kernels["vLLM"].endswith("act-order") and kernels["SGLang"].endswith("act-order")


@pytest.mark.parametrize("traits,why", [
    (CheckpointTraits(bits=4, group_size=64, sym=False), "asymmetric"),
    (CheckpointTraits(bits=3, group_size=128, sym=True), "3-bit"),
    (CheckpointTraits(bits=2, group_size=128, sym=True), "2-bit"),
    (CheckpointTraits(bits=4, group_size=256, sym=True), "group size 256"),
])
def test_no_marlin_falls_back_to_gptq_gemm(traits, why):
    for kernel in engine_kernels(traits).values():
        assert kernel.startswith("gptq: gptq_gemm") and "float16 only" in kernel and why in kernel


def test_eight_bit_symmetric_is_marlin():
    assert "Marlin" in engine_kernels(CheckpointTraits(bits=8, group_size=128, sym=True))["SGLang"]


def test_partial_groups_are_refused_everywhere():
    kernels = engine_kernels(CheckpointTraits(bits=4, group_size=128, sym=True, partial_groups=True))
    assert all(kernel.startswith("refused") for kernel in kernels.values())


def test_awq_layout_gets_awq_marlin():
    kernels = engine_kernels(CheckpointTraits(bits=4, group_size=64, sym=False, layout="awq"))
    assert all(kernel.startswith("awq_marlin") for kernel in kernels.values())
    with pytest.raises(ValueError):
        CheckpointTraits(bits=4, group_size=64, sym=False, layout="exl2")


def test_describe_one_line_per_engine_under_80_columns():
    lines = describe(CheckpointTraits(bits=4, group_size=64, sym=False))
    assert [line.split()[0] for line in lines] == ["vLLM", "SGLang"]
    assert max(map(len, lines)) <= 80
