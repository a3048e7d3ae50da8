"""The routing table: per leaf, its path, shape, matrix view, optimizer and why (pure Python).

Read it once for every new model: it shows what :func:`lwjax.routing.route_leaves`
made of each leaf, and why.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from lwjax.leaf_route import LeafRoute


def routing_table(routes: Iterable[LeafRoute]) -> list[tuple[str, str, str, str, str]]:
    """Per leaf: path, shape, matrix view, optimizer and why, as strings.

    The view is the batch of matrices Muon sees, e.g. ``8 × [64, 128]``.
    """
    rows = []
    for r in routes:
        optimizer = "Muon" if r.is_muon else ("AdamW (tied)" if r.is_tied else "AdamW")
        rows.append((r.path, str(list(r.shape)), _matrix_view(r), optimizer, r.why))
    return rows


def _matrix_view(route: LeafRoute) -> str:
    """The batch of matrices Muon sees and how tensor parallelism splits each, or ``-``."""
    if not route.is_muon:
        return "-"
    batch = (route.view or route.shape)[: route.stack_dims]
    count = f"{math.prod(batch)} × " if batch else ""
    view = f"{count}{list(route.full_param_shape)}"
    for side, axes in zip(("rows", "cols"), route.tensor_split):
        if axes:
            view += f" ({side} / {math.prod(route.tensor_sizes[a] for a in axes)})"
    return view


def format_routing_table(routes: Iterable[LeafRoute]) -> str:
    """:func:`routing_table` as aligned plain text with a header."""
    rows = [("path", "shape", "matrix view", "optimizer", "why"), *routing_table(routes)]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths)) + "  " + row[4] for row in rows
    )
