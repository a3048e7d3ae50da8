"""The vocabulary of shard-aligned parameter layouts (pure Python, no jax).

A *layout* places every parameter of one flat buffer at an element range
``[start, end)`` inside a *bucket*. Each bucket is split into ``num_shards``
equal, contiguous shards, one per data-parallel rank; in a layer-wise layout no
parameter crosses a shard boundary, so the rank that owns a shard owns whole
parameters and can run Muon on them.

Producers and consumers: :mod:`lwjax.policies` computes layouts (as a
:class:`LayoutConfig` asks); :mod:`lwjax.plan` turns them into per-rank tables
and the optimizer consumes those, knowing nothing of how they were made.
Everything here is frozen and hashable, so a layout can be closed over or
passed as a static argument to ``jax.jit``.

Alignment rules (Megatron-Core's ``param_layout.py``):

* every parameter starts on a multiple of :data:`PARAM_ALIGN` (64) elements;
* every bucket ends on a multiple of ``lcm(dp, 128)``, or of
  ``lcm(dp, 128, 2**16)`` when buckets are padded for high NCCL bus bandwidth;
* a layer-wise shard size is a multiple of :func:`shard_divisor`, so shard
  starts stay 64-aligned and bucket ends stay legal.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Literal

PARAM_ALIGN = 64
BUCKET_ALIGN = 128
HIGH_BUSBW_ALIGN = 2**16

LayoutPolicy = Literal["ns_cost", "lpt", "size_matching", "balanced"]
POLICIES: tuple[str, ...] = ("ns_cost", "lpt", "size_matching", "balanced")
DEFAULT_POLICY: LayoutPolicy = "ns_cost"
AUTO_BUCKET_MIN = 40_000_000  # Megatron's DDP bucket size: max(40M, 1M * dp) elements
AUTO_BUCKET_PER_RANK = 1_000_000
# Elements a bucket's shard may hold: lwjax indexes a shard with int32 offsets (jax without x64).
# A whole bucket (dp shards) may hold more: it is built and cut without offsets past int32.
MAX_BUCKET_ELEMENTS = 2**31 - 1


def pad_to_divisor(value: int, divisor: int) -> int:
    """Round ``value`` up to the next multiple of ``divisor``."""
    return -(-value // divisor) * divisor


def pad_param_start(start: int) -> int:
    """Round a parameter's start up to the 64-element boundary."""
    return pad_to_divisor(start, PARAM_ALIGN)


def bucket_end_divisor(dp: int, high_busbw: bool = False) -> int:
    """Return what every bucket end must divide by: ``lcm(dp, 128[, 2**16])``."""
    if high_busbw:
        return math.lcm(dp, BUCKET_ALIGN, HIGH_BUSBW_ALIGN)
    return math.lcm(dp, BUCKET_ALIGN)


def pad_bucket_end(end: int, dp: int, high_busbw: bool = False) -> int:
    """Round a bucket's end up to :func:`bucket_end_divisor`."""
    return pad_to_divisor(end, bucket_end_divisor(dp, high_busbw))


def shard_divisor(dp: int, high_busbw: bool = False) -> int:
    """Return the multiple every layer-wise shard size is rounded to.

    ``lcm(64, bucket_end_divisor(dp) // dp)``: a bucket of ``dp`` such shards
    ends on a legal bucket end and every shard starts 64-aligned.
    """
    return math.lcm(PARAM_ALIGN, bucket_end_divisor(dp, high_busbw) // dp)


def default_bucket_size(dp: int) -> int:
    """Megatron's default DDP bucket size in elements: ``max(40M, 1M * dp)``."""
    return max(AUTO_BUCKET_MIN, AUTO_BUCKET_PER_RANK * dp)


@dataclasses.dataclass(frozen=True)
class LayoutConfig:
    """How parameters are laid out in buckets and shards (the options of :mod:`lwjax.policies`).

    Attributes:
      policy: Layer-wise policy, one of :data:`POLICIES`.
      bucket_size: Bucket size in elements (a soft minimum for layer-wise
        buffers); ``None``: one bucket per buffer (shared embeddings apart);
        ``"auto"``: Megatron's DDP default, :func:`default_bucket_size` of the
        data-parallel size. Several buckets let one bucket's all-gather run
        during a later bucket's Newton–Schulz (:mod:`lwjax.schedule`).
      high_busbw: Pad bucket ends to multiples of ``2**16`` elements for NCCL
        bus bandwidth (Megatron's ``--ddp-pad-buckets-for-high-nccl-busbw``).
    """

    policy: LayoutPolicy = DEFAULT_POLICY
    bucket_size: int | Literal["auto"] | None = "auto"
    high_busbw: bool = False

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(
                f"LayoutConfig.policy must be one of {POLICIES}; got policy={self.policy!r}."
            )
        size = self.bucket_size
        if (
            size != "auto"
            and size is not None
            and (isinstance(size, bool) or not isinstance(size, int) or size < 1)
        ):
            raise ValueError(
                "LayoutConfig.bucket_size must be 'auto', None or a positive integer; "
                f"got bucket_size={size!r}."
            )
        if not isinstance(self.high_busbw, bool):
            raise TypeError(
                f"LayoutConfig.high_busbw must be a bool, but got {type(self.high_busbw).__name__}."
            )

    def bucket_size_for(self, dp: int) -> int | None:
        """The bucket size in elements for ``dp`` data-parallel ranks (``"auto"`` resolved)."""
        return default_bucket_size(dp) if self.bucket_size == "auto" else self.bucket_size


class FrozenDict(Mapping):
    """An immutable, hashable mapping that keeps insertion order."""

    __slots__ = ("_items", "_hash")

    def __init__(self, items=()):
        self._items = dict(items)
        self._hash = None

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self) -> Iterator:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(tuple(self._items.items()))
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __repr__(self) -> str:
        return f"FrozenDict({self._items!r})"


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """What the layout needs to know of one parameter; no array is involved.

    Attributes:
      name: Unique name, e.g. the pytree path ``"blocks/0/attn/wq"``; a matrix of
        a stacked ``[L, m, n]`` leaf is named ``"<path>[i]"``.
      shape: Positive integer dimensions.
      dtype: Parameter dtype name (``"bfloat16"``, ``"float32"``, ...).
      is_muon: Whether the parameter is a Muon matrix, i.e. lives in a
        layer-wise buffer; all others go to elementwise (AdamW) buffers.
      is_shared_embedding: Megatron's ``shared_embedding``: a tied embedding that
        pipeline stages copy (pipeline size > 1); layouts isolate it in its own
        bucket. At pipeline size 1 a tied embedding is an ordinary parameter.
      is_expert: An expert-parallel parameter; its buffer is sharded over the
        expert data-parallel group.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    is_muon: bool = False
    is_shared_embedding: bool = False
    is_expert: bool = False

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ParamSpec.name must be a non-empty string; got {self.name!r}.")
        shape = self.shape
        if isinstance(shape, int) or not isinstance(shape, Sequence):
            raise ValueError(
                f"{self.name}: shape must be a sequence of positive integers; got {shape=}."
            )
        for dim in shape:
            if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
                raise ValueError(
                    f"{self.name}: every dimension must be a positive integer; got {shape=}."
                )
        object.__setattr__(self, "shape", tuple(shape))

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class BufferKey:
    """Which flat buffer a parameter belongs to; hashable, keys :class:`FullParamLayout`.

    Attributes:
      param_dtype: Dtype name of the parameters in the buffer.
      grad_dtype: Dtype name gradients are reduced in (``"float32"`` when
        gradients are reduced in fp32).
      is_expert_parallel: The buffer holds expert parameters and is sharded over
        the expert data-parallel group.
      is_layer_wise: The buffer holds whole Muon matrices in a layer-wise
        (shard-aligned) layout; otherwise it is an elementwise buffer in the
        byte-level distributed-optimizer layout.
    """

    param_dtype: str
    grad_dtype: str
    is_expert_parallel: bool = False
    is_layer_wise: bool = False


@dataclasses.dataclass(frozen=True)
class PerBufferParamLayout:
    """Where every parameter of one buffer lives, in elements.

    Attributes:
      param_index_map: ``name -> (start, end, bucket_id)``, absolute element
        offsets in the buffer with ``end - start == numel``.
      bucket_indices: ``(start, end)`` of each bucket; ``end - start`` divides
        by ``num_shards``.
      per_bucket_numel_unpadded: Elements of each bucket as the producing
        policy counts them (the real parameters' elements for layer-wise
        layouts; including alignment gaps for the distributed-optimizer one).
      param_indices: Position of each parameter (in ``param_index_map`` order)
        among the parameters of its buffer key, in definition order.
      num_shards: Shards per bucket, i.e. the data-parallel size the layout was
        made for (Megatron's ``num_optimizer_shards``).
      is_layer_wise: Parameters lie wholly inside one shard (checked on
        construction). ``False`` for the byte-level distributed-optimizer
        layout, whose parameters may straddle shards.
    """

    param_index_map: Mapping[str, tuple[int, int, int]]
    bucket_indices: tuple[tuple[int, int], ...]
    per_bucket_numel_unpadded: tuple[int, ...]
    param_indices: tuple[int, ...] = ()
    num_shards: int = 1
    is_layer_wise: bool = True

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_("param_index_map", FrozenDict((k, tuple(v)) for k, v in self.param_index_map.items()))
        set_("bucket_indices", tuple(tuple(b) for b in self.bucket_indices))
        set_("per_bucket_numel_unpadded", tuple(self.per_bucket_numel_unpadded))
        set_("param_indices", tuple(self.param_indices))
        for bucket_id, (start, end) in enumerate(self.bucket_indices):
            if (end - start) % self.num_shards:
                raise ValueError(
                    f"bucket {bucket_id}: size {end - start} does not divide into "
                    f"{self.num_shards} equal shards."
                )
        if self.is_layer_wise:
            for name in self.param_index_map:
                self.shard_of(name)

    @property
    def numel(self) -> int:
        """Total buffer length in elements, padding included."""
        return self.bucket_indices[-1][1] if self.bucket_indices else 0

    def shard_size(self, bucket_id: int) -> int:
        """Elements per shard of bucket ``bucket_id``."""
        start, end = self.bucket_indices[bucket_id]
        return (end - start) // self.num_shards

    def shard_of(self, name: str) -> int:
        """Return the shard (data-parallel rank) that owns parameter ``name``.

        ``(start - bucket_start) // shard_size``.

        Raises:
          KeyError: ``name`` is not in this layout.
          ValueError: the parameter crosses a shard boundary, so no rank owns it whole.
        """
        start, end, bucket_id = self.param_index_map[name]
        bucket_start, _ = self.bucket_indices[bucket_id]
        size = self.shard_size(bucket_id)
        shard = (start - bucket_start) // size
        if end > bucket_start + (shard + 1) * size:
            raise ValueError(
                f"{name}: [{start}, {end}) crosses the boundary of shard {shard} "
                f"(bucket {bucket_id}, shard size {size}); a layer-wise layout must "
                "keep every parameter inside one shard."
            )
        return shard

    def owned_params(self, shard: int) -> tuple[str, ...]:
        """Names of the parameters shard ``shard`` owns, in buffer order."""
        ordered = sorted(self.param_index_map.items(), key=lambda kv: kv[1][0])
        return tuple(name for name, _ in ordered if self.shard_of(name) == shard)


@dataclasses.dataclass(frozen=True)
class FullParamLayout:
    """The layouts of all buffers of a model, keyed by :class:`BufferKey`.

    Attributes:
      layouts: ``BufferKey -> PerBufferParamLayout``, in first-appearance order
        of the keys over the parameters in definition order.
    """

    layouts: Mapping[BufferKey, PerBufferParamLayout]

    def __post_init__(self):
        object.__setattr__(self, "layouts", FrozenDict(self.layouts))

    def buffer_of(self, name: str) -> BufferKey:
        """Return the key of the buffer that holds parameter ``name``."""
        for key, layout in self.layouts.items():
            if name in layout.param_index_map:
                return key
        raise KeyError(f"{name}: not in any buffer of this layout.")
