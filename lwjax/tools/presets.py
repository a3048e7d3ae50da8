"""Model presets and JSON specs: parameter lists for layouts, without arrays (pure Python).

A preset returns the :class:`~lwjax.layout.ParamSpec` list of a well-known
model shape in definition (forward) order, named the way Megatron-Core names
the parameters of its GPT model, so that layouts and reports read like
Megatron's:

* ``embedding.word_embeddings.weight`` ``[vocab, hidden]``
* ``decoder.layers.{i}.input_layernorm.weight`` ``[hidden]``
* ``decoder.layers.{i}.self_attention.linear_qkv.weight``
  ``[(heads + 2 * kv_heads) * head_dim, hidden]``
* ``decoder.layers.{i}.self_attention.linear_proj.weight`` ``[hidden, heads * head_dim]``
* ``decoder.layers.{i}.pre_mlp_layernorm.weight`` ``[hidden]``
* ``decoder.layers.{i}.mlp.linear_fc1.weight`` ``[2 * ffn, hidden]`` (SwiGLU:
  gate and up stacked) and ``...mlp.linear_fc2.weight`` ``[hidden, ffn]``
* ``decoder.final_layernorm.weight`` ``[hidden]``
* ``output_layer.weight`` ``[vocab, hidden]`` (absent when embeddings are tied)

The Muon rule is Megatron's: a parameter is a Muon matrix iff it is 2-D and not
an embedding or output projection. Everything is ``bfloat16``.

:func:`specs_from_json` reads the same information from JSON: a list of shapes,
or the ``params`` list of the layout fixtures (``tests/fixtures/layouts``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from lwjax.layout import ParamSpec
from lwjax.routing import is_embedding_or_output

PRESET_DTYPE = "bfloat16"
JSON_SHAPES_DTYPE = "bfloat16"  # dtype of parameters given as a bare list of shapes

_PARAM_KEYS = frozenset(
    {
        "name",
        "shape",
        "dtype",
        "shared_embedding",
        "expert",
        "is_embedding_or_output_parameter",
        "is_muon",
    }
)


def _matrix(name: str, shape: tuple[int, ...], *, is_expert: bool = False) -> ParamSpec:
    """A Muon matrix of a transformer block."""
    return ParamSpec(name, shape, PRESET_DTYPE, is_muon=True, is_expert=is_expert)


def _elementwise(name: str, shape: tuple[int, ...]) -> ParamSpec:
    """A parameter the elementwise optimizer (AdamW) updates."""
    return ParamSpec(name, shape, PRESET_DTYPE)


def _check_positive(where: str, **values: int) -> None:
    for field, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {field} must be a positive integer; got {field}={value!r}.")


def transformer_specs(
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    ffn: int,
    vocab: int,
    experts: int = 0,
    swiglu: bool = True,
    tied: bool = False,
    biases: bool = False,
    max_positions: int = 0,
) -> list[ParamSpec]:
    """Build the parameter specs of a Megatron-style GPT decoder.

    Args:
      layers: Number of transformer layers.
      hidden: Model width.
      heads: Query heads.
      kv_heads: Key/value heads (grouped-query attention when < ``heads``).
      head_dim: Width of one head.
      ffn: MLP hidden width (per expert for MoE).
      vocab: Vocabulary size.
      experts: Number of MoE experts per layer; ``0`` for a dense MLP. Each
        expert has its own ``linear_fc1``/``linear_fc2`` (``is_expert=True``)
        and a dense router ``[experts, hidden]`` selects among them.
      swiglu: Stack gate and up projections in ``linear_fc1`` (``[2 * ffn,
        hidden]``); otherwise ``[ffn, hidden]`` (GELU MLP).
      tied: The output layer reuses the word embeddings: there is no
        ``output_layer.weight``. The embedding is laid out like any other
        parameter, as Megatron does at pipeline size 1.
      biases: Add linear biases and LayerNorm biases (GPT-2 style).
      max_positions: Rows of a learned position embedding; ``0`` for none (RoPE).

    Returns:
      The specs in definition (forward) order.

    Raises:
      ValueError: A size is not a positive integer.
    """
    _check_positive(
        "transformer_specs",
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ffn=ffn,
        vocab=vocab,
    )
    specs = [_elementwise("embedding.word_embeddings.weight", (vocab, hidden))]
    if max_positions:
        specs.append(_elementwise("embedding.position_embeddings.weight", (max_positions, hidden)))
    fc1_rows = 2 * ffn if swiglu else ffn
    qkv_rows = (heads + 2 * kv_heads) * head_dim

    def norm(prefix: str) -> None:
        specs.append(_elementwise(f"{prefix}.weight", (hidden,)))
        if biases:
            specs.append(_elementwise(f"{prefix}.bias", (hidden,)))

    def linear(prefix: str, shape: tuple[int, int], *, is_expert: bool = False) -> None:
        specs.append(_matrix(f"{prefix}.weight", shape, is_expert=is_expert))
        if biases:
            specs.append(
                ParamSpec(f"{prefix}.bias", (shape[0],), PRESET_DTYPE, is_expert=is_expert)
            )

    for i in range(layers):
        layer = f"decoder.layers.{i}"
        norm(f"{layer}.input_layernorm")
        linear(f"{layer}.self_attention.linear_qkv", (qkv_rows, hidden))
        linear(f"{layer}.self_attention.linear_proj", (hidden, heads * head_dim))
        norm(f"{layer}.pre_mlp_layernorm")
        if experts:
            specs.append(_matrix(f"{layer}.mlp.router.weight", (experts, hidden)))
            for e in range(experts):
                expert = f"{layer}.mlp.experts.local_experts.{e}"
                linear(f"{expert}.linear_fc1", (fc1_rows, hidden), is_expert=True)
                linear(f"{expert}.linear_fc2", (hidden, ffn), is_expert=True)
        else:
            linear(f"{layer}.mlp.linear_fc1", (fc1_rows, hidden))
            linear(f"{layer}.mlp.linear_fc2", (hidden, ffn))
    norm("decoder.final_layernorm")
    if not tied:
        specs.append(_elementwise("output_layer.weight", (vocab, hidden)))
    return specs


def llama8b(*, layers: int = 32) -> list[ParamSpec]:
    """Llama-3-8B shapes: hidden 4096, 32/8 heads of 128, SwiGLU 14336, vocab 128256, untied."""
    return transformer_specs(
        layers=layers, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256
    )


def llama1b(*, layers: int = 16) -> list[ParamSpec]:
    """A 1B-class Llama: hidden 2048, 32/8 heads of 64, SwiGLU 8192, vocab 128256, untied."""
    return transformer_specs(
        layers=layers, hidden=2048, heads=32, kv_heads=8, head_dim=64, ffn=8192, vocab=128256
    )


def llama70b(*, layers: int = 80) -> list[ParamSpec]:
    """Llama-3-70B shapes: hidden 8192, 64/8 heads of 128, SwiGLU 28672, vocab 128256, untied."""
    return transformer_specs(
        layers=layers, hidden=8192, heads=64, kv_heads=8, head_dim=128, ffn=28672, vocab=128256
    )


def llama405b(*, layers: int = 126) -> list[ParamSpec]:
    """Llama-3.1-405B shapes: hidden 16384, 128/8 heads of 128, SwiGLU 53248, vocab 128256,
    untied."""
    return transformer_specs(
        layers=layers, hidden=16384, heads=128, kv_heads=8, head_dim=128, ffn=53248, vocab=128256
    )


def small(*, layers: int = 4) -> list[ParamSpec]:
    """A CPU-sized Llama (the benchmark's ``small`` workload): hidden 256, 8/4 heads of 32,
    SwiGLU 704, vocab 4096, untied."""
    return transformer_specs(
        layers=layers, hidden=256, heads=8, kv_heads=4, head_dim=32, ffn=704, vocab=4096
    )


def moe(*, layers: int = 32) -> list[ParamSpec]:
    """A Mixtral-8x7B-like MoE stack: hidden 4096, 32/8 heads, 8 SwiGLU experts of 14336.

    Vocabulary 32000.
    """
    return transformer_specs(
        layers=layers,
        hidden=4096,
        heads=32,
        kv_heads=8,
        head_dim=128,
        ffn=14336,
        vocab=32000,
        experts=8,
    )


def tied(*, layers: int = 12) -> list[ParamSpec]:
    """GPT-2-small shapes with tied embeddings: hidden 768, 12 heads, GELU 3072, biases.

    Vocabulary 50257.

    The word embedding doubles as the output layer (updated by AdamW, in the
    same buckets as the other parameters, as at pipeline size 1); learned position
    embeddings of 1024 rows; 124.4M parameters at 12 layers.
    """
    return transformer_specs(
        layers=layers,
        hidden=768,
        heads=12,
        kv_heads=12,
        head_dim=64,
        ffn=3072,
        vocab=50257,
        swiglu=False,
        tied=True,
        biases=True,
        max_positions=1024,
    )


PRESETS: Mapping[str, Callable[..., list[ParamSpec]]] = {
    "llama8b": llama8b,
    "llama1b": llama1b,
    "llama70b": llama70b,
    "llama405b": llama405b,
    "small": small,
    "moe": moe,
    "tied": tied,
}


def preset_specs(name: str, *, layers: int | None = None) -> list[ParamSpec]:
    """Return the specs of preset ``name``, optionally with ``layers`` layers.

    Args:
      name: One of :data:`PRESETS`.
      layers: Number of transformer layers; ``None`` keeps the preset's own.

    Raises:
      ValueError: Unknown preset or a non-positive ``layers``.

    Examples:
      >>> len(preset_specs("llama8b", layers=2))
      15
    """
    if name not in PRESETS:
        raise ValueError(f"preset: unknown preset {name!r}; choose one of {', '.join(PRESETS)}.")
    if layers is None:
        return PRESETS[name]()
    _check_positive(f"preset {name}", layers=layers)
    return PRESETS[name](layers=layers)


def _flag(entry: Mapping, field: str, where: str, default: bool | None) -> bool | None:
    value = entry.get(field, default)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{where}: {field} must be true or false; got {value!r}.")
    return value


def _shape(value, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or any(
        isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in value
    ):
        raise ValueError(f"{where}: shape must be a list of positive integers; got {value!r}.")
    return tuple(value)


def _spec_from_entry(index: int, entry, seen: set[str]) -> ParamSpec:
    """One fixture-format parameter (a JSON object)."""
    where = f"params[{index}]"
    if not isinstance(entry, Mapping):
        raise ValueError(
            f"{where}: each entry must be a shape (a list of integers) or an object with name "
            f"and shape; got {entry!r}."
        )
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: name must be a non-empty string; got {name!r}.")
    where = f"params[{index}] ({name})"
    unknown = sorted(set(entry) - _PARAM_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown fields {unknown}; allowed: {sorted(_PARAM_KEYS)}.")
    if "shape" not in entry:
        raise ValueError(f"{where}: shape is missing.")
    shape = _shape(entry["shape"], where)
    dtype = entry.get("dtype", "float32")
    if not isinstance(dtype, str) or not dtype:
        raise ValueError(f"{where}: dtype must be a dtype name such as 'bfloat16'; got {dtype!r}.")
    if name in seen:
        raise ValueError(f"{where}: duplicate parameter name; names must be unique.")
    seen.add(name)
    shared = _flag(entry, "shared_embedding", where, False)
    expert = _flag(entry, "expert", where, False)
    embedding_or_output = _flag(entry, "is_embedding_or_output_parameter", where, None)
    is_muon = _flag(entry, "is_muon", where, None)
    if is_muon is None:
        if embedding_or_output is None:
            embedding_or_output = is_embedding_or_output(name)
        is_muon = len(shape) == 2 and not shared and not embedding_or_output
    elif is_muon and (len(shape) != 2 or shared):
        raise ValueError(
            f"{where}: a Muon parameter must be a 2-D matrix and not a tied embedding; got "
            f"{shape=}, shared_embedding={shared}. Set is_muon to false."
        )
    return ParamSpec(
        name, shape, dtype, is_muon=is_muon, is_shared_embedding=shared, is_expert=expert
    )


def specs_from_json(obj) -> list[ParamSpec]:
    """Read parameter specs from decoded JSON.

    Three forms are accepted:

    * a list of shapes, ``[[4096, 4096], [4096], ...]``: parameters ``p0, p1,
      ...`` in ``bfloat16``, Muon iff 2-D;
    * the layout fixtures' ``params`` list: objects with ``name``, ``shape`` and
      optionally ``dtype`` (default ``float32``), ``shared_embedding``,
      ``expert``, ``is_embedding_or_output_parameter`` and ``is_muon``. Unless
      ``is_muon`` is given, a parameter is Muon iff it is 2-D, not a shared
      embedding and not an embedding/output parameter (taken from
      ``is_embedding_or_output_parameter`` or else guessed from the name);
    * an object with a ``params`` key holding either list (e.g. a fixture case).

    Args:
      obj: The decoded JSON value.

    Returns:
      The specs in the given (definition) order.

    Raises:
      ValueError: The document is malformed; the message names the offending
        entry by index (and name when it has one) and the rule.

    Examples:
      >>> [(s.name, s.is_muon) for s in specs_from_json([[8, 4], [4]])]
      [('p0', True), ('p1', False)]
    """
    if isinstance(obj, Mapping):
        if "params" not in obj:
            raise ValueError(f"spec: an object spec needs a 'params' list; got keys {sorted(obj)}.")
        obj = obj["params"]
    if not isinstance(obj, list) or not obj:
        raise ValueError(
            "spec: expected a non-empty list of shapes or of parameter objects; "
            f"got {type(obj).__name__}{'' if obj else ' (empty)'}."
        )
    if all(isinstance(entry, list) for entry in obj):
        return [
            ParamSpec(f"p{i}", shape, JSON_SHAPES_DTYPE, is_muon=len(shape) == 2)
            for i, shape in enumerate(_shape(entry, f"params[{i}]") for i, entry in enumerate(obj))
        ]
    if any(isinstance(entry, list) for entry in obj):
        first = next(i for i, entry in enumerate(obj) if not isinstance(entry, list))
        raise ValueError(
            f"params[{first}]: a spec is either all shapes or all parameter objects; got a mix."
        )
    seen: set[str] = set()
    return [_spec_from_entry(i, entry, seen) for i, entry in enumerate(obj)]


def specs_to_json(specs: Sequence[ParamSpec]) -> list[dict]:
    """Write specs in the fixtures' ``params`` format (inverse of :func:`specs_from_json`)."""
    return [
        {
            "name": spec.name,
            "shape": list(spec.shape),
            "dtype": spec.dtype,
            "shared_embedding": spec.is_shared_embedding,
            "expert": spec.is_expert,
            "is_muon": spec.is_muon,
        }
        for spec in specs
    ]
