"""Routing by path: names, the default Muon rule, overrides, stacking."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from lwjax import RoutingRules
from lwjax.routing import is_embedding_or_output, param_specs, path_name, route_leaves


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
        "conv": jnp.zeros((3, 3, 8)),
    }
    routes = {r.path: r for r in route_leaves(_records(tree))}
    assert routes["blocks/0/attn/wq"].is_muon
    for name in (
        "embed/embedding",
        "lm_head/kernel",
        "blocks/0/attn/bias",
        "blocks/0/norm/scale",
        "conv",
    ):
        assert not routes[name].is_muon, name


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
    assert route.is_shared_embedding and not route.is_muon


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
        "import lwjax.layout, lwjax.policies, lwjax.routing, lwjax.plan, lwjax.schedule, "
        "lwjax.cost, lwjax.elementwise_layout, lwjax.megatron.gpt\n"
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
