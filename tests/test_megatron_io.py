"""Reading Megatron files: the torch-free reader, its restricted unpickler, and
agreement with torch."""

import io
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from lwjax.megatron import pickle_io
from lwjax.megatron.dcp import load_dcp, read_dcp_index
from lwjax.megatron.pickle_io import load_torch_archive, load_torch_file, loads
from lwjax.megatron.state import read_megatron

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "megatron"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
DCP_DIRS = sorted(d for d in FIXTURES.glob("*/iter_*") if (d / ".metadata").exists())
LEGACY_FILES = sorted(FIXTURES.glob("legacy_*/iter_0000002/mp_rank_00/*.pt"))


def assert_same(a, b, where="root"):
    """Recursive equality: arrays by dtype, shape and bytes; objects by attributes."""
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), where
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert a.tobytes() == b.tobytes(), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert type(a).__name__ == type(b).__name__, where
        assert_same(vars(a), vars(b), where)
    else:
        assert type(a) is type(b) and a == b, (where, a, b)


def test_fixtures_are_all_present():
    assert NAMES == [
        "adam_ws1",
        "adam_ws1_fully_reshardable",
        "adam_ws2",
        "legacy_adam",
        "legacy_muon",
        "muonL_tp2",
        "muonL_ws1",
        "muonL_ws2",
        "resume_adam",
        "resume_muon",
        "tied_adam_ws1",
        "tied_adam_ws1_fully_reshardable",
        "tied_adam_ws2",
        "tied_adam_ws2_fully_reshardable",
        "tied_muonL_ws1",
        "tied_muonL_ws1_fully_reshardable",
        "tied_muonL_ws2",
        "tied_muonL_ws2_fully_reshardable",
    ]


def test_dcp_index_merges_chunks_from_every_rank_file():
    index = read_dcp_index(FIXTURES / "muonL_tp2" / "iter_0000002")
    fc1 = index.tensors["decoder.layers.mlp.linear_fc1.weight"]
    assert (fc1.dtype, fc1.shape) == ("bfloat16", (2, 256, 64))
    assert {c.file for c in fc1.chunks} == {"__0_0.distcp", "__1_0.distcp"}
    assert len(fc1.chunks) == 8  # 2 layers x TP 2 x [gate; up]
    assert "common_state/shard_0_1" in index.objects
    data = load_dcp(
        index.directory, keys=["decoder.layers.mlp.linear_fc1.weight", "common_state/shard_0_1"]
    )
    assert data["decoder.layers.mlp.linear_fc1.weight"].shape == (2, 256, 64)
    assert data["common_state/shard_0_1"]["iteration"] == 2
    assert vars(data["common_state/shard_0_1"]["args"])["num_query_groups"] == 2


_NO_TORCH = """
import sys
sys.modules["torch"] = sys.modules["jax"] = None  # any import of torch or jax now fails
from lwjax.megatron import read_megatron
import pathlib
for d in sorted(pathlib.Path(sys.argv[1]).iterdir()):
    if d.is_dir():
        state = read_megatron(d)
        assert state.model and state.masters, d
print("read", "torch" in sys.modules and sys.modules["torch"] is None)
"""


def test_numpy_reader_reads_every_fixture_without_torch_or_jax():
    proc = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, str(FIXTURES)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "read True"


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def _torch_style_archive(payload: bytes, name="archive") -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr(f"{name}/data.pkl", payload)
        z.writestr(f"{name}/byteorder", "little")
    return buffer.getvalue()


def test_restricted_unpickler_refuses_code_and_keeps_unknown_megatron_classes_inert():
    evil = pickle.dumps(_Evil())
    with pytest.raises(
        ValueError,
        match=r"refusing to unpickle global posix\.system|refusing to unpickle global os",
    ):
        loads(evil, where="evil.pkl")
    with pytest.raises(ValueError, match="evil.pt: cannot unpickle: .*refusing"):
        load_torch_archive(_torch_style_archive(evil), where="evil.pt")
    for module, name in (("builtins", "eval"), ("subprocess", "Popen"), ("functools", "partial")):
        with pytest.raises(ValueError, match=f"refusing to unpickle global {module}.{name}"):
            loads(f"c{module}\n{name}\n(tR.".encode(), where="x")
    # An enum of Megatron's args becomes an inert placeholder that records its value.
    obj = loads(b"cmegatron.core.enums\nModelType\n(K\x01tR.", where="args")
    assert isinstance(obj, pickle_io.Opaque) and obj.args == (1,)
    assert obj.global_name == "megatron.core.enums.ModelType"


def test_damaged_files_name_the_file_and_key(tmp_path):
    src = FIXTURES / "muonL_ws2" / "iter_0000002"
    broken = tmp_path / "iter_0000002"
    shutil.copytree(src, broken)
    rank1 = broken / "__1_0.distcp"
    rank1.write_bytes(rank1.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"__1_0\.distcp: .*truncated; expected \d+ bytes"):
        load_dcp(broken)
    rank1.unlink()
    with pytest.raises(ValueError, match=r"__1_0\.distcp: .*cannot open"):
        load_dcp(broken)
    shutil.copy(src / "__1_0.distcp", rank1)
    data = bytearray(rank1.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside some chunk's raw bytes: the zip CRC catches it
    rank1.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"__1_0\.distcp: .*(CRC|damaged|cannot unpickle)"):
        load_dcp(broken)
    (broken / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(ValueError, match=r"\.metadata: cannot unpickle"):
        load_dcp(broken)
    legacy = tmp_path / "model_optim_rng.pt"
    legacy.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="model_optim_rng.pt: not a torch.save zip archive"):
        load_torch_file(legacy)


def test_checkpoint_locations_and_errors(tmp_path):
    assert read_megatron(FIXTURES / "muonL_ws1" / "iter_0000002").iteration == 2
    assert read_megatron(FIXTURES / "muonL_ws1", iteration=2).iteration == 2
    with pytest.raises(
        ValueError, match=r"no iteration 7 \(iter_0000007\); found \['iter_0000002'\]"
    ):
        read_megatron(FIXTURES / "muonL_ws1", iteration=7)
    with pytest.raises(ValueError, match="not a Megatron checkpoint"):
        read_megatron(tmp_path)
    with pytest.raises(ValueError, match="reader must be one of"):
        read_megatron(FIXTURES / "muonL_ws1", reader="pickle")


# --------------------------------------------------------------------------- with torch


def test_torch_and_numpy_readers_agree_bit_for_bit():
    pytest.importorskip("torch")
    from lwjax.megatron.dcp import load_dcp_torch, torch_load

    for directory in DCP_DIRS:
        assert_same(load_dcp(directory), load_dcp_torch(directory), str(directory))
    for path in LEGACY_FILES:
        assert_same(load_torch_file(path), torch_load(str(path), where=str(path)), str(path))
    for name in NAMES:
        a, b = read_megatron(FIXTURES / name), read_megatron(FIXTURES / name, reader="torch")
        for kind in ("model", "masters", "momentum", "exp_avg", "exp_avg_sq", "hyperparameters"):
            assert_same(getattr(a, kind), getattr(b, kind), f"{name}.{kind}")
        assert (a.iteration, a.adam_step) == (b.iteration, b.adam_step)


@pytest.mark.parametrize(
    "fixture, damage, match",
    [
        (
            "legacy_muon",
            "empty",
            "layer_wise_optimizer_0.pt: no optimizer state.*layer_wise_optimizer",
        ),
        ("legacy_adam", "missing", "distrib_optim.pt: no optimizer state.*param groups"),
    ],
    ids=["empty_layer_wise_file", "missing_distrib_optim"],
)
def test_lost_optimizer_state_is_an_error_unless_weights_only(tmp_path, fixture, damage, match):
    """A legacy checkpoint saved with an optimizer whose state file is gone or empty does not
    convert silently to fresh state; --weights-only says that is what is wanted."""
    import torch  # the test extra has it; the readers under test do not use it

    shutil.copytree(FIXTURES / fixture, tmp_path / fixture)
    (rank_dir,) = (tmp_path / fixture).glob("iter_*/mp_rank_00")
    if damage == "empty":
        torch.save({}, rank_dir / "layer_wise_optimizer_0.pt")
    else:
        (rank_dir / "distrib_optim.pt").unlink()
    with pytest.raises(ValueError, match=match):
        read_megatron(tmp_path / fixture)
    state = read_megatron(tmp_path / fixture, weights_only=True)
    assert state.model and not state.masters and not state.exp_avg
    whole = read_megatron(FIXTURES / fixture)
    for key, weight in whole.model.items():
        np.testing.assert_array_equal(state.model[key], weight)


@pytest.mark.parametrize("trap", ["fifo", "dev_zero", "outside"])
def test_storage_files_must_be_regular_files_inside_the_checkpoint(tmp_path, trap):
    """A FIFO would hang the reader and /dev/zero never end; a symlink may not leave the
    checkpoint directory. Each is refused by name before it is opened."""
    shutil.copytree(FIXTURES / "muonL_ws1", tmp_path / "ckpt")
    (iteration,) = (tmp_path / "ckpt").glob("iter_*")
    storage = sorted(iteration.glob("*.distcp"))[0]
    storage.unlink()
    if trap == "fifo":
        os.mkfifo(storage)
        match = "not a regular file"
    elif trap == "dev_zero":
        storage.symlink_to("/dev/zero")
        match = "a symlink out of the checkpoint directory"
    else:
        outside = tmp_path / "elsewhere.distcp"
        shutil.copy(sorted((FIXTURES / "muonL_ws1").glob("iter_*/*.distcp"))[0], outside)
        storage.symlink_to(outside)
        match = "a symlink out of the checkpoint directory"
    with pytest.raises(ValueError, match=f"{storage.name}: .*{match}"):
        read_megatron(tmp_path / "ckpt")


def test_a_bad_iteration_tracker_is_named(tmp_path):
    shutil.copytree(FIXTURES / "muonL_ws1", tmp_path / "ckpt")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("abc\n")
    with pytest.raises(
        ValueError, match="latest_checkpointed_iteration.txt: expected an iteration"
    ):
        read_megatron(tmp_path / "ckpt")


def test_torch_reader_refuses_a_metadata_file_that_would_run_code(tmp_path):
    """torch's DCP reader unpickles .metadata with plain pickle; lwjax's restricted unpickler
    reads it first, so a payload never reaches torch."""
    shutil.copytree(FIXTURES / "muonL_ws1", tmp_path / "ckpt")
    (iteration,) = (tmp_path / "ckpt").glob("iter_*")
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (iteration / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(ValueError, match=r"\.metadata"):
        read_megatron(tmp_path / "ckpt", reader="torch")
    assert not marker.exists()


def test_a_pickle_cannot_change_an_allowed_class_or_function_for_the_process():
    """BUILD on the allow-listed argparse.Namespace (or a rebuild function) sets attributes
    on a copy private to that load, not on the class the rest of the process uses."""
    import argparse

    hostile = (
        b"\x80\x02cargparse\nNamespace\n"  # the class object itself
        b"(N}q\x00X\x08\x00\x00\x00__init__q\x01cbuiltins\nint\nq\x02stq\x03b"  # BUILD slots
        b"cpathlib\nPosixPath\n(N}X\x0c\x00\x00\x00__defaults__(X\x01\x00\x00\x00xtstb"
        b"0."
    )
    try:
        loads(hostile, where="hostile")
    except ValueError:
        pass  # refusing it outright is fine too; what matters is the process is unchanged
    assert argparse.Namespace.__init__ is not int
    assert argparse.ArgumentParser().parse_args([]) == argparse.Namespace()
    assert pickle_io._path_string.__defaults__ is None


def test_expanded_tensor_views_are_refused_before_they_are_copied():
    """A 1024-element storage viewed with stride 0 as a [2**20, 1024] tensor would be copied
    out to 4 GiB; saved tensors never repeat elements, so the view is refused first."""
    storage = np.arange(1024, dtype=np.float32)
    with pytest.raises(pickle.UnpicklingError, match="repeats elements"):
        pickle_io._rebuild_tensor(storage, 0, (1 << 20, 1024), (0, 1))
    with pytest.raises(pickle.UnpicklingError, match="repeats elements"):
        pickle_io._rebuild_tensor(storage, 0, (1000, 2), (1, 1))
    np.testing.assert_array_equal(
        pickle_io._rebuild_tensor(storage, 0, (32, 32), (32, 1)), storage.reshape(32, 32)
    )
