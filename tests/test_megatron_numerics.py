"""``numerics="megatron"`` against a real megatron-core run: the loss Megatron logged and the
gradients it reduced, at the weights of its checkpoint.

The ``resume_*`` fixtures hold a bf16 megatron-core 0.19.2 run (local layer spec) saved after
iteration 3, with iteration 4's batch, logged loss and reduced fp32 gradients (``main_grad``,
before clipping) computed at exactly the saved weights. Measured on CPU: Megatron's numerics
reach |loss - loss/4| = 4.8e-7 (muon) and 0 (adam), every gradient element but one per fixture
bit for bit, worst per-parameter relative difference 5.0e-6 (muon) and 6.7e-8 (adam). lwjax's
own numerics miss the loss by 8.1e-5 / 1.2e-5 (fp32) and 4.8e-5 / 9.3e-5 (bf16), and each
parameter's gradient by 0.40%-0.83% (fp32).
"""

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwjax.megatron import megatron_to_logical, read_megatron
from lwjax.megatron import names as names_lib
from lwjax.megatron.gpt import GPTConfig, keys_from_tree
from lwjax.megatron.model import gpt_logits, gpt_loss

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "megatron"
RUNS = ("resume_muon", "resume_adam")
ITERATION = 4  # the first iteration after the checkpoint: its weights are the saved ones
MODES = {
    "megatron": {"dtype": "bfloat16", "numerics": "megatron"},
    "fp32": {},
    "bf16": {"dtype": "bfloat16"},
}
LOSS_TOL = 5e-6  # measured: 4.8e-7 and 0
GRAD_TOL = 1e-4  # largest per-parameter relative difference; measured: 5.0e-6 and 6.7e-8
FP32_GRAD_FLOOR = 1e-3  # smallest per-parameter relative difference of fp32; measured: 4.0e-3


@functools.cache
def _run(name):
    """The checkpoint's config and bf16 weights, and iteration 4's batch, loss and gradients."""
    imported = megatron_to_logical(read_megatron(FIXTURES / name))
    with np.load(FIXTURES / name / "resume.npz") as recorded:
        tokens = jnp.asarray(recorded[f"tokens/{ITERATION}"])
        loss = float(recorded[f"loss/{ITERATION}"])
        prefix = f"grad/{ITERATION}/"
        grads = {k[len(prefix) :]: recorded[k] for k in recorded.files if k.startswith(prefix)}
    return imported.config, imported.params, (tokens, jnp.roll(tokens, -1, axis=1)), loss, grads


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _loss_and_grads(params, batch, config: GPTConfig, mode: str, grads: bool):
    if grads:
        return jax.value_and_grad(gpt_loss)(params, batch, config, **MODES[mode])
    return gpt_loss(params, batch, config, **MODES[mode]), None


@functools.cache
def _lwjax(name, mode, grads):
    """lwjax's loss (and gradients) in ``mode`` at the run's weights and batch."""
    config, params, batch, _, _ = _run(name)
    loss, grads = _loss_and_grads(params, batch, config, mode, grads)
    return float(loss), grads


def _relative_differences(grads, recorded) -> dict[str, float]:
    """Per Megatron parameter (``named_parameters`` name): ``|g - g_megatron| / |g_megatron|``."""
    out = {}
    for key, stacked in keys_from_tree(grads).items():
        stacked = np.asarray(stacked, np.float32)
        layers = range(len(stacked)) if names_lib.is_layer_key(key) else (None,)
        for layer in layers:
            name = names_lib.layer_name(key, layer, spec="local")
            got = stacked if layer is None else stacked[layer]
            want = recorded[name]
            out[name] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert set(out) == set(recorded)
    return out


@pytest.mark.parametrize("name", RUNS)
def test_megatron_numerics_reproduce_the_logged_loss(name):
    _, _, _, logged, _ = _run(name)
    loss, _ = _lwjax(name, "megatron", True)
    assert abs(loss - logged) < LOSS_TOL, (loss, logged)


@pytest.mark.parametrize("name", RUNS)
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_lwjax_numerics_miss_the_logged_loss_at_that_tolerance(name, mode):
    """The mode is what makes the match: lwjax's own numerics are off by 1e-5 to 1e-4."""
    _, _, _, logged, _ = _run(name)
    loss, _ = _lwjax(name, mode, mode == "fp32")  # fp32's gradients serve below too
    assert abs(loss - logged) > LOSS_TOL, (loss, logged)


@pytest.mark.parametrize("name", RUNS)
def test_megatron_numerics_reproduce_megatrons_gradients(name):
    _, _, _, _, recorded = _run(name)
    ours = _relative_differences(_lwjax(name, "megatron", True)[1], recorded)
    fp32 = _relative_differences(_lwjax(name, "fp32", True)[1], recorded)
    assert max(ours.values()) < GRAD_TOL, ours
    assert min(fp32.values()) > FP32_GRAD_FLOOR, fp32
    # Parameter gradients come out as Megatron's: bf16, here for bf16 parameters.
    assert {g.dtype for g in jax.tree.leaves(_lwjax(name, "megatron", True)[1])} == {
        jnp.dtype("bfloat16")
    }


def test_megatron_numerics_logits_are_bf16_values():
    config, params, (tokens, _), _, _ = _run("resume_muon")
    logits = gpt_logits(params, tokens, config, dtype="bfloat16", numerics="megatron")
    assert logits.dtype == jnp.float32
    np.testing.assert_array_equal(logits, logits.astype(jnp.bfloat16).astype(jnp.float32))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"numerics": "torch"}, "numerics must be one of"),
        ({"numerics": "megatron", "attention": "cudnn"}, "attention='cudnn'"),
        ({"numerics": "megatron", "attention": "flash"}, "attention must be one of"),
        ({"numerics": "megatron", "dtype": "float16"}, "dtype=float16"),
    ],
    ids=["unknown-numerics", "cudnn", "unknown-attention", "float16"],
)
def test_gpt_logits_rejects_bad_options(options, message):
    config = GPTConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        num_query_groups=1,
        ffn_hidden_size=8,
        vocab_size=16,
    )
    with pytest.raises(ValueError, match=message):
        gpt_logits({}, jnp.zeros((1, 4), jnp.int32), config, **options)
