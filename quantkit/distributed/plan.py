"""Who does what: calibration windows per rank and solve work per rank (pure functions of shapes).

Every rank computes the same plan from the same shapes, so no plan is ever communicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from quantkit.config import QuantkitError


def shard_windows(n_windows: int, batch_size: int, world_size: int, rank: int) -> slice:
    """Rank ``rank``'s calibration windows: a contiguous run of whole batches of ``batch_size``.

    Whole batches keep every batch boundary where the single-process run has it, so per-batch
    sampling (AWQ's clip tokens) picks the same tokens whatever the number of ranks.
    """
    if batch_size < 1:
        raise QuantkitError(f"--batch-size must be positive, got {batch_size}")
    n_batches = math.ceil(n_windows / batch_size)
    if n_batches < world_size:
        raise QuantkitError(
            f"{n_windows} calibration windows in batches of {batch_size} make {n_batches} batches, fewer than the "
            f"{world_size} ranks: use --batch-size {max(1, n_windows // world_size)} or fewer, or fewer --gpus")
    base, extra = divmod(n_batches, world_size)
    first = rank * base + min(rank, extra)
    count = base + (1 if rank < extra else 0)
    return slice(first * batch_size, min(n_windows, (first + count) * batch_size))


@dataclass(frozen=True)
class SolveItem:
    """Rows ``[row_start, row_stop)`` of solve ``key`` (a stack of linears sharing one input), on ``owner``."""

    key: int
    row_start: int
    row_stop: int
    owner: int
    cost: float


# A GPTQ solve takes ``in`` sequential column steps (a dozen small kernels each, whose launch cost
# does not depend on the rows) plus ~``2 in^2 rows`` flops of updates: cost ~ in * (rows + _LAUNCH_ROWS),
# the rows a column step could update in the time of its launches (order of magnitude on an H100/H200).
_LAUNCH_ROWS = 4096


def solve_cost(rows: int, in_features: int) -> float:
    return float(in_features) * (rows + _LAUNCH_ROWS)


def plan_solves(shapes: list[tuple[int, int]], world_size: int, min_rows: int = 256) -> list[SolveItem]:
    """Split solves ``shapes[k] = (rows, in_features)`` into items and give each an owner rank.

    Owners come from greedy bin-packing (largest item first, to the least loaded rank). Before that,
    the largest item is cut in two by output rows (GPTQ solves rows independently), down to
    ``min_rows`` rows, while a rank would otherwise idle, or while it costs more than a rank's fair
    share and cutting saves at least a quarter of it (``rows >= _LAUNCH_ROWS``: the column steps'
    launch cost is not cut). With one rank nothing is cut and rank 0 owns everything, in order.
    """
    items = [(k, 0, rows, in_f) for k, (rows, in_f) in enumerate(shapes)]
    if world_size > 1:
        total = sum(solve_cost(r1 - r0, i) for _, r0, r1, i in items)
        for _ in range(64 * world_size):
            items.sort(key=lambda it: (-solve_cost(it[2] - it[1], it[3]), it[0], it[1]))
            k, r0, r1, in_f = items[0]
            idle = len(items) < world_size
            worth = solve_cost(r1 - r0, in_f) > total / world_size and r1 - r0 >= _LAUNCH_ROWS
            if not (idle or worth) or r1 - r0 < 2 * min_rows:
                break
            mid = r0 + (r1 - r0) // 2
            items[0:1] = [(k, r0, mid, in_f), (k, mid, r1, in_f)]
    items.sort(key=lambda it: (-solve_cost(it[2] - it[1], it[3]), it[0], it[1]))
    load = [0.0] * world_size
    planned = []
    for k, r0, r1, in_f in items:
        owner = min(range(world_size), key=lambda r: (load[r], r))
        cost = solve_cost(r1 - r0, in_f)
        load[owner] += cost
        planned.append(SolveItem(k, r0, r1, owner, cost))
    return sorted(planned, key=lambda it: (it.key, it.row_start))


def assign_owners(costs: list[float], world_size: int) -> list[int]:
    """Owner rank of each job (greedy bin-packing, largest first; ties to the lower index and rank)."""
    load = [0.0] * world_size
    owners = [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners[j] = r
        load[r] += costs[j]
    return owners
