"""Property tests: the layout invariants of design.md over random models, for every policy.

Random models mix 1-D and 2-D parameters (dims up to 300, often repeated so that
equal-size peers exist), with some tied embeddings; dp 1..8, bucket sizes
``None`` or random, high-bandwidth padding on or off. Also checks that
:mod:`lwjax.tools.layout_report` conserves elements and FLOPs.
"""

import json
from itertools import product

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lwjax import LayoutConfig
from lwjax.cost import deal, device_loads, ns_flops
from lwjax.elementwise_layout import compute_distributed_optimizer_layout
from lwjax.layout import PARAM_ALIGN, POLICIES, ParamSpec, bucket_end_divisor, pad_param_start
from lwjax.policies import buffer_key_of, compute_full_param_layout, compute_layout
from lwjax.tools.layout_report import layout_to_json, summarize_buffer, summarize_layout

PROPERTY_SETTINGS = settings(max_examples=300, deadline=None, database=None)

_dims = st.one_of(st.integers(1, 300), st.sampled_from([64, 128, 192, 256]))
_shapes = st.one_of(st.tuples(_dims), st.tuples(_dims, _dims))
_tied = st.sampled_from([False] * 9 + [True])


@st.composite
def models(draw, *, with_experts=False):
    """1..40 parameters in definition order: ``p{i}``, Muon iff 2-D and not tied."""
    entries = draw(
        st.lists(
            st.tuples(
                _shapes,
                _tied,
                st.booleans() if with_experts else st.just(False),
                st.sampled_from(["bfloat16", "float32"]) if with_experts else st.just("bfloat16"),
            ),
            min_size=1,
            max_size=40,
        )
    )
    return [
        ParamSpec(
            f"p{i}",
            shape,
            dtype,
            is_muon=len(shape) == 2 and not tied,
            is_shared_embedding=tied,
            is_expert=expert and not tied,
        )
        for i, (shape, tied, expert, dtype) in enumerate(entries)
    ]


_dp = st.integers(1, 8)
_bucket_size = st.one_of(st.none(), st.integers(1, 200_000))


def _params_of_bucket(layout):
    members = [[] for _ in layout.bucket_indices]
    for name, (_, _, bucket_id) in layout.param_index_map.items():
        members[bucket_id].append(name)
    return members


def _check_buckets(layout, dp, high_busbw):
    """Buckets tile the buffer from 0, are non-empty and split into dp equal shards."""
    divisor = bucket_end_divisor(dp, high_busbw)
    cursor = 0
    for start, end in layout.bucket_indices:
        assert start == cursor and end > start
        assert end % divisor == 0
        assert (end - start) % dp == 0
        cursor = end
    assert layout.numel == cursor


def _check_params(layout, specs):
    """Every parameter once, 64-aligned, its own size, inside its bucket, no overlaps."""
    numel = {s.name: s.numel for s in specs}
    assert set(layout.param_index_map) == set(numel)
    assert list(layout.param_index_map) == [s.name for s in specs]  # definition order
    for name, (start, end, bucket_id) in layout.param_index_map.items():
        assert start % PARAM_ALIGN == 0, name
        assert end - start == numel[name], name
        bucket_start, bucket_end = layout.bucket_indices[bucket_id]
        assert bucket_start <= start and end <= bucket_end, name
    ranges = sorted(entry[:2] for entry in layout.param_index_map.values())
    for (_, end), (start, _) in zip(ranges, ranges[1:]):
        assert end <= start
    assert all(_params_of_bucket(layout)), "a bucket holds no parameter"


def _check_backprop_bucket_order(layout, specs):
    """Walking parameters in backprop order, bucket ids go 0, 1, 2, ... (DDP's assertion)."""
    previous = 0
    for spec in reversed(specs):
        bucket_id = layout.param_index_map[spec.name][2]
        assert bucket_id in (previous, previous + 1), spec.name
        previous = bucket_id


def _check_layer_wise(layout, specs, dp, high_busbw):
    assert layout.is_layer_wise and layout.num_shards == dp
    _check_buckets(layout, dp, high_busbw)
    _check_params(layout, specs)
    members = _params_of_bucket(layout)
    by_name = {s.name: s for s in specs}
    for name, (start, end, bucket_id) in layout.param_index_map.items():
        bucket_start, _ = layout.bucket_indices[bucket_id]
        size = layout.shard_size(bucket_id)
        shard = (start - bucket_start) // size
        assert end <= bucket_start + (shard + 1) * size, f"{name} crosses a shard boundary"
        assert layout.shard_of(name) == shard
        if by_name[name].is_shared_embedding:
            assert members[bucket_id] == [name], f"tied {name} shares its bucket"
            assert shard == 0 and start == bucket_start
    for bucket_id, names in enumerate(members):
        assert layout.per_bucket_numel_unpadded[bucket_id] == sum(by_name[n].numel for n in names)


@PROPERTY_SETTINGS
@given(specs=models(), dp=_dp, bucket_size=_bucket_size, high_busbw=st.booleans())
def test_compute_layout_invariants_every_policy(specs, dp, bucket_size, high_busbw):
    for policy in POLICIES:
        layout = compute_layout(
            specs, dp, LayoutConfig(policy=policy, bucket_size=bucket_size, high_busbw=high_busbw)
        )
        _check_layer_wise(layout, specs, dp, high_busbw)
        if (
            policy != "size_matching"
        ):  # size_matching puts tied embeddings first and pulls peers forward
            _check_backprop_bucket_order(layout, specs)
        again = compute_layout(
            specs, dp, LayoutConfig(policy=policy, bucket_size=bucket_size, high_busbw=high_busbw)
        )
        assert again == layout and hash(again) == hash(layout), "not deterministic"


@PROPERTY_SETTINGS
@given(specs=models(), dp=_dp, bucket_size=_bucket_size, high_busbw=st.booleans())
def test_compute_distributed_optimizer_layout_invariants(specs, dp, bucket_size, high_busbw):
    layout = compute_distributed_optimizer_layout(
        specs, dp, bucket_size=bucket_size, high_busbw=high_busbw
    )
    assert not layout.is_layer_wise and layout.num_shards == dp
    _check_buckets(layout, dp, high_busbw)
    _check_params(layout, specs)
    _check_backprop_bucket_order(layout, specs)
    by_name = {s.name: s for s in specs}
    for bucket_id, names in enumerate(_params_of_bucket(layout)):
        bucket_start, _ = layout.bucket_indices[bucket_id]
        starts = [layout.param_index_map[n][0] for n in names]
        last_end = max(layout.param_index_map[n][1] for n in names)
        assert min(starts) == bucket_start  # no leading gap
        unpadded = layout.per_bucket_numel_unpadded[bucket_id]
        assert last_end - bucket_start <= unpadded <= pad_param_start(last_end) - bucket_start
        if any(by_name[n].is_shared_embedding for n in names):
            assert len(names) == 1, "a tied embedding shares its bucket"
    assert (
        compute_distributed_optimizer_layout(
            specs, dp, bucket_size=bucket_size, high_busbw=high_busbw
        )
        == layout
    )


@PROPERTY_SETTINGS
@given(
    specs=models(with_experts=True),
    dp=_dp,
    expert_dp=st.one_of(st.none(), _dp),
    bucket_size=_bucket_size,
    high_busbw=st.booleans(),
    policy=st.sampled_from(POLICIES),
)
def test_compute_full_param_layout_groups_and_invariants(
    specs, dp, expert_dp, bucket_size, high_busbw, policy
):
    full = compute_full_param_layout(
        specs,
        dp,
        LayoutConfig(policy=policy, bucket_size=bucket_size, high_busbw=high_busbw),
        expert_dp=expert_dp,
    )
    seen = []
    for key, layout in full.layouts.items():
        members = [s for s in specs if buffer_key_of(s) == key]
        shards = expert_dp if key.is_expert_parallel and expert_dp is not None else dp
        assert layout.num_shards == shards
        if key.is_layer_wise:
            _check_layer_wise(layout, members, shards, high_busbw)
        else:
            _check_buckets(layout, shards, high_busbw)
            _check_params(layout, members)
        seen += list(layout.param_index_map)
    assert sorted(seen) == sorted(s.name for s in specs)

    summary = summarize_layout(full, specs)
    assert summary.real_numel == sum(s.numel for s in specs)
    assert summary.ns_flops == sum(ns_flops(s.shape) for s in specs if s.is_muon)
    assert summary.padding_pct >= 0
    for ranks in summary.ranks:
        assert sum(load.numel for load in ranks.shards) == ranks.real_numel
    json.dumps([layout_to_json(layout) for layout in full.layouts.values()])


@PROPERTY_SETTINGS
@given(
    specs=models(),
    dp=_dp,
    bucket_size=_bucket_size,
    high_busbw=st.booleans(),
    layer_wise=st.booleans(),
    policy=st.sampled_from(POLICIES),
)
def test_summarize_buffer_conserves_elements_and_flops(
    specs, dp, bucket_size, high_busbw, layer_wise, policy
):
    if layer_wise:
        layout = compute_layout(
            specs, dp, LayoutConfig(policy=policy, bucket_size=bucket_size, high_busbw=high_busbw)
        )
    else:
        layout = compute_distributed_optimizer_layout(
            specs, dp, bucket_size=bucket_size, high_busbw=high_busbw
        )
    summary = summarize_buffer(layout, specs)
    assert summary.real_numel == sum(s.numel for s in specs)
    assert summary.numel == layout.numel
    for bucket, names in zip(summary.buckets, _params_of_bucket(layout)):
        assert len(bucket.shards) == dp
        assert sum(load.numel for load in bucket.shards) == bucket.real_numel
        assert bucket.num_params == len(names)
        if layer_wise:
            assert sum(load.num_params for load in bucket.shards) == len(names)
        for ratio in (bucket.numel_balance, bucket.flops_balance):
            assert ratio is None or 1 - 1e-12 <= ratio <= dp + 1e-12
    flops = sum(ns_flops(s.shape) for s in specs if s.is_muon) if layer_wise else 0
    assert summary.ns_flops == flops
    assert summary.padding_pct == pytest.approx(
        100 * (layout.numel - summary.real_numel) / summary.real_numel
    )


def test_ns_flops_formula():
    assert ns_flops((4, 8), 1) == 4 * 4 * 4 * 8 + 2 * 4**3
    assert ns_flops((8, 4)) == ns_flops((4, 8)) == 5 * ns_flops((4, 8), 1)
    assert ns_flops((16,)) == 0 and ns_flops((2, 3, 4)) == 0
    # QKV split: rows (outputs) in groups of q/k/v blocks, each orthogonalised on its own.
    assert ns_flops((4096, 64), 5, (1024, 512, 512)) == sum(
        ns_flops((2 * r, 64)) for r in (1024, 512, 512)
    )
    with pytest.raises(ValueError, match="do not divide"):
        ns_flops((3000, 64), 5, (1024, 512, 512))
    # A kernel computing a share of the two symmetric products (X X^T and A^2); the update
    # product is whole.
    half = ns_flops(
        (8, 4), 1, symmetric_share=lambda small, large: 0.5 if (small, large) == (4, 8) else 1.0
    )
    assert half == (2 * 4 * 4 * 8 + 2 * 4**3) // 2 + 2 * 4 * 4 * 8
    assert ns_flops(
        (4096, 64),
        5,
        (1024, 512, 512),
        symmetric_share=lambda small, large: 0.5 if large == 2048 else 1.0,
    ) == sum(
        ns_flops((2 * r, 64), symmetric_share=lambda small, large: 0.5 if large == 2048 else 1.0)
        for r in (1024, 512, 512)
    )
    assert ns_flops(
        (4096, 64), 5, (1024, 512, 512), symmetric_share=lambda small, large: 0.5
    ) < ns_flops((4096, 64), 5, (1024, 512, 512))


@given(
    st.lists(st.integers(min_value=0, max_value=100), min_size=0, max_size=6),
    st.integers(min_value=1, max_value=4),
)
@settings(max_examples=200, deadline=None, database=None)
def test_deal_busiest_device_is_within_grahams_bound_of_the_best(costs, devices):
    """``cost.deal`` against every assignment: its busiest device carries at most 4/3 of the
    least achievable busiest load, every item is dealt once, and its loads add up."""
    owners = deal(costs, devices)
    loads = device_loads(costs, owners, devices)
    assert len(owners) == len(costs) and all(0 <= d < devices for d in owners)
    assert sum(loads) == sum(costs)
    best = min(
        (
            max(device_loads(costs, choice, devices))
            for choice in product(range(devices), repeat=len(costs))
        ),
        default=0,
    )
    assert max(loads, default=0) * 3 <= best * 4
    if devices > 1 and costs and max(costs) * 2 >= sum(costs):  # one outweighs the rest
        assert max(loads) == max(costs)
