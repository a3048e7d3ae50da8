#!/usr/bin/env python3
"""Time Megatron-Core's full training step: layer-wise distributed Muon against Adam.

Target: megatron-core 0.19.2 + emerging_optimizers 0.3.0 at TP 1, PP 1, data parallel over
all ranks, on the model shapes of lwjax's training-step benchmark (lwjax/tools/bench/train_bench.py:
the GPT of megatron_bench.py's PRESETS, random tokens reused every step, micro_batch
sequences of seq_len tokens per rank, different on every rank).

Every contender builds its own model (same seed, so the same weights), DDP and optimizer,
and times what megatron/training/training.py::train_step runs for one micro-batch:
  zero_grad_buffer + optimizer.zero_grad
  forward_backward_no_pipelining (forward, loss, backward; finalize_model_grads at its end:
      the grad reduce-scatter, or with overlap_grad_reduce the wait for the reduce-scatters
      that backward started bucket by bucket)
  optimizer.step() (grad norm, clip, update, param all-gather unless overlap_param_gather
      defers it to the next forward's pre-hooks) + the learning-rate scheduler's step

Contenders (--contenders, all by default):
  fwd_bwd       forward + backward into the DDP grad buffers only: no grad sync, no optimizer
                (the floor that the others' overhead is measured against)
  adam          --optimizer adam --use-distributed-optimizer (DistributedOptimizer, ZeRO-1)
  muon          --optimizer muon --use-distributed-optimizer, i.e. the layer-wise layout path:
                ChainedOptimizer([LayerWiseDistributedOptimizer(Muon), DistributedOptimizer(Adam
                for embedding, output layer and norms)]), built as megatron_bench.py builds it
  adam_overlap  adam + --overlap-grad-reduce --overlap-param-gather
  muon_overlap  muon + --overlap-grad-reduce --overlap-param-gather (where the layer-wise
                optimizer supports it; otherwise the dropped flag is named in the JSON)
The overlap contenders use Megatron-LM's default bucket size, max(40M, 1M x dp) elements
(--bucket-size overrides it); without overlap_grad_reduce DDP keeps one bucket per buffer.
As in training.py, the forward pre-hooks of overlap_param_gather are off for the first step.

Attention is the local spec's DotProductAttention (unfused QK^T, causal softmax in torch, AV):
no TransformerEngine, apex or flash attention is used.

GPU:  torchrun --nproc-per-node 2 docs/scripts/megatron_train_bench.py --preset 1b
      torchrun --nproc-per-node 2 docs/scripts/megatron_train_bench.py --preset 8b \\
          --contenders fwd_bwd,adam,muon
CPU:  torchrun --nproc-per-node 2 docs/scripts/megatron_train_bench.py --preset tiny \\
          --layers 2 --cpu --iters 2 --warmup 1
Rank 0 prints one JSON line at the end (prefix-free; last line of stdout) and writes it to
$OUT/megatron_train_bench.json when OUT is set. Times are per step, the maximum over ranks of
each iteration's CUDA-event time (perf_counter on CPU), then the median and min over iterations.
"""

import argparse
import collections
import contextlib
import gc
import importlib.util
import inspect
import json
import logging
import os
import statistics
import time
import traceback
import warnings
from functools import partial

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_megatron_bench():
    """The optimizer-step bench beside this file (its presets, shim path and helpers)."""
    spec = importlib.util.spec_from_file_location(
        "megatron_bench", os.path.join(HERE, "megatron_bench.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MB = _load_megatron_bench()
PRESETS = MB.PRESETS
CONTENDERS = ("fwd_bwd", "adam", "muon", "adam_overlap", "muon_overlap")
# (layers, seq_len, micro_batch) when not given: lwjax's WORKLOADS layers and TRAIN_DEFAULTS.
TRAIN_DEFAULTS = {"1b": (16, 2048, 4), "8b": (4, 2048, 2), "tiny": (2, 64, 2)}
ATTENTION = (
    "megatron-core local spec DotProductAttention: unfused QK^T, torch softmax with a causal "
    "mask, AV (no TransformerEngine, apex or flash attention)"
)
CPU_NOTE = (
    "cpu_shim: CUDA streams and events are no-ops and the collectives run on gloo (async where "
    "Megatron asks), so on CPU the overlap contenders check the code path, not the overlap"
)


def parse_args():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    ap.add_argument("--layers", type=int, default=None, help="num_layers (default per preset)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    ap.add_argument("--micro-batch", type=int, default=None, help="sequences per rank and step")
    ap.add_argument("--iters", type=int, default=10, help="timed steps per contender")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--cpu", action="store_true", help="gloo + cpu_shim (verification only)")
    ap.add_argument("--shim", default=MB.DEFAULT_SHIM, help="path of cpu_shim.py (with --cpu)")
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help="comma list")
    ap.add_argument("--recompute", action="store_true", help="full activation recompute")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--clip-grad", type=float, default=1.0)
    ap.add_argument(
        "--grad-reduce-in-fp32",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fp32 DDP grad buffers and reduce-scatter (--accumulate-allreduce-grads-in-fp32)",
    )
    ap.add_argument(
        "--ns-prec",
        choices=["medium", "high", "highest"],
        default="medium",
        help="muon_fp32_matmul_prec (medium = bf16 Newton-Schulz, Megatron's default)",
    )
    ap.add_argument(
        "--bucket-size",
        type=int,
        default=None,
        help="DDP bucket size of the overlap contenders in elements "
        "(default: Megatron-LM's max(40M, 1M x dp))",
    )
    ap.add_argument(
        "--check-for-nan-in-grad",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="DDP check_for_nan_in_grad (Megatron-LM's CLI turns it on)",
    )
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    layers, seq_len, micro_batch = TRAIN_DEFAULTS[a.preset]
    a.layers = a.layers or layers
    a.seq_len = a.seq_len or seq_len
    a.micro_batch = a.micro_batch or micro_batch
    a.contenders = [c.strip() for c in a.contenders.split(",") if c.strip()]
    unknown = set(a.contenders) - set(CONTENDERS)
    if unknown:
        ap.error(f"unknown contenders {sorted(unknown)}; choose from {CONTENDERS}")
    return a


def init_distributed(a):
    """Process group (nccl on GPU, gloo with the CPU shim); plain `python` runs world size 1."""
    if a.cpu:
        MB.load_shim(a.shim)  # must precede the megatron imports
    import torch
    import torch.distributed as dist

    MB.single_rank_env()
    if a.cpu:
        dist.init_process_group("gloo")
    else:
        assert torch.cuda.is_available(), "no CUDA device; use --cpu for the CPU check"
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")

    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1
    )


def cpu_rng_patches():
    """CPU only: no CUDA RNG to fork (dropout is 0) or for the recompute checkpoint to save."""
    from megatron.core.tensor_parallel import random

    random.get_cuda_rng_tracker().fork = lambda *x, **k: contextlib.nullcontext()
    random._get_cuda_rng_state = lambda *x, **k: None
    random._set_cuda_rng_state = lambda *x, **k: None


def layerwise_overlap_param_gather():
    """(supported, evidence): does LayerWiseDistributedOptimizer defer its param all-gather
    to DDP's forward pre-hooks when OptimizerConfig.overlap_param_gather is set?"""
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer as LW

    init_src = inspect.getsource(LW.__init__)
    step = getattr(LW, "step_with_ready_grads", None)
    step_src = inspect.getsource(step) if step is not None else ""
    if "overlap_param_gather" in init_src and "if not self.overlap_param_gather" in step_src:
        return True, (
            "LayerWiseDistributedOptimizer.__init__ reads config.overlap_param_gather and "
            "step_with_ready_grads skips its all-gather when it is set"
        )
    return False, (
        "LayerWiseDistributedOptimizer in this megatron-core does not read "
        "overlap_param_gather: it all-gathers inside optimizer.step()"
    )


def plan(name, lw_overlap):
    """What a contender runs: optimizer kind, DDP overlap flags, and any dropped flag."""
    kind = None if name == "fwd_bwd" else name.split("_")[0]
    overlap = name.endswith("_overlap")
    p = {
        "optimizer": kind,
        "overlap_grad_reduce": overlap,
        "overlap_param_gather": overlap,
        "dropped": {},
    }
    if overlap and kind == "muon" and not lw_overlap[0]:
        p["overlap_param_gather"] = False
        p["dropped"]["overlap_param_gather"] = lw_overlap[1]
    return p


def transformer_config(a, on_gpu):
    """megatron_bench.py's GPT, with full recomputation under --recompute."""
    recompute = (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if a.recompute
        else {}
    )
    return MB.transformer_config(a, PRESETS[a.preset], on_gpu, **recompute)


def build_model(a, on_gpu):
    """(config, Float16Module(GPTModel)) from the same seed every time."""
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(a.seed)
    if on_gpu:
        tensor_parallel.model_parallel_cuda_manual_seed(a.seed)
    cfg = transformer_config(a, on_gpu)
    gpt = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=PRESETS[a.preset]["vocab"],
        max_sequence_length=a.seq_len,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    for p in gpt.parameters():  # as training.py::get_model
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    if on_gpu:
        gpt.cuda(torch.cuda.current_device())
    return cfg, Float16Module(cfg, gpt)


def wrap_ddp(cfg, inner, p, a):
    """DDP as training.py::get_model + wrap_model_chunks_with_ddp: bucket size resolved,
    the param layout precomputed (layer-wise for Muon, DistOpt's otherwise)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.layer_wise_optimizer import (
        LayerWiseDistributedOptimizer,
        tag_params_for_buffer_routing,
    )

    dp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    bucket_size = None  # training.py::resolve_ddp_bucket_size
    if p["overlap_grad_reduce"]:
        bucket_size = a.bucket_size or max(40_000_000, 1_000_000 * dp)
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=a.grad_reduce_in_fp32,
        overlap_grad_reduce=p["overlap_grad_reduce"],
        overlap_param_gather=p["overlap_param_gather"],
        align_param_gather=False,  # arguments.py turns it off without interleaved PP
        use_distributed_optimizer=True,
        bucket_size=bucket_size,
        check_for_nan_in_grad=a.check_for_nan_in_grad,
    )
    if p["optimizer"] == "muon":
        tag_params_for_buffer_routing([inner])
        compute_layout = LayerWiseDistributedOptimizer.compute_full_param_layout
    else:
        compute_layout = DistributedOptimizer.compute_full_param_layout
    layout = compute_layout(
        [q for q in inner.parameters() if q.requires_grad],
        bucket_size,
        dp,
        ddp_cfg,
        expert_data_parallel_world_size=parallel_state.get_expert_data_parallel_world_size(),
    )
    return DDP(config=cfg, ddp_config=ddp_cfg, module=inner, full_param_layout=layout)


def optimizer_config(p, a):
    """OptimizerConfig as Megatron-LM's get_megatron_optimizer_config fills it; the Muon
    settings are megatron_bench.py's defaults (Megatron's, with muon_tp_mode duplicated)."""
    import torch
    from megatron.core.optimizer import OptimizerConfig

    common = dict(
        lr=a.lr,
        min_lr=a.lr,
        weight_decay=a.weight_decay,
        bf16=True,
        params_dtype=torch.bfloat16,
        clip_grad=a.clip_grad,
        overlap_param_gather=p["overlap_param_gather"],
    )
    if p["optimizer"] == "adam":
        return OptimizerConfig(optimizer="adam", use_distributed_optimizer=True, **common)
    return OptimizerConfig(
        optimizer="muon",
        use_distributed_optimizer=False,  # validate_args moves it to the layer-wise flag
        use_layer_wise_distributed_optimizer=True,
        muon_scalar_optimizer="adam",
        muon_momentum=0.95,
        muon_nesterov=False,
        muon_split_qkv=True,
        muon_scale_mode="spectral",
        muon_fp32_matmul_prec=a.ns_prec,
        muon_coefficient_type="quintic",
        muon_num_ns_steps=5,
        muon_extra_scale_factor=1.0,
        muon_tp_mode="duplicated",
        **common,
    )


def optimizer_structure(opt):
    """E.g. ChainedOptimizer(LayerWiseDistributedOptimizer(...), DistributedOptimizer:AdamW)."""

    def one(o):
        inner = getattr(o, "chained_optimizers", None)
        if inner is not None:
            return type(o).__name__ + "(" + ", ".join(one(c) for c in inner) + ")"
        return type(o).__name__ + ":" + type(getattr(o, "optimizer", o)).__name__

    return one(opt)


def build_contender(p, a, on_gpu):
    """Model, DDP, optimizer and scheduler of one contender, wired as training.py wires them."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    cfg, inner = build_model(a, on_gpu)
    model = wrap_ddp(cfg, inner, p, a)
    c = {"model": model, "cfg": cfg, "opt": None, "sched": None, "plan": p}
    if p["optimizer"] is None:
        return c  # forward + backward only: no finalize_model_grads, no optimizer
    ocfg = optimizer_config(p, a)
    opt = get_megatron_optimizer(ocfg, [model])
    c["ocfg"], c["opt"] = ocfg, opt
    c["sched"] = OptimizerParamScheduler(  # a constant schedule, stepped as train_step does
        opt,
        init_lr=a.lr,
        max_lr=a.lr,
        min_lr=a.lr,
        lr_warmup_steps=0,
        lr_decay_steps=1,
        lr_decay_style="constant",
        start_wd=a.weight_decay,
        end_wd=a.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    cfg.grad_scale_func = opt.scale_loss
    cfg.finalize_model_grads_func = finalize_model_grads
    if p["overlap_grad_reduce"]:
        cfg.no_sync_func = model.no_sync
    return c


def make_batch(a, device):
    """(tokens, labels, positions): micro_batch x (seq_len + 1) random tokens, seeded by rank."""
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(a.seed * 1_000_003 + dist.get_rank())
    vocab = PRESETS[a.preset]["vocab"]
    x = torch.randint(0, vocab, (a.micro_batch, a.seq_len + 1), generator=g).to(device)
    positions = torch.arange(a.seq_len, device=device).unsqueeze(0).expand(a.micro_batch, -1)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous(), positions


def forward_step_func(batch):
    """pretrain_gpt's forward_step: per-token losses, summed, with the token count."""
    import torch

    tokens, labels, positions = batch

    def loss_func(output):
        losses = output.float().view(-1)
        loss = losses.sum()
        n = torch.tensor(losses.numel(), dtype=torch.int, device=losses.device)
        return loss, n, {"lm loss": loss.detach() / n}

    def step(data_iterator, model):
        return model(tokens, positions, attention_mask=None, labels=labels), loss_func

    return step


class StepTimer:
    """Wall time (perf_counter after synchronize) and, on GPU, CUDA-event time of one step."""

    def __init__(self, on_gpu):
        import torch

        self.torch, self.on_gpu = torch, on_gpu

    def __call__(self, fn):
        torch = self.torch
        if self.on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            w0 = time.perf_counter()
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - w0) * 1e3
            return out, start.elapsed_time(end), wall
        w0 = time.perf_counter()
        out = fn()
        wall = (time.perf_counter() - w0) * 1e3
        return out, wall, wall


@contextlib.contextmanager
def ddp_warnings():
    """Count the warnings that Megatron's DDP code raises inside (e.g. when the param
    all-gather prefetch order does not match the forward order)."""
    counts = collections.Counter()

    def show(msg, category, filename, *x, **k):
        if os.sep.join(("megatron", "core", "distributed")) in filename:
            counts.update([str(msg)[:160]])

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        yield counts


def run_steps(c, a, batch, on_gpu):
    """Warm-up and timed training steps of one contender; this rank's records."""
    import torch
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model, opt, sched, p = c["model"], c["opt"], c["sched"], c["plan"]
    fb = get_forward_backward_func()
    step_fn = forward_step_func(batch)
    hooks = p["overlap_param_gather"]

    def train_step():
        model.zero_grad_buffer()
        if opt is not None:
            opt.zero_grad()
        out = fb(
            forward_step_func=step_fn,
            data_iterator=None,
            model=[model],
            num_microbatches=1,
            seq_length=a.seq_len,
            micro_batch_size=a.micro_batch,
            forward_only=False,
        )
        ok = gnorm = None
        if opt is not None:
            ok, gnorm, _ = opt.step()
            if ok:
                sched.step(increment=a.micro_batch * dist.get_world_size())
        return out, ok, gnorm

    timer = StepTimer(on_gpu)
    barrier = dist.barrier
    if on_gpu:
        barrier = partial(dist.barrier, device_ids=[torch.cuda.current_device()])
    if hooks:  # training.py: no param-gather pre-hooks before the first step has run
        model.disable_forward_pre_hook(param_sync=False)
    recs = []
    with ddp_warnings() as warned:
        for it in range(a.warmup + a.iters):
            barrier()
            (out, ok, gnorm), ms, wall = timer(train_step)
            if hooks and it == 0:
                model.enable_forward_pre_hook()
            rec = {
                "ms": ms,
                "wall_ms": wall,
                "loss": float(out[0]["lm loss"]) if out else None,
                "grad_norm": float(gnorm) if gnorm is not None else None,
                "update_ok": ok,
            }
            if it >= a.warmup:
                recs.append(rec)
            if dist.get_rank() == 0:
                tag = "warmup" if it < a.warmup else "iter"
                loss = "-" if rec["loss"] is None else f"{rec['loss']:.4f}"
                print(
                    f"  [{tag} {it}] {ms:.2f} ms (wall {wall:.2f})  loss {loss}"
                    + (f"  grad_norm {rec['grad_norm']:.4g}" if gnorm is not None else ""),
                    flush=True,
                )
    return recs, dict(warned)


def param_checksums(c):
    """Per-tensor param sums after the last step (its all-gather forced where it was deferred)."""
    import torch

    model, opt = c["model"], c["opt"]
    if c["plan"]["overlap_param_gather"] and opt is not None:
        opt.prepare_model_params_for_param_sync()  # training.py::force_param_sync
        with torch.no_grad():
            model.start_param_sync(force_sync=True)
    with torch.no_grad():
        return [float(q.detach().float().sum()) for q in model.parameters()]


def flags_of(c):
    """The DDP and optimizer settings a contender actually ran with."""
    model, p = c["model"], c["plan"]
    d = model.ddp_config
    out = {
        "ddp": {
            k: getattr(d, k)
            for k in (
                "use_distributed_optimizer",
                "overlap_grad_reduce",
                "overlap_param_gather",
                "align_param_gather",
                "bucket_size",
                "grad_reduce_in_fp32",
                "check_for_nan_in_grad",
            )
        },
        "n_bucket_groups": len(model.bucket_groups),
        "forward_pre_hooks": bool(model.remove_forward_pre_hook_handles),
        "no_sync_func": c["cfg"].no_sync_func is not None,
        "finalize_model_grads": c["cfg"].finalize_model_grads_func is not None,
    }
    if c["opt"] is not None:
        o = c["ocfg"]
        out["optimizer"] = {
            k: getattr(o, k)
            for k in (
                "optimizer",
                "use_distributed_optimizer",
                "use_layer_wise_distributed_optimizer",
                "overlap_param_gather",
                "clip_grad",
                "lr",
                "weight_decay",
            )
        }
        if o.optimizer == "muon":
            out["optimizer"]["muon_fp32_matmul_prec"] = o.muon_fp32_matmul_prec
        out["optimizer_structure"] = optimizer_structure(c["opt"])
    if p["dropped"]:
        out["dropped"] = p["dropped"]
    return out


def run_contender(name, a, lw_overlap, batch, on_gpu):
    """Build, time and free one contender; this rank's result."""
    import torch

    p = plan(name, lw_overlap)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    c = build_contender(p, a, on_gpu)
    mine = {"flags": flags_of(c), "n_params": sum(q.numel() for q in c["model"].parameters())}
    if on_gpu:
        mine["mem_after_build_bytes"] = torch.cuda.memory_allocated()
        mine["peak_mem_build_bytes"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    mine["recs"], mine["warnings"] = run_steps(c, a, batch, on_gpu)
    if on_gpu:
        mine["peak_mem_steps_bytes"] = torch.cuda.max_memory_allocated()
        mine["peak_mem_bytes"] = max(mine["peak_mem_build_bytes"], mine["peak_mem_steps_bytes"])
    mine["flags"]["forward_pre_hooks"] = bool(c["model"].remove_forward_pre_hook_handles)
    mine["param_sums"] = param_checksums(c)
    free(c, on_gpu)
    return mine


def free(c, on_gpu):
    """Drop a contender's model, buffers and optimizer state before the next one is built.

    RotaryEmbedding.forward is an lru_cache that keeps the module alive, and with
    overlap_param_gather the module's forward pre-hooks keep the DDP wrapper (and through its
    config the optimizer): remove the hooks and clear the cache, then collect.
    """
    if c["model"].remove_forward_pre_hook_handles:
        c["model"].disable_forward_pre_hook(param_sync=False)
    c.clear()
    collect(on_gpu)


def collect(on_gpu):
    """Clear RotaryEmbedding's cache, collect garbage and return cached GPU memory."""
    import torch
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    RotaryEmbedding.forward.cache_clear()
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()


def summarize(per_rank):
    """One contender's record from every rank's: times are the max over ranks per iteration."""
    n = len(per_rank[0]["recs"])
    ms = [max(r["recs"][i]["ms"] for r in per_rank) for i in range(n)]
    wall = [max(r["recs"][i]["wall_ms"] for r in per_rank) for i in range(n)]
    sums = [r["param_sums"] for r in per_rank]
    out = {
        "median_ms": statistics.median(ms),
        "min_ms": min(ms),
        "times_ms": ms,
        "wall_median_ms": statistics.median(wall),
        "wall_times_ms": wall,
        "stats_ms": MB.stats(ms),
        "losses_rank0": [r["loss"] for r in per_rank[0]["recs"]],
        "grad_norms": [r["grad_norm"] for r in per_rank[0]["recs"]],
        "updates_ok": all(r["update_ok"] is not False for r in per_rank[0]["recs"]),
        "params_identical_across_ranks": all(s == sums[0] for s in sums),
        "flags": per_rank[0]["flags"],
    }
    if "peak_mem_bytes" in per_rank[0]:
        for k in ("peak_mem_bytes", "peak_mem_build_bytes", "peak_mem_steps_bytes"):
            out[k] = max(r[k] for r in per_rank)
        out["peak_mem_bytes_per_rank"] = [r["peak_mem_bytes"] for r in per_rank]
        out["mem_after_build_bytes"] = max(r["mem_after_build_bytes"] for r in per_rank)
    if per_rank[0]["flags"].get("dropped"):
        out["skipped"] = per_rank[0]["flags"]["dropped"]  # flags this contender ran without
    if per_rank[0]["warnings"]:
        out["ddp_warnings_rank0"] = per_rank[0]["warnings"]
    return out


def ratios(res):
    """overhead_vs_fwd_bwd per contender and muon_over_adam, from the median times."""
    base = res.get("fwd_bwd", {}).get("median_ms")
    for r in res.values():
        if base and "median_ms" in r:
            r["overhead_vs_fwd_bwd"] = r["median_ms"] / base
            r["overhead_ms_vs_fwd_bwd"] = r["median_ms"] - base
    out = {}
    for key, (m, d) in {
        "no_overlap": ("muon", "adam"),
        "overlap": ("muon_overlap", "adam_overlap"),
    }.items():
        if "median_ms" in res.get(m, {}) and "median_ms" in res.get(d, {}):
            out[key] = res[m]["median_ms"] / res[d]["median_ms"]
    return out


def main():
    a = parse_args()
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    init_distributed(a)
    import torch
    import torch.distributed as dist

    for name in ("megatron", "emerging_optimizers"):
        logging.getLogger(name).setLevel(logging.WARNING)
    on_gpu = not a.cpu
    rank, ws = dist.get_rank(), dist.get_world_size()
    if not on_gpu:
        cpu_rng_patches()
    t_start = time.time()
    lw_overlap = layerwise_overlap_param_gather()
    batch = make_batch(a, torch.cuda.current_device() if on_gpu else "cpu")

    results = {}
    tokens = a.seq_len * a.micro_batch * ws
    n_params = None
    for name in a.contenders:
        if rank == 0:
            print(f"== {name}", flush=True)
        try:
            mine = run_contender(name, a, lw_overlap, batch, on_gpu)
        except Exception as e:  # noqa: BLE001  (recorded; the other contenders still run)
            traceback.print_exc()
            mine = {"error": f"{type(e).__name__}: {e}"[:2000]}
        if "error" in mine:  # outside the except block, whose traceback holds the model
            collect(on_gpu)
        gathered = [None] * ws
        dist.all_gather_object(gathered, mine)
        errors = {i: r["error"] for i, r in enumerate(gathered) if "error" in r}
        if errors:
            results[name] = {"skipped": f"failed on ranks {sorted(errors)}: {errors[min(errors)]}"}
        else:
            results[name] = summarize(gathered)
            results[name]["tokens_per_s"] = tokens / (results[name]["median_ms"] / 1e3)
            n_params = gathered[0]["n_params"]
        if rank == 0:
            r = results[name]
            print(
                f"== {name}: "
                + (
                    f"skipped: {r['skipped']}"
                    if "median_ms" not in r
                    else f"median {r['median_ms']:.2f} ms, min {r['min_ms']:.2f} ms"
                ),
                flush=True,
            )

    if rank == 0:
        P = PRESETS[a.preset]
        muon_over_adam = ratios(results)
        out = {
            "bench": "megatron_train_step",
            "config": {
                "preset": a.preset,
                "model": dict(P, num_layers=a.layers, tied=False),
                "seq_len": a.seq_len,
                "micro_batch": a.micro_batch,
                "num_microbatches": 1,
                "tokens_per_step": tokens,
                "n_params": n_params,
                "dp": ws,
                "tp": 1,
                "pp": 1,
                "recompute": "full, uniform, 1 layer" if a.recompute else None,
                "attention": ATTENTION,
                "norm": "WrappedTorchNorm (torch RMSNorm)" if not _have_apex() else "apex",
                "grad_reduce_in_fp32": a.grad_reduce_in_fp32,
                "ns_prec": a.ns_prec,
                "lr": a.lr,
                "weight_decay": a.weight_decay,
                "clip_grad": a.clip_grad,
                "iters": a.iters,
                "warmup": a.warmup,
                "seed": a.seed,
                "versions": MB.package_versions(),
                "device": torch.cuda.get_device_name() if on_gpu else "cpu",
                "backend": dist.get_backend(),
                "layerwise_overlap_param_gather": {
                    "supported": lw_overlap[0],
                    "evidence": lw_overlap[1],
                },
                "cpu_note": CPU_NOTE if a.cpu else None,
                "timing": "ms per step: CUDA events around the whole step (perf_counter on CPU), "
                "max over ranks per iteration; wall_* = perf_counter after synchronize",
            },
            "contenders": results,
            "muon_over_adam": muon_over_adam,
            "elapsed_s": round(time.time() - t_start, 2),
        }
        line = json.dumps(out, separators=(",", ":"))
        if os.environ.get("OUT"):
            os.makedirs(os.environ["OUT"], exist_ok=True)
            with open(os.path.join(os.environ["OUT"], "megatron_train_bench.json"), "w") as f:
                f.write(line + "\n")
        print(line, flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _have_apex():
    from megatron.core.models.gpt import gpt_layer_specs

    return bool(getattr(gpt_layer_specs, "HAVE_APEX", False))


if __name__ == "__main__":
    main()
