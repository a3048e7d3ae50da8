"""Megatron-Core's own benchmarks, run as scripts under ``torchrun`` beside lwjax's.

``docs/scripts/megatron_bench.py`` times Megatron's layer-wise optimizer step
(:func:`megatron_optimizer_step`), ``docs/scripts/megatron_train_bench.py`` its training step
(:func:`megatron_train_records`). Each prints one JSON line; the benches run them before JAX
starts, since XLA then holds most of each GPU's memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from lwjax.tools.bench.workloads import workload_config

# docs/scripts/megatron_train_bench.py's contenders, as the records name them.
MEGATRON_CONTENDERS = {
    "muon": "Megatron-Core Muon (layer-wise)",
    "muon_overlap": "Megatron-Core Muon (layer-wise), overlapped",
    "adam": "Megatron-Core Adam (distributed)",
    "adam_overlap": "Megatron-Core Adam (distributed), overlapped",
    "fwd_bwd": "Megatron-Core forward+backward",
}


def run_torch_script(script: str, nproc: int, args: list[str], timeout: int) -> dict:
    """Run ``script`` under torchrun on ``nproc`` processes and return the JSON object of the
    last stdout line that starts with ``{`` (the Megatron scripts' result).

    ``OUT`` is removed from the environment, so the script writes no file of its own.

    Raises:
      RuntimeError: the script failed or printed no JSON line (its stderr's end attached).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", script]
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    done = subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, timeout=timeout)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(
            f"{os.path.basename(script)} failed (rc {done.returncode}): {done.stderr[-2000:]}"
        )
    return json.loads(lines[-1])


def megatron_optimizer_step(cfg, dp: int) -> dict:
    """Run Megatron-Core's layer-wise Muon on ``dp * cfg.tp`` GPUs (torchrun) and read its
    JSON line: the fields of its record in ``lwjax bench`` (``cfg``: the
    :class:`~lwjax.tools.bench.config.BenchConfig`).

    At ``cfg.tp > 1`` the script (``docs/scripts/megatron_bench.py``; the copy
    in ``shared/perf`` has no tensor parallelism) gets ``--tp`` and
    ``--muon-tp-mode``; at tp 1 neither, so either script runs it.
    """
    if cfg.workload not in ("8b", "1b"):
        raise ValueError(
            "BenchConfig.megatron_script: Megatron runs the 8b and 1b workloads only; "
            f"got {cfg.workload!r}."
        )
    layers = workload_config(cfg.workload, cfg.layers).num_layers
    args = [
        "--preset",
        cfg.workload,
        "--layers",
        str(layers),
        "--iters",
        str(cfg.iters),
        "--warmup",
        str(cfg.warmup),
        "--ns-prec",
        cfg.ns_precision,
        "--grad-std",
        repr(cfg.grad_std),
    ]
    if not cfg.grad_reduce_in_fp32:
        args.append("--no-grad-reduce-in-fp32")
    if cfg.tp > 1:
        args += ["--tp", str(cfg.tp), "--muon-tp-mode", cfg.tp_mode]
    result = run_torch_script(cfg.megatron_script, dp * cfg.tp, args, timeout=900)
    if cfg.tp > 1 and result.get("tp_size") != cfg.tp:
        raise RuntimeError(
            f"megatron bench: asked for tp={cfg.tp}, the script ran tp={result.get('tp_size')} "
            "(use docs/scripts/megatron_bench.py, which has --tp)."
        )
    timing = result["timing"]
    return dict(
        step_ms=timing["total_ms"]["median"],
        reduce_ms=timing["reduce_ms"]["median"],
        optimizer_step_ms=timing["step_ms"]["median"],
        peak_mem_bytes=max(r.get("peak_mem_bytes", 0) for r in result["per_rank"]),
        breakdown_ms=result["step_breakdown_ms_median_per_rank"],
        versions=result["versions"],
    )


def megatron_train_records(cfg, dp: int, tokens: int) -> list[dict]:
    """Megatron-Core's training step on ``dp`` GPUs (torchrun of ``cfg.megatron_script``),
    one record per contender it ran (:data:`MEGATRON_CONTENDERS`).

    ``optimizer_ms`` is against Megatron's own forward+backward, and each Muon
    record's ``muon_overhead_pct`` against Megatron's Adam with the same overlap.
    A contender the script skipped is reported with its reason, not dropped. ``cfg`` is the
    :class:`~lwjax.tools.bench.config.TrainBenchConfig`.
    """
    args = [
        *("--preset", cfg.workload, "--layers", str(cfg.model().num_layers)),
        *("--seq-len", str(cfg.seq_len), "--micro-batch", str(cfg.micro_batch)),
        *("--iters", str(cfg.iters), "--warmup", str(cfg.warmup)),
        *("--lr", repr(cfg.learning_rate), "--weight-decay", repr(cfg.weight_decay)),
        *("--clip-grad", repr(cfg.clip_grad or 0.0), "--ns-prec", cfg.ns_precision),
        "--grad-reduce-in-fp32" if cfg.grad_reduce_in_fp32 else "--no-grad-reduce-in-fp32",
        *(["--recompute"] if cfg.remat else []),
    ]
    result = run_torch_script(cfg.megatron_script, dp, args, timeout=1800)
    ran = result["contenders"]
    floor = ran.get("fwd_bwd", {}).get("median_ms")
    records = []
    for key, name in MEGATRON_CONTENDERS.items():
        r = ran.get(key)
        if r is None:
            continue
        if "median_ms" not in r:
            records.append(dict(contender=name, skipped=r.get("skipped", "no time reported")))
            continue
        record = dict(
            contender=name,
            step_ms=r["median_ms"],
            tokens_per_s=tokens / (r["median_ms"] / 1e3),
            compiled_bytes_per_device=None,
            measured_peak_bytes=r.get("peak_mem_bytes"),
            flags=r.get("flags"),
            megatron=result.get("config", {}).get("versions"),
            attention=result.get("config", {}).get("attention"),
        )
        if r.get("skipped"):  # flags it ran without: named in the table too
            record["skipped_flags"] = r["skipped"]
            record["contender"] = f"{name} (without {', '.join(map(str, r['skipped']))})"
        if floor and key != "fwd_bwd":
            record["optimizer_ms"] = r["median_ms"] - floor
        adam = ran.get(key.replace("muon", "adam"), {}).get("median_ms")
        if key.startswith("muon") and adam:
            record["muon_overhead_pct"] = {
                MEGATRON_CONTENDERS[key.replace("muon", "adam")]: 100 * (r["median_ms"] / adam - 1)
            }
        records.append(record)
    return records
