"""The routing table: per leaf, path, shape, matrix view, optimizer, why and a note (pure Python).

Read it once for every new model: it shows what :func:`lwjax.routing.route_leaves`
made of each leaf, and why. The note says where one leaf holds several projections:
a fused QKV matrix whose ``qkv_split`` orthogonalizes q, k and v apart, or a fused
kernel (``kv_einsum``, ``qkv_einsum``, ``gating_einsum``, ``gate_up_proj``) kept as
one matrix.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from lwjax import dims as dims_lib
from lwjax.leaf_route import LeafRoute

COLUMNS = ("path", "shape", "matrix view", "optimizer", "why", "note")

# Words of a module's name (split at "_") that say which projections a fused kernel holds,
# and how many (the size of the axis that indexes them in an einsum kernel).
_FUSED = (
    (frozenset({"qkv", "wqkv", "c_attn"}), "q, k and v", 3),
    (frozenset({"kv", "wkv"}), "k and v", 2),
    (frozenset({"gating"}), "gate and up", 2),
)


def routing_table(routes: Iterable[LeafRoute]) -> list[tuple[str, str, str, str, str, str]]:
    """Per leaf: path, shape, matrix view, optimizer, why and a note (``""`` for none), as
    strings (:data:`COLUMNS`).

    The view is the batch of matrices Muon sees, e.g. ``8 × [64, 128]``.
    """
    rows = []
    for r in routes:
        optimizer = "Muon" if r.is_muon else ("AdamW (tied)" if r.is_tied else "AdamW")
        rows.append((r.path, str(list(r.shape)), _matrix_view(r), optimizer, r.why, _note(r)))
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


def _note(route: LeafRoute) -> str:
    """Which projections a Muon leaf holds, where it holds several, and whether Muon
    orthogonalizes them apart or as one matrix."""
    if not route.is_muon:
        return ""
    if route.qkv_split_shapes:
        rows = "+".join(map(str, route.qkv_split_shapes))
        return f"q, k, v apart (qkv_split: {rows} output rows per group)"
    words = {w for part in dims_lib.components(route.path) for w in (part, *part.split("_"))}
    for names, what, count in _FUSED:
        if words & names:
            return _fused_note(route, what, count)
    if {"gate", "up"} <= words:
        return "gate and up in one matrix"
    return ""


def _fused_note(route: LeafRoute, what: str, count: int) -> str:
    """A fused kernel's note: its projections apart where its first axis, of ``count``, is a
    batch axis (gemma's ``[2, kv_heads, embed, head_dim]``), else in one matrix."""
    if len(route.shape) == 2:
        return f"{what} in one matrix" + (" (qkv_split= splits them)" if count == 3 else "")
    order = route.axes_order or tuple(range(len(route.shape)))
    if route.shape[0] == count and 0 in order[: route.stack_dims]:
        return f"{what} apart (axis 0 is a batch axis)"
    return f"{what} in one matrix (a dims= rule splits them)"


def format_routing_table(routes: Iterable[LeafRoute]) -> str:
    """:func:`routing_table` as aligned plain text with a header; the note column only where
    a leaf has a note, and the reason last."""
    rows = routing_table(routes)
    noted = any(row[5] for row in rows)
    order = (0, 1, 2, 3, 5, 4) if noted else (0, 1, 2, 3, 4)
    lines = [tuple(row[i] for i in order) for row in [COLUMNS, *rows]]
    widths = [max(len(line[i]) for line in lines) for i in range(len(order) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line[:-1], widths)) + "  " + line[-1]
        for line in lines
    )
