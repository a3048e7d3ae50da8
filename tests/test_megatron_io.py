"""Reading Megatron files: the torch-free reader, its restricted unpickler, and
agreement with torch."""

import io
import json
import os
import pathlib
import pickle
import re
import shutil
import struct
import subprocess
import sys
import tomllib
import zipfile

import numpy as np
import pytest

from lwjax.megatron import allow_list
from lwjax.megatron.budget import DEFAULT_MAX_BYTES
from lwjax.megatron.dcp import load_dcp, read_dcp_index
from lwjax.megatron.errors import DamagedCheckpointError
from lwjax.megatron.export import save_torch_dist
from lwjax.megatron.pickle_io import load_torch_archive, load_torch_file
from lwjax.megatron.state import read_megatron
from lwjax.megatron.unpickler import loads

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "megatron"
NAMES = sorted(p.parent.name for p in FIXTURES.glob("*/latest_checkpointed_iteration.txt"))
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
        "ep2_muon",
        "legacy_adam",
        "legacy_muon",
        "muonL_tp2",
        "muonL_ws1",
        "muonL_ws2",
        "pp2_adam",
        "pp2_muon",
        "resume_adam",
        "resume_muon",
        "resume_muon_medium",
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
    if (d / "latest_checkpointed_iteration.txt").exists():
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


def test_the_megatron_extra_leaves_torch_out_and_a_missing_torch_names_the_cpu_wheel(
    monkeypatch, tmp_path
):
    """torch's default wheels bring gigabytes of CUDA libraries, so the ``megatron`` extra (what
    reading and safetensors need) leaves it out; the test extra keeps it for the torch paths,
    which without it say how to install the CPU wheel."""
    pyproject = tomllib.loads((FIXTURES.parents[2] / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    assert [d for d in extras["megatron"] if d.startswith("torch")] == []
    assert [d for d in extras["test"] if d.startswith("torch")]
    state = read_megatron(FIXTURES / "resume_muon")
    monkeypatch.setitem(sys.modules, "torch", None)  # any import of torch now fails
    cpu_wheel = re.escape("pip install torch --index-url https://download.pytorch.org/whl/cpu")
    with pytest.raises(ValueError, match=f"^writing torch_dist needs torch.*: {cpu_wheel}\\.$"):
        save_torch_dist(state, tmp_path / "out")
    with pytest.raises(ValueError, match=f"^reader='torch' needs torch.*{cpu_wheel}. Or read with"):
        read_megatron(FIXTURES / "resume_muon", reader="torch")


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
    assert isinstance(obj, allow_list.Opaque) and obj.args == (1,)
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


@pytest.mark.parametrize("content", ["[1, 2]", '"torch_dist"', "null"])
def test_a_metadata_json_of_another_shape_is_named(tmp_path, content):
    """Megatron's metadata.json is an object; anything else is named as such, not as the
    internal error it would make (``'list' object has no attribute 'get'``)."""
    shutil.copytree(FIXTURES / "muonL_ws1", tmp_path / "ckpt")
    (tmp_path / "ckpt" / "iter_0000002" / "metadata.json").write_text(content)
    kind = {"[": "list", '"': "str", "n": "NoneType"}[content[0]]
    with pytest.raises(
        DamagedCheckpointError, match=rf"metadata.json: a JSON {kind}, not an object such as"
    ):
        read_megatron(tmp_path / "ckpt")


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
    assert allow_list._path_string.__defaults__ is None


def test_expanded_tensor_views_are_refused_before_they_are_copied():
    """A 1024-element storage viewed with stride 0 as a [2**20, 1024] tensor would be copied
    out to 4 GiB; saved tensors never repeat elements, so the view is refused first."""
    storage = np.arange(1024, dtype=np.float32)
    with pytest.raises(pickle.UnpicklingError, match="repeats elements"):
        allow_list._rebuild_tensor(storage, 0, (1 << 20, 1024), (0, 1))
    with pytest.raises(pickle.UnpicklingError, match="repeats elements"):
        allow_list._rebuild_tensor(storage, 0, (1000, 2), (1, 1))
    np.testing.assert_array_equal(
        allow_list._rebuild_tensor(storage, 0, (32, 32), (32, 1)), storage.reshape(32, 32)
    )


# --------------------------------------------------------------------------- hostile sizes
# Each file below is small and asks the reader for gigabytes, a crash or hours of work. Each is
# refused with DamagedCheckpointError in well under a second, before the memory is allocated:
# the cases run in one child process whose address space is limited, and whose peak memory is
# checked per case.


class _Global:
    """Pickles as the global it names (a hostile file may name any of torch's classes)."""

    def __init__(self, qualified: str):
        self.qualified = qualified

    def __reduce__(self):
        return self.qualified  # a string: written as a global

    def __call__(self):  # pickle asks that what it writes as a callable be one
        raise NotImplementedError


class _Call:
    """Pickles as ``qualified(*args)``, then BUILD with ``state`` when given."""

    def __init__(self, qualified: str, *args, **state):
        self.func, self.args, self.state = _Global(qualified), args, state or None

    def __reduce__(self):
        return (self.func, self.args, self.state)


class _Storage:
    """A ``torch.save`` persistent id: storage ``key`` of ``numel`` float32 elements."""

    def __init__(self, key: str, numel: int):
        self.pid = ("storage", _Global("torch.FloatStorage"), key, "cpu", numel)


class _Writer(pickle._Pickler):
    def save_global(self, obj, name=None):
        module, _, attr = obj.qualified.rpartition(".")
        self.write(pickle.GLOBAL + f"{module}\n{attr}\n".encode())
        self.memoize(obj)

    def persistent_id(self, obj):
        return obj.pid if isinstance(obj, _Storage) else None


def _dumps(obj) -> bytes:
    buffer = io.BytesIO()
    _Writer(buffer, protocol=2).dump(obj)
    return buffer.getvalue()


def _tensor(storage: _Storage, size: tuple[int, ...]) -> _Call:
    stride = tuple(int(np.prod(size[i + 1 :])) for i in range(len(size)))
    return _Call("torch._utils._rebuild_tensor_v2", storage, 0, size, stride, False, {})


def _archive_of(payload, members: dict[str, bytes] | None = None, *, deflated_zeros=0) -> bytes:
    """A torch.save-style archive: data.pkl, byteorder and the members (``deflated_zeros``
    bytes of zeros deflated into data/0 instead)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("archive/data.pkl", _dumps(payload))
        z.writestr("archive/byteorder", "little")
        for name, data in (members or {}).items():
            z.writestr(f"archive/data/{name}", data)
        if deflated_zeros:
            info = zipfile.ZipInfo("archive/data/0")
            info.compress_type = zipfile.ZIP_DEFLATED
            with z.open(info, "w") as f:
                for _ in range(deflated_zeros >> 20):
                    f.write(bytes(1 << 20))
    return buffer.getvalue()


def _declare_size(archive: bytes, name: str, file_size: int) -> bytes:
    """Rewrite the uncompressed size that the central directory records for ``name``."""
    data = bytearray(archive)
    at = data.index(b"PK\x01\x02")
    while True:
        length = int.from_bytes(data[at + 28 : at + 30], "little")
        if data[at + 46 : at + 46 + length] == name.encode():
            data[at + 24 : at + 28] = file_size.to_bytes(4, "little")
            return bytes(data)
        at = data.index(b"PK\x01\x02", at + 4)


def _dcp_dir(directory: pathlib.Path, shape, chunks, file_size: int) -> pathlib.Path:
    """A DCP directory whose .metadata gives tensor "w" (float32) ``shape`` and ``chunks``
    ``[(offsets, sizes, byte start, byte length)]`` in a ``file_size``-byte __0_0.distcp."""
    dcp = "torch.distributed.checkpoint."
    key = "w"
    entry = _Call(
        dcp + "metadata.TensorStorageMetadata",
        properties=_Call(dcp + "metadata.TensorProperties", dtype=_Global("torch.float32")),
        size=tuple(shape),
        chunks=[
            _Call(dcp + "metadata.ChunkStorageMetadata", offsets=o, sizes=s)
            for o, s, _, _ in chunks
        ],
    )
    storage = {
        _Call(dcp + "metadata.MetadataIndex", fqn=key, offset=o, index=0): _Call(
            dcp + "filesystem._StorageInfo", relative_path="__0_0.distcp", offset=b, length=n
        )
        for o, _, b, n in chunks
    }
    meta = _Call(dcp + "metadata.Metadata", state_dict_metadata={key: entry}, storage_data=storage)
    directory.mkdir()
    (directory / ".metadata").write_bytes(_dumps(meta))
    (directory / "__0_0.distcp").write_bytes(bytes(file_size))
    return directory


def _overlapping_chunks_dir(directory: pathlib.Path, n: int) -> pathlib.Path:
    """A DCP directory whose .metadata gives tensor "w" ``n`` chunks that overlap (chunk i holds
    elements i and i + 1), each its own 8 bytes of an 8n-byte __0_0.distcp. The pickle is
    written opcode by opcode, from per-chunk templates (pickling n records takes minutes)."""
    dcp = "torch.distributed.checkpoint."
    names = ["metadata.Metadata", "metadata.TensorStorageMetadata", "metadata.TensorProperties"]
    names += ["metadata.ChunkStorageMetadata", "metadata.MetadataIndex", "filesystem._StorageInfo"]
    memo = b"".join(  # GLOBAL, BINPUT k, POP
        f"c{(dcp + name).rpartition('.')[0]}\n{name.rpartition('.')[2]}\nq".encode()
        + bytes([k])
        + b"0"
        for k, name in enumerate(names)
    )
    pack = struct.Struct("<i").pack
    mark, mark8 = pack(0x5EED5EED), pack(0x5EED5EEE)  # stand for i and 8 * i in the templates

    def text(value: str) -> bytes:
        return b"X" + struct.pack("<I", len(value)) + value.encode()

    def record(k: int, **fields: bytes) -> bytes:  # memo k called with (), then BUILD
        return (
            b"h" + bytes([k]) + b")R}(" + b"".join(text(f) + v for f, v in fields.items()) + b"ub"
        )

    chunk = record(3, offsets=b"(J" + mark + b"t", sizes=b"(K\x02t").split(mark)
    index, info = (
        record(4, fqn=text("w"), offset=b"(J" + mark + b"t", index=b"K\x00")
        + record(5, relative_path=text("__0_0.distcp"), offset=b"J" + mark8, length=b"K\x08")
    ).split(mark)
    info = info.split(mark8)
    chunks = b"".join(chunk[0] + pack(i) + chunk[1] for i in range(n))
    storage = b"".join(index + pack(i) + info[0] + pack(8 * i) + info[1] for i in range(n))
    entry = record(
        1,
        properties=record(2, dtype=b"ctorch\nfloat32\n"),
        size=b"(J" + pack(n + 1) + b"t",
        chunks=b"](" + chunks + b"e",
    )
    meta = record(0, state_dict_metadata=b"}(" + text("w") + entry + b"u", storage_data=b"}(")
    meta = meta[:-2] + storage + b"u" + meta[-2:]  # the storage dict's items, before its SETITEMS
    directory.mkdir()
    (directory / ".metadata").write_bytes(b"\x80\x02" + memo + meta + b".")
    (directory / "__0_0.distcp").write_bytes(bytes(8 * n))
    return directory


def _shared_tuples(levels: int) -> bytes:
    """t = (t, t), ``levels`` times: a few bytes, 2**levels entries written out as a tree."""
    return b"\x80\x02)" + b"2\x86" * levels + b"."


def _hostile_cases(tmp: pathlib.Path) -> dict[str, tuple[str, str, str]]:
    """``case -> (reader, path, expected message)``."""
    cases = {
        "bytearray_4gib": (
            "loads",
            b"\x80\x02cbuiltins\nbytearray\n\x8a\x05\x00\x00\x00\x00\x01\x85R.",
            r"bytearray\(4294967296\) needs 4294967296 bytes, beyond the byte budget",
        ),
        "list_of_range_1e8": (
            "loads",
            b"\x80\x02cbuiltins\nlist\ncbuiltins\nrange\nJ\x00\xe1\xf5\x05\x85R\x85R.",
            r"list\(\) of 100000000 elements needs",
        ),
        "binbytes8_1tib": (
            "loads",
            b"\x80\x04\x8e" + (1 << 40).to_bytes(8, "little") + b"x.",
            r"opcode BINBYTES8 declares 1099511627776 bytes; only 2 are left",
        ),
        "bytearray8_1tib": (
            "loads",
            b"\x80\x05\x96" + (1 << 40).to_bytes(8, "little") + b"x.",
            r"opcode BYTEARRAY8 declares 1099511627776 bytes",
        ),
        "nested_lists": (
            "loads",
            b"\x80\x02" + b"]" * 100_000 + b"a" * 99_999 + b".",
            r"a list nests over 100 deep",
        ),
        "nested_tuple_as_key": (  # hashing it overflowed the C stack: a segfault
            "loads",
            b"\x80\x02})" + b"\x85" * 300_000 + b"Ns.",
            r"a dict key: a tuple nests over 100 deep",
        ),
        "shared_tuples": (  # any walk over it (repr, state.py's search) would never end
            "loads",
            _shared_tuples(64),
            r"a tuple holds \d+ entries \(written out as a tree\); the limit is",
        ),
        "codec_doubling": (  # _codecs.encode(..., 'hex') 40 times doubles 4 bytes to 4 TiB
            "loads",
            b"\x80\x03c_codecs\nencode\nq\x00"
            + b"h\x00" * 40
            + b"C\x04abcd"
            + b"X\x03\x00\x00\x00hex\x86R" * 40
            + b".",
            r"_codecs.encode is allowed only as \(str, 'latin1'\)",
        ),
        "storage_beyond_its_member": (
            "archive",
            _archive_of(_tensor(_Storage("0", 1 << 30), (1 << 30,)), {"0": bytes(16)}),
            r"storage 0: declares 4294967296 bytes; archive member archive/data/0 holds 16",
        ),
        "deflated_past_its_size": (  # a zip bomb: 128 MiB inflated from a member that says 16
            "archive",
            _declare_size(
                _archive_of(_tensor(_Storage("0", 4), (4,)), deflated_zeros=128 << 20),
                "archive/data/0",
                16,
            ),
            r"archive/data/0 inflates past the 16 bytes its header declares",
        ),
        "deflated_declared_4gib": (
            "archive",
            _declare_size(
                _archive_of(
                    _tensor(_Storage("0", (1 << 30) - 1), ((1 << 30) - 1,)), deflated_zeros=1 << 20
                ),  # fmt: skip
                "archive/data/0",
                (1 << 32) - 4,
            ),
            r"deflated member archive/data/0 needs 4294967292 bytes, beyond the byte budget",
        ),
        "dcp_tensor_beyond_its_bytes": (
            "dcp",
            _dcp_dir(tmp / "huge", (1 << 40,), [((0,), (1 << 40,), 0, 100)], 100),
            r"needs more than its 100 bytes",
        ),
        "dcp_ranges_overlap": (
            "dcp",
            _dcp_dir(
                tmp / "overlap", (2, 4), [((0, 0), (1, 4), 0, 64), ((1, 0), (1, 4), 0, 64)], 64
            ),
            r"overlap those of w",
        ),
        "dcp_200k_overlapping_chunks": (  # parsed whole, it took 70 s and 660 MiB
            "dcp",
            _overlapping_chunks_dir(tmp / "many", 200_000),
            r"33000500 bytes of DCP metadata, more than the 1600000 bytes of the files beside it",
        ),
        "empty_tensor_of_2e40_layers": (  # state.py walks layers: 2**22 of them took 15 s
            "archive",
            _archive_of(_tensor(_Storage("0", 0), (1 << 40, 0, 64)), {"0": b""}),
            r"tensor of size \(1099511627776, 0, 64\) needs 281474976710656 bytes",
        ),
        "dcp_empty_tensor_of_2e40_layers": (
            "dcp",
            _dcp_dir(tmp / "empty", (1 << 40, 0, 64), [], 0),
            r"an empty tensor of shape \(1099511627776, 0, 64\) needs 281474976710656 bytes",
        ),
        "tensors_overlapping_a_storage": (  # last: it may use the budget before it is refused
            "archive",
            _archive_of(
                [_tensor(s, (1 << 18,)) for s in [_Storage("0", 1 << 18)] * 1024],
                {"0": bytes(4 << 18)},
            ),
            r"tensor of size \(262144,\) needs 1048576 bytes, beyond the byte budget",
        ),
    }
    out = {}
    for name, (reader, payload, match) in cases.items():
        if isinstance(payload, bytes):
            path = tmp / f"{name}.bin"
            path.write_bytes(payload)
            payload = path
        out[name] = (reader, str(payload), match)
    return out


_HOSTILE_CHILD = r"""
import json, pathlib, resource, sys, time
from lwjax.megatron.dcp import load_dcp
from lwjax.megatron.errors import DamagedCheckpointError
from lwjax.megatron.pickle_io import load_torch_archive
from lwjax.megatron.unpickler import loads
cases = json.loads(sys.argv[1])
size = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) << 10
resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), size + (1 << 30)))
readers = {
    "loads": lambda p: loads(pathlib.Path(p).read_bytes(), where=p),
    "archive": lambda p: load_torch_archive(pathlib.Path(p).read_bytes(), where="archive"),
    "dcp": load_dcp,
}
out = {}
for name, (reader, path, _) in cases.items():
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    try:
        readers[reader](path)
        kind, message = "nothing", ""
    except BaseException as err:
        kind, message = type(err).__name__, str(err)[:400]
    seconds = time.perf_counter() - start
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) << 10
    out[name] = [kind, message, seconds, grown]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def hostile_results(tmp_path_factory):
    cases = _hostile_cases(tmp_path_factory.mktemp("hostile"))
    proc = subprocess.run(
        [sys.executable, "-c", _HOSTILE_CHILD, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"the reader crashed ({proc.returncode}): {proc.stderr[-2000:]}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    return {name: (*results[name], cases[name][2]) for name in cases}


@pytest.mark.parametrize(
    "case",
    [
        "bytearray_4gib",
        "list_of_range_1e8",
        "binbytes8_1tib",
        "bytearray8_1tib",
        "nested_lists",
        "nested_tuple_as_key",
        "shared_tuples",
        "codec_doubling",
        "storage_beyond_its_member",
        "deflated_past_its_size",
        "deflated_declared_4gib",
        "dcp_tensor_beyond_its_bytes",
        "dcp_ranges_overlap",
        "dcp_200k_overlapping_chunks",
        "empty_tensor_of_2e40_layers",
        "dcp_empty_tensor_of_2e40_layers",
        "tensors_overlapping_a_storage",
    ],
)
def test_hostile_sizes_are_refused_before_allocating(hostile_results, case):
    kind, message, seconds, grown, match = hostile_results[case]
    assert kind == "DamagedCheckpointError", (kind, message)
    assert re.search(match, message), message
    # A bound on hanging, not a speed target: the refusal takes milliseconds (the overlapping
    # case reads up to the byte budget), an old reader ran for minutes; a busy CI machine
    # took 1.15 s for the slowest case once.
    assert seconds < 10.0, seconds
    budget = DEFAULT_MAX_BYTES + (8 << 20)
    assert grown < (budget if case == "tensors_overlapping_a_storage" else 32 << 20), grown


def test_real_checkpoints_need_no_budget_beyond_their_bytes(tmp_path):
    """Tensors and storages are bounded by the file's size, not by max_bytes: every fixture
    reads with a budget of 0; a hostile file is refused naming the budget read_megatron got."""
    for name in NAMES:
        state = read_megatron(FIXTURES / name, max_bytes=0)
        assert state.model and state.masters
    shutil.copytree(FIXTURES / "legacy_muon", tmp_path / "ckpt")
    (main,) = (tmp_path / "ckpt").glob("iter_*/mp_rank_00/model_optim_rng.pt")
    main.write_bytes(_archive_of(_Call("builtins.bytearray", 8 << 20)))
    with pytest.raises(DamagedCheckpointError, match=r"model_optim_rng.pt: .*max_bytes=1048576"):
        read_megatron(tmp_path / "ckpt", max_bytes=1 << 20)
    assert len(loads(_dumps(_Call("builtins.bytearray", 8 << 20)), where="x")) == 8 << 20
    with pytest.raises(ValueError, match="max_bytes must be a non-negative int"):
        read_megatron(FIXTURES / "legacy_muon", max_bytes=-1)


def test_build_on_a_class_or_function_is_refused():
    for target in ("argparse.Namespace", "torch._utils._rebuild_tensor_v2"):
        module, _, name = target.rpartition(".")
        hostile = f"c{module}\n{name}\n}}(X\x01\x00\x00\x00aK\x01ub.".encode()
        with pytest.raises(DamagedCheckpointError, match="BUILD on .* is not allowed"):
            loads(hostile, where="hostile")


def test_a_huge_tensor_parallel_size_in_the_args_is_refused_without_allocating(monkeypatch):
    """``tensor_model_parallel_size`` comes from the file; the flat-buffer check must not
    build ``range`` of it."""
    import lwjax.megatron.read_torch_dist as torch_dist_lib

    real = torch_dist_lib.load_dcp

    def load_with_huge_tp(directory, **kwargs):
        raw = real(directory, **kwargs)
        for key, value in raw.items():
            if key.startswith("common_state/"):
                vars(value["args"])["tensor_model_parallel_size"] = 10**12
        return raw

    monkeypatch.setattr(torch_dist_lib, "load_dcp", load_with_huge_tp)
    with pytest.raises(DamagedCheckpointError, match="expected one per tensor-parallel"):
        read_megatron(FIXTURES / "adam_ws1")
