"""OptimizerConfig and the other modules below the step import no jax."""

import subprocess
import sys

import jax.numpy as jnp
import pytest

from lwjax.config import OptimizerConfig, is_floating_dtype


def test_config_plan_and_mesh_axes_import_no_jax():
    code = (
        "import sys; sys.modules['jax'] = None\n"
        "import lwjax.config, lwjax.param_plan, lwjax.plan, lwjax.parallel.axes\n"
        "lwjax.config.OptimizerConfig(master_dtype='bfloat16')\n"
        "assert not any(m == 'jax' or m.startswith('jax.') "
        "for m in sys.modules if sys.modules[m] is not None)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "dtype",
    ["float32", "bfloat16", "float16", "float8_e4m3fn", "int32", "bool", "complex64", "foo", 3],
)
def test_is_floating_dtype_agrees_with_jax(dtype):
    try:
        expected = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        expected = False
    assert is_floating_dtype(dtype) == expected


def test_optimizer_config_refuses_a_master_dtype_that_is_not_floating():
    with pytest.raises(ValueError, match="OptimizerConfig.master_dtype must be a floating dtype"):
        OptimizerConfig(master_dtype="int32")
