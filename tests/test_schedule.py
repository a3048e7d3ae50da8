"""The bucket schedule: every bucket once, each gather hidden by one later update."""

import jax
import jax.numpy as jnp
import pytest

from lwjax import LayoutConfig, RoutingRules
from lwjax.optimizer import plan_params
from lwjax.plan import MeshAxes
from lwjax.schedule import BUS_BYTES_PER_S, schedule_buckets
from lwjax.tools.bench import workload_config, workload_shapes


def _plan(workload, dp):
    config = workload_config(workload)
    shapes = workload_shapes(config)
    params = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16),
        shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    return plan_params(
        params,
        MeshAxes("dp", dp_size=dp),
        LayoutConfig(bucket_size=40_000_000 if workload != "small" else 200_000),
        RoutingRules(
            stacked={"decoder/layers/*": 1},
            qkv_split={"*linear_qkv/weight": config.qkv_split_shapes},
        ),
        grad_reduce_in_fp32=True,
        matrix_convention="out_in",  # Megatron's [out, in] weights: the QKV rows are rows
    )


@pytest.mark.parametrize("workload,dp", [("8b", 4), ("1b", 4), ("small", 8), ("small", 1)])
def test_schedule_covers_every_bucket_and_pairs_gathers_with_later_updates(workload, dp):
    plan = _plan(workload, dp)
    schedule = schedule_buckets(plan)
    positions = [(s.buffer, s.bucket) for s in schedule.steps]
    assert sorted(positions) == [
        (i, k) for i, b in enumerate(plan.buffers) for k in range(b.num_buckets)
    ]
    during = [s.gathered_during for s in schedule.steps if s.gathered_during is not None]
    assert len(during) == len(
        set(during)
    )  # one gather per update: XLA runs one collective at a time
    for j, step in enumerate(schedule.steps):
        assert step.gathered_during is None or step.gathered_during > j
        # The step pins a gather hidden by update g before update g + 1 (none after the last
        # update).
        if step.gathered_during is not None and step.gathered_during + 1 < len(schedule.steps):
            assert j in schedule.lands_before(step.gathered_during + 1)
    pinned = [j for t in range(len(schedule.steps)) for j in schedule.lands_before(t)]
    assert len(pinned) == len(set(pinned))
    if dp == 1:
        assert not during and schedule.exposed_gather_s == 0


def test_schedule_hides_the_large_gathers_of_the_8b_workload():
    plan = _plan("8b", 4)
    schedule = schedule_buckets(plan)
    kinds = [plan.buffers[s.buffer].key.is_layer_wise for s in schedule.steps]
    assert kinds[:2] == [False, True]  # the embedding's update first, then the most Newton–Schulz
    layer_wise = [s.update_s for s, lw in zip(schedule.steps, kinds) if lw]
    assert layer_wise == sorted(layer_wise, reverse=True)
    total = sum(s.gather_s for s in schedule.steps)
    # Unhidden: only the last small buckets' gathers, a small part of all gather time.
    assert schedule.exposed_gather_s < 0.15 * total
    embedding = max(schedule.steps, key=lambda s: s.gather_s)
    assert embedding.gathered_during is not None
    assert schedule.steps[embedding.gathered_during].update_s >= embedding.gather_s
    shard = plan.buffers[embedding.buffer].shard_sizes[embedding.bucket]
    assert shard >= 128256 * 4096 // 4  # a quarter of the embedding (or output layer) at least
    assert embedding.gather_s == pytest.approx(
        shard * 3 * 2 / BUS_BYTES_PER_S
    )  # 3 other ranks' bf16 shards
