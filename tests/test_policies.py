"""Layout policies against Megatron-Core's own outputs (tests/fixtures/layouts)."""

import json
import pathlib

import pytest

from lwjax import LayoutConfig
from lwjax.layout import ParamSpec
from lwjax.megatron.ping_pong import ping_pong_ownership
from lwjax.policies import compute_full_param_layout, compute_layout

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "layouts"
POLICY_OF_VERSION = {"v1": "size_matching", "v2": "lpt", "v4": "ns_cost"}


def _load(name):
    return json.loads((FIXTURES / name).read_text())["cases"]


def _spec(p, *, is_muon=True):
    return ParamSpec(
        name=p["name"],
        shape=tuple(p["shape"]),
        dtype=p["dtype"],
        is_muon=is_muon,
        is_shared_embedding=p["shared_embedding"],
        is_expert=p["expert"],
    )


PER_BUFFER_CASES = [c for v in ("v1", "v2", "v4") for c in _load(f"layout_{v}.json")]


def _assert_layout_matches(layout, expected, with_shards=True):
    got_map = {k: list(v) for k, v in layout.param_index_map.items()}
    assert got_map == expected["param_index_map"]
    assert [list(b) for b in layout.bucket_indices] == expected["bucket_indices"]
    assert list(layout.per_bucket_numel_unpadded) == expected["per_bucket_numel_unpadded"]
    if with_shards:
        assert {n: layout.shard_of(n) for n in layout.param_index_map} == expected["shard_of"]


@pytest.mark.parametrize("case", PER_BUFFER_CASES, ids=[c["case_id"] for c in PER_BUFFER_CASES])
def test_compute_layout_matches_megatron(case):
    layout = compute_layout(
        [_spec(p) for p in case["params"]],
        case["dp"],
        LayoutConfig(
            policy=POLICY_OF_VERSION[case["version"]],
            bucket_size=case["bucket_size"],
            high_busbw=case["pad_buckets_for_high_nccl_busbw"],
        ),
    )
    assert layout.num_shards == case["dp"]
    _assert_layout_matches(layout, case["expected"])


FULL_CASES = _load("full_layout.json")


@pytest.mark.parametrize("case", FULL_CASES, ids=[c["case_id"] for c in FULL_CASES])
def test_compute_full_param_layout_matches_megatron(case):
    specs = [
        _spec(p, is_muon=len(p["shape"]) == 2 and not p["is_embedding_or_output_parameter"])
        for p in case["params"]
    ]
    full = compute_full_param_layout(
        specs,
        case["dp"],
        LayoutConfig(
            policy=POLICY_OF_VERSION[case["version"]],
            bucket_size=case["bucket_size"],
            high_busbw=case["pad_buckets_for_high_nccl_busbw"],
        ),
        expert_dp=case["expert_dp"],
        grad_reduce_in_fp32=case["grad_reduce_in_fp32"],
    )
    expected_buffers = case["expected"]["buffers"]
    assert len(full.layouts) == len(expected_buffers)
    for (key, layout), exp in zip(full.layouts.items(), expected_buffers):
        k = exp["key"]
        assert (key.param_dtype, key.grad_dtype, key.is_expert_parallel, key.is_layer_wise) == (
            k["param_dtype"],
            k["grad_dtype"],
            k["is_expert_parallel"],
            k["is_managed_by_layer_wise_optimizer"],
        )
        assert layout.num_shards == exp["num_optimizer_shards"] == exp["dp"]
        assert list(layout.param_index_map) == exp["params"]
        assert list(layout.param_indices) == exp["param_indices"]
        assert layout.is_layer_wise == (exp["layout_kind"] == "layer_wise")
        _assert_layout_matches(layout, exp, with_shards=layout.is_layer_wise)


PING_PONG_CASES = _load("pingpong.json")


@pytest.mark.parametrize("case", PING_PONG_CASES, ids=[c["case_id"] for c in PING_PONG_CASES])
def test_ping_pong_ownership_matches_megatron(case):
    specs = {p["name"]: _spec(p) for p in case["params"]}
    groups = [
        (g["is_expert_parallel"], [specs[n] for n in g["params"]])
        for g in case["optimizer_param_groups"]
    ]
    dense, expert = ping_pong_ownership(groups, case["dp"], case["expert_dp"])
    assert dense == case["expected"]["dp_cp_params_list"]
    assert expert == case["expected"]["expt_dp_params_list"]
