"""Rank planning: window shards, solve splitting and bin-packing (pure functions, no processes)."""

from __future__ import annotations

import pytest
import torch

from quantkit.config import QuantkitError, QuantScheme
from quantkit.distributed.comm import LOCAL
from quantkit.distributed.launch import needs_launch, setup, torchrun_command
from quantkit.distributed.plan import assign_owners, plan_solves, shard_windows
from quantkit.methods.gptq import GPTQConfig, gptq_quantize


@pytest.mark.parametrize("n, bs, world", [(8, 2, 2), (128, 8, 8), (10, 3, 3), (7, 2, 4), (5, 8, 1)])
def test_shards_are_contiguous_whole_batches_covering_every_window(n, bs, world):
    shards = [shard_windows(n, bs, world, r) for r in range(world)]
    assert shards[0].start == 0 and shards[-1].stop == n
    for a, b in zip(shards, shards[1:]):
        assert a.stop == b.start
    for s in shards:
        assert s.stop > s.start and s.start % bs == 0  # every rank works; batch boundaries kept
    batches = [-(-(s.stop - s.start) // bs) for s in shards]
    assert max(batches) - min(batches) <= 1  # balanced to a batch


def test_too_few_batches_for_the_ranks_is_a_clear_error():
    with pytest.raises(QuantkitError, match="--batch-size"):
        shard_windows(8, 8, 2, 0)


def test_one_rank_owns_every_solve_whole_and_in_order():
    shapes = [(3072, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]
    items = plan_solves(shapes, 1)
    assert [(it.key, it.row_start, it.row_stop, it.owner) for it in items] == [
        (k, 0, rows, 0) for k, (rows, _) in enumerate(shapes)]


def test_solves_are_balanced_and_huge_ones_cut_by_rows():
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # Llama-3-8B's four stacks
    for world in (2, 4, 8):
        items = plan_solves(shapes, world)
        for k, (rows, _) in enumerate(shapes):  # the parts of each stack tile its rows exactly
            parts = sorted((it.row_start, it.row_stop) for it in items if it.key == k)
            assert parts[0][0] == 0 and parts[-1][1] == rows
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        load = [sum(it.cost for it in items if it.owner == r) for r in range(world)]
        assert min(load) > 0
        fair = sum(it.cost for it in items) / world
        assert max(load) <= 4 / 3 * max(fair, max(it.cost for it in items))  # greedy bin-packing's bound


def test_a_single_solve_is_spread_over_every_rank_down_to_min_rows():
    items = plan_solves([(1024, 64)], 4, min_rows=256)
    assert sorted(it.owner for it in items) == [0, 1, 2, 3]
    assert plan_solves([(300, 64)], 4, min_rows=256)[0].row_stop == 300  # too small to cut


def test_greedy_bin_packing_puts_the_largest_first_on_the_least_loaded_rank():
    assert assign_owners([1.0, 5.0, 3.0, 3.0], 2) == [0, 0, 1, 1]  # 5 | 3, 3 | then 1 to the lighter
    assert assign_owners([2.0, 2.0], 1) == [0, 0]


def test_gptq_rows_solved_apart_equal_the_stack_solved_whole():
    """What makes cutting a stack between ranks safe: GPTQ's output rows are independent."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g)
    x = torch.randn(512, 64, generator=g)
    H = 2 * x.t() @ x / 512
    for config in (GPTQConfig(), GPTQConfig(desc_act=True)):
        whole = gptq_quantize(w, H, QuantScheme(4, 32, False), config)
        parts = [gptq_quantize(w[a:b], H, QuantScheme(4, 32, False), config) for a, b in ((0, 40), (40, 96))]
        codes = torch.cat([p.codes for p in parts])
        # Row blocks go through matrix products of other shapes: allow a rare one-step flip.
        assert (codes != whole.codes).float().mean() <= 0.01
        assert torch.equal(parts[0].g_idx, whole.g_idx)


def test_local_comm_returns_its_inputs():
    t = torch.arange(4.0)
    assert LOCAL.all_reduce_sum(t) is t and LOCAL.broadcast(t, 0) is t and LOCAL.reduce_sum(t, 0) is t
    assert LOCAL.broadcast_object({"a": 1}, 0) == {"a": 1} and LOCAL.all_gather_rows(t)[0] is t


def test_gpus_outside_torchrun(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert needs_launch(2) and not needs_launch(1) and not needs_launch(None)
    with pytest.raises(QuantkitError, match="--gpus"):
        needs_launch(0)
    with pytest.raises(QuantkitError, match="torchrun"):
        setup(2, "cpu")
    assert setup(None, "cpu") == (LOCAL, "cpu")


def test_torchrun_command_has_no_restarts_and_forwards_arguments():
    cmd = torchrun_command(["-m", "quantkit.cli.app"], ["gptq", "m", "--gpus", "3"], 3, "/tmp/x")
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "3" and cmd[cmd.index("--max-restarts") + 1] == "0"
    assert cmd[-6:] == ["-m", "quantkit.cli.app", "gptq", "m", "--gpus", "3"]
