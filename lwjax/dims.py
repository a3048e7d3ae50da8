"""Which axes of a parameter form its Muon matrix, read from names and shapes (pure Python).

A leaf of any rank is seen as a batch of matrices: its *batch* axes index
independent matrices (scanned layers, experts), its *reduction* axes are the
matrix's inputs (contracted with the activations) and its *output* axes the
matrix's outputs. An einsum kernel ``[N, D, H]`` (heads, model, head dim) with
reduction ``D`` is one ``D × (N·H)`` matrix; a scanned kernel ``[L, D, F]``
with batch ``L`` is ``L`` matrices ``D × F``. :class:`MatrixDims` states this
per leaf, like optax's ``MuonDimensionNumbers`` but with several axes per role.

Without a rule, :func:`infer_dims` reads, in order:

1. flax logical axis names (``nn.with_logical_partitioning``,
   ``nnx.with_partitioning``): ``layers``/``stage``/``experts``-like names are
   batch axes, a ``vocab`` axis marks an embedding or head, and the model axis
   (``embed``) is the one input or the one output of the matrix;
2. shapes: a 2-D view is one matrix as stored; a view of 3+ axes is split at
   the model dimension (``model_dim``, by default the width of the embedding
   table) the same way, when exactly one axis has that size.

Which side the model axis is on comes from the module's name where it tells
(:func:`model_axis_side`: ``q_einsum`` and ``gating_einsum`` take it in,
``attn_vec_einsum`` and ``out`` give it out), else from its position (the
last matrix axis is an output).

Anything else is not a matrix and goes to AdamW, with a warning from
:func:`lwjax.routing.route_leaves`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Sequence

Axes = tuple[int, ...]

BATCH_AXIS_NAMES = frozenset(
    {"layers", "layer", "stage", "stages", "scan", "repeat", "experts", "expert", "exp"}
)
# Not "model" or "hidden": flax examples name a tensor-parallel mesh axis "model", and "hidden"
# is as often an MLP's width as the model's.
MODEL_AXIS_NAMES = frozenset({"embed", "embedding", "d_model"})
VOCAB_AXIS_NAMES = frozenset({"vocab", "vocabulary"})

# Components that name an embedding table or an output head anywhere in a path ...
_HEAD_ANYWHERE = (
    r"[^/.]*embed[^/.]*|wte|wpe|lm_head|head|output_layer|logits|logits_dense|logitdense|classifier"
)
# ... and generic ones that do only outside attention and MLP blocks (an attention
# block's ``out`` projection is a matrix; a model's top-level ``out`` is its head).
_HEAD_OUTSIDE_BLOCKS = r"out|output|score|pos"
_BLOCK = re.compile(r"att|mlp|ffn|feed_?forward|block|layer|expert")
_HEAD = re.compile(rf"^({_HEAD_ANYWHERE})$")
# ``emb`` as a word of a name part (split at "_"): minGPT's ``tok_emb`` and ``pos_emb``.
_EMBEDDING_WORDS = frozenset({"emb", "embs"})
_GENERIC_HEAD = re.compile(rf"^({_HEAD_OUTSIDE_BLOCKS})$")
_BIAS_OR_SCALE = frozenset({"bias", "b", "scale", "gamma", "beta", "offset"})
# Words in a module's name (split at "_") that say which side of it the model dimension is on:
# the input of q/k/v, gate and up projections, the output of attention-out and down projections.
# Input words win (``q_proj``, ``up_proj``); ``proj`` alone is an output (``c_proj``).
_INPUT_WORDS = frozenset(
    {"q", "k", "v", "qkv", "kv", "query", "key", "value", "gate", "gating", "up", "wi", "fc1"}
    | {"w1", "w3", "in"}
)
_OUTPUT_WORDS = frozenset({"out", "o", "wo", "down", "fc2", "w2", "vec", "proj", "output"})


@dataclasses.dataclass(frozen=True)
class MatrixDims:
    """Which axes of a leaf are its matrix's inputs and outputs; all others are batch axes.

    Attributes:
      reduction: The input axes (contracted with the activations), an int or
        a tuple; negative values count from the end.
      output: The output axes, likewise.

    Examples:
      >>> MatrixDims(reduction=1, output=(0, 2)).resolve((8, 64, 16), "q_einsum")
      ((), (1,), (0, 2))
    """

    reduction: int | Axes
    output: int | Axes

    def __post_init__(self):
        for field in ("reduction", "output"):
            value = getattr(self, field)
            value = (value,) if isinstance(value, int) else tuple(value)
            if not value or not all(isinstance(a, int) and not isinstance(a, bool) for a in value):
                raise TypeError(
                    f"MatrixDims.{field} must be an int or a non-empty tuple of ints; "
                    f"got {value!r}."
                )
            object.__setattr__(self, field, value)

    def __str__(self) -> str:
        """As it would be written: ``MatrixDims((0, 1, 2), 3)``."""
        axes = [str(a[0]) if len(a) == 1 else str(a) for a in (self.reduction, self.output)]
        return f"MatrixDims({axes[0]}, {axes[1]})"

    def resolve(self, shape: Sequence[int], name: str) -> tuple[Axes, Axes, Axes]:
        """``(batch, reduction, output)`` axes of a leaf of this ``shape``, non-negative, sorted.

        Raises:
          ValueError: naming the leaf, for an axis out of range or used twice.
        """
        ndim = len(shape)
        roles = []
        for field in ("reduction", "output"):
            axes = getattr(self, field)
            if any(not -ndim <= a < ndim for a in axes):
                raise ValueError(
                    f"{name}: MatrixDims.{field}={axes} is out of range for shape {tuple(shape)}."
                )
            roles.append(tuple(sorted(a % ndim for a in axes)))
        reduction, output = roles
        if (
            set(reduction) & set(output)
            or len(set(reduction)) < len(reduction)
            or len(set(output)) < len(output)
        ):
            raise ValueError(
                f"{name}: MatrixDims uses an axis twice: reduction={reduction}, output={output}."
            )
        batch = tuple(a for a in range(ndim) if a not in reduction and a not in output)
        return batch, reduction, output


def components(name: str) -> list[str]:
    """A parameter name's lower-case components, split at ``/`` and ``.``."""
    return [c for c in re.split(r"[/.]", name.lower()) if c]


def head_or_embedding_reason(name: str) -> str | None:
    """Why a name looks like an embedding table or output head, or ``None`` if it does not.

    Specific names (``*embed*``, ``emb`` as a word such as ``tok_emb``, ``wte``,
    ``wpe``, ``lm_head``, ``head``, ``output_layer``, ``logits``, ``logits_dense``, ``logitdense``,
    ``classifier``) count anywhere in the path; the generic ``out``,
    ``output``, ``score`` and ``pos`` only outside attention and MLP blocks.
    """
    parts = components(name)
    for i, part in enumerate(parts):
        if _HEAD.match(part) or _is_embedding_part(part):
            return f"name {part!r}: embedding or head"
        if _GENERIC_HEAD.match(part) and not any(_BLOCK.search(p) for p in parts[:i]):
            return f"name {part!r} outside a block: embedding or head"
    return None


def _is_embedding_part(part: str) -> bool:
    """Whether one name part names an embedding table: ``*embed*``, ``wte``, or ``emb`` as a
    word (``tok_emb``)."""
    return "embed" in part or part == "wte" or bool(set(part.split("_")) & _EMBEDDING_WORDS)


def is_embedding_or_output(name: str) -> bool:
    """Whether a parameter name looks like an embedding table or output projection.

    Name components are split at ``/`` (pytree paths) and ``.`` (torch/Megatron
    names), so ``output_layer.weight`` and ``embed/embedding`` both match
    (:func:`head_or_embedding_reason` lists the names).
    """
    return head_or_embedding_reason(name) is not None


def is_batch_axis_name(axis_name) -> bool:
    """Whether a flax logical axis name indexes separate parameters (layers, experts)."""
    return isinstance(axis_name, str) and axis_name.lower() in BATCH_AXIS_NAMES


def is_expert_path(name: str) -> bool:
    """Whether a parameter lives in a mixture of experts (a path part names ``expert(s)``)."""
    return any("expert" in part for part in components(name))


def is_bias_or_scale(name: str) -> bool:
    """Whether the leaf's own name is a bias, norm scale or offset (never a matrix by default)."""
    parts = components(name)
    return bool(parts) and re.sub(r"\[.*\]$", "", parts[-1]) in _BIAS_OR_SCALE


def is_conv_kernel(name: str, shape: Sequence[int]) -> bool:
    """Whether a leaf of 3+ axes is a convolution kernel by name (a part contains ``conv``)."""
    return len(shape) >= 3 and any("conv" in part for part in components(name))


def conv_dims(ndim: int, matrix_convention: str) -> MatrixDims:
    """The matrix view that makes a conv kernel one Muon matrix: every axis but the output
    channels is an input, as flax (``[*window, in, out]``, ``"in_out"``) and torch
    (``[out, in, *window]``, ``"out_in"``) store them."""
    if matrix_convention == "in_out":
        return MatrixDims(tuple(range(ndim - 1)), ndim - 1)
    return MatrixDims(tuple(range(1, ndim)), 0)


def dims_from_axis_names(
    names: Sequence[str | None], shape: Sequence[int], name: str = ""
) -> tuple[bool, tuple[Axes, Axes, Axes] | None, str]:
    """``(decided, (batch, reduction, output) or None, why)`` from flax logical axis names.

    Undecided (the caller reads the shape instead) when the names do not
    match the shape one to one (flax's 3-D attention kernels carry two) or
    name no known logical axis (mesh axes such as ``fsdp``). Decided ``None``
    when a ``vocab`` axis marks an embedding or head, or fewer than two matrix
    axes remain.
    """
    lowered = [n.lower() if isinstance(n, str) else None for n in names]
    known = BATCH_AXIS_NAMES | MODEL_AXIS_NAMES | VOCAB_AXIS_NAMES
    if len(names) != len(shape) or not any(n in known for n in lowered):
        return False, None, ""
    why = f"axis names {tuple(names)}"
    if any(n in VOCAB_AXIS_NAMES for n in lowered):
        return True, None, f"{why}: a vocab axis (embedding or head)"
    batch = tuple(a for a, n in enumerate(lowered) if n in BATCH_AXIS_NAMES)
    matrix = [a for a in range(len(shape)) if a not in batch]
    if len(matrix) < 2:
        return True, None, f"{why}: {len(matrix)}-D"
    model = [a for a in matrix if lowered[a] in MODEL_AXIS_NAMES]
    if len(model) == 1:
        axes, side = _split_at(batch, matrix, model[0], name)
        return True, axes, f"{why}: {names[model[0]]} is {side}"
    if len(matrix) == 2:
        return True, (batch, (matrix[0],), (matrix[1],)), why
    return True, None, f"{why}: no single model axis among the matrix axes"


def dims_from_model_dim(
    shape: Sequence[int], batch: Axes, model_dim: int | None, name: str = ""
) -> tuple[tuple[Axes, Axes, Axes] | None, str]:
    """``(batch, reduction, output)`` of a 3+-axis view split at its one ``model_dim`` axis."""
    matrix = [a for a in range(len(shape)) if a not in batch]
    if sum(shape[a] > 1 for a in matrix) < 2:
        return None, f"{len(matrix)}-D with fewer than two axes longer than 1: a vector"
    if model_dim is None:
        return None, f"{len(matrix)}-D with no model dimension to split at"
    model = [a for a in matrix if shape[a] == model_dim]
    if len(model) != 1:
        return None, (
            f"{len(matrix)}-D with {len(model)} axes of the model dimension {model_dim}; "
            "say which are inputs with dims=MatrixDims(...)"
        )
    axes, side = _split_at(batch, matrix, model[0], name)
    return axes, f"einsum: model dim {model_dim} is {side}"


def model_axis_side(name: str) -> str | None:
    """``"input"`` or ``"output"``: where a kernel's module name puts the model dimension.

    Read from the last path component with a telling word: ``q_einsum``,
    ``gating_einsum``, ``query``, ``up_proj`` take the model dimension in;
    ``attn_vec_einsum``, ``out``, ``o_proj``, ``down_proj``, ``c_proj`` give it out.
    ``None`` when no component tells.
    """
    for part in reversed(components(name)):
        words = set(part.split("_"))
        if words & _INPUT_WORDS:
            return "input"
        if words & _OUTPUT_WORDS:
            return "output"
    return None


def _split_at(
    batch: Axes, matrix: list[int], model: int, name: str = ""
) -> tuple[tuple[Axes, Axes, Axes], str]:
    """Split the matrix axes at the model axis: it is the one input or the one output.

    The module's name decides (:func:`model_axis_side`); without a telling
    name, the model axis is the output when it is the last matrix axis.
    Returns the axes and which rule decided.
    """
    rest = tuple(a for a in matrix if a != model)
    side = model_axis_side(name)
    how = "by name" if side else "by position"
    side = side or ("output" if model == matrix[-1] else "input")
    axes = (batch, rest, (model,)) if side == "output" else (batch, (model,), rest)
    return axes, f"the {side} ({how})"


def infer_model_dim(leaves: Sequence[tuple[str, tuple[int, ...]]]) -> int | None:
    """The model width: the last axis of the first 2-D embedding table, else the commonest size.

    ``leaves`` are ``(name, shape)``. The commonest axis size among 2-D leaves
    (ties to the larger) stands in for models without an embedding; leaves of
    3+ axes count only where there is no 2-D leaf, since their axes may be a conv
    kernel's window or a stack of layers rather than a side of a matrix.
    """
    for name, shape in leaves:
        if len(shape) == 2 and any(_is_embedding_part(c) for c in components(name)):
            return shape[-1]
    shapes = [s for _, s in leaves if len(s) == 2] or [s for _, s in leaves if len(s) > 2]
    counts = collections.Counter(d for shape in shapes for d in shape)
    if not counts:
        return None
    return max(counts, key=lambda d: (counts[d], d))


def detect_stacks(
    leaves: Sequence[tuple[str, tuple[int, ...]]], model_dim: int | None = None
) -> dict[str, Axes]:
    """Scanned stacks found without a rule: ``{name: its stack axes}``.

    Two signs give a stack away:

    1. A bias or scale with ``k + 1`` axes is ``k`` stacked vectors. Its stack
       covers the largest enclosing module (path prefix, not the whole tree
       unless the bias sits at its root) whose every leaf has the same ``k``
       leading sizes, so the module's kernels stack with it. A 2-axis bias or
       scale may instead stack on its last axis, as MaxText's scan with
       ``param_scan_axis=1`` stores them (``[embed, layers]``, kernels
       ``[embed, layers, mlp]``): it does when that axis is shared by more of
       the module's leaves, or by as many and its first axis is the model width.
    2. A module named like a batch axis (``layers``, ``scan``, ...) whose leaves
       all have the same size at exactly one axis position, other than the
       model width, stacks on that axis.
    """
    found: dict[str, Axes] = {}
    for name, shape in leaves:
        if not is_bias_or_scale(name) or len(shape) < 2:
            continue
        axes, root = _bias_stack(name, shape, leaves, model_dim)
        for n, _ in leaves if root is not None else ():
            if n.startswith(root):  # a deeper stack (experts in scanned layers) keeps its axes
                found[n] = max(found.get(n, axes), axes, key=_leading_first)
    for root, axis in _named_stack_modules(leaves, model_dim).items():
        for n, _ in leaves:
            if n.startswith(root):
                found.setdefault(n, (axis,))
    return found


def _leading_first(axes: Axes) -> tuple[bool, int]:
    """Which of two stacks a leaf keeps: leading axes before others, then more axes."""
    return axes == tuple(range(len(axes))), len(axes)


def _bias_stack(name, shape, leaves, model_dim) -> tuple[Axes, str | None]:
    """A stacked bias's stack axes and the module its stack covers (``None``: no stack)."""
    k = len(shape) - 1
    lead = _stack_root(name, leaves, lambda s: len(s) > k and s[:k] == shape[:k])
    if k != 1:
        return tuple(range(k)), lead
    last = _stack_root(name, leaves, lambda s: len(s) > 1 and s[1] == shape[1])
    covers = [sum(n.startswith(r) for n, _ in leaves) if r is not None else 0 for r in (lead, last)]
    if covers[1] > covers[0] or (covers[1] == covers[0] and shape[0] == model_dim != shape[1]):
        return (1,), last
    return (0,), lead


def _named_stack_modules(leaves, model_dim) -> dict[str, int]:
    """``{module prefix: stack axis}`` of modules named like a batch axis whose leaves all
    share one size at exactly one axis (not the model width, not 1)."""
    prefixes = set()
    for name, _ in leaves:
        parts = name.split("/")[:-1]
        prefixes |= {
            "/".join(parts[: i + 1]) + "/"
            for i, part in enumerate(parts)
            if part.lower() in BATCH_AXIS_NAMES
        }
    modules = {}
    for prefix in sorted(prefixes):
        shapes = [s for n, s in leaves if n.startswith(prefix)]
        shared = [
            p
            for p in range(min(len(s) for s in shapes))
            if len({s[p] for s in shapes}) == 1 and shapes[0][p] not in (1, model_dim)
        ]
        if len(shapes) >= 2 and len(shared) == 1:
            modules[prefix] = shared[0]
    return modules


def shared_axis(
    name: str, shape: Sequence[int], leaves, skip: Axes, model_dim: int | None
) -> tuple[int, str] | None:
    """An axis of a leaf (outside ``skip``, longer than 1, not the model width) that every leaf
    of a module around it has with the same size, as a stack of layers would:
    ``(axis, module prefix)``, or ``None``.

    The module must hold leaves of different ranks (MLP kernels of 3 axes beside attention
    kernels of 4): an attention module's einsum kernels of one rank share their heads axis.
    """
    for p, size in enumerate(shape):
        if p in skip or size in (1, model_dim):
            continue
        root = _stack_root(name, leaves, lambda s, p=p, size=size: len(s) > p and s[p] == size)
        ranks = {len(s) for n, s in leaves if root is not None and n.startswith(root)}
        if len(ranks) >= 2:
            return p, root
    return None


def _stack_root(name: str, leaves, fits) -> str | None:
    """The path prefix of the largest module around ``name`` whose every leaf's shape ``fits``,
    or ``None`` when even the innermost does not."""
    parts = name.split("/")
    root = None
    # The tree's root counts as a module only for a bias at the root ({"w": ..., "b": ...}).
    for depth in range(len(parts) - 1, 0 if len(parts) > 1 else -1, -1):
        prefix = "/".join(parts[:depth]) + "/" if depth else ""
        if not all(fits(s) for n, s in leaves if n.startswith(prefix)):
            break
        root = prefix
    return root


def view_shape(shape: Sequence[int], batch: Axes, reduction: Axes, output: Axes, rows_first: str):
    """The axis order and shape the optimizer reads: batch axes, then the 2-D matrix.

    ``rows_first`` is ``"in_out"`` (rows are the inputs, as flax stores
    kernels) or ``"out_in"`` (rows are the outputs, as torch does).
    """
    rows, cols = (reduction, output) if rows_first == "in_out" else (output, reduction)
    order = (*batch, *rows, *cols)
    view = (
        *(shape[a] for a in batch),
        math.prod(shape[a] for a in rows),
        math.prod(shape[a] for a in cols),
    )
    return order, view
