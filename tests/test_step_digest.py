"""``docs/scripts/step_digest.py``: the bench's step digested on CPU. The same commit digests to
the same SHA-256 and no differing leaf; one element changed in the saved parameters is reported
at its leaf, once, with its relative size."""

import pathlib

import numpy as np
import pytest
from module_files import imported

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "docs" / "scripts" / "step_digest.py"


@pytest.fixture(scope="module")
def step_digest():
    return imported(SCRIPT)


def test_a_changed_element_is_reported_at_its_leaf(step_digest):
    record, leaves = step_digest.digest("small", 1)
    again, _ = step_digest.digest("small", 1)
    assert record["sha256"] == again["sha256"] and record["temp_gb"] > 0
    saved = {str(k): np.asarray(x, np.float32) for k, (_, x) in enumerate(leaves)}
    assert step_digest.differences(leaves, saved) == []
    k = next(k for k, (_, x) in enumerate(leaves) if x.ndim >= 2)
    saved[str(k)] = saved[str(k)].copy()
    saved[str(k)].flat[5] *= 1.5
    (diff,) = step_digest.differences(leaves, saved)
    assert diff["leaf"] == leaves[k][0] and diff["differing"] == 1
    assert diff["max_relative"] == pytest.approx(1 / 3, rel=1e-6)
