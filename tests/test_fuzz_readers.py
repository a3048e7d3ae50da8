"""A bounded mutation fuzz of the torch-free Megatron readers: whatever the bytes, the only
exception that escapes read_megatron is DamagedCheckpointError, and no input hangs.

Seeds are the real fixtures (a legacy torch.save archive and a DCP .metadata plus storage).
Each case flips, deletes, duplicates or truncates bytes of one file; the loop runs in a child
process under a 3 GiB address-space limit (an allocation bomb becomes a MemoryError, which
the reader must turn into its error) with a per-case alarm. Longer runs: tests/fuzz/, whose
atheris harness is smoke-tested here for a few seconds per target so that it cannot rot.
"""

import importlib.util
import json
import os
import pathlib
import random
import subprocess
import sys
import time

import pytest
from module_files import imported

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "megatron"
HARNESS = pathlib.Path(__file__).parent / "fuzz" / "fuzz_readers.py"
TARGETS = ("torch_file", "torch_pickle", "dcp", "read_megatron")

CHILD = r"""
import json, pathlib, random, resource, shutil, signal, sys, tempfile, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from lwjax.megatron import DamagedCheckpointError, read_megatron

fixtures, seconds = pathlib.Path(sys.argv[1]), float(sys.argv[2])
seeds = [("legacy_muon", "iter_0000002/mp_rank_00/model_optim_rng.pt"),
         ("legacy_muon", "iter_0000002/mp_rank_00/layer_wise_optimizer_0.pt"),
         ("muonL_ws1", "iter_0000002/.metadata"),
         ("muonL_ws1", "iter_0000002/__0_0.distcp")]
rng = random.Random(0)
work = pathlib.Path(tempfile.mkdtemp())
copies = {name: shutil.copytree(fixtures / name, work / name) for name in {n for n, _ in seeds}}
class Hang(Exception): pass
def alarm(*_): raise Hang
signal.signal(signal.SIGALRM, alarm)
escaped, cases, end = {}, 0, time.monotonic() + seconds
while time.monotonic() < end:
    name, rel = seeds[cases % len(seeds)]
    original = (fixtures / name / rel).read_bytes()
    data = bytearray(original)
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(len(data))
        op = rng.random()
        if op < 0.6:
            data[i] = rng.randrange(256)
        elif op < 0.8:
            del data[i:i + rng.randint(1, 64)]
        elif op < 0.9:
            data[i:i] = data[i:i + rng.randint(1, 64)]
        else:
            del data[i:]
    (copies[name] / rel).write_bytes(bytes(data))
    signal.alarm(5)
    try:
        read_megatron(copies[name], verify=False)
    except DamagedCheckpointError:
        pass
    except BaseException as err:
        escaped.setdefault(type(err).__name__, f"{rel}: {str(err)[:200]}")
    finally:
        signal.alarm(0)
        (copies[name] / rel).write_bytes(original)
    cases += 1
print(json.dumps({"cases": cases, "escaped": escaped}))
"""


def test_only_the_readers_error_escapes_mutated_fixtures():
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(FIXTURES), "10"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["cases"] > 50, report
    assert report["escaped"] == {}, report


@pytest.fixture(scope="module")
def harness():
    """tests/fuzz/fuzz_readers.py, imported (no atheris needed)."""
    return imported(HARNESS)


@pytest.mark.parametrize("target", TARGETS)
def test_the_fuzz_harness_reads_its_seeds_and_lets_only_the_readers_error_out(harness, target):
    """Each target of the atheris harness reads its seeds (real checkpoints) whole, then a
    second of byte flips on them: an exception other than DamagedCheckpointError is raised."""
    seeds = harness.seeds(target)
    assert seeds, target
    one = harness.one_input(harness.TARGETS[target], None)
    before = dict(harness.STATS)
    for seed in seeds[:40]:
        one(seed)
    assert harness.STATS["read"] - before["read"] == min(len(seeds), 40)
    rng, end = random.Random(target), time.monotonic() + 1.0
    while time.monotonic() < end:
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        one(bytes(data))


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris not installed")
@pytest.mark.parametrize("target", TARGETS)
def test_the_fuzz_harness_runs_under_libfuzzer(tmp_path, target):
    """The harness under libFuzzer, as README.md runs it but for 2 s and from no corpus (the
    seeds are the test above's): it starts, fuzzes and finds nothing."""
    findings = tmp_path / "findings"
    # No RSS limit here: libFuzzer reads the peak RSS from getrusage, which Linux carries over
    # fork and exec from the pytest worker that starts it (several GB by then in a full run).
    # The long runs of README.md keep -rss_limit_mb and record the peak.
    proc = subprocess.run(
        [sys.executable, str(HARNESS), target, "-max_total_time=2", "-timeout=5"]
        + ["-rss_limit_mb=0", "-max_len=100000", "-print_final_stats=1"]
        + [f"-artifact_prefix={tmp_path}/"],  # a failing input lands here, not in the checkout
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "LWJAX_FUZZ_FINDINGS": str(findings)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stderr.split("stat::number_of_executed_units:")[1].split()[0]) > 0
    assert list(findings.iterdir()) == [], proc.stderr[-3000:]
