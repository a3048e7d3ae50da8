#!/usr/bin/env python3
"""Time Megatron-Core's layer-wise distributed Muon optimizer step ("dist_muon").

Target: megatron-core 0.19.2 + emerging_optimizers 0.3.0, i.e. the Megatron-LM path
`--optimizer muon --use-distributed-optimizer` with the default layer-wise param layout:
  ChainedOptimizer([LayerWiseDistributedOptimizer(Float16(TensorParallelMuon)),
                    DistributedOptimizer(Adam, non-matrix params)])
on top of DDP buffers laid out by LayerWiseDistributedOptimizer.compute_full_param_layout.

No forward/backward is run. Every iteration:
  zero_grad_buffer + optimizer.zero_grad   (untimed, as in training.py::train_step)
  fill every param.main_grad with seeded N(0, grad_std) values (untimed)
  (a) grad reduce-scatter: model.finish_grad_sync() (what finalize_model_grads calls;
      with overlap_grad_reduce it is start_grad_sync() + finish_grad_sync())
  (b) optimizer.step(): main_grad->fp32 master grad copy, global grad norm, clip,
      Muon (momentum + Newton-Schulz) on the Muon params this rank owns, Adam on this
      rank's DistOpt shard, fp32->bf16 copy, and the param all-gathers of both optimizers.

Tensor parallelism (--tp N, world size = dp * tp): the model is built with
tensor_model_parallel_size N (column-parallel linear_qkv / linear_fc1, row-parallel
linear_proj / linear_fc2, vocabulary-parallel embedding and output layer, norms whole on
every rank) and Muon orthogonalises a split matrix as --muon-tp-mode says (passed to
OptimizerConfig.muon_tp_mode; megatron-core 0.19.2 defaults to blockwise, this script to
duplicated, lwjax's default). The gradients of the norms (TP duplicates) are drawn the same
on every rank of a tensor-parallel group, as backward gives them in training.

GPU:  torchrun --nproc-per-node 4 docs/scripts/megatron_bench.py --preset 8b --layers 4
      torchrun --nproc-per-node 4 docs/scripts/megatron_bench.py --preset 8b --layers 4 \
          --tp 2 --muon-tp-mode duplicated                       # dp 2 x tp 2
CPU:  torchrun --nproc-per-node 2 docs/scripts/megatron_bench.py --preset tiny --layers 2 \
          --cpu --iters 3
Rank 0 prints one JSON line at the end (prefix-free; last line of stdout) and writes it to
$OUT/megatron_bench.json when OUT is set.
"""

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import resource
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
# cpu_shim.py: next to the shared copy of this script, else in the shared/ of this repository
# or beside it (this copy, in docs/scripts).
_SHIMS = [
    os.path.normpath(os.path.join(HERE, *parts, "megatron-fixtures", "cpu_shim.py"))
    for parts in (
        (os.pardir, "tools"),  # shared/perf -> shared/tools
        (os.pardir, os.pardir, "shared", "tools"),  # docs/scripts -> <repo>/shared/tools
        (os.pardir, os.pardir, os.pardir, "shared", "tools"),  # docs/scripts -> <repo>/../shared
    )
]
DEFAULT_SHIM = next((s for s in _SHIMS if os.path.exists(s)), _SHIMS[0])
TP_MODES = ("blockwise", "duplicated", "distributed")

PRESETS = {
    # Llama-3-8B-like: untied embeddings, GQA 32/8, SwiGLU.
    "8b": dict(hidden=4096, heads=32, groups=8, ffn=14336, vocab=128256),
    # Llama-3.2-1B-like shapes (Llama-3.2-1B itself ties embeddings; use --tie-embeddings for that).
    "1b": dict(hidden=2048, heads=16, groups=8, ffn=8192, vocab=128256),
    # The CPU fixture config of ../tools/megatron-fixtures/make_megatron_ckpt.py.
    "tiny": dict(hidden=64, heads=4, groups=2, ffn=128, vocab=128),
}


def parse_args():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", choices=sorted(PRESETS), default="8b")
    ap.add_argument("--layers", type=int, default=2, help="num_layers")
    ap.add_argument("--cpu", action="store_true", help="gloo + cpu_shim (verification only)")
    ap.add_argument("--shim", default=DEFAULT_SHIM, help="path of cpu_shim.py (used with --cpu)")
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor_model_parallel_size (world size = dp * tp; dp = world size / tp)",
    )
    ap.add_argument(
        "--muon-tp-mode",
        choices=TP_MODES,
        default="duplicated",
        help="OptimizerConfig.muon_tp_mode: how a TP-split Muon matrix is "
        "orthogonalised (megatron-core 0.19.2's own default is blockwise; "
        "this script passes its value explicitly)",
    )
    ap.add_argument("--iters", type=int, default=20, help="timed iterations")
    ap.add_argument("--warmup", type=int, default=3, help="untimed warm-up iterations")
    ap.add_argument(
        "--grad-reduce-in-fp32",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="DDP grad buffers / reduce-scatter in fp32 (Megatron-LM "
        "--accumulate-allreduce-grads-in-fp32)",
    )
    ap.add_argument(
        "--ns-prec",
        choices=["medium", "high", "highest"],
        default="medium",
        help="muon_fp32_matmul_prec: medium = bf16 Newton-Schulz (Megatron default), "
        "high = TF32, highest = fp32",
    )
    ap.add_argument("--ns-steps", type=int, default=5)
    ap.add_argument("--coefficient-type", default="quintic")
    ap.add_argument(
        "--momentum", type=float, default=0.95, help="OptimizerConfig.muon_momentum default"
    )
    ap.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument(
        "--split-qkv",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="muon_split_qkv (Megatron default on: NS on q, k, v blocks separately)",
    )
    ap.add_argument("--scale-mode", default="spectral")
    ap.add_argument("--extra-scale-factor", type=float, default=1.0)
    ap.add_argument(
        "--scalar-optimizer",
        default="adam",
        choices=["adam", "lion"],
        help="muon_scalar_optimizer for embeddings/output/norms",
    )
    ap.add_argument(
        "--bucket-size",
        type=int,
        default=None,
        help="DDP bucket size in elements (None = one bucket per buffer). "
        "Megatron/DDP force bucket_size=None unless overlap_grad_reduce, so this "
        "also turns on overlap_grad_reduce (async reduce-scatter, waited at once).",
    )
    ap.add_argument(
        "--check-for-nan-in-grad",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="DDP check_for_nan_in_grad (Megatron-LM's CLI default is ON via "
        "--check-for-nan-in-loss-and-grad; DDP dataclass default is off)",
    )
    ap.add_argument("--tie-embeddings", action="store_true")
    ap.add_argument("--vocab", type=int, default=None, help="override the preset's vocab size")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--clip-grad", type=float, default=1.0)
    ap.add_argument(
        "--grad-std",
        type=float,
        default=1e-2,
        help="std of the random grads (the default makes the global norm > clip-grad, "
        "so the clip scaling runs every step)",
    )
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument(
        "--breakdown",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time sub-phases of optimizer.step() (CUDA events around "
        "monkeypatched methods; no extra synchronisation)",
    )
    ap.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after timing, check that all ranks of a data-parallel group hold "
        "identical params (at --tp > 1: the ranks of one TP rank, and the "
        "TP-duplicated params on every rank)",
    )
    a = ap.parse_args()
    if a.tp < 1:
        ap.error(f"--tp must be >= 1; got {a.tp}")
    return a


def load_shim(path):
    spec = importlib.util.spec_from_file_location("cpu_shim", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["cpu_shim"] = mod
    spec.loader.exec_module(mod)
    return mod


class PhaseTimer:
    """Start/stop marks: CUDA events on GPU (no sync), perf_counter on CPU."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.marks = {}  # name -> list of (start, end)

    def mark(self):
        if self.cuda:
            import torch

            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def add(self, name, start, end):
        self.marks.setdefault(name, []).append((start, end))

    def reset(self):
        self.marks = {}

    def elapsed_ms(self, a, b):
        if self.cuda:
            return a.elapsed_time(b)
        return (b - a) * 1e3

    def collect(self):
        """Call after synchronize: {name: total ms} for this iteration."""
        return {k: sum(self.elapsed_ms(a, b) for a, b in v) for k, v in self.marks.items()}

    def wrap(self, obj, attr, name):
        fn = getattr(obj, attr)

        def wrapped(*a, **k):
            s = self.mark()
            try:
                return fn(*a, **k)
            finally:
                self.add(name, s, self.mark())

        setattr(obj, attr, wrapped)


def stats(xs):
    if not xs:
        return None
    return {
        "median": statistics.median(xs),
        "min": min(xs),
        "max": max(xs),
        "mean": sum(xs) / len(xs),
    }


def short_name(n):
    n = n.replace("module.module.", "").replace("module.", "")
    if n.startswith("decoder.layers."):
        rest = n[len("decoder.layers.") :]
        i, _, tail = rest.partition(".")
        return f"L{i}.{tail}"
    return n


def ns_flops(m, n, steps):
    """FLOPs of `steps` Newton-Schulz iterations (A=XX^T; B=bA+cAA; X=aX+BX) on an m x n matrix."""
    s, long = min(m, n), max(m, n)
    return steps * (4 * s * s * long + 2 * s**3)


def ns_flops_tp(m, n, steps, tp, partition_dim, mode):
    """One rank's Newton-Schulz FLOPs for its local m x n block of a matrix split over `tp`
    ranks on `partition_dim` (None: not split), as emerging_optimizers' newton_schulz_tp runs it.

    blockwise: the local block on its own. duplicated: the whole matrix on every rank (after an
    all-gather). distributed: the Gram matrix of the unsplit dimension from the local columns
    (all-reduced), so the Gram's products run whole on every rank and the two products with X
    on the local part (emerging_optimizers picks the orientation from partition_dim, not from
    which dimension is smaller).
    """
    if partition_dim is None or tp == 1 or mode == "blockwise":
        return ns_flops(m, n, steps)
    full = [m, n]
    full[partition_dim] *= tp
    if mode == "duplicated":
        return ns_flops(full[0], full[1], steps)
    gram, local = (n, m) if partition_dim == 0 else (m, n)
    return steps * (4 * gram * gram * local + 2 * gram**3)


def package_versions():
    """torch's version, and megatron-core's and emerging_optimizers' where installed."""
    import torch

    out = {"torch": torch.__version__}
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        out["megatron_core"] = version("megatron-core")
        out["emerging_optimizers"] = version("emerging-optimizers")
    return out


def single_rank_env():
    """Outside torchrun (plain ``python script.py``), the environment of a world of one."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(20000 + os.getpid() % 20000),
        )


def transformer_config(a, preset, on_gpu, **extra):
    """The benchmark GPT's TransformerConfig: RMSNorm, SwiGLU, RoPE, GQA, no biases, bf16,
    no fused kernels; ``extra`` adds fields (tensor parallelism, recomputation)."""
    import torch
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=a.layers,
        hidden_size=preset["hidden"],
        num_attention_heads=preset["heads"],
        num_query_groups=preset["groups"],
        ffn_hidden_size=preset["ffn"],
        kv_channels=preset["hidden"] // preset["heads"],
        use_cpu_initialization=not on_gpu,
        perform_initialization=True,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        **extra,
    )


def main():
    a = parse_args()
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)

    if a.cpu:
        load_shim(a.shim)  # must precede megatron imports
    import torch
    import torch.distributed as dist

    single_rank_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_gpu = not a.cpu
    if on_gpu:
        assert torch.cuda.is_available(), "no CUDA device; use --cpu for the CPU check"
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")  # as megatron/training/initialize.py (no device_id)
    else:
        dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    t_start = time.time()

    import megatron.core.optimizer.optimizer as mopt
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel as DDP,
    )
    from megatron.core.distributed import (
        DistributedDataParallelConfig,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.layer_wise_optimizer import (
        LayerWiseDistributedOptimizer,
        tag_params_for_buffer_routing,
    )
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.module import Float16Module
    from megatron.core.utils import get_pg_size

    versions = package_versions()
    for name in ("megatron", "emerging_optimizers"):
        logging.getLogger(name).setLevel(logging.WARNING)

    if ws % a.tp:
        raise SystemExit(f"--tp {a.tp} does not divide the world size {ws}")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=1
    )
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    torch.manual_seed(a.seed)
    if on_gpu:
        tensor_parallel.model_parallel_cuda_manual_seed(a.seed)
    else:  # CUDA RNG tracker can't be seeded without CUDA; dropout is 0 anyway
        tensor_parallel.random.get_cuda_rng_tracker().fork = lambda *x, **k: (
            contextlib.nullcontext()
        )

    P = dict(PRESETS[a.preset])
    if a.vocab is not None:
        P["vocab"] = a.vocab
    cfg = transformer_config(a, P, on_gpu, tensor_model_parallel_size=a.tp)
    gpt = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=P["vocab"],
        max_sequence_length=4096,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=a.tie_embeddings,
    )
    # as megatron/training/training.py::get_model
    for p in gpt.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    if on_gpu:
        gpt.cuda(torch.cuda.current_device())
    inner = Float16Module(cfg, gpt)

    # ---- DDP with the layer-wise layout, as training.py::wrap_model_chunks_with_ddp ----
    overlap = a.bucket_size is not None
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=a.grad_reduce_in_fp32,
        overlap_grad_reduce=overlap,
        overlap_param_gather=False,
        use_distributed_optimizer=False,  # forced True just below
        bucket_size=a.bucket_size,
        check_for_nan_in_grad=a.check_for_nan_in_grad,
    )
    ddp_cfg.use_distributed_optimizer = True
    tag_params_for_buffer_routing([inner])
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    intra_dp_cp = getattr(pgs, "intra_dp_cp", None)
    intra_expt_dp = getattr(pgs, "intra_expt_dp", None)
    dp_size = get_pg_size(intra_dp_cp if intra_dp_cp is not None else pgs.dp_cp)
    expt_dp_size = get_pg_size(
        intra_expt_dp if intra_expt_dp is not None else getattr(pgs, "expt_dp", None)
    )
    full_layout = LayerWiseDistributedOptimizer.compute_full_param_layout(
        [p for p in inner.parameters() if p.requires_grad],
        a.bucket_size,
        dp_size,
        ddp_cfg,
        expert_data_parallel_world_size=expt_dp_size,
    )
    model = DDP(
        config=cfg,
        ddp_config=ddp_cfg,
        module=inner,
        disable_bucketing=False,
        full_param_layout=full_layout,
    )

    ocfg = OptimizerConfig(
        optimizer="muon",
        lr=a.lr,
        min_lr=a.lr,
        weight_decay=a.weight_decay,
        bf16=True,
        params_dtype=torch.bfloat16,
        clip_grad=a.clip_grad,
        use_distributed_optimizer=False,  # Megatron-LM validate_args resets it for muon
        use_layer_wise_distributed_optimizer=True,
        muon_scalar_optimizer=a.scalar_optimizer,
        muon_momentum=a.momentum,
        muon_nesterov=a.nesterov,
        muon_split_qkv=a.split_qkv,
        muon_scale_mode=a.scale_mode,
        muon_fp32_matmul_prec=a.ns_prec,
        muon_coefficient_type=a.coefficient_type,
        muon_num_ns_steps=a.ns_steps,
        muon_extra_scale_factor=a.extra_scale_factor,
        muon_tp_mode=a.muon_tp_mode,
    )
    opt = get_megatron_optimizer(ocfg, [model])

    # ---- locate the LayerWise (Muon) and DistributedOptimizer (Adam) parts ----
    if isinstance(opt, LayerWiseDistributedOptimizer):
        lw, dopts = opt, []
    else:
        lw = next(o for o in opt.chained_optimizers if isinstance(o, LayerWiseDistributedOptimizer))
        dopts = [o for o in opt.chained_optimizers if isinstance(o, DistributedOptimizer)]
    opt_structure = (
        type(opt).__name__
        + "["
        + ", ".join(
            type(o).__name__
            + (
                "("
                + ", ".join(
                    type(c).__name__ + ":" + type(getattr(c, "optimizer", c)).__name__
                    for c in o.chained_optimizers
                )
                + ")"
                if isinstance(o, LayerWiseDistributedOptimizer)
                else ":" + type(getattr(o, "optimizer", o)).__name__
            )
            for o in getattr(opt, "chained_optimizers", [opt])
        )
        + "]"
    )
    # The tp_mode the Muon optimizers were built with (TensorParallelMuon.tp_mode), as run.
    muon_tp_modes = sorted(
        {str(getattr(getattr(c, "optimizer", c), "tp_mode", None)) for c in lw.chained_optimizers}
    )

    name_of = {p: short_name(n) for n, p in model.named_parameters()}
    all_params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in all_params)
    lw_params = [p for p in all_params if getattr(p, "is_managed_by_layer_wise_optimizer", False)]
    split_shapes = None
    if a.split_qkv:
        q = P["heads"] // P["groups"] * (P["hidden"] // P["heads"])
        split_shapes = [q, P["hidden"] // P["heads"], P["hidden"] // P["heads"]]

    def muon_flops(p):
        """This rank's NS FLOPs for p (its local shape; at --tp > 1 as --muon-tp-mode runs it)."""
        m, n = p.shape
        pdim = getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else -1
        pdim = None if pdim == -1 else pdim

        def one(rows, cols):
            return ns_flops_tp(rows, cols, a.ns_steps, a.tp, pdim, a.muon_tp_mode)

        if a.split_qkv and getattr(p, "is_qkv", False):
            ss = getattr(p, "qkv_split_shapes", split_shapes)
            ng = m // sum(ss)  # this rank's query groups
            return sum(one(ng * s, n) for s in ss)
        return one(m, n)

    # Muon ownership on this rank (Float16 children hold the owned model params in float16_groups).
    muon_owned = []
    for child in lw.chained_optimizers:
        for g in getattr(child, "float16_groups", []):
            muon_owned += list(g)
        for g in getattr(child, "fp32_from_fp32_groups", []):
            muon_owned += list(g)
    adam_owned_numel = 0
    for d in dopts:
        for g in d.shard_fp32_from_float16_groups + d.shard_fp32_groups:
            adam_owned_numel += sum(t.numel() for t in g)
    mine = {
        "rank": rank,
        "muon_params_owned": len(muon_owned),
        "muon_numel_owned": sum(p.numel() for p in muon_owned),
        "muon_ns_gflop_owned": sum(muon_flops(p) for p in muon_owned) / 1e9,
        "muon_owned_names": [name_of.get(p, "?") for p in muon_owned],
        "adam_numel_owned": adam_owned_numel,
    }

    # ---- layout padding overhead (per DDP buffer) ----
    layout_info = []
    for key, lay in full_layout.layouts.items():
        pn = sum(p.numel() for p in lay.param_index_map)
        bn = lay.bucket_indices[-1][1] if lay.bucket_indices else 0
        info = {
            "buffer": ("layerwise" if key.is_managed_by_layer_wise_optimizer else "distopt")
            + f":{str(key.param_dtype).replace('torch.', '')}"
            + f"/grad_{str(key.grad_dtype).replace('torch.', '')}",
            "n_params": len(lay.param_index_map),
            "param_numel": pn,
            "buffer_numel": bn,
            "padding_numel": bn - pn,
            "overhead_pct": 100.0 * (bn - pn) / max(pn, 1),
            "n_buckets": len(lay.bucket_indices),
        }
        if key.is_managed_by_layer_wise_optimizer:
            per_shard = [0] * lay.num_optimizer_shards
            for p, (s, _, b) in lay.param_index_map.items():
                bs, be = lay.bucket_indices[b]
                per_shard[(s - bs) // ((be - bs) // lay.num_optimizer_shards)] += p.numel()
            info["numel_per_shard"] = per_shard
        layout_info.append(info)
    total_pn = sum(i["param_numel"] for i in layout_info)
    total_bn = sum(i["buffer_numel"] for i in layout_info)

    # ---- timing instrumentation (sub-phases of optimizer.step) ----
    pt = PhaseTimer(on_gpu)
    if a.breakdown:
        pt.wrap(opt, "prepare_grads", "copy_main_grad_to_master")
        pt.wrap(opt, "get_grad_norm", "grad_norm")
        _clip = mopt.clip_grad_by_total_norm_fp32

        def _clip_wrapped(*x, **k):
            s = pt.mark()
            try:
                return _clip(*x, **k)
            finally:
                pt.add("clip", s, pt.mark())

        mopt.clip_grad_by_total_norm_fp32 = _clip_wrapped
        for child in lw.chained_optimizers:
            pt.wrap(child, "step_with_ready_grads", "muon_update")  # momentum+NS+update+fp32->bf16
        pt.wrap(lw, "start_param_sync_for_bucket_group_subset", "muon_param_allgather")
        for d in dopts:
            pt.wrap(d, "step_with_ready_grads", "_adam_total")
            pt.wrap(d, "start_param_sync_for_bucket_group_subset", "adam_param_allgather")

    def sync():
        if on_gpu:
            torch.cuda.synchronize()

    def mem():
        if on_gpu:
            return torch.cuda.memory_allocated()
        return None

    def barrier():
        if on_gpu:
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()

    gen = torch.Generator(device="cuda" if on_gpu else "cpu")
    # At --tp > 1 the TP-duplicated params (norms) draw from a generator seeded by the dp rank,
    # so every rank of a TP group holds the same gradient for them, as after backward in
    # training; TP-split params draw from the rank's own. At tp 1 both are the one generator.
    gen_dup = torch.Generator(device="cuda" if on_gpu else "cpu") if a.tp > 1 else gen

    def is_tp_split(p):
        return (
            bool(getattr(p, "tensor_model_parallel", False))
            and getattr(p, "partition_dim", -1) != -1
        )

    def fill_grads(it):
        gen.manual_seed(a.seed * 1_000_003 + rank * 10_007 + it)
        if a.tp > 1:
            gen_dup.manual_seed(a.seed * 1_000_003 + (ws + dp_rank) * 10_007 + it)
        with torch.no_grad():
            for buf in model.buffers + model.expert_parallel_buffers:
                for p in buf.params:
                    p.main_grad.normal_(
                        0.0, a.grad_std, generator=gen if is_tp_split(p) else gen_dup
                    )

    def param_sums():
        with torch.no_grad():
            return (
                torch.stack([p.detach().sum(dtype=torch.float32) for p in all_params])
                .double()
                .cpu()
            )

    sums_before = param_sums() if a.check else None
    mem_after_setup = mem()
    if on_gpu:
        peak_setup = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    recs = []
    last = {}
    for it in range(a.warmup + a.iters):
        model.zero_grad_buffer()
        opt.zero_grad()
        fill_grads(it)
        sync()
        barrier()
        sync()
        pt.reset()
        w0 = time.perf_counter()
        m0 = pt.mark()
        if overlap:
            model.start_grad_sync()
        model.finish_grad_sync()
        m1 = pt.mark()
        sync()
        w1 = time.perf_counter()
        m1b = pt.mark()
        ok, gnorm, _ = opt.step()
        m2 = pt.mark()
        sync()
        w2 = time.perf_counter()
        ph = pt.collect()
        if "_adam_total" in ph:
            ph["adam_update"] = ph.pop("_adam_total") - ph.get("adam_param_allgather", 0.0)
        rec = {
            "reduce_ms": pt.elapsed_ms(m0, m1),
            "step_ms": pt.elapsed_ms(m1b, m2),
            "reduce_wall_ms": (w1 - w0) * 1e3,
            "step_wall_ms": (w2 - w1) * 1e3,
            "phases": ph,
        }
        rec["total_ms"] = rec["reduce_ms"] + rec["step_ms"]
        rec["total_wall_ms"] = rec["reduce_wall_ms"] + rec["step_wall_ms"]
        last = {"update_ok": bool(ok), "grad_norm": float(gnorm) if gnorm is not None else None}
        if it == a.warmup - 1 or (a.warmup == 0 and it == 0):
            mem_after_warmup = mem()
        if it >= a.warmup:
            recs.append(rec)
        if rank == 0:
            tag = "warmup" if it < a.warmup else "iter"
            print(
                f"[{tag} {it}] reduce {rec['reduce_ms']:.3f} ms  step {rec['step_ms']:.3f} ms  "
                f"total {rec['total_ms']:.3f} ms  (wall {rec['total_wall_ms']:.3f})  "
                f"grad_norm {last['grad_norm']:.4g} ok={last['update_ok']}",
                flush=True,
            )
    if a.warmup == 0:
        mem_after_warmup = mem()
    if on_gpu:
        mine["peak_mem_bytes"] = torch.cuda.max_memory_allocated()  # during warm-up + timed iters
        mine["peak_mem_setup_bytes"] = peak_setup  # model build + DDP + optimizer construction
        mine["mem_after_setup_bytes"] = mem_after_setup
        mine["mem_after_warmup_bytes"] = mem_after_warmup
    else:
        mine["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mine["recs"] = recs
    mine.update(last)

    # ---- consistency check: the ranks of a data-parallel group (one TP rank) must hold identical
    # params after the all-gathers; at --tp > 1 the TP-duplicated params (norms) must also be
    # identical on every rank. ----
    check = None
    if a.check:
        sums = param_sums()
        gathered = [None] * ws
        dist.all_gather_object(gathered, (tp_rank, sums.tolist()))
        split = [is_tp_split(p) for p in all_params]
        ref = {}
        for t, g in gathered:
            ref.setdefault(t, g)
        maxdiff = max(abs(x - y) for t, g in gathered for x, y in zip(g, ref[t]))
        dup_diff = max(
            (abs(x - y) for _, g in gathered for x, y, s in zip(g, gathered[0][1], split) if not s),
            default=0.0,
        )
        changed = int((sums != sums_before).sum())
        check = {
            "params_identical_across_ranks": maxdiff == 0.0 and dup_diff == 0.0,
            "max_abs_diff_of_param_sums": maxdiff,
            "param_tensors_changed_on_rank0": changed,
            "param_tensors": len(all_params),
        }
        if a.tp > 1:
            check["compared"] = (
                "ranks of the same TP rank (each data-parallel group); "
                "TP-duplicated params across all ranks"
            )
            check["max_abs_diff_of_tp_duplicated_param_sums"] = dup_diff
            check["tp_split_param_tensors"] = sum(split)

    allr = [None] * ws
    dist.all_gather_object(allr, mine)

    if rank == 0:
        n_it = len(recs)

        def over_ranks(key, fn=max):
            return [fn(r["recs"][i][key] for r in allr) for i in range(n_it)]

        timing = {}
        for key in (
            "reduce_ms",
            "step_ms",
            "total_ms",
            "reduce_wall_ms",
            "step_wall_ms",
            "total_wall_ms",
        ):
            timing[key] = stats(over_ranks(key))
        timing["rank0"] = {
            k: stats([r[k] for r in allr[0]["recs"]])
            for k in ("reduce_ms", "step_ms", "total_ms", "total_wall_ms")
        }
        timing["per_rank_median"] = {
            k: [statistics.median([x[k] for x in r["recs"]]) if r["recs"] else None for r in allr]
            for k in ("reduce_ms", "step_ms", "total_ms")
        }
        phase_names = sorted({k for r in allr for x in r["recs"] for k in x["phases"]})
        breakdown = {
            k: [
                statistics.median([x["phases"].get(k, 0.0) for x in r["recs"]])
                if r["recs"]
                else None
                for r in allr
            ]
            for k in phase_names
        }
        per_rank = [{k: v for k, v in r.items() if k not in ("recs",)} for r in allr]
        result = {
            "bench": "megatron_layerwise_dist_muon",
            "versions": versions,
            "device": (torch.cuda.get_device_name() if on_gpu else "cpu"),
            "backend": dist.get_backend(),
            "world_size": ws,
            "dp_size": dp_size,
            "tp_size": a.tp,
            "preset": a.preset,
            "layers": a.layers,
            "model": dict(P, num_layers=a.layers, tied=a.tie_embeddings),
            "settings": {
                "grad_reduce_in_fp32": a.grad_reduce_in_fp32,
                "ns_prec": a.ns_prec,
                "ns_steps": a.ns_steps,
                "coefficient_type": a.coefficient_type,
                "momentum": a.momentum,
                "nesterov": a.nesterov,
                "split_qkv": a.split_qkv,
                "scale_mode": a.scale_mode,
                "extra_scale_factor": a.extra_scale_factor,
                "scalar_optimizer": a.scalar_optimizer,
                "bucket_size": a.bucket_size,
                "tp": a.tp,
                "muon_tp_mode": a.muon_tp_mode,
                "overlap_grad_reduce": overlap,
                "check_for_nan_in_grad": a.check_for_nan_in_grad,
                "lr": a.lr,
                "weight_decay": a.weight_decay,
                "clip_grad": a.clip_grad,
                "grad_std": a.grad_std,
                "warmup": a.warmup,
                "iters": a.iters,
                "seed": a.seed,
                "ddp_use_distributed_optimizer": ddp_cfg.use_distributed_optimizer,
            },
            "optimizer": opt_structure,
            "muon_tp_mode_in_optimizer": muon_tp_modes,
            "n_params": n_params,
            "n_param_tensors": len(all_params),
            "n_muon_params": len(lw_params),
            "muon_numel": sum(p.numel() for p in lw_params),
            "muon_ns_gflop_total": sum(muon_flops(p) for p in lw_params) / 1e9,
            "muon_note": "n_params, muon_numel, adam_numel, muon_ns_gflop_total and the per-rank "
            "counts are rank 0's: at tp > 1 its local shards (one TP rank's share), "
            "NS GFLOP as --muon-tp-mode runs them (duplicated: the whole matrix on "
            "every TP rank)",
            "adam_numel": n_params - sum(p.numel() for p in lw_params),
            "layout": layout_info,
            "layout_padding_numel": total_bn - total_pn,
            "layout_overhead_pct": 100.0 * (total_bn - total_pn) / max(total_pn, 1),
            "timing_note": "ms; reduce/step/total = CUDA-event (GPU) or perf_counter (CPU) times, "
            "max over ranks per iteration, then stats over iterations",
            "timing": timing,
            "step_breakdown_ms_median_per_rank": breakdown,
            "per_rank": per_rank,
            "check": check,
            "elapsed_s": round(time.time() - t_start, 2),  # since init_process_group, rank 0
        }
        t = timing
        print(
            f"== {a.preset} L={a.layers} ws={ws} (dp {dp_size} x tp {a.tp}"
            + (f", muon_tp_mode {a.muon_tp_mode}" if a.tp > 1 else "")
            + f") {result['device']}: "
            f"reduce-scatter {t['reduce_ms']['median']:.3f} ms, "
            f"optimizer.step {t['step_ms']['median']:.3f} ms, "
            f"sum {t['total_ms']['median']:.3f} ms (median of {n_it}, max over ranks); "
            f"params {n_params / 1e6:.2f}M "
            f"(muon {result['muon_numel'] / 1e6:.2f}M in {len(lw_params)} tensors); "
            f"layout overhead {result['layout_overhead_pct']:.3f}%",
            flush=True,
        )
        for r in per_rank:
            print(
                f"   rank {r['rank']}: muon owns {r['muon_params_owned']} tensors / "
                f"{r['muon_numel_owned'] / 1e6:.3f}M elems / "
                f"{r['muon_ns_gflop_owned']:.2f} NS GFLOP; "
                f"adam shard {r['adam_numel_owned'] / 1e6:.3f}M; "
                + (
                    f"peak mem {r['peak_mem_bytes'] / 2**30:.2f} GiB"
                    if "peak_mem_bytes" in r
                    else f"peak rss {r['peak_rss_bytes'] / 2**20:.0f} MiB"
                ),
                flush=True,
            )
        line = json.dumps(result, separators=(",", ":"))
        out = os.environ.get("OUT")
        if out:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "megatron_bench.json"), "w") as f:
                f.write(line + "\n")
        print(line, flush=True)
    barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
