"""lwjax checkpoints: restore at any dp size and policy, atomic saves, and clear
errors on bad input."""

import asyncio
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from etils import epath
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint._src.path import atomicity

import lwjax
from lwjax import LayoutConfig, RoutingRules, checkpoint, checkpoint_files
from lwjax.checkpoint_manager import LOCK_FILE
from lwjax.logical import from_logical, to_logical
from lwjax.muon import MuonConfig
from lwjax.optimizer import OptimizerConfig, layerwise_muon
from lwjax.train import make_train_step

MUON = MuonConfig(momentum=0.9, nesterov=True, fp32_matmul_prec="highest")
CONFIG = OptimizerConfig(weight_decay=0.1, clip_grad=1.0)


def mesh_of(dp):
    return Mesh(np.array(jax.devices()[:dp]), ("dp",))


def _loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"].astype(jnp.float32) + params["b1"].astype(jnp.float32))
    return jnp.mean((h @ params["w2"].astype(jnp.float32) - y) ** 2)


def _setup(dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "w1": jnp.asarray(rng.standard_normal((8, 32)) / 3, dtype),
        "b1": jnp.zeros(32, dtype),
        "w2": jnp.asarray(rng.standard_normal((32, 4)) / 6, dtype),
    }
    x = rng.standard_normal((64, 8)).astype(np.float32)
    return params, (x, np.sin(x[:, :4]).astype(np.float32))


def _optimizer(params, dp, policy):
    return layerwise_muon(
        params,
        mesh_of(dp),
        learning_rate=0.05,
        muon=MUON,
        config=CONFIG,
        layout=LayoutConfig(policy=policy, bucket_size=300),
    )


_STEPS = {}


def _train(opt, params, state, batch, steps):
    key = id(opt)
    if key not in _STEPS:  # one compiled step per optimizer
        _STEPS[key] = (opt, make_train_step(_loss, opt, donate=False))
    step = _STEPS[key][1]
    for _ in range(steps):
        params, state, _ = step(params, state, batch)
    return params, state


def _assert_trees_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
    "src,dst,dtype",
    [(4, 2, jnp.float32), (2, 4, jnp.float32), (1, 8, jnp.bfloat16), (8, 1, jnp.float32)],
    ids=["4to2", "2to4", "1to8_bf16", "8to1"],
)
def test_restore_reshards_bit_identical_and_training_continues(tmp_path, src, dst, dtype):
    params, batch = _setup(dtype)
    a, b = _optimizer(params, src, "lpt"), _optimizer(params, dst, "size_matching")
    p, s = _train(a, params, a.init(params), batch, 2)
    saved = to_logical(a, s)
    checkpoint.save_logical(tmp_path / "ckpt", p, saved, a.plan.routes)
    p_b, s_b = checkpoint.restore(tmp_path / "ckpt", b)
    # Bit-identical logical state and parameters, now on b's mesh and layout.
    _assert_trees_equal(to_logical(b, s_b), saved)
    _assert_trees_equal(p_b, p)
    assert all(x.sharding.mesh == b.mesh for x in jax.tree.leaves((p_b, s_b)))
    # Continued training equals an uninterrupted run on b (bitwise) and on a (to rounding).
    resumed = _train(b, p_b, s_b, batch, 2)
    direct = _train(
        b, jax.device_put(p, NamedSharding(b.mesh, P())), from_logical(b, saved), batch, 2
    )
    _assert_trees_equal(resumed, direct)
    straight = _train(a, p, s, batch, 2)
    # Across dp sizes only the reduction order differs: fp32 rounding, or bf16 gradients' rounding.
    rtol, atol = (3e-2, 3e-3) if dtype == jnp.bfloat16 else (1e-5, 1e-6)
    for x, y in zip(jax.tree.leaves(resumed[0]), jax.tree.leaves(straight[0])):
        np.testing.assert_allclose(
            np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol, atol=atol
        )


def test_resume_at_same_dp_is_bitwise_identical_and_async_save_completes(tmp_path):
    params, batch = _setup()
    opt = _optimizer(params, 4, "ns_cost")
    p, s = _train(opt, params, opt.init(params), batch, 2)
    handle = checkpoint.save(tmp_path / "step2", p, s, opt, async_save=True)
    assert str(handle.wait()) == str((tmp_path / "step2").resolve())
    assert checkpoint.read_record(tmp_path / "step2")["step"] == 2
    resumed = _train(opt, *checkpoint.restore(tmp_path / "step2", opt), batch, 2)
    straight = _train(opt, p, s, batch, 2)
    _assert_trees_equal(resumed, straight)


def test_a_state_only_step_saves_gathered_params_and_resumes_bitwise_at_another_dp(tmp_path):
    """``overlap_param_gather``: the step keeps only the state. Saved with ``gather_params``,
    restored at dp 2, the restored state alone resumes training as the uninterrupted run at
    dp 2 does, and its parameters are the saved ones (bf16 parameters from fp32 masters)."""
    params, batch = _setup(jnp.bfloat16)
    a, b = _optimizer(params, 4, "ns_cost"), _optimizer(params, 2, "ns_cost")
    state_only = lwjax.TrainStepOptions(overlap_param_gather=True)
    step_a = make_train_step(_loss, a, donate=False, options=state_only)
    state = a.init(params)
    for _ in range(2):
        _, state, _ = step_a(None, state, batch)
    saved = a.gather_params(state)
    checkpoint.save(tmp_path / "ckpt", saved, state, a)
    restored_params, restored = checkpoint.restore(tmp_path / "ckpt", b)
    _assert_trees_equal(b.gather_params(restored), saved)
    _assert_trees_equal(restored_params, saved)
    step_b = make_train_step(_loss, b, donate=False, options=state_only)
    resumed, direct = restored, from_logical(b, to_logical(a, state))
    for _ in range(2):
        _, resumed, _ = step_b(None, resumed, batch)
        _, direct, _ = step_b(None, direct, batch)
    _assert_trees_equal(b.gather_params(resumed), b.gather_params(direct))
    _assert_trees_equal(to_logical(b, resumed), to_logical(b, direct))
    assert not np.array_equal(
        np.asarray(b.gather_params(resumed)["w1"], np.float32), np.asarray(saved["w1"], np.float32)
    )


_INTERRUPTED = textwrap.dedent("""
    import os, signal, sys
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, numpy as np
    from jax.sharding import Mesh
    from orbax.checkpoint._src.path import atomicity
    from lwjax import checkpoint
    from lwjax.optimizer import layerwise_muon

    async def killed(self):  # die after the data is written, before the commit rename
        os.kill(os.getpid(), signal.SIGKILL)

    atomicity.AtomicRenameTemporaryPath.finalize = killed
    params = {"w": np.ones((16, 8), np.float32), "b": np.zeros(8, np.float32)}
    opt = layerwise_muon(params, Mesh(np.array(jax.devices()[:1]), ("dp",)))
    checkpoint.save(sys.argv[1], params, opt.init(params), opt)
    print("save returned")
""")


def test_interrupted_save_never_restores_as_complete(tmp_path):
    path = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert "save returned" not in proc.stdout
    assert not path.exists()
    leftovers = list(tmp_path.glob("ckpt.orbax-checkpoint-tmp*"))
    assert leftovers, "the killed save should leave only orbax's temporary directory"
    params, _ = _setup()
    opt = _optimizer(params, 2, "lpt")
    with pytest.raises(ValueError, match="interrupted before it completed"):
        checkpoint.restore(path, opt)
    with pytest.raises(ValueError, match="unfinished save"):
        checkpoint.restore(leftovers[0], opt)


_UNINSTALLED = textwrap.dedent(
    """
    import importlib.metadata, sys

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    importlib.metadata.version = not_installed  # as from a source tree on PYTHONPATH alone
    import jax, numpy as np
    from jax.sharding import Mesh
    import lwjax
    from lwjax.checkpoint import read_record
    from lwjax.optimizer import layerwise_muon

    mesh = Mesh(np.array(jax.devices()[:1]), ("dp",))
    params = {"w": jax.numpy.ones((8, 8))}
    opt = layerwise_muon(params, mesh, learning_rate=0.1)
    lwjax.save(sys.argv[1], params, opt.init(params), opt)
    print(read_record(sys.argv[1])["lwjax_version"])
    """
)


def test_a_source_tree_never_installed_saves_with_an_unknown_version(tmp_path):
    """lwjax run from ``PYTHONPATH`` (as on a lent GPU machine) has no package metadata: the
    checkpoint records the version as ``lwjax.__version__`` does, instead of failing to save."""
    proc = subprocess.run(
        [sys.executable, "-c", _UNINSTALLED, str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["0+unknown"]


def _saved(tmp_path, dtype=jnp.float32):
    params, batch = _setup(dtype)
    opt = _optimizer(params, 2, "lpt")
    p, s = _train(opt, params, opt.init(params), batch, 1)
    checkpoint.save(tmp_path / "ckpt", p, s, opt)
    return tmp_path / "ckpt", params


def test_restore_lists_every_mismatch_with_the_target(tmp_path):
    path, params = _saved(tmp_path)
    rng = np.random.default_rng(1)
    other = {
        "w1": jnp.asarray(rng.standard_normal((8, 16)), jnp.float32),  # shape differs
        "w2": params["w2"].astype(jnp.bfloat16),  # dtype differs
        "w3": jnp.zeros((4, 4)),
    }  # not in the checkpoint; b1 is missing from the target
    with pytest.raises(ValueError) as err:
        checkpoint.restore(path, _optimizer(other, 2, "lpt"))
    message = str(err.value)
    for expected in (
        "missing: params/w3",
        "unexpected: params/b1",
        "missing: state/momenta/w3",
        "shape: params/w1: checkpoint (8, 32), target (8, 16)",
        "dtype: params/w2: checkpoint float32, target bfloat16",
    ):
        assert expected in message, message
    adam_only = layerwise_muon(
        params, mesh_of(2), routing=RoutingRules(tied=["w1"])
    )  # a tied leaf is never a Muon matrix
    with pytest.raises(
        ValueError, match="routing: w1 is Muon in the checkpoint but elementwise in the target"
    ):
        checkpoint.restore(path, adam_only)
    torch_layout = layerwise_muon(
        params, mesh_of(2), config=OptimizerConfig(matrix_convention="out_in")
    )
    with pytest.raises(
        ValueError, match="matrix_convention: the checkpoint's matrices are 'in_out'"
    ):
        checkpoint.restore(path, torch_layout)
    assert checkpoint.read_record(path)["matrix_convention"] == "in_out"


def _data_files(path: pathlib.Path):
    return sorted(f for f in (path / "arrays").rglob("*") if f.is_file() and f.parent.name == "d")


@pytest.mark.parametrize("damage", ["truncate", "flip", "record", "swapped_data"])
def test_damaged_checkpoint_raises_and_restores_nothing(tmp_path, damage):
    path, params = _saved(tmp_path)
    if damage == "swapped_data":  # readable arrays of the same shapes, but not the ones recorded
        opt = _optimizer(params, 2, "lpt")
        checkpoint.save(tmp_path / "other", params, opt.init(params), opt)
        shutil.rmtree(path / "arrays")
        shutil.copytree(tmp_path / "other" / "arrays", path / "arrays")
    elif damage == "record":
        for f in (path / "lwjax").rglob("*"):
            if f.is_file():
                f.unlink()
    else:
        for data in _data_files(
            path
        ):  # every tensorstore data file; the arrays live in some of them
            raw = bytearray(data.read_bytes())
            if damage == "truncate":
                data.write_bytes(bytes(raw[: len(raw) // 2]))
            else:
                for i in range(len(raw) // 2, min(len(raw), len(raw) // 2 + 8)):
                    raw[i] ^= 0x5A
                data.write_bytes(bytes(raw))
    expected = {
        "truncate": "unreadable",
        "flip": "unreadable",
        "record": "unreadable checkpoint record",
        "swapped_data": r"corrupted checkpoint: the data of \d+ array\(s\) does not match",
    }[damage]
    with pytest.raises(ValueError, match=expected):
        checkpoint.restore(path, _optimizer(params, 2, "lpt"))


def test_uncommitted_or_foreign_directories_are_refused(tmp_path):
    path, params = _saved(tmp_path)
    opt = _optimizer(params, 2, "lpt")
    meta = path / "_CHECKPOINT_METADATA"
    record = json.loads(meta.read_text())
    meta.write_text(json.dumps({**record, "commit_timestamp_nsecs": None}))
    with pytest.raises(ValueError, match="not a complete lwjax checkpoint"):
        checkpoint.restore(path, opt)
    with pytest.raises(ValueError, match="no such checkpoint"):
        checkpoint.restore(tmp_path / "absent", opt)
    with pytest.raises(ValueError, match="already exists"):
        checkpoint.save(path, params, opt.init(params), opt)


def test_fingerprints_agree_between_numpy_and_sharded_jax():
    """numpy, jax arrays split on any axis, and jax arrays in host memory (a save's logical
    state) give the same fingerprints; a changed bit or order changes them."""
    rng = np.random.default_rng(0)
    arrays = {
        "f32": rng.standard_normal((8, 6)).astype(np.float32),
        "i32": np.arange(5, dtype=np.int32),
        "scalar": np.asarray(3, np.int32),
        "f32_3d": rng.standard_normal((3, 4, 5)).astype(np.float32),
    }
    arrays["bf16"] = arrays["f32"].astype(jnp.bfloat16)

    def spec(v):
        if v.ndim == 3:
            return P(None, "dp")
        return P("dp") if v.ndim and v.shape[0] % 2 == 0 else P()

    sharded = {k: jax.device_put(v, NamedSharding(mesh_of(2), spec(v))) for k, v in arrays.items()}
    in_host = {
        k: jax.device_put(v, v.sharding.with_memory_kind("pinned_host")) for k, v in sharded.items()
    }
    assert checkpoint.fingerprints(arrays) == checkpoint.fingerprints(sharded)
    assert checkpoint.fingerprints(in_host) == checkpoint.fingerprints(sharded)
    flipped = dict(arrays, f32=arrays["f32"].copy())
    flipped["f32"][3, 2] = np.nextafter(flipped["f32"][3, 2], np.inf)
    assert checkpoint.fingerprints(flipped)["f32"] != checkpoint.fingerprints(arrays)["f32"]
    swapped = dict(arrays, i32=arrays["i32"][::-1].copy())
    assert checkpoint.fingerprints(swapped)["i32"] != checkpoint.fingerprints(arrays)["i32"]


def test_devices_without_host_memory_save_and_restore_with_a_warning(tmp_path, monkeypatch):
    """Where the devices have no 'pinned_host' memory the logical state stays on them: a
    warning says so, and the checkpoint round-trips."""
    p, _ = _setup()
    opt = _optimizer(p, 2, "lpt")
    s = opt.init(p)
    monkeypatch.setattr(checkpoint, "host_memory_kind", lambda optimizer: None)
    with pytest.warns(UserWarning, match="no 'pinned_host' memory"):
        checkpoint.save(tmp_path / "c", p, s, opt)
    with pytest.warns(UserWarning, match="no 'pinned_host' memory"):
        p_back, s_back = checkpoint.restore(tmp_path / "c", opt)
    _assert_trees_equal(to_logical(opt, s_back), to_logical(opt, s))
    _assert_trees_equal(p_back, p)


class _Crash(BaseException):
    """Stands in for the process dying (not an Exception, so nothing on the way catches it)."""


def _crash_at(monkeypatch, phase: str):
    """Make an overwrite die at one phase: writing the new checkpoint, either rename of the
    swap, or removing the old checkpoint afterwards."""
    real_write, real_remove = checkpoint._write, checkpoint_files.remove
    rename = type(epath.Path("/"))
    real_rename = rename.rename
    renames = []

    def write(path, *args):
        if phase == "write":  # a part-written new checkpoint, then death
            (path.parent / (path.name + checkpoint_files.TMP_SUFFIX)).mkdir(parents=True)
            raise _Crash
        return real_write(path, *args)

    def crash_rename(self, target):
        if checkpoint_files.TMP_SUFFIX not in self.name:  # the swap's, not orbax's own commit
            renames.append(target)
            if phase == f"rename{len(renames)}":
                raise _Crash
        return real_rename(self, target)

    def remove(path):
        if phase == "cleanup" and renames:
            raise _Crash
        return real_remove(path)

    monkeypatch.setattr(checkpoint, "_write", write)
    monkeypatch.setattr(rename, "rename", crash_rename)
    monkeypatch.setattr(checkpoint_files, "remove", remove)


@pytest.mark.parametrize("phase", ["write", "rename1", "rename2", "cleanup"])
def test_overwrite_killed_at_any_phase_leaves_a_complete_checkpoint(tmp_path, monkeypatch, phase):
    """Old or new, a complete checkpoint restores at the path; the next save tidies up."""
    params, batch = _setup()
    opt = _optimizer(params, 2, "lpt")
    path = tmp_path / "ckpt"
    p, s = _train(opt, params, opt.init(params), batch, 1)
    checkpoint.save(path, p, s, opt, step=1)
    p2, s2 = _train(opt, p, s, batch, 1)
    with monkeypatch.context() as patch:
        _crash_at(patch, phase)
        with pytest.raises(_Crash):
            checkpoint.save(path, p2, s2, opt, step=2, overwrite=True)
    step = checkpoint.read_record(path)["step"]
    assert step == (1 if phase in ("write", "rename1") else 2)
    restored, _ = checkpoint.restore(path, opt)
    want = p if step == 1 else p2
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    checkpoint.save(path, p2, s2, opt, step=3, overwrite=True)
    assert checkpoint.read_record(path)["step"] == 3
    assert sorted(x.name for x in tmp_path.iterdir()) == ["ckpt"]  # no leftovers


def test_a_damaged_record_field_is_named(tmp_path):
    """A bit flip that renames a JSON key gives a ValueError naming the entry, not a KeyError."""
    path, params = _saved(tmp_path)
    record_file = next((path / checkpoint_files.RECORD_ITEM).rglob("*"))
    while record_file.is_dir():
        record_file = next(record_file.iterdir())
    text = record_file.read_text()
    assert '"fingerprint"' in text
    record_file.write_text(text.replace('"fingerprint"', '"fingerprinT"', 1))
    with pytest.raises(ValueError, match=r"damaged checkpoint record: arrays\['params/"):
        checkpoint.restore(path, _optimizer(params, 2, "lpt"))


# The checkpoint manager, float64 numpy parameters, another optimizer's state, damaged arrays.


def _small(dp=2, **options):
    """Parameters of two routes (a Muon matrix, an AdamW bias) and an optimizer over them."""
    params = {"w": jnp.arange(128, dtype=jnp.float32).reshape(16, 8) / 128, "b": jnp.ones(8)}
    return params, layerwise_muon(params, mesh_of(dp), **options)


def _scaled(params, k):
    return jax.tree.map(lambda x: x * k, params)


def _entries(run) -> list[str]:
    """What a manager's directory holds besides its writer lock."""
    return sorted(p.name for p in run.iterdir() if p.name != LOCK_FILE)


def test_checkpoint_manager_keeps_the_last_n_and_restores_at_another_dp(tmp_path, monkeypatch):
    params, opt = _small(dp=2)
    state = opt.init(params)
    manager = lwjax.CheckpointManager(tmp_path / "run", max_to_keep=2)
    for step in (1, 2, 3):
        manager.save(step, _scaled(params, step), state, opt, metadata={"note": step})
    assert manager.all_steps() == [2, 3] and manager.latest_step() == 3
    assert _entries(tmp_path / "run") == ["2", "3"]
    # Each step directory is an ordinary lwjax checkpoint.
    assert checkpoint.read_record(manager.step_path(2))["metadata"] == {"note": 2}
    # Restore the latest at dp 4 and an older step at dp 1.
    p4, s4 = manager.restore(_small(dp=4)[1])
    _assert_trees_equal(p4, _scaled(params, 3))
    _assert_trees_equal(to_logical(_small(dp=4)[1], s4), to_logical(opt, state))
    p1, _ = manager.restore(_small(dp=1)[1], step=2)
    _assert_trees_equal(p1, _scaled(params, 2))
    # A half-written step is no step; a new manager on the directory clears it away (orbax
    # does so in the background, done before the manager's first save: checked below).
    (tmp_path / "run" / f"4{checkpoint_files.TMP_SUFFIX}-123").mkdir()
    assert manager.latest_step() == 3
    manager.close()  # one writer per directory
    with lwjax.CheckpointManager(tmp_path / "run", max_to_keep=2, async_save=True) as again:
        assert again.all_steps() == [2, 3]
        # While step 4 is written in the background it is not a step, and step 2 stays.
        real_commit, may_commit = atomicity.AtomicRenameTemporaryPath.finalize, threading.Event()

        async def held_commit(self, *args, **kwargs):
            may_commit.wait(60)
            return await real_commit(self, *args, **kwargs)

        monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", held_commit)
        again.save(4, _scaled(params, 4), state, opt)
        assert again.latest_step() == 3 and (tmp_path / "run" / "2").is_dir()
        _assert_trees_equal(again.restore(opt)[0], _scaled(params, 3))
        may_commit.set()
        again.wait_until_finished()
        assert again.all_steps() == [3, 4]
        assert _entries(tmp_path / "run") == ["3", "4"]
        _assert_trees_equal(again.restore(opt)[0], _scaled(params, 4))


_MANAGER_KILLED = textwrap.dedent("""
    import os, signal, sys
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, numpy as np
    from jax.sharding import Mesh
    from orbax.checkpoint._src.path import atomicity
    import lwjax

    params = {"w": np.ones((16, 8), np.float32), "b": np.zeros(8, np.float32)}
    opt = lwjax.layerwise_muon(params, Mesh(np.array(jax.devices()[:1]), ("dp",)))
    manager = lwjax.CheckpointManager(sys.argv[1], max_to_keep=1)
    manager.save(1, params, opt.init(params), opt)

    async def killed(self):  # die after step 2's data is written, before its commit rename
        os.kill(os.getpid(), signal.SIGKILL)

    atomicity.AtomicRenameTemporaryPath.finalize = killed
    manager.save(2, jax.tree.map(lambda x: x + 1, params), opt.init(params), opt)
    print("save returned")
""")


def test_checkpoint_manager_killed_mid_save_keeps_the_previous_latest(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", _MANAGER_KILLED, str(run)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    left = _entries(run)
    assert left[0] == "1" and len(left) == 2 and checkpoint_files.TMP_SUFFIX in left[1], left
    params, opt = _small(dp=2)
    manager = lwjax.CheckpointManager(run, max_to_keep=1)
    assert manager.all_steps() == [1]  # step 2 never committed; step 1 was not deleted for it
    restored, _ = manager.restore(opt)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.ones((16, 8), np.float32))
    manager.save(2, params, opt.init(params), opt)
    assert _entries(run) == ["2"]


def test_checkpoint_manager_bad_arguments_are_named(tmp_path):
    params, opt = _small(dp=1)
    state = opt.init(params)
    for options, error, message in (
        ({"max_to_keep": 0}, ValueError, "max_to_keep must be >= 1 or None; got 0"),
        ({"max_to_keep": "3"}, TypeError, "max_to_keep must be an int or None, but got str"),
        ({"step_prefix": "a/b"}, ValueError, "step_prefix must be a name without '/'"),
        ({"step_format_fixed_length": 0}, ValueError, "step_format_fixed_length must be >= 1"),
    ):
        with pytest.raises(error, match=message):
            lwjax.CheckpointManager(tmp_path / "run", **options)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        lwjax.CheckpointManager(tmp_path / "file")
    manager = lwjax.CheckpointManager(tmp_path / "run", step_prefix="step")
    with pytest.raises(ValueError, match="no complete checkpoint to restore"):
        manager.restore(opt)
    for step, error in ((-1, ValueError), (1.5, TypeError), (None, TypeError)):
        with pytest.raises(error, match="CheckpointManager.save: step must"):
            manager.save(step, params, state, opt)
    manager.save(5, params, state, opt)
    assert _entries(tmp_path / "run") == ["step_5"]
    with pytest.raises(ValueError, match="step 5 is not after the latest step 5"):
        manager.save(5, params, state, opt)
    with pytest.raises(
        ValueError, match=r"no complete checkpoint for step 4; complete steps: \[5\]"
    ):
        manager.restore(opt, step=4)
    reader = lwjax.CheckpointManager(tmp_path / "run", step_prefix="step", read_only=True)
    assert reader.latest_step() == 5
    with pytest.raises(ValueError, match="read_only"):
        reader.save(6, params, state, opt)


def test_float64_numpy_params_restore_into_the_same_optimizer(tmp_path):
    """With x64 off, jax holds float64 numpy parameters as float32 (init and the step cast
    them): the checkpoint stores and the restore expects what jax holds, for the numpy
    parameters as given and for the float32 ones a step returns."""
    assert not jax.config.jax_enable_x64
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((16, 8)), "b": np.zeros(8)}  # float64 numpy
    opt = layerwise_muon(params, mesh_of(2))
    state = opt.init(params)
    held = jax.tree.map(jnp.asarray, params)  # float32, as a step returns them
    for name, saved in (("numpy", params), ("jax", held)):
        checkpoint.save(tmp_path / name, saved, state, opt)
        restored, restored_state = checkpoint.restore(tmp_path / name, opt)
        _assert_trees_equal(restored, held)
        _assert_trees_equal(to_logical(opt, restored_state), to_logical(opt, state))
    assert checkpoint.read_record(tmp_path / "numpy")["arrays"]["params/w"]["dtype"] == "float32"


def test_a_state_of_another_elementwise_transform_is_refused(tmp_path):
    """Same array names and shapes, another transform: refused, naming both. Hyper-parameters
    (betas, learning rates, Muon's momentum) may change on resume."""
    params, opt = _small(dp=2)
    checkpoint.save(tmp_path / "adam", params, opt.init(params), opt)
    for transform, message in (
        (
            optax.scale_by_belief(),
            r"elementwise: the checkpoint's state is ScaleByAdamState\(count=\*, mu=\*, nu=\*\), "
            r"the target optimizer's ScaleByBeliefState\(count=\*, mu=\*, nu=\*\)",
        ),
        (
            optax.scale_by_adamax(),
            "elementwise: the checkpoint's state was made by scale_by_adam, the target "
            "optimizer uses scale_by_adamax",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            checkpoint.restore(tmp_path / "adam", _small(dp=2, elementwise=transform)[1])
    retuned = _small(dp=4, elementwise=optax.scale_by_adam(b1=0.8), muon=MuonConfig(momentum=0.5))
    checkpoint.restore(tmp_path / "adam", retuned[1])


def _complete_after_its_loop_closed():
    """What each late read does: a tensorstore future completes after the event loop that
    awaited it was closed (orbax closes it as soon as the first read fails)."""
    import tensorstore as ts

    promise, future = ts.Promise.new()

    async def wait():
        await future

    loop = asyncio.new_event_loop()
    loop.set_exception_handler(lambda *_: None)  # no "Task was destroyed" log for the test's task
    loop.run_until_complete(asyncio.sleep(0, loop.create_task(wait())))
    loop.close()
    promise.set_result(None)


def test_damaged_arrays_raise_one_error_naming_the_file_without_event_loop_noise(
    tmp_path, capfd, monkeypatch
):
    """Reads still in flight when the first one fails used to print a traceback each
    ("Event loop is closed", ~1,700 lines for a large checkpoint); other unraisable
    exceptions are still reported."""
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)  # print, as outside pytest
    rng = np.random.default_rng(0)
    params = {f"w{i}": rng.standard_normal((16, 8)).astype(np.float32) for i in range(24)}
    opt = layerwise_muon(params, mesh_of(1))
    checkpoint.save(tmp_path / "ckpt", params, opt.init(params), opt)
    for data in _data_files(tmp_path / "ckpt"):
        if data.parent.parent.name == "arrays":  # the arrays' index: every read fails
            raw = bytearray(data.read_bytes())
            raw[len(raw) // 2] ^= 0x5A
            data.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"array data in \S+/arrays/d/\w+ is unreadable") as err:
        checkpoint.restore(tmp_path / "ckpt", opt)
    assert "tensorstore_spec" not in str(err.value) and "\n" not in str(err.value)
    _complete_after_its_loop_closed()
    time.sleep(0.2)  # let the late reads finish

    class Unraisable:
        def __del__(self):
            raise RuntimeError("still reported")

    Unraisable()
    stderr = capfd.readouterr().err
    assert "Event loop is closed" not in stderr and len(stderr.splitlines()) < 20, stderr[-3000:]
    assert "still reported" in stderr
