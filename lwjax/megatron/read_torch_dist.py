"""Read a ``torch_dist`` (DCP) iteration directory into global per-parameter tables.

Model tensors sit under stacked global keys. Optimizer state is stored per parameter
(``[chained_<i>.]optimizer.state.<kind>.<key>``: Muon's ``fp32_param``/``momentum_buffer``,
fully reshardable Adam's ``param``/``exp_avg``/``exp_avg_sq``) or as the
DistributedOptimizer's flat bucket buffers
(``...optimizer.distributed.dp_group_idx_<tp>.gbuf_idx_<g>.dtype_(...).bucket_idx_<b>.<kind>``,
the default ``dp_reshardable`` form, cut up by :mod:`lwjax.megatron.flat_buffers`). The
common state (args, iteration, param groups) is the ``common_state`` object or ``common.pt``.
"""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Mapping

import numpy as np

from lwjax.megatron import names as names_lib
from lwjax.megatron.allow_list import TORCH_DTYPES
from lwjax.megatron.common_state import Reader, as_dict, find_param_groups, load_file
from lwjax.megatron.dcp import load_dcp, load_dcp_torch
from lwjax.megatron.flat_buffers import unflatten_buffers

_STATE_RE = re.compile(
    r"^(?:chained_\d+\.)?optimizer\.state\."
    r"(fp32_param|param|momentum_buffer|exp_avg|exp_avg_sq)\.(.+)$"
)
_FLAT_RE = re.compile(
    r"^(?:chained_\d+\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\."
    r"dtype_\((.+?), (.+?)\)\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)$"
)


def read_torch_dist(directory: pathlib.Path, reader: Reader) -> dict:
    """The tables, common state, args, param groups and source of one ``torch_dist``
    iteration directory (the dict :func:`lwjax.megatron.state.read_megatron` finishes).
    """
    _check_backend(directory)
    raw = load_dcp(directory) if reader == "numpy" else load_dcp_torch(directory)
    common = _common_state(directory, raw, reader)
    args = as_dict(common.get("args"))
    model = {
        k: v
        for k, v in raw.items()
        if isinstance(v, np.ndarray)
        and "/" not in k
        and not k.startswith(("optimizer.", "chained_"))
    }
    state = {"model": model, "masters": {}, "momentum": {}, "exp_avg": {}, "exp_avg_sq": {}}
    buffers, gbuf_dtypes = _sort_optimizer_keys(directory, raw, state)
    groups = find_param_groups(common.get("optimizer")) + find_param_groups(
        [v for k, v in raw.items() if re.search(r"\.optimizer/shard_", k)]
    )
    sharding = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    source = {"format": "torch_dist", "optimizer_sharding": sharding}
    if buffers:
        source.update(_unflatten_into(state, buffers, gbuf_dtypes, args, directory))
    return {
        **state,
        "common": common,
        "args": args,
        "groups": groups,
        "source": source,
        "iteration": common.get("iteration"),
    }


def _check_backend(directory: pathlib.Path) -> None:
    """Refuse a ``metadata.json`` that names a sharded backend other than ``torch_dist``."""
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


def _common_state(directory: pathlib.Path, raw: Mapping, reader: Reader) -> Mapping:
    """The ``common_state`` object, else ``common.pt``, else an empty dict."""
    common_keys = [k for k in raw if k.startswith("common_state/")]
    if common_keys:
        common = raw[common_keys[0]]
    elif (directory / "common.pt").exists():
        common = load_file(directory / "common.pt", directory, reader)
    else:
        common = {}
    if not isinstance(common, Mapping):
        raise ValueError(f"{directory}: the common state is a {type(common).__name__}, not a dict.")
    return common


def _sort_optimizer_keys(directory: pathlib.Path, raw: Mapping, state: dict) -> tuple[dict, dict]:
    """Put per-parameter optimizer keys into ``state``'s tables; return the flat buffers
    ``{(tp_rank, gbuf): {bucket: {kind: flat}}}`` and ``{gbuf: parameter dtype name}``.
    """
    buffers: dict[tuple[int, int], dict[int, dict[str, np.ndarray]]] = {}
    gbuf_dtypes: dict[int, str] = {}
    for key, value in raw.items():
        if (m := _STATE_RE.match(key)) is not None:
            kind, param = m.groups()
            if param not in state["model"]:
                raise ValueError(
                    f"{directory}: {key}: optimizer state for a parameter the model does not have."
                )
            state[names_lib.STATE_KINDS[kind]][param] = value
        elif (m := _FLAT_RE.match(key)) is not None:
            rank, gbuf, param_dtype, _grad_dtype, bucket, kind = m.groups()
            gbuf_dtypes[int(gbuf)] = TORCH_DTYPES[param_dtype.removeprefix("torch.")].name
            buffers.setdefault((int(rank), int(gbuf)), {}).setdefault(int(bucket), {})[kind] = value
    return buffers, gbuf_dtypes


def _unflatten_into(
    state: dict, buffers: dict, gbuf_dtypes: dict, args: Mapping, directory: pathlib.Path
) -> dict:
    """Cut the flat buffers into ``state``'s tables (Muon's parameters are not in them);
    return the source entries they add (``tp``, ``layer_spec``).
    """
    tp = int(args.get("tensor_model_parallel_size") or len({r for r, _ in buffers}))
    pp = _pipeline_size(args, state["model"], directory)
    ranks = sorted({r for r, _ in buffers})
    # tp and pp come from the file: no range(tp * pp)
    if tp * pp != len(ranks) or ranks != list(range(len(ranks))):
        raise ValueError(
            f"{directory}: flat optimizer buffers for dp groups {ranks}; expected one per "
            f"tensor-parallel rank of each pipeline stage, 0..{tp * pp - 1} "
            f"(tensor-parallel size {tp} x pipeline size {pp})."
        )
    model = state["model"]
    experts = [k for k in model if names_lib.is_expert_key(k) and k not in state["momentum"]]
    if experts:
        raise ValueError(
            f"{directory}: the expert weights {experts} are in the DistributedOptimizer's "
            "flat buffers of each expert-parallel rank (dp_reshardable), which lwjax does not "
            "cut up; save with --dist-ckpt-optim-fully-reshardable for per-parameter optimizer "
            "keys (a Muon run holds its experts per parameter already)."
        )
    ordered = {rg: [b[i] for i in sorted(b)] for rg, b in buffers.items()}
    flat, order_name = unflatten_buffers(
        ordered,
        gbuf_dtypes,
        model,
        _flat_orders(model),
        set(state["momentum"]),
        tp,
        args,
        str(directory),
        pp=pp,
    )
    for kind, values in flat.items():
        state[kind].update(values)
    return {"tp": tp, "pp": pp, "layer_spec": order_name}


# Megatron-LM arguments that place layers or chunks other than an even split over the stages
_UNEVEN_PIPELINE_ARGS = (
    "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank",
    "virtual_pipeline_model_parallel_size",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "pipeline_model_parallel_layout",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)


def _pipeline_size(args: Mapping, model: Mapping, directory: pathlib.Path) -> int:
    """The pipeline size the flat buffers were written at (``args``), checked to be a split
    the buffers can be cut by: layers spread evenly, one model chunk per stage, untied.
    """
    pp = int(args.get("pipeline_model_parallel_size") or 1)
    if pp == 1:
        return 1
    uneven = [name for name in _UNEVEN_PIPELINE_ARGS if args.get(name)]
    layers = {w.shape[0] for k, w in model.items() if names_lib.is_layer_key(k)}
    problem = None
    if uneven:
        problem = f"args {uneven} place the layers other than evenly"
    elif len(layers) != 1 or layers.pop() % pp:
        problem = f"the layers do not split evenly into pipeline size {pp}"
    elif "output_layer.weight" not in model:
        problem = "the embedding is tied to the output layer (a copy on the last stage)"
    if problem:
        raise ValueError(
            f"{directory}: flat (dp_reshardable) optimizer buffers of a pipeline-parallel run "
            f"whose {problem} are not supported; save with "
            "--dist-ckpt-optim-fully-reshardable for per-parameter optimizer keys."
        )
    return pp


def _flat_orders(model: Mapping[str, np.ndarray]) -> dict[str, list[tuple[str, int | None]]]:
    """The candidate definition orders of the flat buffers' parameters, one per layer spec."""
    layers = {w.shape[0] for k, w in model.items() if names_lib.is_layer_key(k)}
    num_layers = layers.pop() if len(layers) == 1 else 0
    return {
        spec: names_lib.definition_order(list(model), num_layers, spec)
        for spec in names_lib.LAYER_SPECS
    }
