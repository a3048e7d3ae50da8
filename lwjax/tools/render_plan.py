"""The tables of ``lwjax plan``: memory per device, collectives per step, Newton–Schulz, meshes
ranked; and the same as JSON.

Each function reads a :class:`~lwjax.tools.plan_report.RunPlan` (or a ranking) and draws it
with :mod:`lwjax.tools.render`'s helpers; ``rich`` is imported only there.
"""

from __future__ import annotations

from collections.abc import Sequence

from lwjax.tools.fit_table import Column
from lwjax.tools.plan_compile import OPTIMIZER_STEP
from lwjax.tools.plan_report import RunPlan
from lwjax.tools.render import console, flops, table


def nbytes(n: float) -> str:
    """Bytes with a decimal prefix and 3 significant digits (``0`` for none)."""
    if not n:
        return "0"
    for scale, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _mesh_title(run: RunPlan) -> str:
    mesh = run.mesh
    hosts = f"{mesh.hosts} host{'s' if mesh.hosts > 1 else ''}"
    if mesh.devices_per_host:
        hosts += f" of {mesh.devices_per_host} devices"
    return f"{run.model} on {mesh.describe()} ({mesh.devices} devices, {hosts})"


def print_plan(run: RunPlan, compiled: dict | None = None) -> None:
    """Memory, collectives and Newton–Schulz of one mesh (with XLA's figures if compiled)."""
    out = console()
    out.print(f"[bold]{_mesh_title(run)}[/bold]")
    mem = table(
        "Memory per device",
        [
            Column("holds", text=True, fold=True),
            Column("bytes"),
            Column("what", text=True, fold=True),
        ],
    )
    notes = {
        "parameters": "this device's blocks, parameter dtype",
        "gradients": "the same blocks, parameter dtype",
        "masters": "fp32, its bucket shards with padding",
        "momenta": "fp32, Muon buckets",
        "adam moments": "fp32 m and v, elementwise buckets",
        "gathered layer": "a layer gathered whole over fsdp (one at a time: remat)",
        "activations": "kept for the backward: layer inputs, one layer, fp32 logits",
    }
    for key, value in run.memory.items():
        mem.add_row(key, nbytes(value), notes[key])
    mem.add_row("total", nbytes(run.total_bytes), "without XLA's temporaries", style="bold")
    if compiled:
        held = compiled["held_bytes"]
        off = 100 * (run.state_bytes / held - 1)
        mem.add_row(
            "XLA: parameters + state",
            nbytes(held),
            f"the plan's {nbytes(run.state_bytes)} is {off:+.2f}% off",
            style="cyan",
        )
        temp = compiled["temp_bytes"]
        on = f"on {compiled['backend'].upper()}" if "backend" in compiled else ""
        mem.add_row("XLA: temporaries", nbytes(temp), f"{compiled['step']} {on}", style="cyan")
        mem.add_row(
            "XLA: step",
            nbytes(held + temp),
            f"parameters, state, temporaries: {(held + temp) / run.total_bytes:.2f}x the total",
            style="cyan",
        )
        widened = compiled.get("widened_bytes", 0)
        if widened:
            step = held + temp - widened
            mem.add_row(
                "XLA: step less CPU copies",
                nbytes(step),
                f"less {nbytes(widened)} of fp32 weight copies the CPU backend carries through "
                f"the scan (a GPU makes none): {step / run.total_bytes:.2f}x the total",
                style="cyan",
            )
    out.print(mem)
    comm = table(
        "Collectives per step, per device",
        [
            Column("collective", text=True, fold=True),
            Column("kind", text=True, drop=1),
            Column("axes", text=True),
            Column("group", drop=2),
            Column("runs", drop=3),
            Column("result"),
            Column("inside host"),
            Column("across hosts"),
        ],
    )
    for c in run.collectives:
        comm.add_row(
            c.name,
            c.kind,
            " x ".join(a for a in c.axes if run.mesh.sizes[a] > 1),
            str(c.group),
            str(c.executions),
            nbytes(c.bytes),
            nbytes(c.inside),
            nbytes(c.across),
        )
    comm.add_row(
        "total",
        "",
        "",
        "",
        "",
        "",
        nbytes(run.bytes_inside()),
        nbytes(run.bytes_across()),
        style="bold",
    )
    out.print(comm)
    if compiled:
        out.print(_compiled_collectives(run, compiled))
    out.print(
        f"Newton-Schulz per step: busiest device {flops(run.ns_busiest)}FLOP; every matrix "
        f"once over {run.mesh.devices} devices {flops(run.ns_total / run.mesh.devices)}FLOP "
        f"each, largest matrix {flops(run.ns_largest)}FLOP: "
        f"{run.ns_busiest / run.ns_ideal if run.ns_ideal else 0:.2f}x the least possible."
    )


def _compiled_collectives(run: RunPlan, compiled: dict):
    """The plan's elements per collective kind beside XLA's (one call of the compiled step)."""
    rows = table(
        f"Collectives: the plan against XLA's compiled {compiled['step']}",
        [
            Column("kind", text=True),
            Column("plan elements"),
            Column("XLA elements"),
            Column("XLA runs"),
        ],
        caption="XLA's CPU backend moves bf16 collectives as f32: elements are compared.",
    )
    planned = compared_elements(run, compiled)
    for kind, (runs, elements, _) in compiled["collectives"].items():
        rows.add_row(kind, f"{planned.get(kind, 0):,}", f"{elements:,}", str(runs))
    return rows


def compared_elements(run: RunPlan, compiled: dict) -> dict[str, int]:
    """The plan's elements per collective kind in the step ``compiled`` is (the optimizer's
    alone for an optimizer step)."""
    optimizer_only = compiled["step"] == OPTIMIZER_STEP
    out: dict[str, int] = {}
    for c in run.collectives:
        if optimizer_only and c.phase == "model":
            continue
        out[c.kind] = out.get(c.kind, 0) + c.elements
    return out


def print_ranking(ranked: Sequence, *, devices: int, memory_gb: float | None, why: str) -> None:
    """Candidate meshes, best first, and why the first is recommended."""
    out = console()
    rows = table(
        f"Meshes of {devices} devices, best first",
        [
            Column("mesh", text=True),
            Column("memory"),
            Column("fits", text=True),
            Column("inside host"),
            Column("across hosts"),
            Column("NS busiest"),
            Column("NS / least"),
        ],
        caption="memory: parameters, gradients, state, one gathered layer and activations; "
        "no XLA temporaries (--compile on a mesh adds them)",
    )
    for run in ranked:
        fits = "—" if memory_gb is None else ("yes" if run.total_bytes <= memory_gb * 1e9 else "no")
        rows.add_row(
            run.mesh.describe(),
            nbytes(run.total_bytes),
            fits,
            nbytes(run.bytes_inside()),
            nbytes(run.bytes_across()),
            f"{flops(run.ns_busiest)}FLOP",
            f"{run.ns_busiest / run.ns_ideal if run.ns_ideal else 0:.2f}x",
        )
    out.print(rows)
    out.print(why)


def plan_json(run: RunPlan, compiled: dict | None = None) -> dict:
    """One mesh's plan as JSON."""
    return dict(
        model=run.model,
        mesh={**run.mesh.sizes, "devices_per_host": run.mesh.devices_per_host},
        memory_bytes=run.memory,
        state_bytes=run.state_bytes,
        total_bytes=run.total_bytes,
        collectives=[
            dict(
                name=c.name,
                kind=c.kind,
                axes=list(c.axes),
                group=c.group,
                executions=c.executions,
                elements=c.elements,
                bytes=c.bytes,
                inside_host_bytes=c.inside,
                across_hosts_bytes=c.across,
            )
            for c in run.collectives
        ],
        ns_flops=dict(
            busiest=run.ns_busiest,
            total=run.ns_total,
            largest_matrix=run.ns_largest,
            ratio_to_least=run.ns_busiest / run.ns_ideal if run.ns_ideal else None,
        ),
        compiled=compiled,
    )
