"""Megatron GPT parameter names: per-layer vs stacked keys, definition order,
tensor-parallel chunks.

Two namings meet here (pure Python and numpy):

* **stacked keys**, as ``torch_dist`` checkpoints store them: one global tensor
  per kind of layer parameter with the layer index as a leading axis, under
  Transformer Engine names (``decoder.layers.self_attention.linear_qkv.weight``
  of shape ``[L, rows, hidden]``; the input norm is
  ``...linear_qkv.layer_norm_weight``, the pre-MLP norm
  ``...linear_fc1.layer_norm_weight``);
* **layer names**, as ``model.named_parameters()`` and the legacy ``torch``
  format give them (``decoder.layers.3.input_layernorm.weight`` with the local
  spec, ``decoder.layers.3.self_attention.linear_qkv.layer_norm_weight`` with TE).

Tensor parallelism splits a parameter ``tp`` ways (:func:`tp_shard`, inverse
:func:`tp_merge`): column-parallel ``linear_qkv`` by rows (whole query groups),
the SwiGLU ``linear_fc1`` = ``[gate; up]`` by rows *of each half*, row-parallel
``linear_proj``/``linear_fc2`` by columns, the vocabulary-parallel embedding and
output layer by rows; norms are replicated.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

LAYER_PREFIX = "decoder.layers."
# local-spec names -> the TE names torch_dist checkpoints use.
TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}
# Definition (``named_parameters``) order of one layer's parameters, per layer spec.
LAYER_ORDER = {
    "local": (
        "self_attention.linear_qkv.layer_norm_weight",
        "self_attention.linear_qkv.layer_norm_bias",
        "self_attention.linear_proj.weight",
        "self_attention.linear_proj.bias",
        "self_attention.linear_qkv.weight",
        "self_attention.linear_qkv.bias",
        "self_attention.q_layernorm.weight",
        "self_attention.k_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight",
        "mlp.linear_fc1.layer_norm_bias",
        "mlp.router.weight",
        "mlp.linear_fc1.weight",
        "mlp.linear_fc1.bias",
        "mlp.linear_fc2.weight",
        "mlp.linear_fc2.bias",
    ),
    "te": (
        "self_attention.linear_proj.weight",
        "self_attention.linear_proj.bias",
        "self_attention.linear_qkv.layer_norm_weight",
        "self_attention.linear_qkv.layer_norm_bias",
        "self_attention.linear_qkv.weight",
        "self_attention.linear_qkv.bias",
        "self_attention.q_layernorm.weight",
        "self_attention.k_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight",
        "mlp.linear_fc1.layer_norm_bias",
        "mlp.router.weight",
        "mlp.linear_fc1.weight",
        "mlp.linear_fc1.bias",
        "mlp.linear_fc2.weight",
        "mlp.linear_fc2.bias",
    ),
}
LAYER_SPECS = tuple(LAYER_ORDER)
# A mixture of experts' per-expert weights ([L, E, ...]): Megatron keeps them in buffers of
# their own (expert data parallel), apart from the dense parameters' definition order.
EXPERT_PREFIX = LAYER_PREFIX + "mlp.experts."
BEFORE_LAYERS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
AFTER_LAYERS = (
    "decoder.final_layernorm.weight",
    "decoder.final_layernorm.bias",
    "output_layer.weight",
)
# Optimizer-state kinds in Megatron's keys -> the MegatronState table that holds them.
STATE_KINDS = {
    "fp32_param": "masters",
    "param": "masters",
    "momentum_buffer": "momentum",
    "exp_avg": "exp_avg",
    "exp_avg_sq": "exp_avg_sq",
}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def stacked_key(name: str) -> tuple[str, int | None]:
    """Map a layer name to its stacked key and layer index (``None`` outside the layers).

    ``decoder.layers.3.input_layernorm.weight`` ->
    ``("decoder.layers.self_attention.linear_qkv.layer_norm_weight", 3)``.
    """
    match = _LAYER_RE.match(name)
    if not match:
        return name, None
    rest = match.group(2)
    return LAYER_PREFIX + TE_NAMES.get(rest, rest), int(match.group(1))


def layer_name(key: str, layer: int | None, spec: str = "te") -> str:
    """Inverse of :func:`stacked_key`: the ``named_parameters`` name under ``spec``
    (``"local"`` or ``"te"``).
    """
    if layer is None:
        return key
    rest = key[len(LAYER_PREFIX) :]
    if spec == "local":
        rest = {te: local for local, te in TE_NAMES.items()}.get(rest, rest)
    return f"{LAYER_PREFIX}{layer}.{rest}"


def is_layer_key(key: str) -> bool:
    """Whether a stacked key holds per-layer parameters (leading layer axis)."""
    return key.startswith(LAYER_PREFIX) and not _LAYER_RE.match(key)


def is_expert_key(key: str) -> bool:
    """Whether a stacked key holds a mixture of experts' per-expert weights ``[L, E, ...]``."""
    return key.startswith(EXPERT_PREFIX)


def definition_order(
    keys: Sequence[str], num_layers: int, spec: str
) -> list[tuple[str, int | None]]:
    """``(stacked key, layer)`` of every dense parameter in Megatron's ``named_parameters``
    order; expert weights (:func:`is_expert_key`), which sit in buffers of their own, are
    left out.

    Args:
      keys: The stacked model keys.
      num_layers: Number of transformer layers.
      spec: ``"local"`` or ``"te"`` (they differ in where the input norm sits).

    Raises:
      ValueError: a key whose place in the order is unknown.
    """
    layer_rank = {rest: i for i, rest in enumerate(LAYER_ORDER[spec])}
    keys = [k for k in keys if not is_expert_key(k)]
    unknown = [
        k
        for k in keys
        if (
            k[len(LAYER_PREFIX) :] not in layer_rank
            if is_layer_key(k)
            else k not in BEFORE_LAYERS + AFTER_LAYERS
        )
    ]
    if unknown:
        raise ValueError(
            f"{unknown[0]}: no known place in a Megatron GPT's parameter order "
            f"(unknown keys: {unknown}); "
            "the DistributedOptimizer buffer layout cannot be re-derived. Save with "
            "--dist-ckpt-optim-fully-reshardable for per-parameter optimizer keys."
        )
    layer_keys = sorted(
        (k for k in keys if is_layer_key(k)), key=lambda k: layer_rank[k[len(LAYER_PREFIX) :]]
    )
    order = [(k, None) for k in BEFORE_LAYERS if k in keys]
    order += [(k, i) for i in range(num_layers) for k in layer_keys]
    order += [(k, None) for k in AFTER_LAYERS if k in keys]
    return order


def pipeline_stage(key: str, layer: int | None, num_layers: int, pp: int) -> int:
    """The pipeline stage that holds parameter ``(key, layer)`` when Megatron splits
    ``num_layers`` evenly over ``pp`` stages: layer ``i`` on stage ``i // (num_layers / pp)``,
    the embedding on the first stage, the final norm and the output layer on the last.
    """
    if layer is not None:
        return layer // (num_layers // pp)
    return 0 if key in BEFORE_LAYERS else pp - 1


def tp_kind(key: str) -> str:
    """How tensor parallelism splits a parameter: ``rows``, ``glu``, ``columns``, ``vocab``
    or ``replicated``.
    """
    base = stacked_key(key)[0]
    if (
        base.endswith("linear_qkv.weight")
        or base.endswith("linear_qkv.bias")
        or base.endswith("linear_fc1.bias")
    ):
        return "rows"
    if base.endswith("linear_fc1.weight"):
        return "glu"
    if base.endswith("linear_proj.weight") or base.endswith("linear_fc2.weight"):
        return "columns"
    if base in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return "vocab"
    return "replicated"


def _check_divides(key: str, size: int, tp: int, what: str) -> None:
    if size % tp:
        raise ValueError(f"{key}: {what} of {size} does not split into tensor-parallel size {tp}.")


def tp_shard(key: str, array: np.ndarray, tp: int, rank: int, *, glu: bool = True) -> np.ndarray:
    """Tensor-parallel rank ``rank``'s piece of one (unstacked) parameter, as Megatron holds it."""
    kind = tp_kind(key)
    if tp == 1 or kind == "replicated":
        return array
    if kind == "glu" and glu:
        half = array.shape[0] // 2
        _check_divides(key, half, tp, "each GLU half's rows")
        gate, up = array[:half], array[half:]
        size = half // tp
        return np.concatenate(
            [gate[rank * size : (rank + 1) * size], up[rank * size : (rank + 1) * size]]
        )
    axis = 1 if kind == "columns" else 0
    _check_divides(key, array.shape[axis], tp, f"dimension {axis}")
    return np.split(array, tp, axis=axis)[rank]


def tp_merge(key: str, pieces: Sequence[np.ndarray], *, glu: bool = True) -> np.ndarray:
    """Inverse of :func:`tp_shard`: the global parameter from every tensor-parallel rank's piece.

    Raises:
      ValueError: replicated pieces that differ between ranks.
    """
    kind = tp_kind(key)
    if len(pieces) == 1:
        return pieces[0]
    if kind == "replicated":
        for rank, piece in enumerate(pieces[1:], 1):
            if piece.shape != pieces[0].shape or piece.tobytes() != pieces[0].tobytes():
                raise ValueError(
                    f"{key}: a replicated parameter differs between tensor-parallel ranks "
                    f"0 and {rank}."
                )
        return pieces[0]
    if kind == "glu" and glu:
        halves = [np.split(p, 2, axis=0) for p in pieces]
        return np.concatenate([h[0] for h in halves] + [h[1] for h in halves])
    return np.concatenate(pieces, axis=1 if kind == "columns" else 0)


def tp_local_shape(key: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """Shape of one rank's piece of an (unstacked) parameter of global ``shape``."""
    kind = tp_kind(key)
    if tp == 1 or kind == "replicated":
        return tuple(shape)
    axis = 1 if kind == "columns" else 0
    _check_divides(key, shape[axis], tp, f"dimension {axis}")
    return tuple(n // tp if i == axis else n for i, n in enumerate(shape))
