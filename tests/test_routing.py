"""Routing by path: names, the default Muon rule, overrides, stacking."""

import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import pytest

from lwjax import RoutingRules
from lwjax.dims import MatrixDims
from lwjax.routing import (
    format_routing_table,
    is_embedding_or_output,
    param_specs,
    path_name,
    role,
    route_leaves,
    routing_table,
)


def _records(tree):
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(path, leaf.shape, leaf.dtype) for path, leaf in flat]


def test_route_leaves_default_rule_matches_megatron():
    tree = {
        "embed": {"embedding": jnp.zeros((50, 8))},
        "blocks": [
            {
                "attn": {"wq": jnp.zeros((8, 8)), "bias": jnp.zeros((8,))},
                "norm": {"scale": jnp.zeros((8,))},
            }
        ],
        "lm_head": {"kernel": jnp.zeros((8, 50))},
        "mixer": jnp.zeros((3, 3, 8, 8)),
    }
    with pytest.warns(UserWarning, match=r"3\+ axes go to AdamW .*: mixer \[3, 3, 8, 8\]"):
        routes = {r.path: r for r in route_leaves(_records(tree))}
    assert routes["blocks/0/attn/wq"].is_muon
    for name in (
        "embed/embedding",
        "lm_head/kernel",
        "blocks/0/attn/bias",
        "blocks/0/norm/scale",
        "mixer",
    ):
        assert not routes[name].is_muon, name
    assert "2 axes of the model dimension 8" in routes["mixer"].why


def test_route_leaves_overrides_by_pattern_and_callable():
    recs = [("a/w", (4, 4), "float32"), ("b/w", (4, 4), "float32"), ("c/w", (4,), "float32")]
    by_pattern = {
        r.path: r.is_muon for r in route_leaves(recs, RoutingRules(is_muon={"a/*": False}))
    }
    assert by_pattern == {"a/w": False, "b/w": True, "c/w": False}
    by_callable = {
        r.path: r.is_muon
        for r in route_leaves(
            recs, RoutingRules(is_muon=lambda n, s: False if n == "b/w" else None)
        )
    }
    assert by_callable == {"a/w": True, "b/w": False, "c/w": False}
    with pytest.raises(ValueError, match="c/w: a Muon parameter must be a 2-D matrix"):
        route_leaves(recs, RoutingRules(is_muon={"c/*": True}))


def test_route_leaves_stacked_leaf_is_many_matrices():
    (route,) = route_leaves(
        [("layers/wq", (3, 4, 6), "bfloat16")], RoutingRules(stacked={"layers/*": 1})
    )
    assert route.is_muon and route.num_params == 3 and route.param_shape == (4, 6)
    specs = param_specs([route])
    assert [s.name for s in specs] == ["layers/wq[0]", "layers/wq[1]", "layers/wq[2]"]
    assert all(s.shape == (4, 6) and s.dtype == "bfloat16" and s.is_muon for s in specs)
    (two,) = route_leaves([("moe/w", (2, 3, 4, 4), "float32")], RoutingRules(stacked={"*": 2}))
    assert two.param_names()[4] == "moe/w[1,1]"
    with pytest.raises(ValueError, match="stacked=2 leading axes"):
        route_leaves([("n", (4, 4), "float32")], RoutingRules(stacked={"*": 2}))


def test_route_leaves_rejects_bad_input():
    with pytest.raises(ValueError, match="step: parameters must be floating point"):
        route_leaves([("step", (), "int32")])
    with pytest.raises(ValueError, match="a/b: two leaves share this name"):
        route_leaves([("a/b", (2,), "float32"), (("a", "b"), (2,), "float32")])
    with pytest.raises(ValueError, match="tied embedding is never a Muon"):
        route_leaves(
            [("emb", (4, 4), "float32")], RoutingRules(tied=["emb"], is_muon={"emb": True})
        )


def test_route_leaves_tied_embedding_is_shared_and_not_muon():
    (route,) = route_leaves([("wte/embedding", (10, 4), "float32")], RoutingRules(tied="wte/*"))
    assert route.is_tied and not route.is_muon


def test_path_name_drops_nnx_value_and_reads_linen_paths():
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(4, 8, rngs=rngs)
            self.embed = nnx.Embed(10, 4, rngs=rngs)

    _, state = nnx.split(Block(nnx.Rngs(0)), nnx.Param)
    names = {r.path: r.is_muon for r in route_leaves(_records(state))}
    assert names == {"embed/embedding": False, "up/bias": False, "up/kernel": True}
    assert path_name(("blocks", 0, "kernel")) == "blocks/0/kernel"


@pytest.mark.parametrize(
    "name",
    [
        "embedding",
        "tok_embeddings/weight",
        "lm_head/kernel",
        "head",
        "output_layer",
        "output_layer.weight",
        "embedding.word_embeddings.weight",
        "model.lm_head.weight",
    ],
)
def test_is_embedding_or_output_names(name):
    assert is_embedding_or_output(name)


@pytest.mark.parametrize(
    "name",
    [
        "attn/out/kernel",
        "mlp/up/kernel",
        "heads_proj",
        "attn/o_proj",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.mlp.linear_fc1.weight",
    ],
)
def test_is_embedding_or_output_leaves_other_names(name):
    assert not is_embedding_or_output(name)


def test_layout_layer_imports_no_jax():
    code = (
        "import sys; sys.modules['jax'] = None\n"
        "import lwjax.layout, lwjax.policies, lwjax.plan, lwjax.schedule, "
        "lwjax.cost, lwjax.elementwise_layout, lwjax.megatron.gpt\n"
        "import lwjax.parallel.geometry, lwjax.routing_rules, lwjax.dims, lwjax.leaf_route\n"
        "import lwjax.matrix_view, lwjax.route_decisions, lwjax.routing_table, lwjax.param_order\n"
        "import lwjax.routing\n"
        "assert not any(m == 'jax' or m.startswith('jax.') "
        "for m in sys.modules if sys.modules[m] is not None)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_route_leaves_expert_leaves_are_stacked_per_expert_and_split_over_ep():
    recs = [
        ("moe/experts/up", (8, 4, 6), "float32"),
        ("moe/experts/b", (8, 6), "float32"),
        ("scan/experts/down", (3, 8, 6, 4), "float32"),
        ("dense", (4, 4), "float32"),
    ]
    routes = {
        r.path: r
        for r in route_leaves(
            recs, RoutingRules(expert=["*/experts/*"], stacked={"scan/*": 2}), expert_parallel=4
        )
    }
    up = routes["moe/experts/up"]
    assert up.is_expert and up.is_muon and up.stack_dims == 1 and up.expert_dim == 0
    assert up.local_shape == (2, 4, 6) and up.param_names() == (
        "moe/experts/up[0]",
        "moe/experts/up[1]",
    )
    assert not routes["moe/experts/b"].is_muon and routes["moe/experts/b"].local_shape == (2, 6)
    down = routes["scan/experts/down"]
    assert down.expert_dim == 1 and down.local_shape == (3, 2, 6, 4) and down.num_params == 6
    assert not routes["dense"].is_expert and routes["dense"].local_shape == (4, 4)
    (first,) = route_leaves(
        [("x", (8, 3, 4, 4), "float32")],
        RoutingRules(expert={"x": 0}, stacked={"x": 2}),
        expert_parallel=2,
    )
    assert first.expert_dim == 0 and first.local_shape == (4, 3, 4, 4)


def test_route_leaves_rejects_bad_expert_leaves():
    with pytest.raises(
        ValueError,
        match=r"moe/w: 6 experts \(axis 0 of shape=\(6, 4, 4\)\) "
        r"do not divide by expert_parallel=4",
    ):
        route_leaves(
            [("moe/w", (6, 4, 4), "float32")], RoutingRules(expert=["moe/*"]), expert_parallel=4
        )
    with pytest.raises(
        ValueError, match="moe/w: the expert axis must be one of the 0 stacked axes"
    ):
        route_leaves(
            [("moe/w", (6, 4, 4), "float32")], RoutingRules(expert=["moe/*"], stacked={"moe/*": 0})
        )
    with pytest.raises(ValueError, match="emb: a tied embedding cannot be an expert"):
        route_leaves([("emb", (6, 4), "float32")], RoutingRules(expert=["emb"], tied=["emb"]))


def test_route_leaves_group_options_by_pattern_and_callable():
    recs = [("a/w", (4, 4), "float32"), ("mtp/w", (4, 4), "float32"), ("c", (4,), "float32")]
    routes = route_leaves(
        recs,
        RoutingRules(
            lr_mult={"a/*": 0.1},
            wd_mult=lambda name, shape: 0.0 if len(shape) == 1 else None,
            grad_norm_group={"mtp/*": "mtp"},
        ),
    )
    assert [(r.lr_mult, r.wd_mult, r.grad_norm_group) for r in routes] == [
        (0.1, 1.0, None),
        (1.0, 1.0, "mtp"),
        (1.0, 0.0, None),
    ]


def _route(name, shape, rules=None, names=None, **kwargs):
    (route,) = route_leaves([(name, shape, "float32", names)], rules or RoutingRules(), **kwargs)
    return route


def test_matrix_dims_put_batch_input_and_output_axes_anywhere():
    """MaxText's scanned [embed, layers, mlp]: 'layers' is a batch axis in the middle."""
    rules = RoutingRules(dims={"*/wi": MatrixDims(reduction=0, output=-1)})
    route = _route("decoder/wi", (32, 4, 64), rules)
    assert route.is_muon and route.stack_dims == 1 and route.num_params == 4
    assert (route.axes_order, route.view, route.param_shape) == ((1, 0, 2), (4, 32, 64), (32, 64))
    torch = _route("decoder/wi", (32, 4, 64), rules, matrix_convention="out_in")
    assert (torch.axes_order, torch.view) == ((1, 2, 0), (4, 64, 32))
    several = _route("q", (8, 32, 16), RoutingRules(dims={"q": MatrixDims(1, (0, 2))}))
    assert (several.stack_dims, several.view) == (0, (32, 128))
    with pytest.raises(ValueError, match="q: MatrixDims uses an axis twice"):
        _route("q", (8, 32, 16), RoutingRules(dims={"q": MatrixDims(1, (1, 2))}))
    with pytest.raises(ValueError, match=r"q: MatrixDims.output=\(3,\) is out of range"):
        _route("q", (8, 32, 16), RoutingRules(dims={"q": MatrixDims(1, 3)}))
    with pytest.raises(TypeError, match="a dims rule must give a MatrixDims"):
        _route("q", (8, 32, 16), RoutingRules(dims={"q": (1, 2)}))


def test_logical_axis_names_route_scanned_and_einsum_kernels():
    layers = _route("mlp/wo", (64, 4, 32), names=("mlp", "layers", "embed"))
    assert (layers.stack_dims, layers.view, layers.axes_order) == (1, (4, 64, 32), (1, 0, 2))
    query = _route("attn/query", (32, 4, 8), names=("embed", "heads", "kv"))
    assert (query.view, query.axes_order) == ((32, 32), None)
    out = _route("attn/out", (4, 8, 32), names=("heads", "kv", "embed"))
    assert out.is_muon and out.view == (32, 32)
    tokens = _route("tok/w", (64, 32), names=("vocab", "embed"))  # no telling name: the axis
    assert not tokens.is_muon and "a vocab axis" in tokens.why
    # mesh-axis names (not logical ones) say nothing: the shape decides
    meshed = _route("attn/q", (4, 32, 8), RoutingRules(model_dim=32), names=("tp", "fsdp", None))
    assert meshed.is_muon and meshed.axes_order == (1, 0, 2)


def test_einsum_kernels_split_at_the_model_dimension():
    rules = RoutingRules(model_dim=32)
    q = _route("attn/q_einsum", (4, 32, 8), rules)  # [N, D, H]
    assert (q.is_muon, q.axes_order, q.view) == (True, (1, 0, 2), (32, 32))
    assert "model dim 32 is the input" in q.why
    vec = _route("attn/attn_vec_einsum", (4, 8, 32), rules)  # [N, H, D]
    assert (vec.is_muon, vec.axes_order, vec.view) == (True, None, (32, 32))
    with pytest.warns(UserWarning, match=r"by position only.*: blocks/kernel \[4, 32, 8\]"):
        unnamed = _route("blocks/kernel", (4, 32, 8), rules)
    assert unnamed.is_muon and "model dim 32 is the input (by position)" in unnamed.why
    with pytest.warns(UserWarning, match="3\\+ axes go to AdamW"):
        ambiguous = _route("w", (32, 32, 32), rules)
    assert not ambiguous.is_muon and "3 axes of the model dimension 32" in ambiguous.why


def test_heads_embeddings_biases_and_scales_stay_off_muon():
    heads = ("out/kernel", "logits_dense/kernel", "decoder/logitdense/kernel", "pos", "wpe")
    heads += ("score/kernel", "classifier/kernel", "transformer/wte", "output/kernel")
    for name in heads:
        assert not _route(name, (32, 64)).is_muon, name
    for name in ("blocks/0/attn/out/kernel", "layers/3/mlp/output/kernel", "attention/score/w"):
        assert _route(name, (32, 64)).is_muon, name
    assert not _route("mlp/b", (32, 64)).is_muon  # a [L, d] stack of biases, not a matrix
    with pytest.warns(UserWarning, match="biases or scales go to Muon: mlp/bias"):
        _route("mlp/bias", (32, 64), RoutingRules(is_muon={"*": True}, stacked={"*": 0}))
    with pytest.warns(UserWarning, match="embedding- or head-like names go to Muon: lm_head"):
        _route("lm_head", (32, 64), RoutingRules(is_muon={"*": True}))


def test_scanned_modules_are_found_from_their_stacked_biases():
    tree = [
        ("blocks/dense/kernel", (3, 16, 16), "float32"),
        ("blocks/dense/bias", (3, 16), "float32"),
        ("blocks/norm/scale", (3, 16), "float32"),
        ("head/kernel", (16, 4), "float32"),
    ]
    routes = {r.path: r for r in route_leaves(tree)}
    assert routes["blocks/dense/kernel"].is_muon and routes["blocks/dense/kernel"].num_params == 3
    assert routes["blocks/norm/scale"].stack_dims == 1 and not routes["blocks/norm/scale"].is_muon
    assert routes["head/kernel"].stack_dims == 0


def test_qkv_split_is_checked_against_the_output_rows_at_construction():
    rules = RoutingRules(qkv_split={"qkv": (32, 16, 16)})
    assert _route("qkv", (256, 32), rules, matrix_convention="out_in").qkv_split_shapes
    with pytest.raises(ValueError, match="qkv: qkv_split=.*does not divide the 32 output rows"):
        _route("qkv", (256, 32), rules)  # in_out: the outputs are the 32 columns


def test_routing_table_says_why():
    routes = route_leaves(
        [("w", (8, 16), "float32"), ("b", (16,), "float32"), ("embed", (64, 8), "float32")]
    )
    rows = {row[0]: row for row in routing_table(routes)}
    assert rows["w"] == ("w", "[8, 16]", "[8, 16]", "Muon", "2-D", "")
    assert rows["b"][3:] == ("AdamW", "bias or scale", "")
    assert rows["embed"][3] == "AdamW" and "embedding or head" in rows["embed"][4]


def test_gemma_package_layout_routes_every_einsum_kernel_whole():
    """The ``gemma`` package's linen Transformer (names and shapes as it stores them, gemma 2/3
    with ``transpose_gating_einsum``): D = 32, 4 heads of 8, 2 kv heads, hidden 64."""
    layer = "transformer/layer_0/"
    leaves = [
        ("transformer/embedder/input_embedding", (256, 32)),
        (layer + "attn/q_einsum/w", (4, 32, 8)),  # [N, D, H]
        (layer + "attn/kv_einsum/w", (2, 2, 32, 8)),  # [2, K, D, H]
        (layer + "attn/attn_vec_einsum/w", (4, 8, 32)),  # [N, H, D]
        (layer + "mlp/gating_einsum", (2, 64, 32)),  # [2, F, D]: D contracted, though last
        (layer + "mlp/linear", (64, 32)),  # [F, D]
        (layer + "pre_attention_norm/scale", (32,)),
        ("transformer/final_norm/scale", (32,)),
    ]
    routes = route_leaves([(n, s, "float32") for n, s in leaves])
    table = {r.path: (r.axes_order, r.view) if r.is_muon else "adamw" for r in routes}
    assert table == {
        "transformer/embedder/input_embedding": "adamw",
        layer + "attn/q_einsum/w": ((1, 0, 2), (32, 32)),
        layer + "attn/kv_einsum/w": ((2, 0, 1, 3), (32, 32)),
        layer + "attn/attn_vec_einsum/w": (None, (32, 32)),
        layer + "mlp/gating_einsum": ((2, 0, 1), (32, 128)),
        layer + "mlp/linear": (None, None),
        layer + "pre_attention_norm/scale": "adamw",
        "transformer/final_norm/scale": "adamw",
    }
    assert "is the input (by name)" in routes[4].why


def test_review_cases_stacks_experts_mesh_axis_names_and_repeated_axes():
    """Cases a review found: named stacks of biases keep their stack (no weight decay), expert
    leaves are one matrix per expert, a mesh axis called "model" is no model axis, and a
    repeated output axis is refused."""
    scale = _route("layers/norm/scale", (3, 32), names=("layers", "norm"))
    assert (scale.is_muon, scale.stack_dims, scale.param_shape) == (False, 1, (32,))
    experts = _route("layer0/moe/experts/wi", (4, 32, 64), RoutingRules(model_dim=32))
    assert experts.is_muon and experts.num_params == 4 and experts.param_shape == (32, 64)
    query = _route("attn/query/kernel", (64, 8, 16), RoutingRules(model_dim=64),
                   names=(None, "model", None))  # fmt: skip
    assert query.is_muon and query.view == (64, 128)
    with pytest.raises(ValueError, match="MatrixDims uses an axis twice"):
        _route("w", (4, 8, 16), RoutingRules(dims={"w": MatrixDims(0, (1, -2))}))
    scanned_moe = route_leaves(
        [
            ("layers/moe/experts/wi", (2, 4, 32, 64), "float32"),
            ("layers/moe/experts/bias", (2, 4, 64), "float32"),
            ("layers/norm/scale", (2, 32), "float32"),
        ]
    )
    assert [r.stack_dims for r in scanned_moe] == [2, 2, 1]


def test_role_names_a_parameter_the_same_in_every_layer():
    assert (
        role("decoder/layers/3/mlp/linear_fc1/weight") == "decoder/layers/#/mlp/linear_fc#/weight"
    )
    assert role("layers_12/attn/kernel") == role("layers_0/attn/kernel") == "layers_#/attn/kernel"
    assert role("decoder/layers/linear_qkv/weight[3]") == "decoder/layers/linear_qkv/weight[#]"


@pytest.mark.parametrize("workload,dp", [("small", 4), ("1b", 2)])
def test_a_model_with_a_leaf_per_layer_is_laid_out_as_with_stacked_layers(workload, dp):
    """The same GPT with its layers stacked and with one leaf per layer (a list, as flax
    examples and HF Flax models hold them): the same buffers, buckets and slot groups, so
    Newton–Schulz is batched the same way. In layer order the 1b model at dp 2 had 62 slot
    groups of one matrix each, against 19 stacked."""
    from lwjax import LayoutConfig
    from lwjax.optimizer import plan_params
    from lwjax.plan import MeshAxes
    from lwjax.tools.bench import workload_config, workload_shapes

    config = workload_config(workload)
    stacked = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16),
        workload_shapes(config),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    listed = dict(stacked, decoder=dict(stacked["decoder"]))
    listed["decoder"]["layers"] = [
        jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), stacked["decoder"]["layers"]
        )
        for _ in range(config.num_layers)
    ]
    rules = config.routing_rules()
    plans = [
        plan_params(
            tree,
            MeshAxes("dp", dp_size=dp),
            LayoutConfig(bucket_size="auto"),
            rules if tree is stacked else RoutingRules(qkv_split=rules.qkv_split),
            matrix_convention="out_in",
        )
        for tree in (stacked, listed)
    ]
    assert sum(r.is_muon for r in plans[1].routes) == 4 * config.num_layers

    def geometry(plan):
        return [
            (b.key, b.shard_sizes, [(g.bucket, g.shape, g.width) for g in b.slot_groups])
            for b in plan.buffers
        ]

    assert geometry(plans[0]) == geometry(plans[1])
    # In the listed model the norms (not Muon) keep their places between the layers' matrices.
    specs = param_specs(plans[1].routes)
    names = [s.name for s in specs if not s.is_muon]
    assert names == [r.path for r in plans[1].routes if not r.is_muon]


def test_by_role_orders_a_roles_matrices_by_layer_number_and_keeps_the_rest_in_place():
    """Flattening a dict puts ``layers_10`` before ``layers_2``; the layout takes the layers
    in number order, as a stack holds them. A norm between them keeps its place."""
    from lwjax.layout import ParamSpec
    from lwjax.routing import by_role

    names = [f"layers_{i}/mlp/kernel" for i in (0, 1, 10, 11, 2)]
    specs = [ParamSpec(n, (8, 8), is_muon=True) for n in names]
    specs.insert(2, ParamSpec("final_norm/scale", (8,)))
    out = [s.name for s in by_role(specs)]
    assert out == [
        "layers_0/mlp/kernel",
        "layers_1/mlp/kernel",
        "final_norm/scale",
        "layers_2/mlp/kernel",
        "layers_10/mlp/kernel",
        "layers_11/mlp/kernel",
    ]


def _maxtext_block(layers="decoder/layers/", *, scale=True):
    """MaxText's scanned decoder layer (``param_scan_axis=1``) without axis names: the layer
    axis second in every leaf. Width 64, 3 layers, 4 heads of 16, MLP 128."""
    leaves = [
        ("token_embedder/embedding", (256, 64)),
        (layers + "mlp/wi/kernel", (64, 3, 128)),
        (layers + "mlp/wo/kernel", (128, 3, 64)),
        *(
            (f"{layers}self_attention/{p}/kernel", (64, 3, 4, 16))
            for p in ("query", "key", "value")
        ),
        (layers + "self_attention/out/kernel", (4, 3, 16, 64)),
        *([(layers + "pre_self_attention_layer_norm/scale", (64, 3))] if scale else []),
        ("decoder/decoder_norm/scale", (64,)),
        ("decoder/logits_dense/kernel", (64, 256)),
    ]
    return [(n, s, "float32") for n, s in leaves]


def test_a_stack_axis_in_the_middle_is_found_from_a_stacked_scale_or_a_layers_module():
    """Issue 45, item 1: each kernel is 3 matrices, not one [64, 384] / [192, 64] matrix."""
    expected = {
        "mlp/wi/kernel": (3, 64, 128),
        "mlp/wo/kernel": (3, 128, 64),
        **{f"self_attention/{p}/kernel": (3, 64, 64) for p in ("query", "key", "value")},
        "self_attention/out/kernel": (3, 64, 64),
    }
    for layers, scale in (("decoder/layers/", True), ("decoder/layers/", False),
                          ("decoder/blocks/", True)):  # fmt: skip
        routes = {r.path: r for r in route_leaves(_maxtext_block(layers, scale=scale))}
        views = {p: routes[layers + p].view for p in expected}
        assert views == expected, (layers, scale)
        assert all(routes[layers + p].num_params == 3 for p in expected)
        assert routes[layers + "mlp/wi/kernel"].axes_order == (1, 0, 2)
        assert routes[layers + "self_attention/out/kernel"].axes_order == (1, 0, 2, 3)
        if scale:  # 3 vectors of 64, read with the stack first: no weight decay
            norm = routes[layers + "pre_self_attention_layer_norm/scale"]
            assert (norm.is_muon, norm.stack_dims, norm.param_shape) == (False, 1, (64,))
            assert norm.axes_order == (1, 0)


def test_a_middle_stack_axis_that_nothing_confirms_is_warned():
    """No stacked scale and no ``layers`` module: the kernels stay einsum matrices, but the
    shared axis of size 3 is named in a warning, with the rule that fixes it."""
    with pytest.warns(UserWarning, match=r"as a stack of layers would.*dims=MatrixDims") as caught:
        routes = {r.path: r for r in route_leaves(_maxtext_block("decoder/blocks/", scale=False))}
    assert routes["decoder/blocks/mlp/wi/kernel"].view == (64, 384)
    message = str(caught[0].message)
    assert "decoder/blocks/mlp/wi/kernel [64, 3, 128] (axis 1 of size 3" in message
    rules = RoutingRules(dims={"*/wi/kernel": MatrixDims(0, 2), "*/wo/kernel": MatrixDims(0, 2),
                               "*/out/kernel": MatrixDims((0, 2), 3),
                               "*_attention/*/kernel": MatrixDims(0, (2, 3))})  # fmt: skip
    routes = {
        r.path: r for r in route_leaves(_maxtext_block("decoder/blocks/", scale=False), rules)
    }
    assert routes["decoder/blocks/self_attention/query/kernel"].view == (3, 64, 64)
    assert routes["decoder/blocks/self_attention/out/kernel"].view == (3, 64, 64)


def test_conv_kernels_are_warned_with_the_rule_and_the_model_width_is_no_kernel_size():
    """Issue 45, item 2: a conv net's 3x3 kernels do not make the model width 3; each conv
    kernel is named, with the dims rule that makes it a Muon matrix."""
    leaves = [("conv_init/kernel", (7, 7, 3, 8))]
    for i, (cin, cout) in enumerate(((8, 8), (8, 16), (16, 16))):
        leaves += [(f"block_{i}/Conv_0/kernel", (3, 3, cin, cout)),
                   (f"block_{i}/Conv_1/kernel", (3, 3, cout, cout)),
                   (f"block_{i}/BatchNorm_0/scale", (cout,))]  # fmt: skip
    leaves += [("Dense_0/kernel", (16, 10)), ("Dense_0/bias", (10,))]
    records = [(n, s, "float32") for n, s in leaves]
    with pytest.warns(UserWarning, match=r"conv kernels go to AdamW") as caught:
        routes = {r.path: r for r in route_leaves(records)}
    message = str(caught[0].message)
    assert 'dims={"*[Cc]onv*/kernel": MatrixDims((0, 1, 2), 3)}' in message
    assert "block_0/Conv_0/kernel [3, 3, 8, 8]" in message and "conv_init" in message
    assert not any("model dimension 3" in r.why for r in routes.values())
    assert "dims=MatrixDims((0, 1, 2), 3)" in routes["block_1/Conv_0/kernel"].why
    with pytest.warns(UserWarning, match=r'"\*\[Cc\]onv\*weight": MatrixDims\(\(1, 2, 3\), 0\)'):
        torch = route_leaves(
            [("conv1.weight", (8, 4, 3, 3), "float32")], matrix_convention="out_in"
        )
    assert "dims=MatrixDims((1, 2, 3), 0)" in torch[0].why
    rules = RoutingRules(dims={"*[Cc]onv*/kernel": MatrixDims((0, 1, 2), 3)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fixed = {r.path: r for r in route_leaves(records, rules)}
    assert fixed["block_1/Conv_0/kernel"].view == (72, 16)
    assert fixed["conv_init/kernel"].view == (147, 8)


def test_min_gpt_embeddings_and_vit_tokens_are_not_muon_and_not_warned():
    """Issue 45, item 5: ``tok_emb``/``pos_emb`` are embeddings by name, a ``cls`` token
    ``[1, 1, D]`` is a vector, and leaves routed to AdamW by name raise no 3+-axis warning."""
    leaves = [
        ("tok_emb/weight", (64, 32)),
        ("pos_emb", (1, 16, 32)),
        ("cls", (1, 1, 32)),
        ("Transformer/posembed_input/pos_embedding", (1, 17, 32)),
        ("embedding/kernel", (4, 4, 3, 32)),  # ViT's patch embedding, a conv named so
        ("blocks/0/attn/c_attn/weight", (32, 96)),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        routes = {r.path: r for r in route_leaves([(n, s, "float32") for n, s in leaves])}
    assert {p for p, r in routes.items() if r.is_muon} == {"blocks/0/attn/c_attn/weight"}
    assert "embedding or head" in routes["tok_emb/weight"].why
    assert "a vector" in routes["cls"].why


def test_routing_table_notes_qkv_splits_and_fused_kernels_kept_whole():
    """Issue 45, item 5: the table says which projections a fused leaf holds, and whether
    Muon takes them apart."""
    leaves = [("embed", (256, 32)), ("attn/q_einsum/w", (4, 32, 8)),
              ("attn/kv_einsum/w", (2, 2, 32, 8)), ("mlp/gating_einsum", (2, 64, 32)),
              ("attn/qkv/kernel", (32, 96)), ("mlp/linear", (64, 32))]  # fmt: skip
    records = [(n, s, "float32") for n, s in leaves]
    notes = {row[0]: row[5] for row in routing_table(route_leaves(records))}
    assert notes == {
        "embed": "",
        "attn/q_einsum/w": "",
        "attn/kv_einsum/w": "k and v in one matrix (a dims= rule splits them)",
        "mlp/gating_einsum": "gate and up in one matrix (a dims= rule splits them)",
        "attn/qkv/kernel": "q, k and v in one matrix (qkv_split= splits them)",
        "mlp/linear": "",
    }
    rules = RoutingRules(qkv_split={"attn/qkv/*": (16, 8, 8)},
                         dims={"*/kv_einsum/w": MatrixDims(2, (1, 3))})  # fmt: skip
    routes = route_leaves(records, rules)
    notes = {row[0]: row[5] for row in routing_table(routes)}
    assert notes["attn/qkv/kernel"] == "q, k, v apart (qkv_split: 16+8+8 output rows per group)"
    assert notes["attn/kv_einsum/w"] == "k and v apart (axis 0 is a batch axis)"
    text = format_routing_table(routes)
    assert text.splitlines()[0].split() == ["path", "shape", "matrix", "view", "optimizer",
                                            "note", "why"]  # fmt: skip
    assert "k and v apart (axis 0 is a batch axis)" in text
