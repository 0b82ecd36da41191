"""Tokens per expert per layer, from the walker's per-layer stats (``routed_tokens`` of every expert linear),
and their plot for ``--save-stats`` (matplotlib, imported only when plotting)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_EXPERT_GATE = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|w1)$")


def expert_tokens(layer_stats: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{layer prefix: {"routed": [tokens of expert e], "calibration": [...], "rtn_fallback": [e, ...]}}``
    for every layer with experts (empty for a dense model)."""
    out: dict[str, dict[str, Any]] = {}
    for row in layer_stats:
        found: dict[int, dict[str, float]] = {}
        for name, stats in row.get("linears", {}).items():
            m = _EXPERT_GATE.match(name)
            if m and "routed_tokens" in stats:
                found[int(m.group(2))] = stats
        if found:
            n = max(found) + 1
            out[row["prefix"]] = {
                "routed": [int(found.get(e, {}).get("routed_tokens", 0)) for e in range(n)],
                "calibration": [int(found.get(e, {}).get("calib_tokens", 0)) for e in range(n)],
                "rtn_fallback": [e for e in range(n) if found.get(e, {}).get("fallback_rtn")],
            }
    return out


def plot_expert_tokens(layer_stats: list[dict[str, Any]], path: str | Path, title: str = "") -> Path | None:
    """A heat map of routed calibration tokens per expert (x) and layer (y); RTN-fallback experts marked."""
    tokens = expert_tokens(layer_stats)
    if not tokens:
        return None
    from matplotlib.figure import Figure

    rows = list(tokens.values())
    width = max(len(r["routed"]) for r in rows)
    grid = [r["routed"] + [0] * (width - len(r["routed"])) for r in rows]
    fig = Figure(figsize=(min(4 + width * 0.08, 16), 2 + len(rows) * 0.15), dpi=120)
    ax = fig.subplots()
    im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis")
    for y, r in enumerate(rows):
        for e in r["rtn_fallback"]:
            ax.plot(e, y, "rx", markersize=4)
    ax.set_xlabel("expert")
    ax.set_ylabel("decoder layer")
    ax.set_title((title + "  " if title else "") + "routed calibration tokens per expert (x: RTN fallback)")
    fig.colorbar(im, ax=ax, label="tokens")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path
