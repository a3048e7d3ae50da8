"""The tables of ``lwjax layout``: buffers and their shards, the model summary, policies compared,
sharding groups.

Each function reads the summaries of :mod:`lwjax.tools.layout_report` and draws
them with :mod:`lwjax.tools.render`'s helpers; ``rich`` is imported only there,
and nothing here imports jax.
"""

from __future__ import annotations

from collections.abc import Sequence

from lwjax.groups import GroupChoice
from lwjax.layout import DEFAULT_POLICY, LayoutConfig
from lwjax.tools.fit_table import Column
from lwjax.tools.layout_report import BufferSummary, LayoutSummary, PolicyResult
from lwjax.tools.render import console, count, flops, pct, ratio, table

MAX_SHARD_ROWS = 64  # list shards under every bucket while buckets * dp stays below this


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


def _shard_rows(rows, shards, bucket_start: int | None, shard_size: int | None) -> None:
    """Rows of one shard each, with its loads relative to the mean."""
    mean_numel = sum(s.numel for s in shards) / len(shards)
    mean_flops = sum(s.ns_flops for s in shards) / len(shards)
    for load in shards:
        start = None if bucket_start is None else bucket_start + load.shard * shard_size
        where = "" if start is None else f"[{start:,}, {start + shard_size:,})"
        rows.add_row(
            "",
            f"shard {load.shard}",
            where,
            str(load.num_params),
            count(load.numel),
            flops(load.ns_flops),
            "",
            ratio(load.numel / mean_numel if mean_numel else None),
            ratio(load.ns_flops / mean_flops if mean_flops else None),
            style="dim",
        )


def _render_buffer(out, index: int, buffer: BufferSummary) -> None:
    """One buffer: a row per bucket (with its shards while few), then the buffer's total."""
    rows = table(
        _buffer_title(index, buffer),
        (
            Column("bucket", text=True),
            Column("shard", text=True),
            Column("range", drop=3),
            Column("params", drop=2),
            Column("elements"),
            Column("NS FLOPs", drop=1),
            Column("padding"),
            Column("max/mean el."),
            Column("max/mean FLOPs"),
        ),
    )
    with_shards = len(buffer.buckets) * buffer.num_shards <= MAX_SHARD_ROWS
    for bucket in buffer.buckets:
        rows.add_row(
            str(bucket.bucket_id),
            "all",
            f"[{bucket.start:,}, {bucket.end:,})",
            str(bucket.num_params),
            count(bucket.real_numel),
            flops(bucket.ns_flops),
            pct(bucket.padding_pct),
            ratio(bucket.numel_balance),
            ratio(bucket.flops_balance),
            end_section=not with_shards,
        )
        if with_shards:
            shard_size = bucket.numel // buffer.num_shards
            _shard_rows(rows, bucket.shards, bucket.start, shard_size)
            rows.end_section()
    if len(buffer.buckets) > 1 or not with_shards:
        rows.add_row(
            "total",
            "all",
            f"[0, {buffer.numel:,})",
            str(buffer.num_params),
            count(buffer.real_numel),
            flops(buffer.ns_flops),
            pct(buffer.padding_pct),
            ratio(buffer.numel_balance),
            ratio(buffer.flops_balance),
            style="bold",
        )
        if buffer.num_shards <= MAX_SHARD_ROWS:
            _shard_rows(rows, buffer.shards, None, None)
    out.print(rows)


def _render_summary(out, summary: LayoutSummary, layout_ms: float) -> None:
    """A row per buffer and per group of equally sharded ranks."""
    rows = table(
        f"Model summary (layout computed in {layout_ms:.1f} ms)",
        (
            Column("buffer", text=True, fold=True),
            Column("shards", drop=5),
            Column("params", drop=4),
            Column("buckets", drop=3),
            Column("elements"),
            Column("buffer size", drop=2),
            Column("padding"),
            Column("NS FLOPs", drop=1),
            Column("max/mean el."),
            Column("max/mean FLOPs"),
        ),
    )
    for i, buffer in enumerate(summary.buffers):
        rows.add_row(
            f"{i}: {_buffer_label(buffer)}",
            str(buffer.num_shards),
            str(buffer.num_params),
            str(len(buffer.buckets)),
            count(buffer.real_numel),
            count(buffer.numel),
            pct(buffer.padding_pct),
            flops(buffer.ns_flops),
            ratio(buffer.numel_balance),
            ratio(buffer.flops_balance),
            end_section=i == len(summary.buffers) - 1,
        )
    for ranks in summary.ranks:
        label = "model" if len(summary.ranks) == 1 else f"ranks of {ranks.num_shards}-way buffers"
        alike = [b for b in summary.buffers if b.num_shards == ranks.num_shards]
        rows.add_row(
            label,
            str(ranks.num_shards),
            str(sum(b.num_params for b in alike)),
            str(sum(len(b.buckets) for b in alike)),
            count(ranks.real_numel),
            count(ranks.numel),
            pct(ranks.padding_pct),
            flops(ranks.ns_flops),
            ratio(ranks.numel_balance),
            ratio(ranks.flops_balance),
            style="bold",
        )
    out.print(rows)


def _render_per_rank(out, summary: LayoutSummary) -> None:
    """A row per rank of each group of equally sharded buffers, while the ranks are few."""
    for ranks in summary.ranks:
        if ranks.num_shards > MAX_SHARD_ROWS:
            continue
        per_rank = table(
            f"Per rank, all {ranks.num_shards}-way buffers",
            (
                Column("rank"),
                Column("params", drop=1),
                Column("elements"),
                Column("NS FLOPs"),
                Column("el. / mean"),
                Column("FLOPs / mean"),
            ),
        )
        mean_numel = ranks.real_numel / ranks.num_shards
        mean_flops = ranks.ns_flops / ranks.num_shards
        for load in ranks.shards:
            per_rank.add_row(
                str(load.shard),
                str(load.num_params),
                count(load.numel),
                flops(load.ns_flops),
                ratio(load.numel / mean_numel if mean_numel else None),
                ratio(load.ns_flops / mean_flops if mean_flops else None),
            )
        out.print(per_rank)


def print_layout(
    result: PolicyResult,
    *,
    model: str,
    specs: Sequence,
    dp: int,
    expert_dp: int | None,
    layout: LayoutConfig,
    num_ns_steps: int,
) -> None:
    """Print one policy's layout of ``model``: a heading, each buffer, the summary, each rank."""
    out = console()
    total = sum(spec.numel for spec in specs)
    out.print(
        f"[bold]{model}[/]: {len(specs)} params, {count(total)} elements · dp {dp}"
        + (f" · expert dp {expert_dp}" if expert_dp is not None else "")
        + f" · policy {layout.policy} · bucket size {layout.bucket_size}"
        + f" · high busbw {'on' if layout.high_busbw else 'off'} · {num_ns_steps} NS steps"
    )
    for i, buffer in enumerate(result.summary.buffers):
        _render_buffer(out, i, buffer)
    _render_summary(out, result.summary, result.layout_ms)
    _render_per_rank(out, result.summary)


def _best(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def print_comparison(
    results: Sequence[PolicyResult],
    *,
    model: str,
    specs: Sequence,
    dp: int,
    expert_dp: int | None,
    layout: LayoutConfig,
) -> None:
    """Print the policies' layouts of ``model`` side by side, the best of each column in green."""
    out = console()
    total = sum(spec.numel for spec in specs)
    title = (
        f"Policies for {model}: {len(specs)} params, {count(total)} elements, dp {dp}"
        + (f", expert dp {expert_dp}" if expert_dp is not None else "")
        + f", bucket size {layout.bucket_size}, high busbw {'on' if layout.high_busbw else 'off'}"
    )
    rows = table(
        title,
        (
            Column("policy", text=True),
            Column("buckets", drop=3),
            Column("buffer size", drop=2),
            Column("padding"),
            Column("max/mean el."),
            Column("max/mean NS FLOPs"),
            Column("max rank NS FLOPs", drop=1),
            Column("layout ms", drop=4),
        ),
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
        rows.add_row(
            result.policy + (" (default)" if result.policy == DEFAULT_POLICY else ""),
            str(s.num_buckets),
            count(s.numel),
            mark(pct(s.padding_pct), s.padding_pct, best_padding),
            mark(ratio(s.numel_balance), s.numel_balance, best_numel),
            mark(ratio(s.flops_balance), s.flops_balance, best_flops),
            flops(max_rank_flops),
            f"{result.layout_ms:.1f}",
        )
    out.print(rows)


def comparison_json(results: Sequence[PolicyResult]) -> list[dict]:
    """The policies' summaries as the JSON of ``layout --compare --json``."""
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


def print_groups(choice: GroupChoice, *, model: str, specs: Sequence, dp: int) -> None:
    """Print every sharding-group option weighed for ``dp`` ranks, the chosen one in green,
    and the choice's notes."""
    out = console()
    total = sum(spec.numel for spec in specs)
    chosen = choice.option
    holds = "holds" if choice.holds_bounds else "misses"
    rows = table(
        f"Sharding groups for {model}: {count(total)} elements, dp {dp}, "
        f"{chosen.devices_per_rank} device(s) per rank; chosen: groups of {chosen.shards} "
        f"({chosen.policy}), {holds} padding <= {100 * choice.max_padding:g}% and NS <= "
        f"{choice.max_ns_ratio:g}x the least ({flops(choice.least_ns_flops)})",
        (
            Column("group size"),
            Column("groups", drop=3),
            Column("policy", text=True),
            Column("buffer size", drop=2),
            Column("padding"),
            Column("state el./device", drop=4),
            Column("grad el. sent/device", drop=1),
            Column("max device NS FLOPs"),
            Column("NS / least"),
            Column("hosts", drop=5),
        ),
    )
    for option in choice.options:
        cells = [
            str(option.shards),
            str(option.replicas),
            option.policy,
            count(option.numel),
            pct(100 * option.padding),
            count(option.state_numel_per_device),
            count(round(option.reduced_numel_per_device)),
            flops(option.max_device_ns_flops),
            f"{choice.ns_ratio(option):.2f}x",
            "-" if option.hosts is None else str(option.hosts),
        ]
        if option is chosen:
            cells = [f"[bold green]{c}[/]" for c in cells]
        rows.add_row(*cells)
    out.print(rows)
    for note in choice.notes:
        out.print(note)


def groups_json(choice: GroupChoice) -> list[dict]:
    """The sharding-group options as the JSON of ``layout --groups --json``."""
    return [
        {
            "shards": o.shards,
            "replicas": o.replicas,
            "policy": o.policy,
            "numel": o.numel,
            "real_numel": o.real_numel,
            "padding": o.padding,
            "state_numel_per_device": o.state_numel_per_device,
            "reduced_numel_per_device": o.reduced_numel_per_device,
            "max_rank_ns_flops": o.max_rank_ns_flops,
            "max_device_ns_flops": o.max_device_ns_flops,
            "ns_ratio": choice.ns_ratio(o),
            "hosts": o.hosts,
            "chosen": o is choice.option,
        }
        for o in choice.options
    ]
