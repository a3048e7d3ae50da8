"""CheckpointManager against a careless operator: step directories that are incomplete, copies
of another step or symbolic links are never counted, restored or kept over a complete step;
one writer per directory."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
from test_checkpoint import _assert_trees_equal, _entries, _scaled, _small

import lwjax
from lwjax import checkpoint
from lwjax.checkpoint_manager import ASIDE_SUFFIX


def _run(tmp_path, steps=(100, 200, 300), **options):
    """A manager over ``tmp_path / "run"`` with ``steps`` saved (step s holds params * s)."""
    params, opt = _small(dp=2)
    state = opt.init(params)
    manager = lwjax.CheckpointManager(tmp_path / "run", **options)
    for step in steps:
        manager.save(step, _scaled(params, step), state, opt)
    return manager, params, state, opt


def _reopened(manager, **options):
    """A new manager on ``manager``'s directory (as after a restart), the old one closed."""
    manager.close()
    return lwjax.CheckpointManager(manager.directory, **options)


def _clear(path):
    for name in os.listdir(path):
        (shutil.rmtree if (path / name).is_dir() else os.remove)(path / name)


# Each way a step directory can be incomplete: the damage, and what the reason says.
DAMAGES = {
    "no_commit_metadata": (lambda p: os.remove(p / "_CHECKPOINT_METADATA"), "orbax metadata"),
    "empty_commit_metadata": (
        lambda p: (p / "_CHECKPOINT_METADATA").write_text("{}"),
        "orbax metadata",
    ),
    "no_record_item": (lambda p: shutil.rmtree(p / "lwjax"), "no lwjax/"),
    "no_arrays_item": (lambda p: shutil.rmtree(p / "arrays"), "no arrays/"),
    "emptied": (_clear, "orbax metadata"),
    "record_of_another_format": (
        lambda p: (p / "lwjax" / "metadata").write_text(json.dumps({"format": "x"})),
        "not an lwjax checkpoint record",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGES) + ["stray_empty_directory"])
def test_an_incomplete_step_is_skipped_and_never_kept_over_a_complete_one(tmp_path, damage):
    manager, params, state, opt = _run(tmp_path)
    run = tmp_path / "run"
    if damage == "stray_empty_directory":
        (run / "400").mkdir()
        reason = "orbax metadata"
    else:
        manager.save(400, _scaled(params, 400), state, opt)
        DAMAGES[damage][0](run / "400")
        reason = DAMAGES[damage][1]
    manager = _reopened(manager, max_to_keep=3)
    assert manager.all_steps() == [100, 200, 300] and manager.latest_step() == 300
    with pytest.raises(ValueError, match=f"step 400 is not a complete checkpoint: .*{reason}"):
        manager.restore(opt, step=400)
    # restore() falls back to the newest complete step and says what it skipped, and why.
    with pytest.warns(UserWarning, match=f"restoring step 300.*step 400: .*{reason}"):
        restored, _ = manager.restore(opt)
    _assert_trees_equal(restored, _scaled(params, 300))
    # The next save moves the incomplete directory aside, then keeps the newest 3 complete steps.
    with pytest.warns(UserWarning, match=f"step 400 is not a complete checkpoint .*{reason}"):
        manager.save(500, _scaled(params, 500), state, opt)
    assert manager.all_steps() == [200, 300, 500]
    assert _entries(run) == ["200", "300", "400" + ASIDE_SUFFIX, "500"]
    # A step of that number can be saved again.
    manager.save(600, _scaled(params, 600), state, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _assert_trees_equal(manager.restore(opt)[0], _scaled(params, 600))
    manager.close()


def test_a_step_directory_must_hold_its_own_step(tmp_path):
    """A copy of step 200 in directory 300 and a symbolic link to step 100 (or to a directory
    outside the manager's) are not step 300; retention never follows a link."""
    manager, params, state, opt = _run(tmp_path, max_to_keep=3)
    run = tmp_path / "run"
    shutil.rmtree(run / "300")
    shutil.copytree(run / "200", run / "300")
    manager = _reopened(manager, max_to_keep=3)
    assert manager.all_steps() == [100, 200]
    with pytest.raises(ValueError, match=r"step 300 is not a complete checkpoint: .*step 200"):
        manager.restore(opt, step=300)
    with pytest.warns(UserWarning, match="restoring step 200"):
        restored, _ = manager.restore(opt)
    _assert_trees_equal(restored, _scaled(params, 200))

    shutil.rmtree(run / "300")
    os.symlink(run / "100", run / "300")
    assert manager.all_steps() == [100, 200]
    with pytest.raises(ValueError, match="step 300 is not a complete checkpoint: a symbolic link"):
        manager.restore(opt, step=300)
    outside = tmp_path / "elsewhere"
    shutil.copytree(run / "100", outside)
    os.symlink(outside, run / "350")
    manager = _reopened(manager, max_to_keep=3)
    assert manager.all_steps() == [100, 200]
    with pytest.warns(UserWarning, match="not a complete checkpoint"):
        manager.save(400, _scaled(params, 400), state, opt)
    manager.save(500, _scaled(params, 500), state, opt)
    assert manager.all_steps() == [200, 400, 500]
    # Retention deleted step 100 itself; the links were moved aside, their targets untouched.
    assert not (run / "100").exists()
    assert (run / ("300" + ASIDE_SUFFIX)).is_symlink()
    assert (run / ("350" + ASIDE_SUFFIX)).is_symlink()
    assert checkpoint.read_record(outside)["step"] == 100
    manager.close()


def test_one_writer_per_directory(tmp_path):
    manager, params, state, opt = _run(tmp_path, steps=(1,), max_to_keep=2)
    with pytest.raises(ValueError, match=r"another CheckpointManager writes to this directory "):
        lwjax.CheckpointManager(tmp_path / "run", max_to_keep=2)
    with pytest.raises(ValueError, match=rf"held by pid {os.getpid()}"):
        lwjax.CheckpointManager(tmp_path / "run")
    # A reader takes no lock; once the writer is closed another writer may open.
    reader = lwjax.CheckpointManager(tmp_path / "run", read_only=True)
    assert reader.all_steps() == [1]
    manager.close()
    with lwjax.CheckpointManager(tmp_path / "run", max_to_keep=2) as again:
        again.save(2, params, state, opt)
        assert again.all_steps() == [1, 2]


_SECOND_WRITER = textwrap.dedent("""
    import os, sys
    os.environ["JAX_PLATFORMS"] = "cpu"
    import lwjax
    try:
        lwjax.CheckpointManager(sys.argv[1])
    except ValueError as err:
        print(err)
""")


def test_a_writer_in_another_process_is_refused_and_a_dead_one_releases(tmp_path):
    manager, *_ = _run(tmp_path, steps=(1,))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-c", _SECOND_WRITER, str(tmp_path / "run")]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert "another CheckpointManager writes to this directory" in proc.stdout, proc.stderr[-2000:]
    manager.close()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout == "", (proc.stdout, proc.stderr[-2000:])


def test_retention_counts_complete_steps_only_with_async_saves(tmp_path):
    manager, params, state, opt = _run(tmp_path, steps=(1, 2), max_to_keep=2, async_save=True)
    manager.wait_until_finished()
    (tmp_path / "run" / "3").mkdir()
    manager = _reopened(manager, max_to_keep=2, async_save=True)
    with pytest.warns(UserWarning, match="step 3 is not a complete checkpoint"):
        manager.save(4, _scaled(params, 4), state, opt)
    manager.wait_until_finished()
    assert manager.all_steps() == [2, 4]
    _assert_trees_equal(manager.restore(opt)[0], _scaled(params, 4))
    manager.close()
