"""Test session setup: 8 virtual CPU devices, configured before any JAX op and started at once."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The CLI's tables follow $COLUMNS when it is set, and pytest-xdist's workers get COLUMNS=80
# where a plain run has none: tests read them at the width a pipe gets (160) unless they set
# their own.
os.environ["COLUMNS"] = "160"
# The tests compile hundreds of small programs and run each for milliseconds, so LLVM's
# optimisations cost more than they save: without them the suite takes about a fifth less
# time on 2 cores. Set before JAX starts, keeping the caller's flags; processes the tests spawn
# inherit it.
os.environ["XLA_FLAGS"] = " ".join(
    (
        "--xla_backend_optimization_level=0",
        "--xla_llvm_disable_expensive_passes=true",
        os.environ.get("XLA_FLAGS", ""),
    )
).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
# A compilation cache for this test process only (each xdist worker has its own): many tests
# compile the same programs (the same optimizer step, reference, model) from fresh closures,
# which jit's own cache cannot match but the HLO-keyed persistent cache does (about 15% of
# the suite's time on 2 cores).
_CACHE = tempfile.mkdtemp(prefix="lwjax-tests-xla-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

# Start the backend now: a CLI call inside a test asks for its own --dp devices, which would
# otherwise set the whole session's count when that test happens to run first.
jax.devices()


def pytest_xdist_auto_num_workers(config):
    """Workers for ``-n auto`` (pyproject's default): one per core this process may use, at
    most 4, since each holds its own 8 virtual devices and compilation cache. Each worker runs
    whole files (``--dist loadfile``), so a file's shared optimizers compile once. On 2 cores
    the suite takes 9 minutes instead of 14."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(4, cores or 1))


# The two files with the most test time (on 2 idle cores, 2026-11-29: test_optimizer.py 294 s,
# test_train_bench.py 251 s, of 2,316 s over 51 files). Each worker takes the next whole file
# as it frees, in collection order, so a long file collected late kept one worker busy for
# minutes after the other had finished; taken first, the two workers' shares come within a few
# percent of each other (a simulation over the measured durations: 1,251 / 1,064 s -> 1,173 /
# 1,143 s).
LONGEST_FILES = ("test_optimizer.py", "test_train_bench.py")


def pytest_collection_modifyitems(items):
    """Move the tests of :data:`LONGEST_FILES` to the front, every other test in its order."""
    first = {name: rank for rank, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))
