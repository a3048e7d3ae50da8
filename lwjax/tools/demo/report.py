"""The demo's outputs: a rich summary table, a loss-curve PNG and a metrics JSON.

Everything here reads the metrics dict that :func:`lwjax.tools.demo.run.run_demo`
returns; nothing trains or touches devices.
"""

from __future__ import annotations

import json
import math
import pathlib


def _bytes(n: int) -> str:
    """Bytes with a binary prefix."""
    for scale, suffix in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{n} B"


def summary_table(metrics: dict):
    """A table with one row per run (:class:`~lwjax.tools.fit_table.FitTable`)."""
    from lwjax.tools.fit_table import Column
    from lwjax.tools.render import table

    data, devices = metrics["data"], metrics["devices"]
    title = (
        f"lwjax demo · {metrics['model']['size']} GPT "
        f"({metrics['model']['num_params']:,} params) · "
        f"{devices['count']} {devices['platform']} devices · {metrics['config']['steps']} steps"
    )
    unigram = data["unigram_entropy"]
    caption = (
        f"losses in nats/byte; unigram baseline {unigram:.3f} "
        f"({unigram / math.log(2):.2f} bits/byte); "
        f"train loss averaged over the last 10 steps; val on {data['val_tokens']:,} held-out bytes "
        f"of {data['num_files']} stdlib files"
    )
    columns = (
        Column("optimizer", text=True, fold=True),
        Column("final train loss", drop=1),
        Column("val loss"),
        Column("vs unigram", drop=2),
        Column("step time"),
        Column("tokens/s", drop=3),
        Column("opt. state / device"),
    )
    rows = table(title, columns, caption=caption)
    for run in metrics["runs"].values():
        rows.add_row(
            run["optimizer"],
            f"{run['final_train_loss']:.3f}",
            f"{run['final_val_loss']:.3f}",
            f"{run['final_val_loss'] - unigram:+.3f}",
            f"{1e3 * run['step_time_s']:.0f} ms",
            f"{run['tokens_per_s']:,.0f}",
            _bytes(run["state_bytes_per_device"]),
        )
    return rows


def _smooth(values: list[float]) -> list[float]:
    """Centred moving average (no lag), over about 4 % of the curve, narrower at the ends."""
    half = max(1, len(values) // 50)
    return [
        sum(values[max(0, i - half) : i + half + 1]) / len(values[max(0, i - half) : i + half + 1])
        for i in range(len(values))
    ]


def write_plot(metrics: dict, path: str | pathlib.Path) -> pathlib.Path:
    """Plot each run's loss curves and the unigram baseline into a PNG at ``path``.

    Training loss is drawn raw and smoothed, validation loss at its evaluation steps.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    path = pathlib.Path(path)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    colors = ("tab:blue", "tab:orange", "tab:green")
    for color, run in zip(colors, metrics["runs"].values()):
        losses = run["train_losses"]
        steps = range(1, len(losses) + 1)
        ax.plot(steps, losses, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(steps, _smooth(losses), color=color, label=f"{run['optimizer']} (train, smoothed)")
        val_steps, val = zip(*run["val_losses"])
        ax.plot(
            val_steps,
            val,
            color=color,
            linestyle="--",
            marker="o",
            markersize=4,
            label=f"{run['optimizer']} (val)",
        )
    unigram = metrics["data"]["unigram_entropy"]
    ax.axhline(unigram, color="gray", linestyle=":", label=f"unigram baseline ({unigram:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(f"lwjax demo: {metrics['model']['size']} GPT on Python stdlib bytes")
    ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_json(metrics: dict, path: str | pathlib.Path) -> pathlib.Path:
    """Write the metrics as indented JSON."""
    path = pathlib.Path(path)
    path.write_text(json.dumps(metrics, indent=1) + "\n")
    return path
