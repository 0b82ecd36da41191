"""The Pareto front of a batch: which jobs no other job beats on both size and quality (the report marks them,
the plot draws them)."""

from __future__ import annotations

from typing import Any

# Sizes on disk of checkpoints with the same bits and groups differ by a few hundred bytes of metadata (the
# quantization config each method writes); closer than this share of x, two points count as the same size.
SAME_X_REL = 1e-3


def pareto_front(points: list[tuple[float, float]], same_x_rel: float = SAME_X_REL) -> list[int]:
    """Indices of the points no other point dominates (lower is better on both coordinates; x values within
    ``same_x_rel`` of each other are one x, so a few bytes less on disk do not put a worse model on the front)."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(ox <= x * (1 + same_x_rel) and oy <= y and (ox < x * (1 - same_x_rel) or oy < y)
                        for j, (ox, oy) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return front


def quality_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The metric columns a front is drawn for: every perplexity column, then mean KL."""
    return [c for c in rows[0] if c.startswith("ppl ")] + ["kl_mean"] if rows else []
