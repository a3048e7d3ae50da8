"""The local launcher: job environment, prefixed output, failure propagation,
timeouts (children without JAX)."""

import io
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from lwjax import distributed as dist
from lwjax.launch import EXIT_TIMEOUT, LaunchConfig, child_env, describe_returncode, launch
from lwjax.tools import cli


def _python(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", textwrap.dedent(code))


def _run(code: str, **options):
    out, report = io.StringIO(), io.StringIO()
    result = launch(LaunchConfig(command=_python(code), **options), out=out, report=report)
    return result, out.getvalue(), report.getvalue()


def test_launch_prefixes_output_and_passes_the_job_environment():
    result, out, report = _run(
        """
        import os, sys
        e = os.environ
        print("job", e["LWJAX_PROCESS_ID"], e["LWJAX_NUM_PROCESSES"],
              e["LWJAX_COORDINATOR_ADDRESS"], e["LWJAX_CPU_DEVICES"],
              e["LWJAX_HEARTBEAT_TIMEOUT"])
        print("[Gloo] Rank 0 is connected to 3 peer ranks. "
              "Expected number of connected peer ranks is : 3")
        print("to stderr", file=sys.stderr)
        sys.stdout.write("no newline at the end")
    """,
        nproc=3,
        devices_per_proc=2,
        heartbeat_timeout=7,
        timeout=60,
    )
    assert result.returncode == 0 and result.failed is None and report == "", (out, report)
    lines = out.splitlines()
    assert all(line.startswith(("[p0] ", "[p1] ", "[p2] ")) for line in lines), out
    for i in range(3):
        assert f"[p{i}] job {i} 3 {result.coordinator_address} 2 7" in lines, out
        assert f"[p{i}] to stderr" in lines and f"[p{i}] no newline at the end" in lines
    assert "Gloo" not in out  # gloo's connection chatter is filtered


def test_launch_shows_gloo_lines_when_asked():
    _, out, _ = _run(
        'print("[Gloo] Rank 1 is connected to 1 peer ranks")', nproc=1, show_gloo=True, timeout=60
    )
    assert out == "[p0] [Gloo] Rank 1 is connected to 1 peer ranks\n"


def test_launch_first_failure_stops_the_others_and_sets_the_exit_status():
    result, out, report = _run(
        """
        import os, sys, time
        if os.environ["LWJAX_PROCESS_ID"] == "1":
            print("failing", flush=True)
            sys.exit(3)
        time.sleep(60)
    """,
        nproc=2,
        grace=1.0,
        timeout=60,
    )
    assert result.returncode == 3 and result.failed == 1 and not result.timed_out
    p0, p1 = result.exits
    assert p1.returncode == 3 and not p1.stopped_by_launcher
    assert p0.returncode == -signal.SIGTERM and p0.stopped_by_launcher
    assert result.wall_s < 20
    assert "[p1] failing" in out
    assert "process 1 of 2 failed first (exit status 3)" in report
    assert "p0: killed by SIGTERM (signal 15), stopped by the launcher" in report


def test_launch_treats_an_abort_signal_as_failure():
    result, _, report = _run(
        """
        import os, time
        if os.environ["LWJAX_PROCESS_ID"] == "0":
            os.abort()
        time.sleep(60)
    """,
        nproc=2,
        grace=1.0,
        timeout=60,
    )
    assert result.failed == 0 and result.exits[0].returncode == -signal.SIGABRT
    assert result.returncode == 128 + signal.SIGABRT
    assert "process 0 of 2 failed first (killed by SIGABRT (signal 6))" in report


def test_launch_timeout_kills_every_process_and_what_they_started():
    # Process 1 ignores SIGTERM (so SIGKILL must follow); both start a grandchild that must die too.
    result, out, report = _run(
        """
        import os, signal, subprocess, time
        if os.environ["LWJAX_PROCESS_ID"] == "1":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen(["sleep", "60"])
        print("grandchild", child.pid, flush=True)
        time.sleep(60)
    """,
        nproc=2,
        timeout=1.5,
        grace=0.5,
    )
    assert result.timed_out and result.returncode == EXIT_TIMEOUT and result.failed is None
    assert [e.returncode for e in result.exits] == [-signal.SIGTERM, -signal.SIGKILL]
    assert all(e.stopped_by_launcher for e in result.exits)
    assert result.wall_s < 10
    assert "timed out after" in report and "[0, 1]" in report
    pids = [int(line.split()[-1]) for line in out.splitlines() if "grandchild" in line]
    assert len(pids) == 2, out
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped by init) is not alive
        return f.read().split(") ")[-1][0] != "Z"


def test_child_env_sets_job_variables_devices_and_gpu_blocks():
    config = LaunchConfig(
        command=("x",), nproc=2, devices_per_proc=2, bind_gpus=True, env={"EXTRA": "1"}
    )
    environ = {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/d",
        "CUDA_VISIBLE_DEVICES": "4,5,6,7",
        dist.ENV_CLUSTER_DETECTION: "slurm",
    }
    env = child_env(config, 1, 1234, environ)
    assert env[dist.ENV_COORDINATOR] == "127.0.0.1:1234" and env[dist.ENV_PROCESS_ID] == "1"
    assert (
        env[dist.ENV_NUM_PROCESSES] == "2"
        and env[dist.ENV_CPU_DEVICES] == "2"
        and env["EXTRA"] == "1"
    )
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert dist.ENV_CLUSTER_DETECTION not in env
    # What the child's lwjax.distributed makes of it.
    assert dist.config_from_env(env) == dist.DistributedConfig(
        coordinator_address="127.0.0.1:1234",
        num_processes=2,
        process_id=1,
        cpu_devices=2,
        initialization_timeout=config.init_timeout,
        heartbeat_timeout=config.heartbeat_timeout,
    )
    with pytest.raises(ValueError, match="need 6 GPUs; CUDA_VISIBLE_DEVICES lists 4"):
        child_env(
            LaunchConfig(command=("x",), nproc=3, devices_per_proc=2, bind_gpus=True), 0, 1, environ
        )


@pytest.mark.parametrize(
    "options,message",
    [
        ({"command": ()}, "must name a program"),
        ({"nproc": 0}, "nproc must be a positive int"),
        ({"devices_per_proc": 0}, "devices_per_proc must be a positive int"),
        ({"timeout": 0}, "timeout must be > 0"),
        ({"bind_gpus": True}, "bind_gpus needs devices_per_proc"),
    ],
    ids=["empty-command", "nproc", "devices", "timeout", "bind-gpus"],
)
def test_launch_config_rejects_bad_values(options, message):
    with pytest.raises(ValueError, match=message):
        LaunchConfig(**{"command": ("x",), **options})


def test_describe_returncode():
    assert describe_returncode(0) == "exit status 0"
    assert describe_returncode(-6) == "killed by SIGABRT (signal 6)"


def test_cli_launch_returns_the_failed_status_and_reports_usage_errors(capsys):
    code = "import os, sys; print('hello'); sys.exit(int(os.environ['LWJAX_PROCESS_ID']) * 5)"
    assert (
        cli.main(["launch", "--nproc", "2", "--grace", "1", "--", sys.executable, "-c", code]) == 5
    )
    captured = capsys.readouterr()
    assert "[p1] hello" in captured.out
    assert "lwjax launch: process 1 of 2 failed first (exit status 5)" in captured.err
    assert cli.main(["launch", "--nproc", "2", "--", sys.executable, "-c", "print('ok')"]) == 0
    assert sorted(capsys.readouterr().out.splitlines()) == ["[p0] ok", "[p1] ok"]
    assert cli.main(["launch", "--nproc", "2"]) == cli.EXIT_USAGE
    assert "must name a program" in capsys.readouterr().err
    assert cli.main(["launch", "--", "/nonexistent/program"]) == cli.EXIT_USAGE
    assert "/nonexistent/program: no such program" in capsys.readouterr().err


def test_launcher_imports_no_jax():
    code = (
        "import sys; sys.modules['jax'] = None\n"
        "import lwjax.tools.cli, lwjax.launch, lwjax.distributed\n"
        "sys.exit(lwjax.tools.cli.main(['launch', '--nproc', '2', '--', "
        f"{sys.executable!r}, '-c', 'print(7)']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[p0] 7", "[p1] 7"]
