"""Per-device pieces of the step that the end-to-end tests cannot pin down alone."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwjax import LayoutConfig, RoutingRules, shards
from lwjax.optimizer import plan_params
from lwjax.plan import MeshAxes


def _expected(buffer, bucket, rank, value_of, fill):
    """Rank ``rank``'s per-element vector built directly from the plan's runs."""
    out = np.full(buffer.shard_sizes[bucket], fill, np.float32)
    for start, numel, leaf in buffer.runs[bucket][rank]:
        out[start : start + numel] = value_of[leaf]
    return out


def _interleaved(num_leaves, dp):
    """Alternating 1-D and 2-D elementwise leaves of uneven sizes: many runs, different per rank."""
    params = {
        f"p{i:02d}": jnp.zeros((8, 4 + i % 3) if i % 2 else (12 + 4 * (i % 5),))
        for i in range(num_leaves)
    }
    return plan_params(
        params,
        MeshAxes("dp", dp_size=dp),
        LayoutConfig(bucket_size=None),
        RoutingRules(is_muon=lambda *_: False),
    )


@pytest.mark.parametrize(
    "max_runs", [0, 10**6]
)  # every shard through jnp.repeat, then through the selects
@pytest.mark.parametrize("num_leaves,dp", [(25, 2), (11, 3)])
def test_per_element_matches_the_runs(monkeypatch, max_runs, num_leaves, dp):
    plan = _interleaved(num_leaves, dp)
    value_of = [float(i % 3) + 0.5 for i in range(len(plan.routes))]
    monkeypatch.setattr(shards, "MAX_SELECT_RUNS", max_runs)
    (buffer,) = plan.buffers
    for rank in range(buffer.dp):
        got = shards.per_element(buffer, 0, jnp.int32(rank), value_of)
        np.testing.assert_array_equal(
            np.asarray(got), _expected(buffer, 0, rank, value_of, min(value_of))
        )
    runs = [len(buffer.runs[0][r]) for r in range(buffer.dp)]
    assert min(runs) > 2 and len(set(runs)) > 1  # several runs, and a different count on some rank


@pytest.mark.parametrize(
    "offsets, block",
    [
        ((12, 6, 0), 0),  # back to back in reverse slot order: one block
        ((4, 10), 4),  # back to back after a gap: one block
        ((0, 10), None),  # a gap between the matrices: matrix by matrix
    ],
)
@pytest.mark.parametrize("transpose", [False, True])
def test_slot_groups_are_read_and_written_where_they_lie(offsets, block, transpose):
    shape, flat = (2, 3), jnp.arange(20.0)
    offsets = np.asarray(offsets)
    assert shards.block_start(offsets, shape) == block
    order = np.sort(offsets) if block is not None else offsets  # a block is read in place order
    stack = shards.take(flat, offsets, shape, transpose)
    want = np.stack([np.arange(o, o + 6.0).reshape(shape) for o in order])
    np.testing.assert_array_equal(np.asarray(stack), want.swapaxes(1, 2) if transpose else want)
    # The same offsets as a traced row (ranks that differ) read the slots in slot order.
    traced = shards.take(flat, jnp.asarray(offsets), shape, False)
    np.testing.assert_array_equal(
        np.asarray(traced), np.stack([np.arange(o, o + 6.0).reshape(shape) for o in offsets])
    )
    written = np.asarray(shards.put(flat, offsets, -np.asarray(want)))
    expect = np.arange(20.0)
    for o in offsets:
        expect[o : o + 6] *= -1
    np.testing.assert_array_equal(written, expect)


@pytest.mark.parametrize(
    "size, offsets, updates, gathers",
    [(18, (12, 6, 0), 0, 0), (20, (4, 10), 1, 0), (20, (0, 10), 2, 1)],
)
def test_a_slot_block_is_one_slice_and_at_most_one_update(size, offsets, updates, gathers):
    # Matrix-by-matrix updates of one buffer make XLA copy the buffer first; a block is
    # written once, and a block filling the buffer replaces it.
    offsets = np.asarray(offsets)
    step = jax.jit(lambda f: shards.put(f, offsets, 2 * shards.take(f, offsets, (2, 3), False)))
    text = step.lower(jnp.zeros(size)).as_text()
    assert len(re.findall(r"= stablehlo\.dynamic_update_slice", text)) == updates
    assert len(re.findall(r'= "stablehlo\.gather"', text)) == gathers
