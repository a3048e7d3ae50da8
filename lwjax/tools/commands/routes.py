"""``lwjax routes``: which leaves of a model go to Muon, as what matrices, and why.

Routes the parameter shapes of a JSON file (``{"path/of/leaf": [shape...]}``,
e.g. written with ``{lwjax.routing.path_name(p): x.shape for p, x in
jax.tree_util.tree_flatten_with_path(params)[0]}``) or of an lwjax checkpoint
with the default rules (:func:`lwjax.routing.route_leaves`), and a Megatron GPT
(a Megatron checkpoint, or an lwjax checkpoint converted from one) with the rules
its import uses; prints the routing table, which rules, and the share of elements
on Muon.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
from typing import Any

from lwjax.routing_table import COLUMNS
from lwjax.tools.render import print_json, print_routes


@dataclasses.dataclass(frozen=True)
class _Source:
    """What ``lwjax routes`` routes: each parameter's ``(name, shape, dtype)``, the rules
    and convention its optimizer uses (``None``: the defaults and ``--matrix-convention``),
    and which routing that is."""

    records: list[tuple[str, tuple[int, ...], str]]
    rules: Any = None
    convention: str | None = None
    routing: str = "lwjax's default rules"


def _read_source(source: str) -> _Source:
    """The parameters of a JSON shapes file, an lwjax checkpoint or a Megatron checkpoint; a
    Megatron GPT (a Megatron checkpoint, or an lwjax checkpoint converted from one) is routed
    by the rules :func:`lwjax.megatron.import_megatron` gives its optimizer."""
    path = pathlib.Path(source)
    if path.is_dir():
        from lwjax.megatron.lwjax_checkpoint import detect_source

        return _lwjax_source(path) if detect_source(path) == "lwjax" else _megatron_source(path)
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
    return _Source([(name, tuple(shape), "float32") for name, shape in shapes.items()])


def _lwjax_source(path: pathlib.Path) -> _Source:
    from lwjax.checkpoint import read_record
    from lwjax.megatron.gpt import GPTConfig

    record = read_record(path)
    records = [
        (name.removeprefix("params/"), tuple(entry["shape"]), entry["dtype"])
        for name, entry in record["arrays"].items()
        if name.startswith("params/")
    ]
    megatron = record.get("metadata", {}).get("megatron", {})
    if "config" not in megatron:
        return _Source(records, convention=record.get("matrix_convention"))
    rules = GPTConfig(**megatron["config"]).routing_rules(muon=bool(megatron.get("muon", True)))
    return _Source(records, rules, record.get("matrix_convention"), _MEGATRON_ROUTING)


def _megatron_source(path: pathlib.Path) -> _Source:
    from lwjax.megatron.gpt import MATRIX_CONVENTION
    from lwjax.megatron.megatron_import import gpt_config_of
    from lwjax.megatron.state import read_megatron

    state = read_megatron(path)  # its optimizer state says whether Megatron ran Muon
    rules = gpt_config_of(state, None, {}).routing_rules(muon=bool(state.momentum))
    records = [(k.replace(".", "/"), w.shape, w.dtype.name) for k, w in state.model.items()]
    return _Source(records, rules, MATRIX_CONVENTION, _MEGATRON_ROUTING)


_MEGATRON_ROUTING = "the Megatron GPT's rules, as lwjax.megatron.import_megatron routes it"
_KEYS = tuple(column.replace(" ", "_") for column in COLUMNS)  # the JSON names of the columns


def _cmd_routes(args: argparse.Namespace) -> int:
    """Route a model's parameters (by its optimizer's rules, else the defaults); show the table."""
    from lwjax.routing import RoutingRules, route_leaves, routing_table

    source = _read_source(args.source)
    convention = args.matrix_convention or source.convention or "in_out"
    rules = source.rules or RoutingRules()
    if args.model_dim is not None:
        rules = dataclasses.replace(rules, model_dim=args.model_dim)
    routes = route_leaves(source.records, rules, matrix_convention=convention)
    muon = sum(math.prod(r.shape) for r in routes if r.is_muon)
    total = sum(math.prod(r.shape) for r in routes) or 1
    if args.json:
        print_json(
            {
                "matrix_convention": convention,
                "routing": source.routing,
                "muon_fraction": muon / total,
                "routes": [dict(zip(_KEYS, row)) for row in routing_table(routes)],
            }
        )
        return 0
    print_routes(routing_table(routes), args.source, convention, muon / total, source.routing)
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
