"""The example scripts run as scripts (fresh processes, 8 virtual CPU devices) and
lower the loss."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMALL = [
    "--size",
    "tiny",
    "--steps",
    "10",
    "--batch-size",
    "8",
    "--seq-len",
    "32",
    "--log-every",
    "4",
]


def run_script(name: str, *flags: str) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *SMALL, *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize(
    "script,flags",
    [("nnx_gpt.py", ["--tied", "--separate-qkv"]), ("linen_gpt.py", ["--scan"])],
    ids=["nnx-unrolled-tied-separate-qkv", "linen-scan-fused-qkv"],
)
def test_example_script_lowers_the_loss(script, flags):
    out = run_script(script, *flags)
    first, last = map(float, re.search(r"loss (\S+) -> (\S+)", out).groups())
    assert last < first - 1.0, out
    assert "8 " in out.splitlines()[0] and "devices" in out.splitlines()[0], (
        out
    )  # all 8 virtual CPU devices
