"""``docs/scripts/compile_time.py kernels``: the Triton kernels a step launches, read from its
CUDA lowering on the CPU (Pallas lowers its kernels to Triton in Python, so the kernels' real
lowering runs here too)."""

import pathlib

import jax
import jax.numpy as jnp
import pytest
from module_files import imported

from lwjax import newton_schulz as ns_lib

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "docs" / "scripts" / "compile_time.py"


@pytest.fixture(scope="module")
def compile_time():
    return imported(SCRIPT)


def _batches(launches: dict) -> dict[str, tuple[int, list[str], int]]:
    """Per launching function: its calls, its one kernel's result types (sorted) and its
    accumulation loops (``dots``)."""
    out = {}
    for name, launch in launches.items():
        (kernel,) = launch["kernels"]
        assert kernel["ir_chars"] > 1000
        out[name] = (launch["calls"], sorted(kernel["results"]), kernel["dots"])
    return out


def test_newton_schulz_many_launches_each_kernel_once_a_step_for_cuda(compile_time):
    """The stacks of one matrix shape are one batch whatever their leading axes, and each
    Newton–Schulz step launches one Gram kernel and one factor kernel for every batch the
    kernels take: 5 steps, 2 kernels, 3 batches in each launch. The Gram kernel writes the
    batches' Grams as one array, with a loop per batch; the factor kernel runs one loop over
    it and writes each batch's factors apart."""
    shapes = [
        (1, 5, 2048, 2048),  # joined with the two below: 14 matrices
        (8, 2048, 2048),
        (2048, 2048),
        (2, 16384, 2048),  # tall: its Gram is [2048, 2048] too, of rows
        (3, 2048, 8192),  # joined with the one below: 4 matrices
        (2048, 8192),
        (2, 512, 1024),  # below gram.MIN_SIZE: XLA's products, no kernel
    ]
    xs = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
    many = jax.jit(lambda xs: ns_lib.newton_schulz_many(xs, "quintic", 5, precision="medium"))
    text = many.trace(xs).lower(lowering_platforms=("cuda",)).as_text()
    batches = sorted(f"tensor<{n}x2048x2048xbf16>" for n in (14, 2, 4))
    assert _batches(compile_time.triton_launches(text)) == {
        "_upper_grams": (5, ["tensor<20x2048x2048xbf16>"], 3),
        "_polynomials": (5, batches, 1),
    }


def test_the_training_steps_newton_schulz_is_one_launch_per_kernel_and_step(compile_time):
    """The 1b training step with 2 layers at dp 1: every Muon matrix's Newton–Schulz runs in
    the joint pass, one Gram launch a step (a loop per batch) and one factor launch (one
    loop over the batches' joined Grams). Its batches: q and proj of each
    layer ([2048, 2048]), fc2 ([2048, 8192]) and fc1 ([16384, 2048], rows contracted), all
    2048-edge Grams; k and v ([512, 2048]) are below the kernel's size."""
    layers = 2
    batches = sorted(f"tensor<{n}x2048x2048xbf16>" for n in (2 * layers, layers, layers))
    assert _batches(compile_time.kernels("1b", layers)) == {
        "_upper_grams": (5, [f"tensor<{4 * layers}x2048x2048xbf16>"], 3),
        "_polynomials": (5, batches, 1),
    }
