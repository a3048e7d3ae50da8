"""``lwjax routes``: which leaves of a model go to Muon, as what matrices, and why.

Routes the parameter shapes of a JSON file (``{"path/of/leaf": [shape...]}``,
e.g. written with ``{lwjax.routing.path_name(p): x.shape for p, x in
jax.tree_util.tree_flatten_with_path(params)[0]}``) or of an lwjax checkpoint
with the default rules (:func:`lwjax.routing.route_leaves`), and prints the
routing table with the share of elements on Muon.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib

from lwjax.tools.render import print_json, print_routes


def _records(source: str) -> tuple[list[tuple[str, tuple[int, ...], str]], str | None]:
    """``(name, shape, dtype)`` of every parameter in ``source``, and a recorded convention."""
    path = pathlib.Path(source)
    if path.is_dir():
        from lwjax.checkpoint import read_record

        record = read_record(path)
        params = [
            (name.removeprefix("params/"), tuple(entry["shape"]), entry["dtype"])
            for name, entry in record["arrays"].items()
            if name.startswith("params/")
        ]
        return params, record.get("matrix_convention")
    try:
        shapes = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(
            f"{source}: not a checkpoint directory or a readable JSON file: {err}"
        ) from None
    if not isinstance(shapes, dict) or not all(
        isinstance(s, list) and all(isinstance(d, int) for d in s) for s in shapes.values()
    ):
        raise ValueError(f'{source}: expected a JSON object {{"path": [shape...]}}.')
    return [(name, tuple(shape), "float32") for name, shape in shapes.items()], None


def _cmd_routes(args: argparse.Namespace) -> int:
    """Route a model's parameters by the default rules and show the table."""
    from lwjax.routing import RoutingRules, route_leaves, routing_table
    from lwjax.routing_table import COLUMNS

    records, recorded = _records(args.source)
    convention = args.matrix_convention or recorded or "in_out"
    routes = route_leaves(
        records, RoutingRules(model_dim=args.model_dim), matrix_convention=convention
    )
    muon = sum(math.prod(r.shape) for r in routes if r.is_muon)
    total = sum(math.prod(r.shape) for r in routes) or 1
    if args.json:
        keys = tuple(column.replace(" ", "_") for column in COLUMNS)
        print_json(
            {
                "matrix_convention": convention,
                "muon_fraction": muon / total,
                "routes": [dict(zip(keys, row)) for row in routing_table(routes)],
            }
        )
        return 0
    print_routes(routing_table(routes), args.source, convention, muon / total)
    return 0


def add_parser(subparsers) -> None:
    """Add ``routes`` and its flags to the ``lwjax`` subparsers."""
    p = subparsers.add_parser(
        "routes",
        help="show which parameters go to Muon (as what matrices) and why",
        description=(
            "Route a model's parameters by lwjax's default rules and print, per leaf, its "
            "shape, the matrices Muon sees, Muon or AdamW, and why."
        ),
    )
    p.add_argument(
        "source", help='an lwjax checkpoint directory, or a JSON file {"path": [shape...]}'
    )
    p.add_argument(
        "--model-dim",
        type=int,
        default=None,
        help="the model width that splits 3+-axis kernels (default: the embedding's width)",
    )
    p.add_argument(
        "--matrix-convention",
        choices=("in_out", "out_in"),
        default=None,
        help="how 2-D weights are stored (default: the checkpoint's, else in_out)",
    )
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(command=_cmd_routes, command_name="routes")
