"""Megatron's distributed-optimizer layout of an elementwise buffer (pure Python).

Elementwise (AdamW) parameters need no whole-parameter ownership: Megatron packs
them back to back and cuts each bucket into plain ``1/dp`` slices, so a
parameter may straddle two ranks. lwjax lays out its elementwise buffers the
same way, and reads Megatron's ``DistributedOptimizer`` checkpoints with it.
"""

from __future__ import annotations

from collections.abc import Sequence

from lwjax.layout import ParamSpec, PerBufferParamLayout, pad_bucket_end, pad_param_start


def check_size(where: str, name: str, value) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {name} must be a positive integer; got {name}={value!r}.")


def check_specs(specs: Sequence[ParamSpec], dp: int, where: str) -> None:
    """Raise unless ``dp`` is positive and ``specs`` are ``ParamSpec`` with unique names."""
    check_size(where, "dp", dp)
    seen: set[str] = set()
    for spec in specs:
        if not isinstance(spec, ParamSpec):
            raise TypeError(
                f"{where}: parameters must be ParamSpec, but got {type(spec).__name__}."
            )
        if spec.name in seen:
            raise ValueError(f"{spec.name}: duplicate parameter name; names must be unique.")
        seen.add(spec.name)


def compute_distributed_optimizer_layout(
    specs: Sequence[ParamSpec],
    dp: int,
    *,
    bucket_size: int | None = None,
    high_busbw: bool = False,
    param_indices: Sequence[int] | None = None,
) -> PerBufferParamLayout:
    """Compute Megatron's byte-level distributed-optimizer layout of an elementwise buffer.

    Parameters are packed back to back in backprop order (64-aligned); a bucket
    closes once it reaches ``bucket_size`` elements or after a tied embedding
    (which also starts a fresh bucket), and its end is padded to a multiple of
    ``lcm(dp, 128)``. Shards are plain ``1/dp`` slices of a bucket, so a
    parameter may straddle two ranks; that is fine for elementwise optimizers.

    Args:
      specs: The buffer's parameters in definition (forward) order.
      dp: Number of shards per bucket.
      bucket_size: Bucket size in elements; ``None``: one bucket (and one per
        tied embedding).
      high_busbw: Pad bucket ends to ``2**16``-multiples for NCCL bus bandwidth.
      param_indices: Stored as the layout's ``param_indices``.

    Raises:
      ValueError: ``dp < 1``, a bad ``bucket_size`` or duplicate names.
    """
    check_specs(specs, dp, "compute_distributed_optimizer_layout")
    if bucket_size is not None:
        check_size("compute_distributed_optimizer_layout", "bucket_size", bucket_size)
    index_map: dict[str, tuple[int, int, int]] = {}
    buckets: list[tuple[int, int]] = []
    unpadded: list[int] = []
    bucket_start = start = end = 0
    in_bucket = 0

    def close(at: int) -> None:
        nonlocal bucket_start, start, in_bucket
        unpadded.append(at - bucket_start)
        bucket_end = pad_bucket_end(at, dp, high_busbw)
        buckets.append((bucket_start, bucket_end))
        bucket_start = start = bucket_end
        in_bucket = 0

    for spec in reversed(specs):
        start = pad_param_start(start)
        if spec.is_shared_embedding and in_bucket:
            close(start)
        end = start + spec.numel
        index_map[spec.name] = (start, end, len(buckets))
        in_bucket += 1
        if spec.is_shared_embedding or (
            bucket_size is not None and end - bucket_start >= bucket_size
        ):
            close(end)
        else:
            start = end
    if in_bucket:
        close(end)
    order = {spec.name: i for i, spec in enumerate(specs)}
    return PerBufferParamLayout(
        param_index_map=dict(sorted(index_map.items(), key=lambda kv: order[kv[0]])),
        bucket_indices=tuple(buckets),
        per_bucket_numel_unpadded=tuple(unpadded),
        param_indices=tuple(range(len(specs)) if param_indices is None else param_indices),
        num_shards=dp,
        is_layer_wise=False,
    )
