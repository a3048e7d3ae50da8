"""``docs/scripts/checkpoint_at_scale.py`` (run 6 of ``multi_gpu_runs.sh``) as two processes on
virtual CPU devices: a fully sharded state saved at fsdp 4 comes back bitwise at dp 2 x fsdp 2,
and a fingerprint that does not match what was restored fails the restore, naming the leaf."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "docs" / "scripts" / "checkpoint_at_scale.py"


def _run(mode: str, directory: pathlib.Path, *mesh: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    common = ["--workload", "small", "--layers", "1", "--dir", str(directory), "--json"]
    return subprocess.run(
        [sys.executable, str(SCRIPT), mode, *common, *mesh],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_saved_at_fsdp4_restores_bitwise_at_dp2_fsdp2_and_a_changed_leaf_fails(tmp_path):
    saved = _run("save", tmp_path, "--fsdp", "4")
    assert saved.returncode == 0, saved.stderr[-3000:]
    save = json.loads(saved.stdout)
    assert save["mesh"] == "dp 1 x fsdp 4"
    assert save["peak_bytes_before"] is None and save["peak_bytes_after"] is None  # CPU: n/a

    restored = _run("restore", tmp_path, "--dp", "2", "--fsdp", "2")
    assert restored.returncode == 0, restored.stderr[-3000:]
    restore = json.loads(restored.stdout)
    assert (restore["saved_mesh"], restore["mesh"]) == ("dp 1 x fsdp 4", "dp 2 x fsdp 2")
    assert restore["bitwise"] is True and restore["first_difference"] is None
    assert restore["leaves"] == save["leaves"] > 0

    # One leaf's fingerprint no longer that of the state saved: the restore must name it.
    record = json.loads((tmp_path / "fingerprints.json").read_text())
    leaf = "state/momenta/decoder/layers/mlp/linear_fc2/weight"
    record["fingerprints"][leaf] = "0" * 64
    (tmp_path / "fingerprints.json").write_text(json.dumps(record))
    failed = _run("restore", tmp_path, "--dp", "2", "--fsdp", "2")
    assert failed.returncode == 1
    assert leaf in failed.stderr
    assert json.loads(failed.stdout)["first_difference"] == leaf
