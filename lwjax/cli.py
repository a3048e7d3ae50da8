"""The ``lwjax`` command line: one subcommand per job.

``lwjax layout`` shows how a model's parameters are laid out over data-parallel
ranks: buckets, per-shard loads in elements and Newton–Schulz FLOPs, padding
overhead and max/mean balance, for one layout policy or (``--compare``) for all
of them side by side. With ``--json`` it prints machine-readable layouts in the
format of ``tests/fixtures/layouts``.

Each subcommand is a ``_cmd_<name>(args) -> int`` that calls library functions
(:mod:`lwjax.presets`, :mod:`lwjax.policies`, :mod:`lwjax.layout_report`) and
only renders their results. A user error prints one line, ``lwjax <command>:
<message>``, on stderr and exits with status 2. This module imports no jax;
subcommands that need it import it themselves.

Examples::

    lwjax layout --preset llama8b --dp 8
    lwjax layout --preset moe --dp 8 --expert-dp 4 --bucket-size 40000000 --compare
    lwjax layout --spec params.json --policy lpt --dp 4 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
from collections.abc import Sequence

from lwjax.layout_report import (
    BufferSummary,
    LayoutSummary,
    PolicyResult,
    compare_policies,
    evaluate_policy,
    full_layout_to_json,
    layout_to_json,
)
from lwjax.policies import DEFAULT_NUM_NS_STEPS, DEFAULT_POLICY, POLICIES, compute_layout
from lwjax.presets import PRESETS, preset_specs, specs_from_json

EXIT_USAGE = 2
MAX_SHARD_ROWS = 64  # list shards under every bucket while buckets * dp stays below this


class _UsageError(Exception):
    """A user error; its message is printed as one line and the exit status is 2."""


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, raised instead of exiting."""

    def error(self, message: str):
        raise _UsageError(f"{self.prog}: {message}")


# --------------------------------------------------------------------------- formatting


def _count(n: int) -> str:
    """An element or parameter count: exact below 100k, else 3 significant digits (K, M, B)."""
    if n < 100_000:
        return f"{n:,}"
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def _flops(n: int) -> str:
    """FLOPs with an SI prefix."""
    if n == 0:
        return "0"
    for scale, suffix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g} {suffix}"
    return str(n)


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _pct(value: float) -> str:
    return f"{value:.2f}%"


def _buffer_title(index: int, buffer: BufferSummary) -> str:
    key = buffer.key
    kind = "layer-wise (Muon)" if buffer.is_layer_wise else "elementwise (distributed optimizer)"
    parts = [f"Buffer {index}"]
    if key is not None:
        parts.append(f"{key.param_dtype} params, {key.grad_dtype} grads")
        parts.append("expert" if key.is_expert_parallel else "dense")
    parts += [kind, f"{buffer.num_shards} shards"]
    return " · ".join(parts)


def _buffer_label(buffer: BufferSummary) -> str:
    key = buffer.key
    kind = "Muon" if buffer.is_layer_wise else "elementwise"
    if key is None:
        return kind
    return f"{key.param_dtype} {'expert' if key.is_expert_parallel else 'dense'} {kind}"


def _console():
    from rich.console import Console

    return Console(file=sys.stdout, width=None if sys.stdout.isatty() else 160)


def _table(title: str, columns: Sequence[str], *, text_columns: int = 1):
    """A table whose first ``text_columns`` columns are left-aligned text, the rest numbers."""
    from rich.table import Table

    table = Table(title=title, title_justify="left", title_style="bold")
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i < text_columns else "right", no_wrap=True)
    return table


def _shard_rows(table, shards, bucket_start: int | None, shard_size: int | None) -> None:
    """Rows of one shard each, with its loads relative to the mean."""
    mean_numel = sum(s.numel for s in shards) / len(shards)
    mean_flops = sum(s.ns_flops for s in shards) / len(shards)
    for load in shards:
        start = None if bucket_start is None else bucket_start + load.shard * shard_size
        where = "" if start is None else f"[{start:,}, {start + shard_size:,})"
        table.add_row(
            "",
            f"shard {load.shard}",
            where,
            str(load.num_params),
            _count(load.numel),
            _flops(load.ns_flops),
            "",
            _ratio(load.numel / mean_numel if mean_numel else None),
            _ratio(load.ns_flops / mean_flops if mean_flops else None),
            style="dim",
        )


def _render_buffer(console, index: int, buffer: BufferSummary) -> None:
    table = _table(
        _buffer_title(index, buffer),
        ["bucket", "shard", "range", "params", "elements", "NS FLOPs", "padding", "max/mean el.", "max/mean FLOPs"],
        text_columns=2,
    )
    with_shards = len(buffer.buckets) * buffer.num_shards <= MAX_SHARD_ROWS
    for bucket in buffer.buckets:
        table.add_row(
            str(bucket.bucket_id),
            "all",
            f"[{bucket.start:,}, {bucket.end:,})",
            str(bucket.num_params),
            _count(bucket.real_numel),
            _flops(bucket.ns_flops),
            _pct(bucket.padding_pct),
            _ratio(bucket.numel_balance),
            _ratio(bucket.flops_balance),
            end_section=not with_shards,
        )
        if with_shards:
            shard_size = bucket.numel // buffer.num_shards
            _shard_rows(table, bucket.shards, bucket.start, shard_size)
            table.rows[-1].end_section = True
    if len(buffer.buckets) > 1 or not with_shards:
        table.add_row(
            "total",
            "all",
            f"[0, {buffer.numel:,})",
            str(buffer.num_params),
            _count(buffer.real_numel),
            _flops(buffer.ns_flops),
            _pct(buffer.padding_pct),
            _ratio(buffer.numel_balance),
            _ratio(buffer.flops_balance),
            style="bold",
        )
        if buffer.num_shards <= MAX_SHARD_ROWS:
            _shard_rows(table, buffer.shards, None, None)
    console.print(table)


def _render_summary(console, summary: LayoutSummary, layout_ms: float) -> None:
    table = _table(
        f"Model summary (layout computed in {layout_ms:.1f} ms)",
        ["buffer", "shards", "params", "buckets", "elements", "buffer size", "padding", "NS FLOPs",
         "max/mean el.", "max/mean FLOPs"],
    )
    for i, buffer in enumerate(summary.buffers):
        table.add_row(
            f"{i}: {_buffer_label(buffer)}",
            str(buffer.num_shards),
            str(buffer.num_params),
            str(len(buffer.buckets)),
            _count(buffer.real_numel),
            _count(buffer.numel),
            _pct(buffer.padding_pct),
            _flops(buffer.ns_flops),
            _ratio(buffer.numel_balance),
            _ratio(buffer.flops_balance),
            end_section=i == len(summary.buffers) - 1,
        )
    for ranks in summary.ranks:
        label = "model" if len(summary.ranks) == 1 else f"ranks of {ranks.num_shards}-way buffers"
        table.add_row(
            label,
            str(ranks.num_shards),
            str(sum(b.num_params for b in summary.buffers if b.num_shards == ranks.num_shards)),
            str(sum(len(b.buckets) for b in summary.buffers if b.num_shards == ranks.num_shards)),
            _count(ranks.real_numel),
            _count(ranks.numel),
            _pct(ranks.padding_pct),
            _flops(ranks.ns_flops),
            _ratio(ranks.numel_balance),
            _ratio(ranks.flops_balance),
            style="bold",
        )
    console.print(table)
    for ranks in summary.ranks:
        if ranks.num_shards > MAX_SHARD_ROWS:
            continue
        per_rank = _table(
            f"Per rank, all {ranks.num_shards}-way buffers",
            ["rank", "params", "elements", "NS FLOPs", "el. / mean", "FLOPs / mean"],
        )
        mean_numel = ranks.real_numel / ranks.num_shards
        mean_flops = ranks.ns_flops / ranks.num_shards
        for load in ranks.shards:
            per_rank.add_row(
                str(load.shard),
                str(load.num_params),
                _count(load.numel),
                _flops(load.ns_flops),
                _ratio(load.numel / mean_numel if mean_numel else None),
                _ratio(load.ns_flops / mean_flops if mean_flops else None),
            )
        console.print(per_rank)


def _best(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def _render_compare(console, title: str, results: Sequence[PolicyResult]) -> None:
    table = _table(
        title,
        ["policy", "buckets", "buffer size", "padding", "max/mean el.", "max/mean NS FLOPs",
         "max rank NS FLOPs", "layout ms"],
    )
    summaries = [r.summary for r in results]
    best_padding = _best([s.padding_pct for s in summaries])
    best_numel = _best([s.numel_balance for s in summaries])
    best_flops = _best([s.flops_balance for s in summaries])

    def mark(text: str, value, best) -> str:
        return f"[bold green]{text}[/]" if value is not None and value == best else text

    for result in results:
        s = result.summary
        max_rank_flops = max((load.ns_flops for r in s.ranks for load in r.shards), default=0)
        table.add_row(
            result.policy + (" (default)" if result.policy == DEFAULT_POLICY else ""),
            str(s.num_buckets),
            _count(s.numel),
            mark(_pct(s.padding_pct), s.padding_pct, best_padding),
            mark(_ratio(s.numel_balance), s.numel_balance, best_numel),
            mark(_ratio(s.flops_balance), s.flops_balance, best_flops),
            _flops(max_rank_flops),
            f"{result.layout_ms:.1f}",
        )
    console.print(table)


def _compare_json(results: Sequence[PolicyResult]) -> list[dict]:
    return [
        {
            "policy": r.policy,
            "layout_ms": r.layout_ms,
            "num_buckets": r.summary.num_buckets,
            "numel": r.summary.numel,
            "real_numel": r.summary.real_numel,
            "padding_pct": r.summary.padding_pct,
            "ns_flops": r.summary.ns_flops,
            "numel_balance": r.summary.numel_balance,
            "flops_balance": r.summary.flops_balance,
        }
        for r in results
    ]


def _json_text(obj, depth: int = 0) -> str:
    """JSON with one entry per line, but lists of numbers kept on one line."""
    pad, inner = " " * depth, " " * (depth + 1)
    if isinstance(obj, dict) and obj:
        items = (f"{inner}{json.dumps(k)}: {_json_text(v, depth + 1)}" for k, v in obj.items())
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, list) and any(isinstance(x, (dict, list)) for x in obj):
        return "[\n" + ",\n".join(f"{inner}{_json_text(x, depth + 1)}" for x in obj) + f"\n{pad}]"
    return json.dumps(obj)


def _print_json(obj) -> None:
    sys.stdout.write(_json_text(obj) + "\n")


# --------------------------------------------------------------------------- layout


def _load_spec_file(path: str):
    try:
        text = pathlib.Path(path).read_text()
    except OSError as err:
        raise ValueError(f"--spec: cannot read {path}: {err.strerror or err}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--spec: {path} is not valid JSON: {err}") from None
    return specs_from_json(obj)


def _cmd_layout(args: argparse.Namespace) -> int:
    """Show (or print as JSON) the layout of a preset or a spec file."""
    if args.spec is not None and args.layers is not None:
        raise ValueError("--layers applies to --preset only.")
    if args.preset is not None:
        specs = preset_specs(args.preset, layers=args.layers)
        model = f"preset {args.preset}"
    else:
        specs = _load_spec_file(args.spec)
        model = args.spec
    options = dict(
        bucket_size=args.bucket_size, high_busbw=args.high_busbw, expert_dp=args.expert_dp,
        grad_reduce_in_fp32=args.grad_reduce_in_fp32, num_ns_steps=args.ns_steps,
    )
    if args.compare:
        results = compare_policies(specs, args.dp, **options)
        if args.json:
            _print_json(_compare_json(results))
            return 0
        total = sum(spec.numel for spec in specs)
        title = (
            f"Policies for {model}: {len(specs)} params, {_count(total)} elements, dp {args.dp}"
            + (f", expert dp {args.expert_dp}" if args.expert_dp is not None else "")
            + f", bucket size {args.bucket_size}, high busbw {'on' if args.high_busbw else 'off'}"
        )
        _render_compare(_console(), title, results)
        return 0
    if args.json and args.spec is not None and not args.full:
        # One layer-wise buffer holding every parameter, exactly as the fixtures do.
        layout = compute_layout(
            specs, args.dp, policy=args.policy, bucket_size=args.bucket_size, high_busbw=args.high_busbw
        )
        _print_json(layout_to_json(layout))
        return 0
    result = evaluate_policy(specs, args.dp, policy=args.policy, **options)
    if args.json:
        _print_json(full_layout_to_json(result.layout))
        return 0
    console = _console()
    total = sum(spec.numel for spec in specs)
    console.print(
        f"[bold]{model}[/]: {len(specs)} params, {_count(total)} elements · dp {args.dp}"
        + (f" · expert dp {args.expert_dp}" if args.expert_dp is not None else "")
        + f" · policy {args.policy} · bucket size {args.bucket_size}"
        + f" · high busbw {'on' if args.high_busbw else 'off'} · {args.ns_steps} NS steps"
    )
    for i, buffer in enumerate(result.summary.buffers):
        _render_buffer(console, i, buffer)
    _render_summary(console, result.summary, result.layout_ms)
    return 0


def _add_layout_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "layout",
        help="show how a model's parameters are laid out over data-parallel ranks",
        description=(
            "Lay a model's parameters out over data-parallel ranks and show buckets, per-shard loads "
            "(elements and Newton-Schulz FLOPs), padding overhead and max/mean balance."
        ),
    )
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--preset", choices=tuple(PRESETS), help="a built-in model")
    model.add_argument(
        "--spec",
        metavar="FILE.json",
        help="parameters as JSON: a list of shapes, or the layout fixtures' 'params' list",
    )
    p.add_argument("--dp", type=int, required=True, help="data-parallel size (shards per bucket)")
    p.add_argument(
        "--policy", choices=POLICIES, default=DEFAULT_POLICY, help=f"layer-wise policy (default {DEFAULT_POLICY})"
    )
    p.add_argument(
        "--bucket-size", "--ddp-bucket-size", dest="bucket_size", type=int, default=None, metavar="B",
        help="bucket size in elements (a soft minimum for layer-wise buffers); default: one bucket per buffer",
    )
    p.add_argument(
        "--high-busbw", "--ddp-pad-buckets-for-high-nccl-busbw", dest="high_busbw", action="store_true",
        help="pad bucket ends to multiples of 2**16 for NCCL bus bandwidth",
    )
    p.add_argument("--layers", type=int, default=None, metavar="L", help="number of layers of the preset")
    p.add_argument(
        "--expert-dp", type=int, default=None, metavar="E",
        help="data-parallel size of expert buffers (default: --dp)",
    )
    p.add_argument(
        "--grad-reduce-in-fp32", action=argparse.BooleanOptionalAction, default=True,
        help="reduce gradients in fp32 (sets the buffers' grad dtype; default on)",
    )
    p.add_argument(
        "--ns-steps", "--muon-num-ns-steps", dest="ns_steps", type=int, default=DEFAULT_NUM_NS_STEPS, metavar="K",
        help=f"Newton-Schulz iterations per step for the FLOP counts (default {DEFAULT_NUM_NS_STEPS})",
    )
    p.add_argument("--compare", action="store_true", help="compare all policies side by side")
    p.add_argument(
        "--json", action="store_true",
        help="print JSON: with --spec the single-buffer layout in the fixtures' 'expected' format; "
        "with --preset (or --spec --full) every buffer",
    )
    p.add_argument("--full", action="store_true", help="with --spec --json: lay out every buffer, as for a preset")
    p.set_defaults(command=_cmd_layout, command_name="layout")


# --------------------------------------------------------------------------- bench


def _cmd_bench(args: argparse.Namespace) -> int:
    """Time the optimizer step (or, with --train-step, a full training step) of lwjax and its baselines."""
    from lwjax.demo.devices import request_cpu_devices

    if args.train_step:
        if args.megatron or args.profile or args.grad_std is not None:
            raise ValueError("--megatron, --profile and --grad-std apply to the optimizer step only; drop them with "
                             "--train-step.")
    elif (args.seq_len, args.micro_batch, args.remat) != (None, None, False):
        raise ValueError("--seq-len, --micro-batch and --remat apply to --train-step only.")
    request_cpu_devices(max(args.dp))
    if args.train_step:
        return _bench_train_step(args)
    from lwjax.bench import BenchConfig, run_bench

    config = BenchConfig(
        workload=args.workload, layers=args.layers, dp_sizes=tuple(args.dp), iters=args.iters,
        warmup=BenchConfig.warmup if args.warmup is None else args.warmup, param_dtype=args.param_dtype,
        grad_reduce_in_fp32=args.grad_reduce_in_fp32,
        ns_precision=args.ns_precision, policy=args.policy, bucket_size=args.bucket_size,
        baselines=args.baselines, megatron_script=args.megatron, profile_dir=args.profile, pgle=args.pgle,
        grad_std=BenchConfig.grad_std if args.grad_std is None else args.grad_std, pipeline_muon=args.pipeline_muon,
    )
    records = run_bench(config)
    if _emit_records(args, records):
        return 0
    first = records[0]
    table = _table(
        f"Optimizer step, {first['workload']} workload ({first['layers']} layers, {_count(first['params'])} params) "
        f"on {first['device']}, jax {first['jax']}; gradient norm (clip 1.0) "
        + ", ".join(f"{r['grad_norm']:.3g} at dp {r['dp']}" for r in records if r["contender"] == "lwjax"),
        ["contender", "dp", "step ms", "back to back", "vs lwjax", "state bytes / device"],
    )
    lwjax_ms = {r["dp"]: r["step_ms"] for r in records if r["contender"] == "lwjax"}
    for r in records:
        nbytes = r.get("state_bytes_per_device")
        table.add_row(r["contender"], str(r["dp"]), f"{r['step_ms']:.2f}",
                      f"{r['back_to_back_ms']:.2f}" if "back_to_back_ms" in r else "—",
                      f"{r['step_ms'] / lwjax_ms[r['dp']]:.2f}x", "—" if nbytes is None else _count(nbytes))
        if "floor_sum_ms" in r:
            table.add_row(f"  floor: RS {r['rs_ms']:.2f} + AG {r['ag_ms']:.2f} + NS {r['ns_ms']:.2f} ms", str(r["dp"]),
                          f"{r['floor_sum_ms']:.2f}", f"{r['floor_sum_back_to_back_ms']:.2f}",
                          f"{r['floor_sum_ms'] / r['step_ms']:.2f}x", "", style="dim")
        if "floor_sum_computed_ms" in r and r["floor_sum_computed_ms"] != r["floor_sum_ms"]:
            table.add_row(f"  the same, FLOPs lwjax computes: NS {r['ns_computed_ms']:.2f} ms", str(r["dp"]),
                          f"{r['floor_sum_computed_ms']:.2f}", "", f"{r['floor_sum_computed_ms'] / r['step_ms']:.2f}x",
                          "", style="dim")
    _console().print(table)
    return 0


def _emit_records(args: argparse.Namespace, records: list[dict]) -> bool:
    """Write ``bench.json`` into ``--out`` if given; print the records as JSON with ``--json`` (then True)."""
    if args.out:
        pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(args.out) / "bench.json").write_text(json.dumps(records, indent=1) + "\n")
    if args.json:
        _print_json(records)
    return args.json


def _bench_train_step(args: argparse.Namespace) -> int:
    """``bench --train-step``: full training steps, lwjax Muon against AdamW; a table, optionally JSON."""
    from lwjax.train_bench import MUON, TrainBenchConfig, run_train_bench

    config = TrainBenchConfig(
        workload=args.workload, layers=args.layers, dp_sizes=tuple(args.dp), seq_len=args.seq_len,
        micro_batch=args.micro_batch, remat=args.remat, iters=args.iters,
        warmup=TrainBenchConfig.warmup if args.warmup is None else args.warmup, param_dtype=args.param_dtype,
        grad_reduce_in_fp32=args.grad_reduce_in_fp32, ns_precision=args.ns_precision,
        policy=args.policy, bucket_size=args.bucket_size, pipeline_muon=args.pipeline_muon, pgle=args.pgle,
        baselines=args.baselines,
    )
    records = run_train_bench(config)
    if _emit_records(args, records):
        return 0
    first = records[0]
    table = _table(
        f"Training step, {first['workload']} workload ({first['layers']} layers, {_count(first['params'])} params), "
        f"{first['micro_batch']} × {first['seq_len']} tokens per device, remat {'on' if first['remat'] else 'off'}, "
        f"{first['param_dtype']}, on {first['device']}, jax {first['jax']}",
        ["contender", "dp", "step ms", "optimizer ms", "tokens/s", "MFU", "Muon overhead", "memory / device"],
    )
    overhead = {(r["dp"], name): pct for r in records if r["contender"] == MUON
                for name, pct in r["muon_overhead_pct"].items()}
    for r in records:
        nbytes = r["compiled_bytes_per_device"]
        pct = overhead.get((r["dp"], r["contender"]))
        table.add_row(
            r["contender"], str(r["dp"]), f"{r['step_ms']:.2f}",
            f"{r['optimizer_ms']:.2f}" if "optimizer_ms" in r else "—", f"{r['tokens_per_s']:,.0f}",
            "—" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%", "—" if pct is None else f"{pct:+.1f}%",
            "—" if nbytes is None else f"{nbytes / 1e9:.2f} GB",
        )
    _console().print(table)
    _console().print(
        "[dim]optimizer ms: step ms minus forward+backward's; Muon overhead: lwjax Muon's step time over this row's, "
        "minus 1; memory: XLA's estimate for the compiled step (arguments + outputs - donated + temporaries).[/]"
    )
    return 0


def _bucket_size(text: str) -> int | str | None:
    if text in ("auto", "none"):
        return None if text == "none" else text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, 'none' or 'auto'; got {text!r}") from None


def _dp_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers; got {text!r}") from None
    return values


def _add_bench_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="time the optimizer step against replicated optax Muon (--train-step: a full training step)",
        description=(
            "Time lwjax's optimizer step against replicated optax Muon on Megatron-shaped workloads: 'step ms' is "
            "the median of synchronised steps, 'back to back' the time per step of steps dispatched without "
            "synchronising, as a training loop runs them (Megatron's times are CUDA-event times). With "
            "--train-step, time a full training step (forward, backward, optimizer) of the workload's Llama with "
            "lwjax Muon, lwjax AdamW (ZeRO-1) and replicated optax AdamW, and report Muon's overhead."
        ),
    )
    p.add_argument("--workload", choices=("small", "1b", "8b"), default="small")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--dp", type=_dp_list, default=[1, 2, 4, 8], help="data-parallel sizes, e.g. 1,2,4,8")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed calls before timing (default 8: a pipelined step's first calls run slow)")
    p.add_argument("--param-dtype", default="bfloat16")
    p.add_argument("--grad-reduce-in-fp32", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--ns-precision", "--muon-fp32-matmul-prec", dest="ns_precision",
                   choices=("highest", "high", "medium"), default="medium")
    p.add_argument("--policy", choices=POLICIES, default=DEFAULT_POLICY)
    p.add_argument("--bucket-size", "--ddp-bucket-size", dest="bucket_size", type=_bucket_size, default="auto",
                   help="elements per bucket, 'none' for one bucket per buffer, or 'auto' (default)")
    p.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--megatron", default=None, metavar="megatron_bench.py",
                   help="also time Megatron-Core with this script (GPU host with megatron-core installed)")
    p.add_argument("--profile", default=None, metavar="DIR", help="trace lwjax steps into DIR and summarise kernels")
    p.add_argument("--pgle", action="store_true",
                   help="compile lwjax's step (with --train-step: every contender's) with profile-guided latency "
                        "estimates (JAX's PGLE)")
    p.add_argument("--grad-std", type=float, default=None,
                   help="std of each device's random gradients (default 1e-2: the clip binds every step); the mean "
                        "gradient's norm is about std*sqrt(params/dp), reported; passed on to Megatron")
    p.add_argument("--pipeline-muon", action="store_true",
                   help="lwjax's Newton-Schulz overlaps the reduce-scatters, speculating that clipping does not bind "
                        "(OptimizerConfig.pipeline_muon)")
    p.add_argument("--train-step", action="store_true",
                   help="time a full training step with lwjax Muon, lwjax AdamW and optax AdamW instead")
    p.add_argument("--seq-len", "--seq-length", dest="seq_len", type=int, default=None,
                   help="with --train-step: tokens per sequence (default 2048; small workload 128)")
    p.add_argument("--micro-batch", "--micro-batch-size", dest="micro_batch", type=int, default=None,
                   help="with --train-step: sequences per device per step (default 4 for 1b, 2 for 8b and small)")
    p.add_argument("--remat", action="store_true",
                   help="with --train-step: recompute each layer's activations in the backward pass")
    p.add_argument("--json", action="store_true", help="print the records as JSON")
    p.add_argument("--out", default=None, help="also write bench.json into this directory")
    p.set_defaults(command=_cmd_bench, command_name="bench")


# --------------------------------------------------------------------------- convert


def _cmd_convert(args: argparse.Namespace) -> int:
    """Convert a checkpoint (Megatron <-> lwjax, or to safetensors); show progress and a summary table."""
    import math

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from lwjax.megatron.convert import ConvertConfig, convert

    config = ConvertConfig(
        src=args.src, dst=args.dst, to=args.to, reader=args.reader, iteration=args.iteration,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        overwrite=args.overwrite,
    )
    console = _console()
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, disable=args.json) as progress:
        task = progress.add_task("converting", total=3)

        def report(stage: str, done: int, total: int) -> None:
            progress.update(task, description=stage, completed=done, total=total)

        summary = convert(config, progress=report)
    if args.json:
        _print_json({"source": summary.source, "target": summary.target, "src": summary.src, "dst": summary.dst,
                     "iteration": summary.iteration, "seconds": summary.seconds, "notes": summary.notes,
                     "params": [{"key": k, "shape": list(s), "dtype": d, "state": st} for k, s, d, st in summary.rows]})
        return 0
    notes = ", ".join(f"{k} {v}" for k, v in summary.notes.items() if v is not None)
    table = _table(
        f"{summary.src} ({summary.source}) -> {summary.dst} ({summary.target}) · iteration {summary.iteration}"
        f" · {summary.seconds:.2f} s",
        ["parameter", "shape", "dtype", "optimizer state"], text_columns=4,
    )
    for key, shape, dtype, state in summary.rows:
        table.add_row(key, "×".join(map(str, shape)), dtype, state)
    numel = sum(math.prod(shape) for _, shape, _, _ in summary.rows)
    table.add_row(f"{len(summary.rows)} parameters", _count(numel), "", "", style="bold")
    console.print(table)
    if notes:
        console.print(f"[dim]source: {notes}[/]")
    return 0


def _add_convert_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "convert",
        help="convert checkpoints: Megatron -> lwjax or safetensors, lwjax -> Megatron torch_dist or safetensors",
        description=(
            "Convert a Megatron-Core checkpoint (torch_dist or legacy torch) into an lwjax checkpoint, or into "
            "safetensors when DST ends in .safetensors; or an lwjax checkpoint into Megatron torch_dist."
        ),
    )
    p.add_argument("src", metavar="SRC", help="Megatron checkpoint directory or lwjax checkpoint directory")
    p.add_argument("dst", metavar="DST", help="output directory, or FILE.safetensors")
    p.add_argument("--to", choices=("lwjax", "safetensors", "torch_dist"), default=None,
                   help="output format (default: inferred from SRC and DST)")
    p.add_argument("--reader", choices=("numpy", "torch"), default="numpy",
                   help="read Megatron files without torch (default) or through torch")
    p.add_argument("--iteration", type=int, default=None, help="Megatron iteration (default: the latest)")
    p.add_argument("--num-attention-heads", type=int, default=None,
                   help="for checkpoints whose args do not record it")
    p.add_argument("--num-query-groups", type=int, default=None, help="for checkpoints whose args do not record it")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(command=_cmd_convert, command_name="convert")


# --------------------------------------------------------------------------- demo


def _cmd_demo(args: argparse.Namespace) -> int:
    """Train the demo GPT with lwjax and a baseline; print the summary, write metrics.json and loss.png."""
    from lwjax.demo.run import DemoConfig, run_demo

    fields = {f.name for f in dataclasses.fields(DemoConfig)}
    options = {name: value for name, value in vars(args).items() if name in fields}
    config = DemoConfig(**{**options, "progress": args.progress and not args.json})
    metrics = run_demo(config, console=_console())
    if args.json:
        _print_json(metrics)
    return 0


def _add_demo_parser(subparsers) -> None:
    from lwjax.demo.run import BASELINES, DemoConfig  # jax-free module

    default = {f.name: f.default for f in dataclasses.fields(DemoConfig)}
    p = subparsers.add_parser(
        "demo",
        help="train a small GPT on Python-stdlib bytes with lwjax, then with AdamW, and compare",
        description=(
            "Train a small GPT (flax nnx) on the bytes of the Python standard library with layer-wise Muon on all "
            "local devices (8 virtual CPU devices without an accelerator), then the same model from the same "
            "initial weights on the same batches with a replicated optax baseline. Prints a summary table and "
            "writes metrics.json and loss.png into --out."
        ),
    )
    p.add_argument("--steps", type=int, default=default["steps"], help="training steps per run (default %(default)s)")
    p.add_argument("--model-size", "--size", dest="model_size", default=default["model_size"],
                   help="tiny, small or base (default %(default)s)")
    p.add_argument("--devices", type=int, default=None, help="data-parallel devices (default: all local devices)")
    p.add_argument("--batch-size", "--global-batch-size", dest="batch_size", type=int, default=default["batch_size"],
                   help="global batch in sequences, a multiple of the device count (default %(default)s)")
    p.add_argument("--seq-len", "--seq-length", dest="seq_len", type=int, default=default["seq_len"],
                   help="bytes per sequence (default %(default)s)")
    p.add_argument("--learning-rate", "--lr", dest="learning_rate", type=float, default=default["learning_rate"],
                   help="lwjax peak learning rate (default %(default)s)")
    p.add_argument("--baseline", choices=BASELINES, default=default["baseline"],
                   help="the comparison run (default %(default)s)")
    p.add_argument("--baseline-learning-rate", "--baseline-lr", dest="baseline_learning_rate", type=float,
                   default=None, help="baseline peak learning rate (default: tuned per baseline)")
    p.add_argument("--warmup-steps", type=int, default=default["warmup_steps"])
    p.add_argument("--weight-decay", type=float, default=default["weight_decay"])
    p.add_argument("--clip-grad", type=float, default=default["clip_grad"])
    p.add_argument("--eval-every", type=int, default=default["eval_every"],
                   help="validation period in steps; 0: only at the start and the end (default %(default)s)")
    p.add_argument("--eval-windows", type=int, default=default["eval_windows"],
                   help="validation sequences (default %(default)s)")
    p.add_argument("--seed", type=int, default=default["seed"])
    p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=default["scan_layers"],
                   help="the scan-over-layers model variant")
    p.add_argument("--fused-qkv", action=argparse.BooleanOptionalAction, default=default["fused_qkv"],
                   help="one fused QKV projection, routed with qkv_split (default on)")
    p.add_argument("--tied-embedding", action=argparse.BooleanOptionalAction, default=default["tied_embedding"],
                   help="tie the output head to the embedding")
    p.add_argument("--out", default=default["out"], metavar="DIR",
                   help="directory for metrics.json and loss.png (default %(default)s)")
    p.add_argument("--max-corpus-bytes", type=int, default=None, help="read at most this many stdlib bytes")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="progress bars and the summary table (default on)")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON instead of the table")
    p.set_defaults(command=_cmd_demo, command_name="demo")


# --------------------------------------------------------------------------- launch


def _cmd_launch(args: argparse.Namespace) -> int:
    """Run the command as N local processes of one jax.distributed job; return the launcher's exit status."""
    from lwjax.launch import LaunchConfig, launch

    command = args.program[1:] if args.program[:1] == ["--"] else args.program
    config = LaunchConfig(
        command=tuple(command), nproc=args.nproc, devices_per_proc=args.devices_per_proc, timeout=args.timeout,
        heartbeat_timeout=args.heartbeat_timeout, init_timeout=args.init_timeout,
        stop_on_failure=args.stop_on_failure, grace=args.grace, bind_gpus=args.bind_gpus, port=args.port,
        show_gloo=args.show_gloo,
    )
    try:
        return launch(config).returncode
    except FileNotFoundError as err:
        raise ValueError(f"{command[0]}: no such program ({err.strerror}).") from None
    except KeyboardInterrupt:
        print("lwjax launch: interrupted; stopped every process.", file=sys.stderr)
        return 130


def _add_launch_parser(subparsers) -> None:
    from lwjax.launch import DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_INIT_TIMEOUT  # jax-free module

    p = subparsers.add_parser(
        "launch",
        help="run a script as N local processes of one jax.distributed job (multi-host on one machine)",
        description=(
            "Start N copies of a command on this machine as one jax.distributed job: a free coordinator port, "
            "LWJAX_* variables that lwjax.distributed.initialize() reads, K virtual CPU devices per process. "
            "Output is forwarded line by line as '[p<i>] ...'. When a process fails, the others are stopped and "
            "the exit status names the failure (the failed process's status, 128+signal, or 124 on --timeout)."
        ),
        epilog="example: lwjax launch --nproc 2 --devices-per-proc 4 -- python examples/nnx_gpt.py --steps 20",
    )
    p.add_argument("--nproc", type=int, default=2, help="processes (default %(default)s)")
    p.add_argument("--devices-per-proc", type=int, default=None, metavar="K",
                   help="virtual CPU devices per process; with --bind-gpus also GPUs per process")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="kill every process and fail after S seconds (default: no limit)")
    p.add_argument("--heartbeat-timeout", type=int, default=DEFAULT_HEARTBEAT_TIMEOUT, metavar="S",
                   help="seconds before JAX declares a silent process dead (default %(default)s)")
    p.add_argument("--init-timeout", type=int, default=DEFAULT_INIT_TIMEOUT, metavar="S",
                   help="seconds for all processes to connect (default %(default)s)")
    p.add_argument("--stop-on-failure", action=argparse.BooleanOptionalAction, default=True,
                   help="stop the other processes when one fails (default on)")
    p.add_argument("--grace", type=float, default=3.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping processes (default %(default)s)")
    p.add_argument("--bind-gpus", action="store_true",
                   help="give each process its own K GPUs through CUDA_VISIBLE_DEVICES")
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    p.add_argument("--show-gloo", action="store_true", help="also forward gloo's 'connected to N peer ranks' lines")
    p.add_argument("program", nargs=argparse.REMAINDER, metavar="-- PROGRAM [ARGS ...]",
                   help="the command each process runs, after --")
    p.set_defaults(command=_cmd_launch, command_name="launch")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lwjax", description="Megatron-Core's layer-wise distributed Muon optimizer in JAX.")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    _add_layout_parser(subparsers)
    _add_bench_parser(subparsers)
    _add_convert_parser(subparsers)
    _add_demo_parser(subparsers)
    _add_launch_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``lwjax`` command line; return the exit status.

    Args:
      argv: Arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
      0 on success, 2 on a user error (after printing one line on stderr).
    """
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except _UsageError as err:
        print(err, file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exit_:  # --help
        return exit_.code if isinstance(exit_.code, int) else 0
    try:
        return args.command(args)
    except ValueError as err:
        print(f"lwjax {args.command_name}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # stdout was closed early, e.g. piped into `head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
