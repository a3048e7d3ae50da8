"""The DistributedOptimizer's flat bucket buffers cut back into per-parameter arrays.

Flat buffers do not store their layout. It is re-derived with
:func:`lwjax.elementwise_layout.compute_distributed_optimizer_layout` over the buffer's
parameters in definition order (for each tensor-parallel rank, with its local shapes); of
several candidate orders (layer specs), the one whose unflattened fp32 masters round
exactly to the stored model weights wins, so a wrong layout cannot pass silently.
Also here: stacking per-layer arrays into the stacked ``torch_dist`` keys and back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from lwjax.elementwise_layout import compute_distributed_optimizer_layout
from lwjax.layout import ParamSpec
from lwjax.megatron import names as names_lib

# The kinds a flat bucket holds -> the MegatronState tables they fill.
FLAT_KINDS = {"param": "masters", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def rounds_to(master: np.ndarray, model: np.ndarray) -> bool:
    return master.shape == model.shape and _same_bits(master.astype(model.dtype), model)


def stack_layers(
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


def layer_slices(model: Mapping[str, np.ndarray]) -> dict[tuple[str, int | None], np.ndarray]:
    out = {}
    for key, weight in model.items():
        if names_lib.is_layer_key(key):
            for i in range(weight.shape[0]):
                out[(key, i)] = weight[i]
        else:
            out[(key, None)] = weight
    return out


def is_glu(args: Mapping) -> bool:
    """Whether ``linear_fc1`` is ``[gate; up]`` (SwiGLU and other gated MLPs)."""
    return bool(args.get("swiglu", args.get("gated_linear_unit", True)))


def _bucket_size_for(unpadded: Sequence[int], args: Mapping) -> int | None:
    if len(unpadded) == 1:
        return None
    return int(args.get("ddp_bucket_size") or min(unpadded[:-1]))


def unflatten_buffers(
    buffers: Mapping[tuple[int, int], list[dict[str, np.ndarray]]],
    gbuf_dtypes: Mapping[int, str],
    model: Mapping[str, np.ndarray],
    orders: Mapping[str, list[tuple[str, int | None]]],
    exclude: set[str],
    tp: int,
    args: Mapping,
    where: str,
    *,
    pp: int = 1,
) -> tuple[dict[str, dict], str]:
    """Cut DistributedOptimizer flat buffers into per-parameter arrays.

    Args:
      buffers: ``(model-parallel rank, gbuf) -> [bucket {"param"|"exp_avg"|"exp_avg_sq":
        flat}]``; model-parallel rank ``stage * tp + tp_rank`` holds the parameters of that
        pipeline stage (:func:`lwjax.megatron.names.pipeline_stage`).
      gbuf_dtypes: ``gbuf -> numpy dtype name`` of its parameters.
      model: Global stacked model weights (for shapes and the master check).
      orders: Candidate definition orders ``name -> [(key, layer)]``; the first
        whose masters round to the model wins.
      exclude: Stacked keys not in these buffers (Muon parameters).
      pp: Pipeline size, the layers split evenly over the stages.

    Returns:
      ``({"masters"|"exp_avg"|"exp_avg_sq": {key: global stacked array}}, order name)``.
    """
    per_layer_model = layer_slices(model)
    failures = []
    for order_name, order in orders.items():
        members = [(k, i) for k, i in order if k not in exclude]
        try:
            pieces = _cut(buffers, gbuf_dtypes, model, per_layer_model, members, tp, pp, args)
            merged = _merged_and_checked(pieces, per_layer_model, is_glu(args))
        except _WrongOrder as problem:
            failures.append(f"{order_name} order: {problem}")
            continue
        return {kind: stack_layers(per, model) for kind, per in merged.items()}, order_name
    raise ValueError(
        f"{where}: cannot re-derive the DistributedOptimizer flat-buffer layout; "
        + "; ".join(failures)
        + "."
    )


class _WrongOrder(Exception):
    """The buffers do not fit a candidate order; the message says where."""


def _cut(buffers, gbuf_dtypes, model, per_layer_model, members, tp: int, pp: int, args) -> dict:
    """Per kind, ``(key, layer) -> [piece of each tensor-parallel rank]`` cut from the
    buffers at the layout re-derived for ``members`` (one definition order), each
    model-parallel rank's buffers from the members of its pipeline stage.
    """
    pieces: dict[str, dict[tuple, list]] = {kind: {} for kind in FLAT_KINDS.values()}
    layers = {w.shape[0] for k, w in model.items() if names_lib.is_layer_key(k)}
    num_layers = max(layers, default=0)
    for (mp_rank, gbuf), buckets in sorted(buffers.items()):
        dtype = gbuf_dtypes[gbuf]
        stage, rank = divmod(mp_rank, tp)
        mine = [
            (k, i)
            for k, i in members
            if model[k].dtype.name == dtype
            and names_lib.pipeline_stage(k, i, num_layers, pp) == stage
        ]
        specs = [
            ParamSpec(
                name=f"{k}#{i}",
                dtype=dtype,
                # A tied embedding is not isolated: Megatron sets shared_embedding only at
                # pipeline size > 1, where the readers refuse tied flat buffers.
                shape=names_lib.tp_local_shape(k, per_layer_model[(k, i)].shape, tp),
            )
            for k, i in mine
        ]
        sizes = [next(iter(b.values())).size for b in buckets]
        layout = compute_distributed_optimizer_layout(
            specs, 1, bucket_size=_bucket_size_for(sizes, args)
        )
        if list(layout.per_bucket_numel_unpadded) != sizes:
            raise _WrongOrder(
                f"buffer {gbuf} of model-parallel rank {mp_rank}: re-derived bucket sizes "
                f"{list(layout.per_bucket_numel_unpadded)} differ from the stored {sizes}"
            )
        for spec, (k, i) in zip(specs, mine):
            start, end, bucket = layout.param_index_map[spec.name]
            offset = layout.bucket_indices[bucket][0]
            for kind, flat in buckets[bucket].items():
                piece = flat[start - offset : end - offset].reshape(spec.shape)
                pieces[FLAT_KINDS[kind]].setdefault((k, i), [None] * tp)[rank] = piece
    return pieces


def _merged_and_checked(pieces: dict, per_layer_model: Mapping, glu: bool) -> dict:
    """The tensor-parallel pieces merged; every master must round to its model weight."""
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
        if not rounds_to(m, per_layer_model[(k, i)])
    ]
    if not merged["masters"]:
        raise _WrongOrder("the buffers hold no fp32 'param' entries to check the layout against")
    if bad:
        raise _WrongOrder(
            "masters do not round to the model weights for "
            f"{bad[:4]}{'...' if len(bad) > 4 else ''}"
        )
    return merged
