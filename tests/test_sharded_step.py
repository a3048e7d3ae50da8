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


@pytest.mark.parametrize("max_runs", [0, 16])
def test_per_element_matches_the_runs(monkeypatch, max_runs):
    # Interleaved 1-D and 2-D elementwise leaves: many runs of two values per shard.
    params = {f"p{i:02d}": jnp.zeros((8, 4) if i % 2 else (12,)) for i in range(24)}
    plan = make_plan(params, 2, bucket_size=None, is_muon=lambda *_: False)
    value_of = [float(i % 3) + 0.5 for i in range(len(plan.routes))]
    monkeypatch.setattr(sharded_step, "MAX_SELECT_RUNS", max_runs)
    (buffer,) = plan.buffers
    widths = []
    for rank in range(buffer.dp):
        got = sharded_step.per_element(buffer, 0, jnp.int32(rank), value_of)
        fill = min(value_of)
        np.testing.assert_array_equal(np.asarray(got), _expected(buffer, 0, rank, value_of, fill))
        widths.append(len(buffer.runs[0][rank]))
    assert max(widths) > 2  # both the select chain and the repeat see several runs
