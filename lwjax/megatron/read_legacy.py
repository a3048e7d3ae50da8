"""Read a legacy ``torch`` iteration directory into global per-parameter tables.

Per tensor-parallel rank, ``mp_rank_<tp>/`` holds ``model_optim_rng.pt`` (model, args,
optimizer param groups) and either ``distrib_optim.pt`` (the DistributedOptimizer's flat
state, cut up by :mod:`lwjax.megatron.flat_buffers`), ``layer_wise_optimizer_<dp>.pt``
(per child optimizer, state keyed by integer parameter ids) or, for a plain optimizer, the
state inside ``model_optim_rng.pt``. Integer ids are named the way Megatron numbers them:
per child optimizer, per parameter group (weight decay or not), in definition order, and
with several layer-wise files each data-parallel rank's share follows Megatron's legacy
ping-pong ownership.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from lwjax.layout import ParamSpec
from lwjax.megatron import names as names_lib
from lwjax.megatron.allow_list import TORCH_DTYPES
from lwjax.megatron.common_state import Reader, as_dict, find_param_groups, load_file
from lwjax.megatron.flat_buffers import FLAT_KINDS, is_glu, stack_layers, unflatten_buffers
from lwjax.megatron.ping_pong import ping_pong_ownership
from lwjax.routing import is_embedding_or_output

_RANK_DIR_RE = re.compile(r"^mp_rank_(\d+)(?:_(\d+))?(?:_(\d+))?$")


@dataclasses.dataclass(frozen=True)
class _Ranks:
    """A legacy iteration directory, opened: per tensor-parallel rank its directory,
    ``model_optim_rng.pt`` and model state dict (``local``), the args, the parameter names
    in definition order, and the file loader of the chosen reader.
    """

    directory: pathlib.Path
    dirs: list[pathlib.Path]
    main: list[Mapping]
    local: list[dict[str, np.ndarray]]
    args: dict
    order: list[str]
    load: Callable[[pathlib.Path], Any]

    @property
    def tp(self) -> int:
        return len(self.dirs)


def read_legacy(directory: pathlib.Path, reader: Reader, weights_only: bool = False) -> dict:
    """The tables, common state, args, param groups and source of one legacy iteration
    directory (the dict :func:`lwjax.megatron.state.read_megatron` finishes).
    """
    ranks = _open_ranks(directory, functools.partial(load_file, directory=directory, reader=reader))
    model = _merged_model(ranks)
    state = {"model": model, "masters": {}, "momentum": {}, "exp_avg": {}, "exp_avg_sq": {}}
    source = {"format": "torch", "tp": ranks.tp}
    lw_files = sorted(ranks.dirs[0].glob("layer_wise_optimizer_*.pt"))
    distrib = [d / "distrib_optim.pt" for d in ranks.dirs]
    if weights_only:
        source["optimizer_sharding"] = None
        return _result(ranks, state, source, groups=[])
    steps: list[int] = []
    if lw_files or not all(p.exists() for p in distrib):
        read = _read_per_parameter(ranks, len(lw_files), model)
        if read is None:
            return _result(ranks, state, source, groups=[])
        tables, steps = read
        state.update(tables)
        source["optimizer_sharding"] = "layer_wise" if lw_files else "per_parameter"
    else:
        for kind, values in _read_distrib_optim(ranks, distrib, model).items():
            state[kind].update(values)
        source["optimizer_sharding"] = "distrib_optim"
    groups = find_param_groups(ranks.main[0].get("optimizer"))
    return {**_result(ranks, state, source, groups=groups), "steps": steps}


def _result(ranks: _Ranks, state: dict, source: dict, *, groups: list) -> dict:
    return {
        **state,
        "common": ranks.main[0],
        "args": ranks.args,
        "groups": groups,
        "source": source,
        "iteration": ranks.main[0].get("iteration"),
    }


def _open_ranks(directory: pathlib.Path, load: Callable[[pathlib.Path], Any]) -> _Ranks:
    """Find ``mp_rank_<tp>/`` (0..tp-1, no pipeline or expert parallelism) and load each
    rank's ``model_optim_rng.pt``.
    """
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
    dirs = [rank_dirs[r] for r in range(tp)]
    main = [load(d / "model_optim_rng.pt") for d in dirs]
    for d, obj in zip(dirs, main):
        if not isinstance(obj, Mapping) or not isinstance(obj.get("model"), Mapping):
            raise ValueError(f"{d / 'model_optim_rng.pt'}: no 'model' state dict.")
    order = [n for n, v in main[0]["model"].items() if isinstance(v, np.ndarray)]
    return _Ranks(
        directory=directory,
        dirs=dirs,
        main=main,
        local=[{n: m["model"].get(n) for n in order} for m in main],
        args=as_dict(main[0].get("args")),
        order=order,
        load=load,
    )


def _merged_model(ranks: _Ranks) -> dict[str, np.ndarray]:
    """The global model weights: tensor-parallel pieces merged, layers stacked."""
    per_layer = {}
    for n in ranks.order:
        if any(lm[n] is None for lm in ranks.local):
            raise ValueError(f"{ranks.directory}: {n} is missing on some tensor-parallel ranks.")
        per_layer[names_lib.stacked_key(n)] = names_lib.tp_merge(
            n, [lm[n] for lm in ranks.local], glu=is_glu(ranks.args)
        )
    model: dict[str, np.ndarray] = {}
    for key, layer in per_layer:
        if layer is None:
            model[key] = per_layer[(key, None)]
        elif key not in model:
            count = 1 + max(i for k, i in per_layer if k == key and i is not None)
            if any((key, i) not in per_layer for i in range(count)):
                raise ValueError(
                    f"{ranks.directory}: {key}: some layers are missing from the model state dict."
                )
            model[key] = np.stack([per_layer[(key, i)] for i in range(count)])
    return model


def _read_per_parameter(
    ranks: _Ranks, num_layer_wise_files: int, model: Mapping[str, np.ndarray]
) -> tuple[dict, list[int]] | None:
    """Per-parameter optimizer state from the layer-wise files (``dp`` of them per rank),
    or from ``model_optim_rng.pt`` when there are none: ``(tables, Adam steps)``, or
    ``None`` where a file holds no state and nothing says it should.
    """
    dp = num_layer_wise_files or 1
    collected: dict[str, dict[tuple, list]] = {
        k: {} for k in ("masters", "momentum", "exp_avg", "exp_avg_sq")
    }
    steps: list[int] = []
    for r in range(ranks.tp):
        names = [(n, tuple(ranks.local[r][n].shape)) for n in ranks.order]
        for d in range(dp):
            if num_layer_wise_files:
                path = ranks.dirs[r] / f"layer_wise_optimizer_{d}.pt"
                children = _children_of(ranks.load(path))
            else:
                path = ranks.dirs[r] / "model_optim_rng.pt"
                children = _children_of(ranks.main[r].get("optimizer"))
            if not children:
                _refuse_missing_state(ranks, r, path, bool(num_layer_wise_files))
                return None
            for name, entry in _owned_state(children, names, d, dp, str(path)).items():
                for kind, value in entry.items():
                    if kind == "step":
                        steps.append(int(float(np.asarray(value))))
                    else:
                        collected[kind].setdefault(names_lib.stacked_key(name), [None] * ranks.tp)[
                            r
                        ] = value
    return _merge_tensor_parallel(ranks, collected, model), steps


def _refuse_missing_state(ranks: _Ranks, r: int, path: pathlib.Path, layer_wise: bool) -> None:
    """Raise where rank ``r`` holds no optimizer state although the checkpoint says it should."""
    expected = _expected_optimizer_state(ranks.main[r], ranks.args, layer_wise)
    if expected:
        raise ValueError(
            f"{path if layer_wise else ranks.dirs[r] / 'distrib_optim.pt'}: no "
            f"optimizer state (the file is missing or empty), but {expected}. "
            "Convert the weights alone with --weights-only (fresh optimizer "
            "state) if that is what you want."
        )


def _owned_state(
    children: list, names: list[tuple[str, tuple[int, ...]]], d: int, dp: int, where: str
) -> dict:
    """The named state data-parallel rank ``d`` of ``dp`` holds (all of it when ``dp == 1``)."""
    pools = _child_pools(children, names)
    owned = None
    if dp > 1:
        shape_of = dict(names)
        groups = [
            (False, [ParamSpec(n, shape_of[n]) for n in pool]) for child in pools for pool in child
        ]
        owned = set(ping_pong_ownership(groups, dp)[0][d])
    return _name_children(children, pools, owned, where)


def _merge_tensor_parallel(
    ranks: _Ranks, collected: dict[str, dict[tuple, list]], model: Mapping[str, np.ndarray]
) -> dict:
    """Each table's tensor-parallel pieces merged and its layers stacked into model keys."""
    tables = {}
    for kind, per in collected.items():
        merged = {}
        for (key, layer), parts in per.items():
            if any(p is None for p in parts):
                raise ValueError(
                    f"{ranks.directory}: {names_lib.layer_name(key, layer)}: {kind} is missing on "
                    "some tensor-parallel ranks."
                )
            merged[(key, layer)] = names_lib.tp_merge(key, parts, glu=is_glu(ranks.args))
        tables[kind] = stack_layers(merged, model)
    return tables


def _read_distrib_optim(
    ranks: _Ranks, files: list[pathlib.Path], model: Mapping[str, np.ndarray]
) -> dict:
    """The tables held in each rank's ``distrib_optim.pt`` flat buffers (one bucket each)."""
    buffers, gbuf_dtypes = {}, {}
    for r, path in enumerate(files):
        obj = ranks.load(path)
        for gbuf, per_dtype in ((k, v) for k, v in obj.items() if isinstance(k, int)):
            for (param_dtype, _grad), content in per_dtype.items():
                gbuf_dtypes[gbuf] = TORCH_DTYPES[str(param_dtype).removeprefix("torch.")].name
                buffers[(r, gbuf)] = [{k: content[k] for k in FLAT_KINDS if k in content}]
    orders = {"checkpoint": [names_lib.stacked_key(n) for n in ranks.order]}
    flat, _ = unflatten_buffers(
        buffers, gbuf_dtypes, model, orders, set(), ranks.tp, ranks.args, str(ranks.directory)
    )
    return flat


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
                        entry[names_lib.STATE_KINDS[kind]] = value
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
    if find_param_groups(main.get("optimizer")):
        return (
            "model_optim_rng.pt holds the optimizer's param groups without per-parameter state "
            "(a distributed optimizer keeps it in another file)"
        )
    if args.get("use_distributed_optimizer"):
        return "model_optim_rng.pt's args say use_distributed_optimizer=True"
    if args.get("optimizer") in LAYER_WISE_OPTIMIZERS:
        return f"model_optim_rng.pt's args say optimizer={args.get('optimizer')!r}"
    return None
