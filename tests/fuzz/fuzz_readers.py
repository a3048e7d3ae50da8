"""Coverage-guided fuzzing (atheris) of the torch-free Megatron readers; see README.md.

    python tests/fuzz/fuzz_readers.py TARGET [libFuzzer flags] [corpus dir]

Targets, each seeded with the real fixtures in tests/fixtures/megatron/:

* ``torch_file``: the bytes are a ``torch.save`` file, read by ``load_torch_file``;
* ``torch_pickle``: the bytes are the ``data.pkl`` of a real archive (first byte: which
  one), zipped with that archive's storages (mutating a zipped pickle only breaks its CRC);
* ``dcp``: the bytes are a DCP ``.metadata`` (first byte: which fixture's ``.distcp``
  files lie beside it), read by ``load_dcp``;
* ``read_megatron``: the bytes replace a ``.metadata`` or a legacy file's ``data.pkl`` in a
  copy of a fixture (first byte: which), read whole by ``read_megatron``.

Only ``DamagedCheckpointError`` may escape a reader; any other exception is a finding.
By default a finding stops the run (libFuzzer keeps the input as ``crash-*``); with
``LWJAX_FUZZ_FINDINGS=DIR`` each new exception kind is written to DIR and the run goes on.

Imported rather than run (``tests/test_fuzz_readers.py`` does, as a smoke test of every
target), it needs no atheris: :func:`seeds` and :func:`one_input` drive the targets directly.
"""

import atexit
import contextlib
import hashlib
import io
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time

if __name__ == "__main__":
    import atheris

    # Instrumented for coverage: our readers, and the pure-Python pickle and zipfile they run.
    _instrumented = atheris.instrument_imports(include=["lwjax.megatron", "pickle", "zipfile"])
else:
    _instrumented = contextlib.nullcontext()
with _instrumented:
    from lwjax.megatron.dcp import load_dcp, read_dcp_index
    from lwjax.megatron.errors import DamagedCheckpointError
    from lwjax.megatron.pickle_io import load_torch_archive, load_torch_file
    from lwjax.megatron.state import read_megatron
import zipfile  # noqa: E402 (after the block: the instrumented module)

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "megatron"
MAX_LEN = 100_000
DCP_FIXTURES = ("muonL_ws1", "adam_ws2", "muonL_tp2", "tied_adam_ws1_fully_reshardable")
LEGACY_FILES = (
    "legacy_muon/iter_0000002/mp_rank_00/model_optim_rng.pt",
    "legacy_muon/iter_0000002/mp_rank_00/layer_wise_optimizer_0.pt",
    "legacy_adam/iter_0000002/mp_rank_00/model_optim_rng.pt",
    "legacy_adam/iter_0000002/mp_rank_00/distrib_optim.pt",
)
WORK = pathlib.Path(tempfile.mkdtemp(prefix="lwjax-fuzz-"))
atexit.register(shutil.rmtree, WORK, ignore_errors=True)  # libFuzzer's exit skips it


def _iteration(name: str) -> pathlib.Path | None:
    """The fixture's iteration directory; ``None`` for fixtures without one (``tp2_*``)."""
    return next((FIXTURES / name).glob("iter_*"), None)


def _split(archive: bytes) -> tuple[str, bytes, dict[str, bytes]]:
    """A torch.save archive's prefix, data.pkl and other members."""
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        names = z.namelist()
        pkl = next(n for n in names if n.endswith("/data.pkl"))
        prefix = pkl[: -len("data.pkl")]
        return prefix, z.read(pkl), {n: z.read(n) for n in names if n != pkl}


def _join(prefix: str, pkl: bytes, members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr(f"{prefix}data.pkl", pkl)
        for name, data in members.items():
            z.writestr(name, data)
    return buffer.getvalue()


def _chunk_archives() -> list[bytes]:
    """Every distinct torch.save archive inside the DCP fixtures' .distcp files."""
    seen, out = set(), []
    for name in sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()):
        directory = _iteration(name)
        if directory is None or not (directory / ".metadata").exists():
            continue
        index = read_dcp_index(directory)
        spans = list(index.objects.values())
        spans += [(c.file, c.start, c.length) for e in index.tensors.values() for c in e.chunks]
        for file, start, length in spans:
            data = (directory / file).read_bytes()[start : start + length]
            digest = hashlib.sha1(data).digest()
            if digest not in seen and len(data) <= MAX_LEN:
                seen.add(digest)
                out.append(data)
    return out


# Archives whose data.pkl the torch_pickle and read_megatron targets replace.
TEMPLATES = [_split((FIXTURES / rel).read_bytes()) for rel in LEGACY_FILES]
TEMPLATES += [_split(data) for data in _chunk_archives()[:12]]


def seeds(target: str) -> list[bytes]:
    """The inputs a target's corpus starts from: the real fixtures, as that target reads them."""
    if target == "torch_file":
        return _chunk_archives()
    if target == "torch_pickle":
        return [bytes([i]) + pkl for i, (_, pkl, _) in enumerate(TEMPLATES)]
    metadata = [(_iteration(n) / ".metadata").read_bytes() for n in DCP_FIXTURES]
    if target == "dcp":
        return [bytes([i]) + data for i, data in enumerate(metadata)]
    legacy = [TEMPLATES[i][1] for i in range(len(LEGACY_FILES))]
    return [bytes([i]) + data for i, data in enumerate(metadata + legacy)]


# --------------------------------------------------------------------------- targets


def _torch_file(data: bytes) -> None:
    path = WORK / "input.pt"
    path.write_bytes(data)
    load_torch_file(path, WORK)


def _torch_pickle(data: bytes) -> None:
    if not data:
        return
    prefix, _, members = TEMPLATES[data[0] % len(TEMPLATES)]
    load_torch_archive(_join(prefix, data[1:], members), where="fuzzed")


_COPIES: dict[str, pathlib.Path] = {}


def _copy(name: str) -> pathlib.Path:
    """A private copy of fixture ``name``, made once."""
    if name not in _COPIES:
        _COPIES[name] = pathlib.Path(shutil.copytree(FIXTURES / name, WORK / name))
    return _COPIES[name]


def _dcp(data: bytes) -> None:
    if not data:
        return
    directory = next(_copy(DCP_FIXTURES[data[0] % len(DCP_FIXTURES)]).glob("iter_*"))
    (directory / ".metadata").write_bytes(data[1:])
    load_dcp(directory)


def _read_megatron(data: bytes) -> None:
    if not data:
        return
    choice = data[0] % (len(DCP_FIXTURES) + len(LEGACY_FILES))
    if choice < len(DCP_FIXTURES):
        root = _copy(DCP_FIXTURES[choice])
        target, content = next(root.glob("iter_*")) / ".metadata", data[1:]
    else:
        rel = pathlib.Path(LEGACY_FILES[choice - len(DCP_FIXTURES)])
        root = _copy(rel.parts[0])
        prefix, _, members = TEMPLATES[choice - len(DCP_FIXTURES)]
        target, content = root / rel.relative_to(rel.parts[0]), _join(prefix, data[1:], members)
    original = target.read_bytes()
    target.write_bytes(content)
    try:
        read_megatron(root)
    finally:
        target.write_bytes(original)


TARGETS = {
    "torch_file": _torch_file,
    "torch_pickle": _torch_pickle,
    "dcp": _dcp,
    "read_megatron": _read_megatron,
}
STATS = {"executions": 0, "refused": 0, "read": 0, "slowest_s": 0.0, "findings": {}}


def one_input(read, findings: pathlib.Path | None):
    """libFuzzer's callback for the target ``read``: counts, times and (with ``findings``)
    records what escapes; without ``findings`` an escaping exception is raised."""

    def test_one_input(data: bytes) -> None:
        start = time.perf_counter()
        try:
            read(data)
            STATS["read"] += 1
        except DamagedCheckpointError:
            STATS["refused"] += 1
        except Exception as err:
            kind = f"{type(err).__name__} at {_where(err)}"
            if findings is None:
                raise
            if kind not in STATS["findings"]:
                digest = hashlib.sha1(data).hexdigest()[:12]
                (findings / f"{type(err).__name__}-{digest}").write_bytes(data)
                STATS["findings"][kind] = f"{digest}: {str(err)[:300]}"
                print(f"FINDING {kind}: {str(err)[:300]}", file=sys.stderr, flush=True)
        finally:
            now = time.perf_counter()
            STATS["executions"] += 1
            STATS["slowest_s"] = max(STATS["slowest_s"], now - start)
            if now > STATS.setdefault("next_report", now + 30):
                STATS["next_report"] = now + 30
                _report()

    return test_one_input


def _where(err: BaseException) -> str:
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f"{pathlib.Path(tb.tb_frame.f_code.co_filename).name}:{tb.tb_lineno}" if tb else "?"


def _report() -> None:
    """Print the counts so far (libFuzzer ends the process without Python's exit handlers)."""
    stats = {k: v for k, v in STATS.items() if k != "next_report"}
    print(f"LWJAX_FUZZ_STATS {TARGET} " + json.dumps(stats), file=sys.stderr, flush=True)


def main(argv: list[str]) -> None:
    global TARGET
    if len(argv) < 2 or argv[1] not in TARGETS:
        raise SystemExit(f"usage: {argv[0]} {{{','.join(TARGETS)}}} [libFuzzer flags] [corpus]")
    TARGET = argv[1]
    flags = argv[2:]
    corpus = [a for a in flags if not a.startswith("-")]
    if corpus and not any(pathlib.Path(corpus[0]).iterdir()):
        for i, seed in enumerate(seeds(TARGET)):
            (pathlib.Path(corpus[0]) / f"seed-{i:03d}").write_bytes(seed)
    findings = os.environ.get("LWJAX_FUZZ_FINDINGS")
    if findings:
        pathlib.Path(findings).mkdir(parents=True, exist_ok=True)
    atheris.Setup(
        [argv[0], *flags],
        one_input(TARGETS[TARGET], pathlib.Path(findings) if findings else None),
    )
    atheris.Fuzz()


TARGET = ""

if __name__ == "__main__":
    main(sys.argv)
