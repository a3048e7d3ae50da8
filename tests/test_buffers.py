"""Packing pytrees into rank-major flat buffers and back; per-rank slot tables."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwjax import LayoutConfig, RoutingRules
from lwjax import buffers as buffers_lib
from lwjax.buffers import _pieces, _read_rows, pack, unpack
from lwjax.layout import POLICIES
from lwjax.optimizer import plan_params
from lwjax.plan import MeshAxes


def stacked_params(seed=0):
    rng = np.random.default_rng(seed)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    return {
        "embed": r(50, 8),
        "layers": {"wq": r(3, 8, 8), "up": r(3, 8, 24), "down": r(3, 24, 8), "ln": r(3, 8)},
        "lonely": r(5, 7),
        "bias": r(13),
    }


STACK = {"layers/*": 1}


@pytest.mark.parametrize(
    "starts, ops",
    [
        ([4, 8, 12], {"slice"}),
        ([12, 8, 4], {"slice", "rev"}),
        ([0, 20, 8], {"gather"}),
        ([8, 4, 8], {"gather"}),
        ([8, 8], {"gather"}),
        ([16], {"slice"}),
    ],
    ids=["forward", "back_to_front", "scattered", "back_and_forth", "repeated", "one"],
)
def test_read_rows_slices_back_to_back_rows_and_gathers_the_rest(starts, ops):
    array = jnp.arange(40.0)
    rows = _read_rows(array, starts, 4)
    np.testing.assert_array_equal(np.asarray(rows), np.stack([np.arange(s, s + 4) for s in starts]))
    jaxpr = str(jax.make_jaxpr(lambda a: _read_rows(a, starts, 4))(array))
    assert {op for op in ("slice", "rev", "gather") if f" {op}[" in jaxpr} == ops


def test_read_rows_past_int32_reads_whole_rows_by_index(monkeypatch):
    """Offsets past the index type (here a limit of 20 elements) are read as rows of the array
    viewed ``[-1, numel]``: the same rows, no element offset in the program; rows that are
    not whole rows of that view are static slices, no gather."""
    monkeypatch.setattr(buffers_lib, "MAX_BUCKET_ELEMENTS", 20)
    array = jnp.arange(40.0)
    for starts, offsets in (([0, 24, 8], False), ([0, 26, 9], True)):
        rows = _read_rows(array, starts, 4)
        expected = np.stack([np.arange(s, s + 4) for s in starts])
        np.testing.assert_array_equal(np.asarray(rows), expected)
        jaxpr = str(jax.make_jaxpr(lambda a, starts=starts: _read_rows(a, starts, 4))(array))
        assert ("26" in jaxpr) is offsets and (" gather[" in jaxpr) is not offsets


@pytest.mark.parametrize(
    "max_concat", [0, buffers_lib.MAX_CONCAT_OPERANDS, 10**6], ids=["dus", "default", "concat"]
)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dp", [1, 3, 4, 8])
def test_pack_unpack_round_trip(policy, dp, max_concat, monkeypatch):
    monkeypatch.setattr(buffers_lib, "MAX_CONCAT_OPERANDS", max_concat)
    params = stacked_params()
    plan = plan_params(
        params,
        MeshAxes("dp", dp_size=dp),
        LayoutConfig(policy=policy, bucket_size=300),
        RoutingRules(stacked=STACK),
    )
    buffers = pack(plan, params)
    for buckets, buffer in zip(buffers, plan.buffers):
        assert [b.shape for b in buckets] == [
            (end - start,) for start, end in buffer.layout.bucket_indices
        ]
    back = unpack(plan, buffers)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Padding is zero: the buffers hold exactly the parameters' elements.
    total = sum(float(jnp.sum(jnp.abs(x))) for x in jax.tree.leaves(params))
    assert np.isclose(
        sum(float(jnp.sum(jnp.abs(b))) for bs in buffers for b in bs), total, rtol=1e-6
    )
    # Bucket arrays are Megatron's buffer, bucket by bucket.
    for buckets, buffer in zip(buffers, plan.buffers):
        whole = np.concatenate([np.asarray(b) for b in buckets])
        for route, leaf in zip(plan.routes, jax.tree.leaves(params)):
            for i, name in enumerate(route.param_names()):
                if name in buffer.layout.param_index_map:
                    start, end, _ = buffer.layout.param_index_map[name]
                    np.testing.assert_array_equal(
                        whole[start:end],
                        np.asarray(leaf).reshape(-1)[i * (end - start) : (i + 1) * (end - start)],
                    )


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dp", [2, 4])
def test_rank_blocks_hold_exactly_the_owned_matrices(policy, dp):
    params = stacked_params()
    plan = plan_params(
        params,
        MeshAxes("dp", dp_size=dp),
        LayoutConfig(policy=policy, bucket_size=300),
        RoutingRules(stacked=STACK),
    )
    (buffer,) = [b for b in plan.buffers if b.key.is_layer_wise]
    buckets = [np.asarray(b) for b in pack(plan, params)[plan.buffers.index(buffer)]]
    by_name = {}
    for route, leaf in zip(plan.routes, jax.tree.leaves(params)):
        for i, name in enumerate(route.param_names()):
            by_name[name] = (
                np.asarray(leaf).reshape(-1, *route.param_shape)[i]
                if route.stack_dims
                else np.asarray(leaf)
            )
    seen = []
    # balanced buckets hold at least dp x the largest matrix: one bucket of this model at dp 4
    assert buffer.num_buckets > 1 or (policy, dp) == ("balanced", 4)
    for group in buffer.slot_groups:
        m, n = group.shape
        size = buffer.shard_sizes[group.bucket]
        for rank in range(dp):
            shard = buckets[group.bucket][rank * size : (rank + 1) * size]
            for offset, name in zip(group.offsets[rank], group.names[rank]):
                assert buffer.layout.shard_of(name) == rank
                assert buffer.layout.param_index_map[name][2] == group.bucket
                np.testing.assert_array_equal(
                    shard[offset : offset + m * n].reshape(m, n), by_name[name]
                )
                seen.append(name)
            spare = group.offsets[rank][len(group.names[rank]) :]
            assert all(o == size for o in spare)
    assert sorted(seen) == sorted(buffer.layout.param_index_map)


def test_pack_writes_a_bucket_of_few_pieces_in_one_concatenate(monkeypatch):
    params = stacked_params()
    plan = plan_params(
        params,
        MeshAxes("dp", dp_size=4),
        LayoutConfig(bucket_size=300),
        RoutingRules(stacked=STACK),
    )
    pieces = [
        _pieces(
            sorted((s for s in b.segments if s.bucket == k), key=lambda s: s.offset), b.dp * size
        )
        for b in plan.buffers
        for k, size in enumerate(b.shard_sizes)
    ]
    counts = [len(p) for p in pieces]
    # Back-to-back rows of one stacked leaf are one piece: fewer runs than segments.
    assert sum(not isinstance(x, int) for p in pieces for x in p) < sum(
        len(b.segments) for b in plan.buffers
    )
    for limit in (0, max(counts)):
        monkeypatch.setattr(buffers_lib, "MAX_CONCAT_OPERANDS", limit)
        jaxpr = str(jax.make_jaxpr(lambda p: pack(plan, p))(params))
        assert jaxpr.count(" concatenate[") == (len(counts) if limit else 0)
        assert ("= dynamic_update_slice " in jaxpr) == (limit == 0)


def test_pack_casts_and_is_jittable():
    params = stacked_params()
    plan = plan_params(
        params,
        MeshAxes("dp", dp_size=4),
        LayoutConfig(bucket_size=None),
        RoutingRules(stacked=STACK),
    )
    packed = jax.jit(lambda p: pack(plan, p, dtypes=["bfloat16"] * len(plan.buffers)))(params)
    assert all(b.dtype == jnp.bfloat16 for bs in packed for b in bs)
    back = jax.jit(lambda b: unpack(plan, b))(packed)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(
            np.asarray(a), np.asarray(b.astype(jnp.bfloat16).astype(jnp.float32))
        )


def test_pack_rejects_mismatched_trees():
    params = stacked_params()
    plan = plan_params(
        params,
        MeshAxes("dp", dp_size=2),
        LayoutConfig(bucket_size=None),
        RoutingRules(stacked=STACK),
    )
    with pytest.raises(ValueError, match="pack: the tree does not match"):
        pack(plan, {"embed": params["embed"]})
    with pytest.raises(ValueError, match=r"pack: lonely: expected shape \(5, 7\); got \(7, 5\)"):
        pack(plan, {**params, "lonely": params["lonely"].T})
    with pytest.raises(ValueError, match="bias: expected a floating dtype"):
        pack(plan, {**params, "bias": jnp.zeros(13, jnp.int32)})


def test_make_plan_lays_out_local_experts_over_expert_dp():
    params = {
        "dense": jnp.zeros((8, 8)),
        "experts": {"up": jnp.zeros((8, 8, 16)), "b": jnp.zeros((8, 16))},
    }
    plan = plan_params(
        params,
        MeshAxes("dp", "ep", dp_size=2, ep_size=4),
        LayoutConfig(bucket_size=None),
        RoutingRules(expert=["experts/*"], lr_mult={"experts/up": 0.5}),
    )
    by_key = {(b.key.is_expert_parallel, b.key.is_layer_wise): b for b in plan.buffers}
    assert (
        by_key[(True, True)].dp == by_key[(True, False)].dp == 2 and by_key[(False, True)].dp == 8
    )
    assert sorted(by_key[(True, True)].layout.param_index_map) == ["experts/up[0]", "experts/up[1]"]
    assert {(g.lr_mult, g.wd_mult) for g in by_key[(True, True)].slot_groups} == {(0.5, 1.0)}
    rng = np.random.default_rng(0)
    local = {
        "dense": params["dense"] + 1,
        "experts": {
            "up": jnp.asarray(rng.standard_normal((2, 8, 16))),
            "b": jnp.asarray(rng.standard_normal((2, 16))),
        },
    }
    for a, b in zip(jax.tree.leaves(unpack(plan, pack(plan, local))), jax.tree.leaves(local)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(
        ValueError, match=r"pack: experts/b: expected shape \(2, 16\); got \(8, 16\)"
    ):
        pack(plan, params)


@pytest.mark.parametrize("dp", [1, 4])
def test_reordered_views_pack_transposed_and_unpack_to_the_leaf(dp):
    """A leaf read with its axes reordered (MaxText's [embed, layers, mlp], an einsum kernel)
    packs each matrix of the view whole, and unpacks to the stored leaf."""
    from lwjax.dims import MatrixDims

    rng = np.random.default_rng(0)
    params = {
        "wi": jnp.asarray(rng.standard_normal((8, 3, 16)), jnp.float32),  # [embed, layers, mlp]
        "q": jnp.asarray(rng.standard_normal((2, 8, 4)), jnp.float32),  # [heads, embed, head_dim]
    }
    rules = RoutingRules(dims={"wi": MatrixDims(0, 2), "q": MatrixDims(1, (0, 2))})
    plan = plan_params(params, MeshAxes("dp", dp_size=dp), LayoutConfig(bucket_size=None), rules)
    back = unpack(plan, pack(plan, params))
    for name in params:
        np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(params[name]))
    (buffer,) = [b for b in plan.buffers if b.key.is_layer_wise]
    whole = np.concatenate([np.asarray(b) for b in pack(plan, params)[plan.buffers.index(buffer)]])
    start, end, _ = buffer.layout.param_index_map["wi[1]"]
    np.testing.assert_array_equal(whole[start:end], np.asarray(params["wi"])[:, 1, :].reshape(-1))
    start, end, _ = buffer.layout.param_index_map["q"]
    want = np.asarray(params["q"]).transpose(1, 0, 2).reshape(-1)  # [embed, heads * head_dim]
    np.testing.assert_array_equal(whole[start:end], want)


def test_init_reads_a_leaf_whose_offsets_pass_int32():
    """A 70B model's stacked fc1 ``[80, 8192, 57344]`` at dp 2 x fsdp 4 is 9.4e9 elements per
    device: with 2**29-element buckets, pack reads its blocks at leaf offsets past int32
    (0.4.0: OverflowError). Abstract shapes under ``jax.eval_shape``: nothing allocated."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import lwjax

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "fsdp"))
    shape = (80, 8192, 57344)
    params = {
        "layers/fc1": jax.ShapeDtypeStruct(
            shape, jnp.bfloat16, sharding=NamedSharding(mesh, P(None, None, "fsdp"))
        )
    }
    opt = lwjax.layerwise_muon(
        params,
        mesh,
        param_axes="fsdp",
        layout=LayoutConfig(bucket_size=2**29),
        routing=RoutingRules(stacked={"layers/*": 1}),
    )
    starts = [s.leaf_offset for s in opt.plan.buffers[0].segments]
    assert max(starts) >= 2**31  # offsets into this device's block of the leaf
    state = jax.eval_shape(opt.init, params)
    assert sum(x.size for x in state.masters[0]) == np.prod(shape)  # every element, once


def many_small_leaves(n, seed=0):
    """``n / 2`` matrices and biases of odd sizes, so that a bucket holds gaps between them."""
    rng = np.random.default_rng(seed)
    params = {}
    for i in range(n // 2):
        params[f"block{i}/w"] = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)
        params[f"block{i}/b"] = jnp.asarray(rng.standard_normal((1 + i % 3,)), jnp.float32)
    return params


def test_pack_writes_many_pieces_in_chunks_not_one_update_per_leaf(monkeypatch):
    """A bucket of many pieces is written a chunk of at most MAX_CONCAT_OPERANDS pieces at a
    time: the program's in-place writes grow with the leaves over that limit, not one per leaf
    (each is a kernel of its own offset, which XLA:CPU compiles apart, some 20 ms each), and
    the buckets hold the same bits as written piece by piece."""
    writes = {}
    for n in (100, 200):
        params = many_small_leaves(n)
        plan = plan_params(params, MeshAxes("dp", dp_size=4), LayoutConfig(bucket_size=None))
        pieces = [
            _pieces(
                sorted((s for s in b.segments if s.bucket == k), key=lambda s: s.offset),
                b.dp * size,
            )
            for b in plan.buffers
            for k, size in enumerate(b.shard_sizes)
        ]
        gaps = sum(isinstance(x, int) for p in pieces for x in p)
        assert gaps > len(pieces) and all(len(p) > buffers_lib.MAX_CONCAT_OPERANDS for p in pieces)
        jaxpr = str(jax.make_jaxpr(lambda p, plan=plan: pack(plan, p))(params))
        writes[n] = jaxpr.count("= dynamic_update_slice ")
        assert writes[n] <= sum(-(-len(p) // buffers_lib.MAX_CONCAT_OPERANDS) + 1 for p in pieces)
        chunked = pack(plan, params)
        for a, b in zip(jax.tree.leaves(unpack(plan, chunked)), jax.tree.leaves(params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        with monkeypatch.context() as m:
            m.setattr(buffers_lib, "MAX_CONCAT_OPERANDS", 0)  # one write per piece
            one_by_one = pack(plan, params)
        for a, b in zip(jax.tree.leaves(chunked), jax.tree.leaves(one_by_one)):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    # Each chunk holds about 4 leaves and 4 gaps here: a write per 4 leaves, not per leaf.
    assert writes[200] <= 2 * writes[100] <= 200 // 3
