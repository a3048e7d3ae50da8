"""Per-device pieces of the step that the end-to-end tests cannot pin down alone."""

import jax.numpy as jnp
import numpy as np
import pytest

from lwjax import sharded_step
from lwjax.buffers import make_plan


def _expected(buffer, bucket, rank, value_of, fill):
    """Rank ``rank``'s per-element vector built directly from the plan's runs."""
    out = np.full(buffer.shard_sizes[bucket], fill, np.float32)
    for start, numel, leaf in buffer.runs[bucket][rank]:
        out[start : start + numel] = value_of[leaf]
    return out


def _interleaved(num_leaves, dp):
    """Alternating 1-D and 2-D elementwise leaves of uneven sizes: many runs, different per rank."""
    params = {f"p{i:02d}": jnp.zeros((8, 4 + i % 3) if i % 2 else (12 + 4 * (i % 5),)) for i in range(num_leaves)}
    return make_plan(params, dp, bucket_size=None, is_muon=lambda *_: False)


@pytest.mark.parametrize("max_runs", [0, 10**6])  # every shard through jnp.repeat, then through the selects
@pytest.mark.parametrize("num_leaves,dp", [(25, 2), (11, 3)])
def test_per_element_matches_the_runs(monkeypatch, max_runs, num_leaves, dp):
    plan = _interleaved(num_leaves, dp)
    value_of = [float(i % 3) + 0.5 for i in range(len(plan.routes))]
    monkeypatch.setattr(sharded_step, "MAX_SELECT_RUNS", max_runs)
    (buffer,) = plan.buffers
    for rank in range(buffer.dp):
        got = sharded_step.per_element(buffer, 0, jnp.int32(rank), value_of)
        np.testing.assert_array_equal(np.asarray(got), _expected(buffer, 0, rank, value_of, min(value_of)))
    runs = [len(buffer.runs[0][r]) for r in range(buffer.dp)]
    assert min(runs) > 2 and len(set(runs)) > 1  # several runs, and a different count on some rank
