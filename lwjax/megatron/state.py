"""Read a Megatron-Core checkpoint into global, per-parameter numpy arrays (:class:`MegatronState`).

Formats (one iteration directory, ``iter_XXXXXXX/``):

* ``torch_dist`` (DCP): model tensors under stacked global keys; optimizer
  state per parameter (``[chained_<i>.]optimizer.state.<kind>.<key>``: Muon's
  ``fp32_param``/``momentum_buffer``, fully reshardable Adam's
  ``param``/``exp_avg``/``exp_avg_sq``) or as the DistributedOptimizer's flat
  bucket buffers (``...optimizer.distributed.dp_group_idx_<tp>.gbuf_idx_<g>
  .dtype_(...).bucket_idx_<b>.<kind>``, the default ``dp_reshardable`` form);
  the common state (args, iteration, param groups) as the ``common_state``
  object or in ``common.pt``.
* legacy ``torch``: ``mp_rank_<tp>/model_optim_rng.pt`` (model, args,
  optimizer param groups), ``distrib_optim.pt`` (flat DistributedOptimizer
  state) and ``layer_wise_optimizer_<dp>.pt`` (per child optimizer, state keyed
  by integer parameter ids).

Flat buffers do not store their layout. It is re-derived with
:func:`lwjax.elementwise_layout.compute_distributed_optimizer_layout` over the buffer's
parameters in definition order (for each tensor-parallel rank, with its local
shapes); the layer spec (local or Transformer Engine, which order parameters
differently) is the one whose unflattened masters round exactly to the stored
bf16 weights. Integer ids of legacy layer-wise files are named the same way
Megatron numbers them: per child optimizer, per parameter group (weight decay
or not), in definition order. Every master is checked to round to its model
weight, so a wrong mapping cannot pass silently.
"""

from __future__ import annotations

import dataclasses
import json
import lzma
import pathlib
import pickle
import re
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from lwjax.elementwise_layout import compute_distributed_optimizer_layout
from lwjax.layout import ParamSpec
from lwjax.megatron import names as names_lib
from lwjax.megatron.allow_list import TORCH_DTYPES
from lwjax.megatron.budget import DEFAULT_MAX_BYTES, byte_budget
from lwjax.megatron.dcp import load_dcp, load_dcp_torch, torch_load
from lwjax.megatron.errors import DamagedCheckpointError
from lwjax.megatron.pickle_io import load_torch_file, open_checkpoint_file
from lwjax.megatron.ping_pong import ping_pong_ownership
from lwjax.routing import is_embedding_or_output

READERS = ("numpy", "torch")
Reader = Literal["numpy", "torch"]
STATE_KINDS = {
    "fp32_param": "masters",
    "param": "masters",
    "momentum_buffer": "momentum",
    "exp_avg": "exp_avg",
    "exp_avg_sq": "exp_avg_sq",
}
_STATE_RE = re.compile(
    r"^(?:chained_\d+\.)?optimizer\.state\."
    r"(fp32_param|param|momentum_buffer|exp_avg|exp_avg_sq)\.(.+)$"
)
_FLAT_RE = re.compile(
    r"^(?:chained_\d+\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\."
    r"dtype_\((.+?), (.+?)\)\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)$"
)
_FLAT_KINDS = {"param": "masters", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


@dataclasses.dataclass
class MegatronState:
    """A Megatron GPT checkpoint as global per-parameter arrays, whatever its format and
    parallelism.

    Keys are the ``torch_dist`` model keys (stacked layers, TE names), in
    definition order.

    Attributes:
      iteration: Training iterations done.
      model: Model weights (e.g. bf16), global shapes.
      masters: fp32 master weights (empty when the checkpoint has no optimizer state).
      momentum: Muon ``momentum_buffer`` of the parameters Megatron ran Muon on.
      exp_avg: Adam first moments of the other parameters.
      exp_avg_sq: Adam second moments.
      adam_step: Adam's step count (bias correction), or ``None``.
      hyperparameters: ``{"muon": {...}, "adam": {...}}`` from the param groups.
      args: Megatron's ``args`` as a dict.
      source: Where it came from: format, directory, reader, tp, optimizer sharding.
      scheduler: Megatron-LM's ``opt_param_scheduler`` state (the schedule's
        position in samples and its stored settings), empty when not saved.
    """

    iteration: int
    model: dict[str, np.ndarray]
    masters: dict[str, np.ndarray]
    momentum: dict[str, np.ndarray]
    exp_avg: dict[str, np.ndarray]
    exp_avg_sq: dict[str, np.ndarray]
    adam_step: int | None
    hyperparameters: dict[str, Any]
    args: dict[str, Any]
    source: dict[str, Any]
    scheduler: dict[str, Any] = dataclasses.field(default_factory=dict)


def _is_iteration_dir(path: pathlib.Path) -> bool:
    return (path / ".metadata").exists() or any(
        p.name.startswith("mp_rank_") for p in path.iterdir()
    )


def locate_iteration(path, iteration: int | None = None) -> pathlib.Path:
    """The iteration directory of a Megatron checkpoint
    (``latest_checkpointed_iteration.txt`` unless given).

    Raises:
      ValueError: no such directory, or nothing that looks like a Megatron checkpoint.
    """
    path = pathlib.Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: no such checkpoint directory.")
    if iteration is not None:
        found = path / f"iter_{int(iteration):07d}"
        if not found.is_dir():
            have = sorted(p.name for p in path.glob("iter_*"))
            raise ValueError(
                f"{path}: no iteration {iteration} (iter_{int(iteration):07d}); found {have}."
            )
        return found
    tracker = path / "latest_checkpointed_iteration.txt"
    if tracker.exists():
        with open_checkpoint_file(tracker, path) as f:
            text = f.read(64).decode("ascii", "replace").strip()
        if text and text != "release" and not text.isdigit():
            raise ValueError(
                f"{tracker}: expected an iteration number or 'release'; got {text[:32]!r}."
            )
        found = (
            path / ("release" if text == "release" else f"iter_{int(text):07d}") if text else None
        )
        if found is None or not found.is_dir():
            raise ValueError(f"{tracker}: names iteration {text!r}, whose directory is missing.")
        return found
    if _is_iteration_dir(path):
        return path
    candidates = sorted(p for p in path.glob("iter_*") if p.is_dir())
    if not candidates:
        raise ValueError(
            f"{path}: not a Megatron checkpoint (no latest_checkpointed_iteration.txt, iter_*/, "
            ".metadata or mp_rank_*/)."
        )
    return candidates[-1]


def _as_dict(obj) -> dict:
    return (
        dict(vars(obj))
        if hasattr(obj, "__dict__") and not isinstance(obj, dict)
        else dict(obj or {})
    )


def _param_groups(obj) -> list[dict]:
    """Every optimizer param-group dict nested anywhere in ``obj``."""
    found = []
    if isinstance(obj, Mapping):
        groups = obj.get("param_groups")
        if isinstance(groups, list):
            found += [g for g in groups if isinstance(g, Mapping)]
        for key, value in obj.items():
            if key != "param_groups":
                found += _param_groups(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            found += _param_groups(value)
    return found


def _hyperparameters(groups: Sequence[Mapping]) -> tuple[dict, int | None]:
    """Muon and Adam hyperparameters and Adam's step from param groups."""
    hyper: dict[str, dict] = {}
    steps = []
    for group in groups:
        kind = "adam" if "betas" in group else "muon" if "momentum" in group else None
        if kind is None:
            continue
        entry = hyper.setdefault(kind, {})
        for name in (
            "lr",
            "max_lr",
            "min_lr",
            "weight_decay",
            "betas",
            "eps",
            "momentum",
            "nesterov",
        ):
            if name in group and name not in entry:
                entry[name] = group[name]
        if kind == "adam" and group.get("step") is not None:
            steps.append(int(float(np.asarray(group["step"]))))
    return hyper, (max(steps) if steps else None)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _rounds_to(master: np.ndarray, model: np.ndarray) -> bool:
    return master.shape == model.shape and _same_bits(master.astype(model.dtype), model)


def _stack(
    per_layer: dict[tuple[str, int | None], np.ndarray], model: Mapping[str, np.ndarray]
) -> dict:
    """Stack ``(key, layer) -> array`` into model keys; skip keys with no entries."""
    out = {}
    for key, weight in model.items():
        if names_lib.is_layer_key(key):
            layers = [per_layer.get((key, i)) for i in range(weight.shape[0])]
            if all(x is not None for x in layers):
                out[key] = np.stack(layers)
            elif any(x is not None for x in layers):
                missing = [i for i, x in enumerate(layers) if x is None]
                raise ValueError(f"{key}: optimizer state for layers {missing} is missing.")
        elif (key, None) in per_layer:
            out[key] = per_layer[(key, None)]
    return out


def _unstack(model: Mapping[str, np.ndarray]) -> dict[tuple[str, int | None], np.ndarray]:
    out = {}
    for key, weight in model.items():
        if names_lib.is_layer_key(key):
            for i in range(weight.shape[0]):
                out[(key, i)] = weight[i]
        else:
            out[(key, None)] = weight
    return out


def _is_glu(args: Mapping) -> bool:
    """Whether ``linear_fc1`` is ``[gate; up]`` (SwiGLU and other gated MLPs)."""
    return bool(args.get("swiglu", args.get("gated_linear_unit", True)))


def _bucket_size_for(unpadded: Sequence[int], args: Mapping) -> int | None:
    if len(unpadded) == 1:
        return None
    return int(args.get("ddp_bucket_size") or min(unpadded[:-1]))


def _unflatten(
    buffers: Mapping[tuple[int, int], list[dict[str, np.ndarray]]],
    gbuf_dtypes: Mapping[int, str],
    model: Mapping[str, np.ndarray],
    orders: Mapping[str, list[tuple[str, int | None]]],
    exclude: set[str],
    tp: int,
    args: Mapping,
    where: str,
) -> tuple[dict[str, dict], str]:
    """Cut DistributedOptimizer flat buffers into per-parameter arrays.

    Args:
      buffers: ``(tp_rank, gbuf) -> [bucket {"param"|"exp_avg"|"exp_avg_sq": flat}]``.
      gbuf_dtypes: ``gbuf -> numpy dtype name`` of its parameters.
      model: Global stacked model weights (for shapes and the master check).
      orders: Candidate definition orders ``name -> [(key, layer)]``; the first
        whose masters round to the model wins.
      exclude: Stacked keys not in these buffers (Muon parameters).

    Returns:
      ``({"masters"|"exp_avg"|"exp_avg_sq": {key: global stacked array}}, order name)``.
    """
    per_layer_model = _unstack(model)
    glu = _is_glu(args)
    failures = []
    for order_name, order in orders.items():
        members = [(k, i) for k, i in order if k not in exclude]
        pieces: dict[str, dict[tuple, list]] = {kind: {} for kind in _FLAT_KINDS.values()}
        problem = None
        for (rank, gbuf), buckets in sorted(buffers.items()):
            dtype = gbuf_dtypes[gbuf]
            mine = [(k, i) for k, i in members if model[k].dtype.name == dtype]
            specs = [
                ParamSpec(
                    name=f"{k}#{i}",
                    dtype=dtype,
                    # A tied embedding is not isolated: Megatron sets shared_embedding
                    # only at pipeline size > 1, whose flat buffers are refused above.
                    shape=names_lib.tp_local_shape(k, per_layer_model[(k, i)].shape, tp),
                )
                for k, i in mine
            ]
            sizes = [next(iter(b.values())).size for b in buckets]
            layout = compute_distributed_optimizer_layout(
                specs, 1, bucket_size=_bucket_size_for(sizes, args)
            )
            if list(layout.per_bucket_numel_unpadded) != sizes:
                problem = (
                    f"buffer {gbuf} of tensor-parallel rank {rank}: re-derived bucket sizes "
                    f"{list(layout.per_bucket_numel_unpadded)} differ from the stored {sizes}"
                )
                break
            for spec, (k, i) in zip(specs, mine):
                start, end, bucket = layout.param_index_map[spec.name]
                offset = layout.bucket_indices[bucket][0]
                for kind, flat in buckets[bucket].items():
                    piece = flat[start - offset : end - offset].reshape(spec.shape)
                    pieces[_FLAT_KINDS[kind]].setdefault((k, i), [None] * tp)[rank] = piece
        if problem is None:
            merged = {
                kind: {
                    ki: names_lib.tp_merge(ki[0], parts, glu=glu)
                    for ki, parts in per.items()
                    if all(p is not None for p in parts)
                }
                for kind, per in pieces.items()
            }
            bad = [
                f"{k}[{i}]"
                for (k, i), m in merged["masters"].items()
                if not _rounds_to(m, per_layer_model[(k, i)])
            ]
            if not merged["masters"]:
                problem = "the buffers hold no fp32 'param' entries to check the layout against"
            elif bad:
                problem = (
                    "masters do not round to the model weights for "
                    f"{bad[:4]}{'...' if len(bad) > 4 else ''}"
                )
            else:
                return {kind: _stack(per, model) for kind, per in merged.items()}, order_name
        failures.append(f"{order_name} order: {problem}")
    raise ValueError(
        f"{where}: cannot re-derive the DistributedOptimizer flat-buffer layout; "
        + "; ".join(failures)
        + "."
    )


def _flat_orders(model: Mapping[str, np.ndarray]) -> dict[str, list[tuple[str, int | None]]]:
    layers = {w.shape[0] for k, w in model.items() if names_lib.is_layer_key(k)}
    num_layers = layers.pop() if len(layers) == 1 else 0
    return {
        spec: names_lib.definition_order(list(model), num_layers, spec)
        for spec in names_lib.LAYER_SPECS
    }


def _check_masters(state: dict, where: str) -> None:
    bad = [
        k
        for k, m in state["masters"].items()
        if k in state["model"] and not _rounds_to(m, state["model"][k])
    ]
    if bad:
        raise ValueError(
            f"{where}: fp32 masters do not round to the stored model weights for {bad}; "
            "the optimizer state does not belong to these weights."
        )


def _read_torch_dist(directory: pathlib.Path, reader: Reader) -> dict:
    meta_json = directory / "metadata.json"
    if meta_json.exists():
        try:
            record = json.loads(meta_json.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{meta_json}: unreadable: {err}") from None
        if not isinstance(record, dict):
            raise ValueError(
                f"{meta_json}: a JSON {type(record).__name__}, not an object such as "
                '{"sharded_backend": "torch_dist", ...}.'
            )
        backend = record.get("sharded_backend")
        if backend not in (None, "torch_dist"):
            raise ValueError(
                f"{meta_json}: sharded_backend is {backend!r}; only 'torch_dist' is supported."
            )
    raw = load_dcp(directory) if reader == "numpy" else load_dcp_torch(directory)
    common_keys = [k for k in raw if k.startswith("common_state/")]
    if common_keys:
        common = raw[common_keys[0]]
    elif (directory / "common.pt").exists():
        path = directory / "common.pt"
        common = (
            load_torch_file(path, directory)
            if reader == "numpy"
            else torch_load(str(path), where=str(path))
        )
    else:
        common = {}
    if not isinstance(common, Mapping):
        raise ValueError(f"{directory}: the common state is a {type(common).__name__}, not a dict.")
    args = _as_dict(common.get("args"))
    model = {
        k: v
        for k, v in raw.items()
        if isinstance(v, np.ndarray)
        and "/" not in k
        and not k.startswith(("optimizer.", "chained_"))
    }
    state = {"model": model, "masters": {}, "momentum": {}, "exp_avg": {}, "exp_avg_sq": {}}
    buffers: dict[tuple[int, int], dict[int, dict[str, np.ndarray]]] = {}
    gbuf_dtypes: dict[int, str] = {}
    for key, value in raw.items():
        if (m := _STATE_RE.match(key)) is not None:
            kind, param = m.groups()
            if param not in model:
                raise ValueError(
                    f"{directory}: {key}: optimizer state for a parameter the model does not have."
                )
            state[STATE_KINDS[kind]][param] = value
        elif (m := _FLAT_RE.match(key)) is not None:
            rank, gbuf, param_dtype, _grad_dtype, bucket, kind = m.groups()
            gbuf_dtypes[int(gbuf)] = TORCH_DTYPES[param_dtype.removeprefix("torch.")].name
            buffers.setdefault((int(rank), int(gbuf)), {}).setdefault(int(bucket), {})[kind] = value
    groups = _param_groups(common.get("optimizer")) + _param_groups(
        [v for k, v in raw.items() if re.search(r"\.optimizer/shard_", k)]
    )
    sharding = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    source = {"format": "torch_dist", "optimizer_sharding": sharding}
    if buffers:
        tp = int(args.get("tensor_model_parallel_size") or len({r for r, _ in buffers}))
        if int(args.get("pipeline_model_parallel_size") or 1) > 1:
            raise ValueError(
                f"{directory}: flat (dp_reshardable) optimizer buffers of a pipeline-parallel run "
                "are not supported; save with --dist-ckpt-optim-fully-reshardable."
            )
        ranks = sorted({r for r, _ in buffers})
        if tp != len(ranks) or ranks != list(range(tp)):  # tp comes from the file: no range(tp)
            raise ValueError(
                f"{directory}: flat optimizer buffers for dp groups {ranks}; "
                f"expected one per tensor-parallel rank 0..{tp - 1}."
            )
        ordered = {rg: [b[i] for i in sorted(b)] for rg, b in buffers.items()}
        flat, order_name = _unflatten(
            ordered,
            gbuf_dtypes,
            model,
            _flat_orders(model),
            set(state["momentum"]),
            tp,
            args,
            str(directory),
        )
        for kind, values in flat.items():
            state[kind].update(values)
        source.update(tp=tp, layer_spec=order_name)
    return {
        **state,
        "common": common,
        "args": args,
        "groups": groups,
        "source": source,
        "iteration": common.get("iteration"),
    }


_RANK_DIR_RE = re.compile(r"^mp_rank_(\d+)(?:_(\d+))?(?:_(\d+))?$")


def _no_weight_decay(name: str, shape: tuple[int, ...]) -> bool:
    """Megatron's default: biases and 1-D parameters get no weight decay."""
    return name.endswith(".bias") or len(shape) == 1


def _children_of(obj) -> list:
    """Child optimizer dicts that hold per-parameter state
    (a DistributedOptimizer's keep theirs elsewhere).
    """
    children = obj if isinstance(obj, list) else [obj] if isinstance(obj, Mapping) else []
    return [
        c
        for c in children
        if isinstance(c, Mapping)
        and (c.get("fp32_from_fp16_params") or (c.get("optimizer") or {}).get("state"))
    ]


def _child_pools(children: list, names: list[tuple[str, tuple[int, ...]]]) -> list[list[list[str]]]:
    """Per child optimizer and param group, the names it holds on a single data-parallel rank.

    A child is Muon's when its groups carry ``momentum`` and no ``betas``; it
    holds the 2-D non-embedding parameters, the others the rest. Groups split
    by weight decay (``wd_mult``), each in definition order.
    """
    pools = []
    for child in children:
        groups = child.get("optimizer", {}).get("param_groups", [])
        is_muon = any("momentum" in g and "betas" not in g for g in groups)
        mine = [
            (n, s) for n, s in names if (len(s) == 2 and not is_embedding_or_output(n)) == is_muon
        ]
        pools.append(
            [
                [
                    n
                    for n, s in mine
                    if _no_weight_decay(n, s) != (float(g.get("wd_mult", 1.0)) != 0.0)
                ]
                for g in groups
            ]
        )
    return pools


def _name_children(
    children: list, pools: list[list[list[str]]], owned: set[str] | None, where: str
) -> dict:
    """Per parameter name, its fp32 master and optimizer state from child optimizers keyed
    by integer ids.
    """
    out: dict[str, dict[str, np.ndarray]] = {}
    for c, (child, child_pools) in enumerate(zip(children, pools)):
        inner = child.get("optimizer", {})
        groups, state = inner.get("param_groups", []), inner.get("state", {})
        masters = child.get("fp32_from_fp16_params") or [[] for _ in groups]
        for g, (group, pool) in enumerate(zip(groups, child_pools)):
            ids = list(group.get("params", []))
            fit = [n for n in pool if owned is None or n in owned]
            if len(fit) != len(ids) or len(masters[g]) != len(ids):
                raise ValueError(
                    f"{where}: child optimizer {c} group {g} has {len(ids)} parameters "
                    f"({len(masters[g])} masters); the model has {len(fit)} that fit it."
                )
            for name, pid, master in zip(fit, ids, masters[g]):
                entry = {"masters": master}
                for kind, value in (state.get(pid) or {}).items():
                    if kind in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
                        entry[STATE_KINDS[kind]] = value
                    elif kind == "step":
                        entry["step"] = value
                out[name] = entry
    return out


# Megatron-LM's --optimizer values of the layer-wise distributed optimizer.
LAYER_WISE_OPTIMIZERS = ("dist_muon",)


def _expected_optimizer_state(main: Mapping, args: Mapping, layer_wise_files: bool) -> str | None:
    """Why a legacy checkpoint must hold optimizer state, or ``None`` where it need not."""
    if layer_wise_files:
        return "the checkpoint has layer_wise_optimizer_<dp>.pt files"
    if _param_groups(main.get("optimizer")):
        return (
            "model_optim_rng.pt holds the optimizer's param groups without per-parameter state "
            "(a distributed optimizer keeps it in another file)"
        )
    if args.get("use_distributed_optimizer"):
        return "model_optim_rng.pt's args say use_distributed_optimizer=True"
    if args.get("optimizer") in LAYER_WISE_OPTIMIZERS:
        return f"model_optim_rng.pt's args say optimizer={args.get('optimizer')!r}"
    return None


def _read_legacy(directory: pathlib.Path, reader: Reader, weights_only: bool = False) -> dict:
    load = (
        (lambda p: load_torch_file(p, directory))
        if reader == "numpy"
        else (lambda p: torch_load(str(p), where=str(p)))
    )
    rank_dirs = {}
    for path in sorted(directory.iterdir()):
        if (m := _RANK_DIR_RE.match(path.name)) is not None:
            if (m.group(2) and int(m.group(2))) or m.group(3) is not None:
                raise ValueError(
                    f"{path}: pipeline- or expert-parallel legacy checkpoints are not supported; "
                    "convert to torch_dist or PP=1 with Megatron's tools/checkpoint first."
                )
            rank_dirs[int(m.group(1))] = path
    tp = len(rank_dirs)
    if sorted(rank_dirs) != list(range(tp)):
        raise ValueError(
            f"{directory}: tensor-parallel rank directories {sorted(rank_dirs)} "
            f"are not 0..{tp - 1}."
        )
    main = [load(rank_dirs[r] / "model_optim_rng.pt") for r in range(tp)]
    for r, obj in enumerate(main):
        if not isinstance(obj, Mapping) or not isinstance(obj.get("model"), Mapping):
            raise ValueError(f"{rank_dirs[r] / 'model_optim_rng.pt'}: no 'model' state dict.")
    args = _as_dict(main[0].get("args"))
    order = [n for n, v in main[0]["model"].items() if isinstance(v, np.ndarray)]
    local = [{n: m["model"].get(n) for n in order} for m in main]
    per_layer = {}
    for n in order:
        if any(lm[n] is None for lm in local):
            raise ValueError(f"{directory}: {n} is missing on some tensor-parallel ranks.")
        per_layer[names_lib.stacked_key(n)] = names_lib.tp_merge(
            n, [lm[n] for lm in local], glu=_is_glu(args)
        )
    model: dict[str, np.ndarray] = {}
    for key, layer in per_layer:
        if layer is None:
            model[key] = per_layer[(key, None)]
        elif key not in model:
            count = 1 + max(i for k, i in per_layer if k == key and i is not None)
            if any((key, i) not in per_layer for i in range(count)):
                raise ValueError(
                    f"{directory}: {key}: some layers are missing from the model state dict."
                )
            model[key] = np.stack([per_layer[(key, i)] for i in range(count)])
    state = {"model": model, "masters": {}, "momentum": {}, "exp_avg": {}, "exp_avg_sq": {}}
    source = {"format": "torch", "tp": tp}
    steps: list[int] = []
    lw_files = sorted(rank_dirs[0].glob("layer_wise_optimizer_*.pt"))
    distrib = [rank_dirs[r] / "distrib_optim.pt" for r in range(tp)]
    if weights_only:
        source["optimizer_sharding"] = None
        return {**state, "common": main[0], "args": args, "groups": [], "source": source,
                "iteration": main[0].get("iteration")}  # fmt: skip
    if lw_files or not all(p.exists() for p in distrib):
        dp = len(lw_files) or 1
        collected: dict[str, dict[tuple, list]] = {
            k: {} for k in ("masters", "momentum", "exp_avg", "exp_avg_sq")
        }
        for r in range(tp):
            names = [(n, tuple(local[r][n].shape)) for n in order]
            for d in range(dp):
                name = f"layer_wise_optimizer_{d}.pt" if lw_files else "model_optim_rng.pt"
                path = rank_dirs[r] / name
                children = _children_of(load(path) if lw_files else main[r].get("optimizer"))
                if not children:
                    expected = _expected_optimizer_state(main[r], args, bool(lw_files))
                    if expected and not weights_only:
                        raise ValueError(
                            f"{path if lw_files else rank_dirs[r] / 'distrib_optim.pt'}: no "
                            f"optimizer state (the file is missing or empty), but {expected}. "
                            "Convert the weights alone with --weights-only (fresh optimizer "
                            "state) if that is what you want."
                        )
                    return {
                        **state,
                        "common": main[0],
                        "args": args,
                        "groups": [],
                        "source": source,
                        "iteration": main[0].get("iteration"),
                    }
                pools = _child_pools(children, names)
                owned = None
                if dp > 1:
                    shape_of = dict(names)
                    groups = [
                        (False, [ParamSpec(n, shape_of[n]) for n in pool])
                        for child in pools
                        for pool in child
                    ]
                    owned = set(ping_pong_ownership(groups, dp)[0][d])
                for name, entry in _name_children(children, pools, owned, str(path)).items():
                    for kind, value in entry.items():
                        if kind == "step":
                            steps.append(int(float(np.asarray(value))))
                        else:
                            collected[kind].setdefault(names_lib.stacked_key(name), [None] * tp)[
                                r
                            ] = value
        for kind, per in collected.items():
            merged = {}
            for (key, layer), parts in per.items():
                if any(p is None for p in parts):
                    raise ValueError(
                        f"{directory}: {names_lib.layer_name(key, layer)}: {kind} is missing on "
                        "some tensor-parallel ranks."
                    )
                merged[(key, layer)] = names_lib.tp_merge(key, parts, glu=_is_glu(args))
            state[kind] = _stack(merged, model)
        source["optimizer_sharding"] = "layer_wise" if lw_files else "per_parameter"
    else:
        buffers, gbuf_dtypes = {}, {}
        for r, path in enumerate(distrib):
            obj = load(path)
            for gbuf, per_dtype in ((k, v) for k, v in obj.items() if isinstance(k, int)):
                for (param_dtype, _grad), content in per_dtype.items():
                    gbuf_dtypes[gbuf] = TORCH_DTYPES[str(param_dtype).removeprefix("torch.")].name
                    buffers[(r, gbuf)] = [{k: content[k] for k in _FLAT_KINDS if k in content}]
        orders = {"checkpoint": [names_lib.stacked_key(n) for n in order]}
        flat, _ = _unflatten(buffers, gbuf_dtypes, model, orders, set(), tp, args, str(directory))
        for kind, values in flat.items():
            state[kind].update(values)
        source["optimizer_sharding"] = "distrib_optim"
    return {
        **state,
        "common": main[0],
        "args": args,
        "groups": _param_groups(main[0].get("optimizer")),
        "source": source,
        "iteration": main[0].get("iteration"),
        "steps": steps,
    }


# What damaged or hostile bytes make numpy, zipfile, zlib, lzma and pickle raise, besides
# ValueError: each becomes a DamagedCheckpointError at read_megatron's boundary.
INPUT_ERRORS = (
    MemoryError,  # numpy's _ArrayMemoryError too
    OverflowError,
    OSError,
    TypeError,
    AttributeError,
    KeyError,
    IndexError,
    RecursionError,
    NotImplementedError,
    RuntimeError,
    EOFError,
    UnicodeError,
    zipfile.BadZipFile,
    zlib.error,
    lzma.LZMAError,
    pickle.UnpicklingError,
)


def read_megatron(
    path,
    *,
    iteration: int | None = None,
    reader: Reader = "numpy",
    verify: bool = True,
    weights_only: bool = False,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> MegatronState:
    """Read a Megatron-Core GPT checkpoint into a :class:`MegatronState`.

    Args:
      path: The checkpoint directory (with ``latest_checkpointed_iteration.txt``)
        or one iteration directory.
      iteration: Which iteration; defaults to the latest.
      reader: ``"numpy"`` (no torch; restricted unpickler) or ``"torch"``
        (torch's loaders, after ``.metadata`` passed the restricted unpickler
        and with ``torch.load(weights_only=True)``). Both give identical arrays.
      verify: Check that every fp32 master rounds to its stored model weight.
      weights_only: Read the model weights alone, without optimizer state.
        Otherwise a legacy checkpoint whose optimizer file is missing or empty
        although its args or files say it was saved with one is an error.
      max_bytes: Per file, what the reader may allocate beyond the bytes it
        reads from the file (256 MiB; see
        :class:`~lwjax.megatron.budget.ByteBudget`). Tensors are bounded by
        the file's real size instead, so real checkpoints of any size fit.

    Returns:
      The global per-parameter state.

    Raises:
      DamagedCheckpointError: (a ``ValueError``) an unreadable, incomplete,
        inconsistent or hostile checkpoint; the message names the file or key
        and what was expected. No other exception escapes for bad input.
    """
    if reader not in READERS:
        raise ValueError(f"read_megatron: reader must be one of {READERS}; got {reader=}.")
    budget = byte_budget(max_bytes)
    try:
        with budget:
            return _read_megatron(path, iteration, reader, verify, weights_only)
    except DamagedCheckpointError:
        raise
    except ValueError as err:
        raise DamagedCheckpointError(str(err)) from None
    except INPUT_ERRORS as err:
        raise DamagedCheckpointError(
            f"{path}: damaged or hostile checkpoint ({type(err).__name__}: {err})"
        ) from None
    except BaseException as err:  # torch's DCP CheckpointException is a BaseException
        if type(err).__name__ != "CheckpointException":
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise DamagedCheckpointError(f"{path}: torch could not read it: {first}") from None


def _read_megatron(
    path, iteration: int | None, reader: Reader, verify: bool, weights_only: bool
) -> MegatronState:
    """:func:`read_megatron` without its error boundary."""
    directory = locate_iteration(path, iteration)
    if (directory / ".metadata").exists():
        state = _read_torch_dist(directory, reader)
        if weights_only:
            state.update(masters={}, momentum={}, exp_avg={}, exp_avg_sq={}, groups=[], steps=[])
    else:
        state = _read_legacy(directory, reader, weights_only)
    if not state["model"]:
        raise ValueError(f"{directory}: the checkpoint holds no model weights.")
    for key, weight in state["model"].items():
        if not np.issubdtype(weight.dtype, np.floating) and weight.dtype.name != "bfloat16":
            raise ValueError(
                f"{directory}: {key}: model weights must be floating point; got {weight.dtype}."
            )
    for kind in ("masters", "momentum", "exp_avg", "exp_avg_sq"):
        for key, value in state[kind].items():
            if value.shape != state["model"][key].shape:
                raise ValueError(
                    f"{directory}: {key}: {kind} shape {value.shape} differs from the model's "
                    f"{state['model'][key].shape}."
                )
    if verify:
        _check_masters(state, str(directory))
    for kind in (
        "masters",
        "momentum",
        "exp_avg",
        "exp_avg_sq",
    ):  # every table in model (definition) order
        state[kind] = {k: state[kind][k] for k in state["model"] if k in state[kind]}
    hyper, adam_step = _hyperparameters(state["groups"])
    if adam_step is None and state.get("steps"):
        adam_step = max(state["steps"])
    iteration_done = state["iteration"]
    if iteration_done is None:
        match = re.match(r"iter_(\d+)$", directory.name)
        iteration_done = int(match.group(1)) if match else 0
    return MegatronState(
        iteration=int(iteration_done),
        model=state["model"],
        masters=state["masters"],
        momentum=state["momentum"],
        exp_avg=state["exp_avg"],
        exp_avg_sq=state["exp_avg_sq"],
        adam_step=adam_step,
        hyperparameters=hyper,
        args=state["args"],
        source={**state["source"], "directory": str(directory), "reader": reader},
        scheduler=_as_dict(state["common"].get("opt_param_scheduler")),
    )
