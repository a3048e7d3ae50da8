"""Megatron-Core's GPT as a JAX parameter tree and forward pass (RoPE, RMSNorm, GQA, SwiGLU).

The parameter tree mirrors Megatron's ``torch_dist`` keys: a nested dict whose
path, joined with ``.``, is the key, with the layers stacked on a leading axis
and weights stored ``[out, in]`` as torch does::

    embedding/word_embeddings/weight                      [V, H]
    decoder/layers/self_attention/linear_qkv/layer_norm_weight  [L, H]
    decoder/layers/self_attention/linear_qkv/weight       [L, (nq + 2 ng) d, H]
    decoder/layers/self_attention/linear_proj/weight      [L, H, nq d]
    decoder/layers/mlp/linear_fc1/layer_norm_weight       [L, H]
    decoder/layers/mlp/linear_fc1/weight                  [L, 2 F, H]   ([gate; up])
    decoder/layers/mlp/linear_fc2/weight                  [L, H, F]
    decoder/final_layernorm/weight                        [H]
    output_layer/weight                                   [V, H]        (absent when tied)

A mixture-of-experts GPT (``num_experts`` ``E`` > 0, Megatron's local-spec
``SequentialMLP`` as ``torch_dist`` saves it) has, in place of the two MLP
matrices, a router and every expert's matrices stacked on an expert axis::

    decoder/layers/mlp/router/weight                      [L, E, H]
    decoder/layers/mlp/experts/experts/linear_fc1/weight  [L, E, 2 Fe, H]
    decoder/layers/mlp/experts/experts/linear_fc2/weight  [L, E, H, Fe]

(``Fe`` is ``moe_ffn_hidden_size``). Each expert's matrix is a Muon matrix of its
own, as Megatron's layer-wise optimizer holds it; lwjax's forward has no MoE
layer (:func:`lwjax.megatron.model.gpt_logits` refuses one).

``linear_qkv`` rows are grouped per query group ``g``: ``nq/ng`` query heads,
then one key head, then one value head, ``d`` rows each
(:func:`split_qkv`). Use it with :func:`lwjax.optimizer.layerwise_muon` through
:meth:`GPTConfig.routing_rules` (stacked layers, the QKV split) and ``out_in``
matrices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from lwjax.routing import RoutingRules

# Megatron (torch) stores a linear weight as [out, in]: the optimizer's matrix_convention for it.
MATRIX_CONVENTION = "out_in"
# The attentions lwjax.megatron.model.gpt_logits takes: jax.nn.dot_product_attention's
# implementations, and "auto" (resolved by backend and dtype)
ATTENTIONS = ("auto", "cudnn", "xla")
# A mixture-of-experts MLP's keys (SequentialMLP, as torch_dist stores it)
ROUTER_KEY = "decoder.layers.mlp.router.weight"
EXPERT_FC1_KEY = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
EXPERT_FC2_KEY = "decoder.layers.mlp.experts.experts.linear_fc2.weight"


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of a Megatron GPT (no biases, RMSNorm, RoPE, SwiGLU).

    Attributes:
      num_layers: Transformer layers ``L``.
      hidden_size: Model width ``H``.
      num_attention_heads: Query heads ``nq``.
      num_query_groups: Key/value heads ``ng`` (GQA); ``nq`` for plain attention.
      ffn_hidden_size: MLP width ``F`` (each SwiGLU half).
      vocab_size: Rows of the embedding (Megatron's padded vocabulary).
      kv_channels: Head dimension ``d``; ``None`` means ``H / nq``.
      tied_embeddings: The output layer reuses the embedding.
      norm_epsilon: RMSNorm epsilon.
      rotary_base: RoPE base.
      num_experts: Experts per MLP ``E`` (a mixture of experts in every layer);
        0 for the dense SwiGLU MLP.
      moe_ffn_hidden_size: Each expert's width ``Fe``; ``None`` means
        ``ffn_hidden_size``.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    kv_channels: int | None = None
    tied_embeddings: bool = False
    norm_epsilon: float = 1e-5
    rotary_base: float = 10000.0
    num_experts: int = 0
    moe_ffn_hidden_size: int | None = None

    def __post_init__(self):
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "ffn_hidden_size",
            "vocab_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"GPTConfig.{name} must be a positive integer; got {name}={value!r}."
                )
        for name in ("num_experts", "moe_ffn_hidden_size"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ValueError(
                    f"GPTConfig.{name} must be a non-negative integer; got {name}={value!r}."
                )
        if self.moe_ffn_hidden_size == 0:
            raise ValueError("GPTConfig.moe_ffn_hidden_size must be positive or None; got 0.")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"GPTConfig.num_query_groups must divide num_attention_heads; got "
                f"{self.num_query_groups=}, {self.num_attention_heads=}."
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"GPTConfig: hidden_size={self.hidden_size} does not divide into "
                f"{self.num_attention_heads} heads; give kv_channels."
            )

    @property
    def head_dim(self) -> int:
        """Channels per head ``d``."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def qkv_split_shapes(self) -> tuple[int, int, int]:
        """Rows of q, k and v in one query group of ``linear_qkv``."""
        d = self.head_dim
        return (self.num_attention_heads // self.num_query_groups * d, d, d)

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Each expert's width ``Fe`` (``moe_ffn_hidden_size`` or ``ffn_hidden_size``)."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Megatron key -> global shape of every parameter, in definition order."""
        L, H, F, V, d = (
            self.num_layers,
            self.hidden_size,
            self.ffn_hidden_size,
            self.vocab_size,
            self.head_dim,
        )
        shapes = {
            "embedding.word_embeddings.weight": (V, H),
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (L, H),
            "decoder.layers.self_attention.linear_proj.weight": (
                L,
                H,
                self.num_attention_heads * d,
            ),
            "decoder.layers.self_attention.linear_qkv.weight": (
                L,
                (self.num_attention_heads + 2 * self.num_query_groups) * d,
                H,
            ),
            "decoder.layers.mlp.linear_fc1.layer_norm_weight": (L, H),
        }
        if self.num_experts:
            E, Fe = self.num_experts, self.expert_ffn_hidden_size
            shapes[ROUTER_KEY] = (L, E, H)
            shapes[EXPERT_FC1_KEY] = (L, E, 2 * Fe, H)
            shapes[EXPERT_FC2_KEY] = (L, E, H, Fe)
        else:
            shapes["decoder.layers.mlp.linear_fc1.weight"] = (L, 2 * F, H)
            shapes["decoder.layers.mlp.linear_fc2.weight"] = (L, H, F)
        shapes["decoder.final_layernorm.weight"] = (H,)
        if not self.tied_embeddings:
            shapes["output_layer.weight"] = (V, H)
        return shapes

    def tensor_specs(self, axis: str = "tp") -> dict:
        """Megatron-Core's tensor-parallel split of the parameters, as a ``PartitionSpec`` tree.

        The column-parallel ``linear_qkv`` and ``linear_fc1`` are split on their
        output rows (axis 1 of ``[L, out, in]``), the row-parallel
        ``linear_proj`` and ``linear_fc2`` on their input columns (axis 2), the
        vocabulary-parallel word embedding and output layer on the vocabulary
        (axis 0); the norms are whole (``P()``). Each device holds a contiguous
        block: Megatron's SwiGLU ``linear_fc1`` interleaves gate and up rows per
        rank instead (stride 2), a row permutation of the same block shapes.
        The whole-matrix Muon modes (``duplicated``, ``distributed``) do not
        see it; ``blockwise`` orthogonalises other ``linear_fc1`` blocks than
        Megatron does.

        Use it with :func:`lwjax.layerwise_muon`'s ``param_axes=axis``.

        Raises:
          ValueError: a mixture-of-experts GPT (Megatron splits experts by its
            own expert tensor-parallel size, which lwjax does not follow).
        """
        if self.num_experts:
            raise ValueError(
                f"GPTConfig.tensor_specs: a mixture-of-experts GPT ({self.num_experts} experts) "
                "has no tensor-parallel split in lwjax (Megatron splits experts by "
                "expert_tensor_parallel_size); use it without a tensor-parallel axis."
            )
        from jax.sharding import PartitionSpec as P  # here: the tree itself needs no jax

        rows, columns, vocabulary = P(None, axis), P(None, None, axis), P(axis)
        split = {
            "embedding.word_embeddings.weight": vocabulary,
            "decoder.layers.self_attention.linear_qkv.weight": rows,
            "decoder.layers.self_attention.linear_proj.weight": columns,
            "decoder.layers.mlp.linear_fc1.weight": rows,
            "decoder.layers.mlp.linear_fc2.weight": columns,
            "output_layer.weight": vocabulary,
        }
        return tree_from_keys({key: split.get(key, P()) for key in self.param_shapes()})

    @classmethod
    def from_megatron(
        cls, shapes: Mapping[str, tuple[int, ...]], args: Mapping[str, Any]
    ) -> GPTConfig:
        """Read the configuration from a checkpoint's model shapes and its ``args``.

        Raises:
          ValueError: a parameter the GPT does not have, or shapes that disagree
            with ``args``.
        """
        experts, expert_width = 0, None
        try:
            L, qkv_rows, H = shapes["decoder.layers.self_attention.linear_qkv.weight"]
            V = shapes["embedding.word_embeddings.weight"][0]
            if ROUTER_KEY in shapes:  # a mixture of experts: no dense MLP to read F from
                experts = int(shapes[ROUTER_KEY][1])
                expert_width = int(shapes[EXPERT_FC2_KEY][3])
                F = args.get("ffn_hidden_size") or expert_width
            else:
                F = shapes["decoder.layers.mlp.linear_fc2.weight"][2]
        except (KeyError, ValueError, IndexError) as err:
            raise ValueError(
                f"not a Megatron GPT checkpoint: model parameter {err} is missing or misshapen."
            ) from None
        heads = args.get("num_attention_heads")
        if heads is None:
            raise ValueError(
                "checkpoint args lack num_attention_heads (legacy torch checkpoints often do); "
                "the QKV layout cannot be read from shapes. Give the model's heads and query "
                "groups: lwjax convert --num-attention-heads N --num-query-groups G, or "
                "megatron_to_logical(state, num_attention_heads=N, num_query_groups=G)."
            )
        stored = {"num_experts": experts, "moe_ffn_hidden_size": expert_width}
        disagree = {
            name: (args[name], value)
            for name, value in stored.items()
            if experts and args.get(name) is not None and int(args[name]) != value
        }
        if disagree:
            raise ValueError(
                "checkpoint is not the mixture of experts its args describe: "
                + "; ".join(f"args.{k}={a}, the weights give {v}" for k, (a, v) in disagree.items())
                + "."
            )
        groups = (
            heads
            if args.get("group_query_attention") is False
            else (args.get("num_query_groups") or heads)
        )
        config = cls(
            num_layers=int(L),
            hidden_size=int(H),
            num_attention_heads=int(heads),
            num_query_groups=int(groups),
            ffn_hidden_size=int(F),
            vocab_size=int(V),
            kv_channels=args.get("kv_channels"),
            tied_embeddings="output_layer.weight" not in shapes,
            norm_epsilon=float(
                args.get("norm_epsilon", args.get("layernorm_epsilon", 1e-5)) or 1e-5
            ),
            rotary_base=float(args.get("rotary_base", 10000) or 10000),
            num_experts=experts,
            moe_ffn_hidden_size=expert_width,
        )
        expected = config.param_shapes()
        wrong = {
            k: (tuple(shapes.get(k, ())), v)
            for k, v in expected.items()
            if tuple(shapes.get(k, ())) != v
        }
        extra = sorted(set(shapes) - set(expected))
        if wrong or extra:
            detail = "; ".join(
                f"{k}: got {got}, expected {want}" for k, (got, want) in wrong.items()
            )
            hint = (
                ""
                if args.get("num_query_groups")
                else " The args lack num_query_groups: if the model uses grouped-query "
                "attention, give it (lwjax convert --num-query-groups G, or "
                "num_query_groups=G)."
            )
            raise ValueError(
                f"checkpoint is not the GPT its args describe ({config}): {detail}"
                + (f"; unexpected parameters {extra}" if extra else "")
                + "."
                + hint
            )
        return config

    def routing_rules(self, *, muon: bool = True, stacked: bool = True) -> RoutingRules:
        """The :class:`~lwjax.routing.RoutingRules` of this tree for :func:`lwjax.layerwise_muon`.

        Args:
          muon: Route the decoder matrices to Muon (Megatron's ``dist_muon``);
            ``False`` routes every parameter to the elementwise optimizer
            (Adam).
          stacked: The layers are stacked ``[L, ...]`` (Megatron's tree);
            ``False``: a list of per-layer trees
            (:func:`lwjax.megatron.model.unstack_layers`).

        Expert matrices ``[L, E, m, n]`` are expert leaves (``expert=``, two stack
        axes, the expert axis last): each expert's matrix is its own Muon matrix,
        as Megatron's layer-wise optimizer holds every expert's weight; the
        router ``[L, E, H]`` is a dense matrix, on Muon as in Megatron.
        """
        experts = "decoder/layers/mlp/experts/*"
        if self.num_experts and not stacked:
            raise ValueError(
                "GPTConfig.routing_rules: stacked=False (per-layer trees) is for the dense "
                "GPT forward; a mixture-of-experts GPT keeps its layers stacked."
            )
        # first match wins: the expert matrices' two stack axes before the layers' one
        stacks = (
            {experts: 2, "decoder/layers/*": 1} if self.num_experts else {"decoder/layers/*": 1}
        )
        return RoutingRules(
            stacked=stacks if stacked else None,
            expert={experts: True} if self.num_experts else None,
            qkv_split={"*linear_qkv/weight": self.qkv_split_shapes} if muon else None,
            is_muon=None if muon else (lambda name, shape: False),
            tied={"embedding/word_embeddings/weight": True} if self.tied_embeddings else None,
        )


def tree_from_keys(flat: Mapping[str, Any]) -> dict:
    """Nest ``{"a.b.c": x}`` into ``{"a": {"b": {"c": x}}}`` (the GPT parameter tree)."""
    tree: dict = {}
    for key, value in flat.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def keys_from_tree(tree: Mapping) -> dict[str, Any]:
    """Inverse of :func:`tree_from_keys`: flatten nested dicts into ``.``-joined keys
    (``None`` leaves kept).
    """
    flat: dict[str, Any] = {}

    def walk(node, prefix):
        for name, value in node.items():
            key = f"{prefix}{name}"
            if isinstance(value, Mapping):
                walk(value, key + ".")
            else:
                flat[key] = value

    walk(tree, "")
    return flat


def split_qkv(weight, config: GPTConfig):
    """Split ``linear_qkv`` rows ``[..., (nq + 2 ng) d, H]`` into ``q [..., nq d, H]``,
    ``k``, ``v [..., ng d, H]``.
    """
    q_rows, k_rows, v_rows = config.qkv_split_shapes
    *batch, rows, cols = weight.shape
    grouped = weight.reshape(*batch, config.num_query_groups, q_rows + k_rows + v_rows, cols)
    q = grouped[..., :q_rows, :].reshape(*batch, config.num_query_groups * q_rows, cols)
    k = grouped[..., q_rows : q_rows + k_rows, :].reshape(
        *batch, config.num_query_groups * k_rows, cols
    )
    v = grouped[..., q_rows + k_rows :, :].reshape(*batch, config.num_query_groups * v_rows, cols)
    return q, k, v
