"""How the ``lwjax`` commands print: number formats, rich tables and JSON.

The formatters and the JSON writer are plain Python. ``rich`` is the ``tools``
extra and is imported inside the functions that draw: :func:`console` and
:func:`table` first call :func:`require_rich`, which turns a missing ``rich``
into the one-line usage error that :func:`lwjax.tools.cli.main` prints. The
layout tables live in :mod:`lwjax.tools.render_layout`; the tables of
``lwjax bench`` and ``lwjax convert`` live here. Each table is a
:class:`~lwjax.tools.fit_table.FitTable`, whose columns fit the console (``$COLUMNS``).
Nothing here imports jax.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Iterator, Sequence

from lwjax.routing_table import COLUMNS
from lwjax.tools.fit_table import Column, FitTable

NEEDS_TOOLS_EXTRA = "this command needs the tools extra: pip install 'lwjax[tools]'"


def has_rich() -> bool:
    """Whether ``rich`` (the ``tools`` extra) can be imported."""
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def require_rich() -> None:
    """Raise the usage error of a command that renders when ``rich`` is not installed.

    Raises:
      ValueError: ``rich`` (the ``tools`` extra) cannot be imported; the CLI
        prints ``lwjax <command>: <message>`` and exits with status 2.
    """
    if not has_rich():
        raise ValueError(NEEDS_TOOLS_EXTRA)


# --------------------------------------------------------------------------- numbers


def count(n: int) -> str:
    """An element or parameter count: exact below 100k, else 3 significant digits (K, M, B)."""
    if n < 100_000:
        return f"{n:,}"
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def flops(n: int) -> str:
    """FLOPs with an SI prefix."""
    if n == 0:
        return "0"
    for scale, suffix in (
        (1e18, "E"),
        (1e15, "P"),
        (1e12, "T"),
        (1e9, "G"),
        (1e6, "M"),
        (1e3, "k"),
    ):
        if n >= scale:
            return f"{n / scale:.3g} {suffix}"
    return str(n)


def ratio(value: float | None) -> str:
    """A max/mean ratio to 3 decimals; a dash where there is none."""
    return "—" if value is None else f"{value:.3f}"


def pct(value: float) -> str:
    """A percentage to 2 decimals."""
    return f"{value:.2f}%"


# --------------------------------------------------------------------------- rich and JSON


def console():
    """A ``rich.console.Console`` on stdout: ``$COLUMNS`` wide when set, else the terminal's
    width, else (a file or a pipe) 160 columns."""
    require_rich()
    from rich.console import Console

    columns = os.environ.get("COLUMNS", "")
    return Console(file=sys.stdout, width=None if columns.isdigit() or sys.stdout.isatty() else 160)


def table(title: str, columns: Sequence[Column], *, caption: str | None = None) -> FitTable:
    """A :class:`~lwjax.tools.fit_table.FitTable`: its columns fit the console it is printed on."""
    require_rich()
    return FitTable(title, columns, caption)


def json_text(obj, depth: int = 0) -> str:
    """JSON with one entry per line, but lists of numbers kept on one line."""
    pad, inner = " " * depth, " " * (depth + 1)
    if isinstance(obj, dict) and obj:
        items = (f"{inner}{json.dumps(k)}: {json_text(v, depth + 1)}" for k, v in obj.items())
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, list) and any(isinstance(x, (dict, list)) for x in obj):
        return "[\n" + ",\n".join(f"{inner}{json_text(x, depth + 1)}" for x in obj) + f"\n{pad}]"
    return json.dumps(obj)


def print_json(obj) -> None:
    """Print ``obj`` as :func:`json_text` on stdout."""
    sys.stdout.write(json_text(obj) + "\n")


# --------------------------------------------------------------------------- routes


# how each routing-table column (lwjax.routing_table.COLUMNS) fits a narrow console
_ROUTE_COLUMNS_FIT = {
    "path": {"fold": True},
    "shape": {"drop": 1},
    "matrix view": {"drop": 2},
    "optimizer": {},
    "why": {"fold": True},
    "note": {"fold": True, "drop": 3},
}


def print_routes(
    rows: Sequence[tuple], source: str, convention: str, muon_fraction: float, routing: str
) -> None:
    """The routing table (:func:`lwjax.routing.routing_table` rows), the rules that made it
    and the Muon share."""
    out = console()
    result = table(
        f"Routing of {source} (matrix_convention={convention})",
        [Column(name, text=True, **_ROUTE_COLUMNS_FIT[name]) for name in COLUMNS],
    )
    for row in rows:
        result.add_row(*row)
    out.print(result)
    out.print(f"Routed by {routing}; {pct(100 * muon_fraction)} of the elements are on Muon.")


# --------------------------------------------------------------------------- bench


def print_bench(records: Sequence[dict]) -> None:
    """The optimizer-step table of ``lwjax bench``: one row per contender and dp, plus floors."""
    first = records[0]
    norms = ", ".join(
        f"{r['grad_norm']:.3g} at dp {r['dp']}" for r in records if r["contender"] == "lwjax"
    )
    title = (
        f"Optimizer step, {first['workload']} workload ({first['layers']} layers, "
        f"{count(first['params'])} params) on {first['device']}, jax {first['jax']}; "
        + (
            f"tp {first['tp']} ({first['tp_mode']}; dp × tp devices); "
            if first.get("tp", 1) > 1
            else ""
        )
        + "gradient norm (clip 1.0) "
        + norms
    )
    columns = (
        Column("contender", text=True, fold=True),
        Column("dp"),
        Column("step ms"),
        Column("back to back", drop=2),
        Column("vs lwjax"),
        Column("state bytes / device", drop=1),
    )
    rows = table(title, columns)
    lwjax_ms = {r["dp"]: r["step_ms"] for r in records if r["contender"] == "lwjax"}
    for r in records:
        nbytes = r.get("state_bytes_per_device")
        rows.add_row(
            r["contender"],
            _dp_groups(r),
            f"{r['step_ms']:.2f}",
            f"{r['back_to_back_ms']:.2f}" if "back_to_back_ms" in r else "—",
            f"{r['step_ms'] / lwjax_ms[r['dp']]:.2f}x",
            "—" if nbytes is None else count(nbytes),
        )
        if "floor_sum_ms" in r:
            rows.add_row(
                f"  floor: RS {r['rs_ms']:.2f} + AG {r['ag_ms']:.2f} + NS {r['ns_ms']:.2f} "
                f"+ bytes {r['bytes_ms']:.2f} ms ({r['step_gbytes']:.2f} GB at "
                f"{r['copy_gbytes_per_s']:.0f} GB/s)",
                str(r["dp"]),
                f"{r['floor_sum_ms']:.2f}",
                f"{r['floor_sum_back_to_back_ms']:.2f}",
                f"{r['floor_sum_ms'] / r['step_ms']:.2f}x",
                "",
                style="dim",
            )
        if "floor_sum_computed_ms" in r and r["floor_sum_computed_ms"] != r["floor_sum_ms"]:
            rows.add_row(
                f"  the same, FLOPs lwjax computes: NS {r['ns_computed_ms']:.2f} ms",
                str(r["dp"]),
                f"{r['floor_sum_computed_ms']:.2f}",
                "",
                f"{r['floor_sum_computed_ms'] / r['step_ms']:.2f}x",
                "",
                style="dim",
            )
    console().print(rows)


def _dp_groups(record: dict) -> str:
    """A bench record's dp, with its sharding groups when ``--replica`` asked for them:
    ``8 = 2 × 4`` (``auto`` when the chooser picked them)."""
    if record.get("replica", 1) == 1:
        return str(record["dp"])
    auto = " auto" if record["replica"] == "auto" else ""
    return f"{record['dp']} = {record['replicas']} × {record['group_size']}{auto}"


def print_train_bench(records: Sequence[dict]) -> None:
    """The training-step table of ``lwjax bench --train-step``."""
    first = records[0]
    title = (
        f"Training step, {first['workload']} workload ({first['layers']} layers, "
        f"{count(first['params'])} params), {first['micro_batch']} × {first['seq_len']} tokens "
        f"per device, remat {'on' if first['remat'] else 'off'}, {first['param_dtype']}, "
        f"{'parameters fully sharded (FSDP), ' if first.get('fsdp') else ''}"
        f"on {first['device']}, jax {first['jax']}; XLA options: "
        + (
            ", ".join(f"{k}={v}" for k, v in first.get("compiler_options", {}).items())
            or "XLA's defaults"
        )
    )
    columns = (
        Column("contender", text=True, fold=True),
        Column("dp"),
        Column("step ms"),
        Column("optimizer ms", drop=2),
        Column("tokens/s", drop=3),
        Column("MFU", drop=4),
        Column("Muon overhead"),
        Column("memory / device", drop=1),
    )
    rows = table(title, columns)
    overhead = {  # lwjax Muon's over each other contender, Megatron's Muon's over its Adam
        (r["dp"], name): value
        for r in records
        for name, value in r.get("muon_overhead_pct", {}).items()
    }
    for r in records:
        if "step_ms" not in r:  # a contender Megatron's script could not run
            rows.add_row(f"{r['contender']} (skipped: {r['skipped']})", str(r["dp"]))
            continue
        nbytes = r.get("measured_peak_bytes", r["compiled_bytes_per_device"])
        over = overhead.get((r["dp"], r["contender"]))
        rows.add_row(
            r["contender"],
            str(r["dp"]),
            f"{r['step_ms']:.2f}",
            f"{r['optimizer_ms']:.2f}" if "optimizer_ms" in r else "—",
            f"{r['tokens_per_s']:,.0f}",
            "—" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
            "—" if over is None else f"{over:+.1f}%",
            "—" if nbytes is None else f"{nbytes / 1e9:.2f} GB",
        )
    out = console()
    out.print(rows)
    out.print(
        "[dim]optimizer ms: step ms minus forward+backward's; Muon overhead: lwjax Muon's step "
        "time over this row's, minus 1 (a gather-in-forward AdamW row: Muon's with the same "
        "gathers; Megatron's rows: Megatron's Muon over its Adam); "
        "memory: XLA's estimate for the compiled step "
        "(arguments + outputs - donated + temporaries), Megatron's measured peak.[/]"
    )
    if first.get("fsdp"):
        limit = first.get("device_bytes_limit")
        out.print(
            f"[dim]Replicated, the parameters and their fp32 gradients alone would take "
            f"{first['replicated_bytes'] / 1e9:.2f} GB per device"
            + (f" (XLA may allocate {limit / 1e9:.2f} GB)." if limit else ".")
            + "[/]"
        )
    _print_floors(out, [r for r in records if "floor_ms" in r])


def _print_floors(out, records: Sequence[dict]) -> None:
    """``bench --train-step``'s second table: each lwjax contender against its floor."""
    if not records:
        return
    rows = table(
        "Against the floor: what no schedule removes",
        (
            Column("contender", text=True, fold=True),
            Column("dp"),
            Column("step ms"),
            Column("floor ms"),
            Column("over floor"),
            Column("comm. beside compute", drop=1),
        ),
    )
    for r in records:
        profile = r.get("profile") or {}
        comm = profile.get("comm_ms")
        rows.add_row(
            r["contender"],
            str(r["dp"]),
            f"{r['step_ms']:.2f}",
            f"{r['floor_ms']:.2f}",
            f"{r['step_ms'] - r['floor_ms']:+.2f} ms ({r['step_ms'] / r['floor_ms']:.3f}x)",
            f"{100 * profile['overlap_ms'] / comm:.0f}%" if comm else "—",
        )
    out.print(rows)
    notes = [
        f"dp {r['dp']}: Newton-Schulz on the busiest rank, {ns['ns_gflop_computed_max_rank']:,.1f} "
        f"GFLOP computed ({ns['ns_gflop_max_rank']:,.1f} as full products): "
        f"{ns['ns_computed_ms']:.2f} ms at {ns['matmul_tflops']:,.1f} TFLOP/s measured"
        for r in records
        if (ns := r.get("newton_schulz"))
    ]
    out.print(
        "[dim]floor ms: forward+backward's step ms, plus for a Muon step the busiest rank's "
        "Newton-Schulz at the measured matmul rate; comm. beside compute: the part of device "
        "0's communication kernel time that ran beside compute kernels (--profile, GPU). "
        + "; ".join(notes)
        + ".[/]"
    )


# --------------------------------------------------------------------------- convert


@contextlib.contextmanager
def convert_progress(out) -> Iterator:
    """A transient progress bar on the console ``out``; yields ``report(stage, done, total)``."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=out, transient=True) as progress:
        task = progress.add_task("converting", total=3)

        def report(stage: str, done: int, total: int) -> None:
            progress.update(task, description=stage, completed=done, total=total)

        yield report


def convert_json(summary) -> dict:
    """A :class:`~lwjax.megatron.convert.ConvertSummary` as the JSON of ``convert --json``."""
    return {
        "source": summary.source,
        "target": summary.target,
        "src": summary.src,
        "dst": summary.dst,
        "iteration": summary.iteration,
        "seconds": summary.seconds,
        "notes": summary.notes,
        "params": [
            {"key": k, "shape": list(s), "dtype": d, "state": st} for k, s, d, st in summary.rows
        ],
    }


def convert_text(summary) -> str:
    """A conversion's parameters as plain aligned text (what ``lwjax convert`` prints without
    ``rich``): a title line, one line per parameter, the total and the source notes."""
    rows = [
        (key, "×".join(map(str, shape)), dtype, state) for key, shape, dtype, state in summary.rows
    ]
    widths = [max((len(row[i]) for row in rows), default=0) for i in range(3)]
    numel = sum(math.prod(shape) for _, shape, _, _ in summary.rows)
    lines = [
        f"{summary.src} ({summary.source}) -> {summary.dst} ({summary.target}) · "
        f"iteration {summary.iteration} · {summary.seconds:.2f} s",
        *("  ".join(cell.ljust(w) for cell, w in zip(row, (*widths, 0))).rstrip() for row in rows),
        f"{len(summary.rows)} parameters, {count(numel)} elements",
    ]
    notes = ", ".join(f"{k} {v}" for k, v in summary.notes.items() if v is not None)
    return "\n".join(lines + ([f"source: {notes}"] if notes else []))


def print_convert(out, summary) -> None:
    """The table of a conversion's parameters on the console ``out``, then its source notes."""
    notes = ", ".join(f"{k} {v}" for k, v in summary.notes.items() if v is not None)
    rows = table(
        f"{summary.src} ({summary.source}) -> {summary.dst} ({summary.target}) · "
        f"iteration {summary.iteration} · {summary.seconds:.2f} s",
        (
            Column("parameter", text=True, fold=True),
            Column("shape", text=True),
            Column("dtype", text=True, drop=2),
            Column("optimizer state", text=True, fold=True, drop=1),
        ),
    )
    for key, shape, dtype, state in summary.rows:
        rows.add_row(key, "×".join(map(str, shape)), dtype, state)
    numel = sum(math.prod(shape) for _, shape, _, _ in summary.rows)
    rows.add_row(f"{len(summary.rows)} parameters", count(numel), "", "", style="bold")
    out.print(rows)
    if notes:
        out.print(f"[dim]source: {notes}[/]")
