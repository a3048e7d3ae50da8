"""Tests for lwjax.muon against emerging_optimizers 0.3.0 ground truth."""

import dataclasses
import doctest
import functools
import json
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwjax import muon
from lwjax import newton_schulz as ns_lib
from lwjax.muon import (
    SCALE_MODES,
    MuonConfig,
    apply_polar,
    get_muon_scale_factor,
    muon_polar,
    muon_update,
    orthogonalize,
)
from lwjax.newton_schulz import (
    COEFFICIENT_SETS,
    COEFFICIENT_TYPES,
    PRECISIONS,
    newton_schulz,
    newton_schulz_many,
)

_FIXTURE = json.loads(
    (pathlib.Path(__file__).parent / "fixtures" / "muon" / "muon_reference.json").read_text()
)
# Inputs are stored as float32 values written in decimal; the round trip is exact.
_INPUTS = {
    k: np.asarray(v["data"], np.float64).astype(np.float32) for k, v in _FIXTURE["inputs"].items()
}
_NS_CASES = _FIXTURE["newton_schulz"]
_MUON_CASES = _FIXTURE["muon"]

# megatron-notes §3: G[i][j] = ((7i + 3j) mod 11 - 5) / 5, 4x6, quintic, 5 steps (H200, torch).
_NOTES_G = np.array(
    [[((7 * i + 3 * j) % 11 - 5) / 5 for j in range(6)] for i in range(4)], np.float32
)
_NOTES_HIGHEST = np.array(
    [
        -0.711818,
        -0.063569,
        0.099229,
        0.483501,
        -0.441526,
        -0.278728,
        0.105586,
        0.667247,
        -0.190802,
        -0.012693,
        0.144831,
        -0.713218,
        -0.13645,
        0.29999,
        0.654302,
        -0.593672,
        -0.339895,
        0.014417,
        0.653299,
        -0.239428,
        0.122395,
        0.182794,
        -0.628619,
        -0.266796,
    ]
).reshape(4, 6)
_NOTES_MEDIUM = np.array(
    [
        -0.710938,
        -0.067383,
        0.100586,
        0.480469,
        -0.445312,
        -0.277344,
        0.109863,
        0.671875,
        -0.19043,
        -0.015747,
        0.146484,
        -0.714844,
        -0.137695,
        0.298828,
        0.65625,
        -0.59375,
        -0.339844,
        0.014282,
        0.652344,
        -0.241211,
        0.121582,
        0.185547,
        -0.628906,
        -0.265625,
    ]
).reshape(4, 6)
_NOTES_ONE_STEP = np.array(
    [
        -0.841422,
        -0.064412,
        0.05874,
        0.580773,
        -0.441461,
        -0.318309,
        0.102823,
        0.677274,
        -0.27872,
        0.062427,
        0.194455,
        -0.761538,
        -0.16516,
        0.256444,
        0.675085,
        -0.656102,
        -0.278039,
        0.140603,
        0.807867,
        -0.311104,
        0.078155,
        0.237072,
        -0.670461,
        -0.281202,
    ]
).reshape(4, 6)
_NOTES_TEN_STEPS = np.array(
    [
        -0.713823,
        -0.063833,
        0.099318,
        0.48529,
        -0.442961,
        -0.27981,
        0.108323,
        0.668808,
        -0.193029,
        -0.010539,
        0.144403,
        -0.717434,
        -0.140711,
        0.301532,
        0.658703,
        -0.598847,
        -0.339327,
        0.017844,
        0.660149,
        -0.241122,
        0.119684,
        0.187566,
        -0.632406,
        -0.271602,
    ]
).reshape(4, 6)


def _rng_matrix(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _config_from_kwargs(kwargs):
    assert kwargs["weight_decay_method"] == "decoupled"
    return MuonConfig(
        momentum=kwargs["momentum"],
        nesterov=kwargs["nesterov"],
        coefficient_type=kwargs["coefficient_type"],
        num_ns_steps=kwargs["num_ns_steps"],
        scale_mode=kwargs["scale_mode"],
        extra_scale_factor=kwargs["extra_scale_factor"],
        fp32_matmul_prec=kwargs["fp32_matmul_prec"],
    )


# --- constants ---------------------------------------------------------------------------------


def test_coefficient_sets_match_fixture():
    assert set(COEFFICIENT_TYPES) == set(_FIXTURE["coefficient_sets"])
    for name, table in _FIXTURE["coefficient_sets"].items():
        assert COEFFICIENT_SETS[name] == tuple(tuple(abc) for abc in table), name


def test_muon_config_defaults_match_megatron():
    assert dataclasses.asdict(MuonConfig()) == dict(
        momentum=0.95,
        nesterov=False,
        coefficient_type="quintic",
        num_ns_steps=5,
        scale_mode="spectral",
        extra_scale_factor=1.0,
        fp32_matmul_prec="medium",
        split_qkv=True,
        tp_mode="duplicated",  # Megatron-LM main's default; megatron-core 0.19.2's is blockwise
    )
    assert PRECISIONS == ("highest", "high", "medium")
    assert SCALE_MODES == ("spectral", "unit_rms_norm", "shape_scaling")


# --- newton_schulz -----------------------------------------------------------------------------


@pytest.mark.parametrize("case", _NS_CASES, ids=[c["id"] for c in _NS_CASES])
def test_newton_schulz_matches_fp64_reference_in_fp32(case):
    x = jnp.asarray(_INPUTS[case["input"]])
    out = newton_schulz(
        x, case["coefficient_type"], case["steps"], eps=case["eps"], precision="highest"
    )
    assert out.dtype == jnp.float32 and out.shape == x.shape
    # At most twice torch's own fp32 drift from the fp64 reference, and never looser than 1e-5.
    tol = max(1e-5, 2 * case["max_abs_diff_fp32_vs_fp64"])
    np.testing.assert_allclose(
        np.asarray(out), np.asarray(case["output_fp64_reference"]), rtol=0, atol=tol
    )


@pytest.mark.parametrize("case", _NS_CASES, ids=[c["id"] for c in _NS_CASES])
def test_newton_schulz_matches_fp64_reference_in_float64(case):
    with jax.enable_x64(True):
        x = jnp.asarray(_INPUTS[case["input"]].astype(np.float64))
        out = newton_schulz(
            x, case["coefficient_type"], case["steps"], eps=case["eps"], precision="highest"
        )
        assert out.dtype == jnp.float64
        out = np.asarray(out)
    np.testing.assert_allclose(out, np.asarray(case["output_fp64_reference"]), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "steps, precision, expected",
    [
        (5, "highest", _NOTES_HIGHEST),
        (1, "highest", _NOTES_ONE_STEP),
        (10, "highest", _NOTES_TEN_STEPS),
        (5, "medium", _NOTES_MEDIUM),
    ],
    ids=["highest_5", "highest_1", "highest_10", "medium_5"],
)
def test_newton_schulz_matches_megatron_notes_vectors(steps, precision, expected):
    out = np.asarray(newton_schulz(jnp.asarray(_NOTES_G), "quintic", steps, precision=precision))
    # The notes print 6 decimals; "medium" is reproduced to the bf16 value, not just nearby.
    np.testing.assert_allclose(out, expected, rtol=0, atol=2e-6)
    out_t = np.asarray(
        newton_schulz(jnp.asarray(_NOTES_G.T), "quintic", steps, precision=precision)
    )
    np.testing.assert_array_equal(out_t, out.T)


def test_newton_schulz_medium_rounds_through_bf16():
    x = jnp.asarray(_NOTES_G)
    medium = np.asarray(newton_schulz(x, precision="medium"))
    highest = np.asarray(newton_schulz(x, precision="highest"))
    assert np.abs(medium - highest).max() > 1e-3
    # The final iterate is a bf16 value cast back to fp32.
    np.testing.assert_array_equal(medium, medium.astype(jnp.bfloat16).astype(np.float32))
    assert newton_schulz(x, precision="medium").dtype == jnp.float32


def test_newton_schulz_high_uses_fp32_storage():
    # XLA's default fp32 dot is plain fp32 on CPU; on recent GPUs it is TF32 (about 2e-3
    # off, notes §3).
    x = jnp.asarray(_INPUTS["50x70"])
    high = np.asarray(newton_schulz(x, precision="high"))
    atol = 1e-6 if jax.default_backend() == "cpu" else 5e-3
    np.testing.assert_allclose(
        high, np.asarray(newton_schulz(x, precision="highest")), rtol=0, atol=atol
    )


@pytest.mark.parametrize("coefficient_type, steps", [("quintic", 5), ("polar_express", 20)])
def test_folded_iteration_is_the_same_polynomial_in_float64(coefficient_type, steps):
    table = ns_lib._coefficient_schedule(coefficient_type, steps)
    with jax.enable_x64(True):
        x = jnp.asarray(_rng_matrix(3, 2, 6, 9).astype(np.float64))
        x = x / jnp.linalg.norm(x, axis=(-2, -1), keepdims=True)
        kwargs = dict(steps=table, precision=jax.lax.Precision.HIGHEST, acc_dtype=jnp.float64)
        exact = np.asarray(ns_lib._iterate_exact(x, **kwargs))
        folded = np.asarray(ns_lib._iterate_folded(x, **kwargs))
    np.testing.assert_allclose(folded, exact, rtol=0, atol=1e-12)


def test_folded_iteration_in_bf16_stays_near_the_fp32_result():
    x = _rng_matrix(4, 64, 256)
    reference = np.asarray(newton_schulz(jnp.asarray(x), precision="highest"))
    y = jnp.asarray(x / np.linalg.norm(x)).astype(jnp.bfloat16)
    kwargs = dict(
        steps=ns_lib._coefficient_schedule("quintic", 5),
        precision=jax.lax.Precision.DEFAULT,
        acc_dtype=jnp.float32,
    )
    outputs = {
        name: np.asarray(fn(y, **kwargs))
        for name, fn in (("exact", ns_lib._iterate_exact), ("folded", ns_lib._iterate_folded))
    }
    errors = {
        name: np.sqrt(np.mean((out - reference) ** 2) / np.mean(reference**2))
        for name, out in outputs.items()
    }
    # RMS error here: 0.53% in Megatron's order, 0.51% folded (the same number of bf16 roundings).
    assert errors["exact"] < 0.008 and errors["folded"] < 0.008, errors
    # Both hand back X_N as bf16 values.
    for out in outputs.values():
        np.testing.assert_array_equal(out, out.astype(jnp.bfloat16).astype(np.float32))
    zero = ns_lib._iterate_folded(jnp.zeros((1, 6, 4), jnp.bfloat16), **kwargs)
    np.testing.assert_array_equal(np.asarray(zero), 0.0)


@pytest.mark.parametrize(
    "platform, coefficient_type, product_dtype, sums",
    [("cuda", "quintic", "bf16", 0), ("cuda", "cans", "f32", 5), ("cpu", "quintic", "f32", 5)],
)
def test_newton_schulz_lowers_the_folded_iteration_for_cuda_only(
    platform, coefficient_type, product_dtype, sums
):
    # Folded (CUDA, quintic): each [m, n] update is one matmul with a bf16 output. Megatron's order
    # (elsewhere, and cans everywhere) takes the product in fp32 and adds a X to it.
    fn = jax.jit(lambda x: newton_schulz(x, coefficient_type, precision="medium"))
    text = jax.export.export(fn, platforms=[platform])(jnp.ones((8, 24), jnp.float32)).mlir_module()
    products = re.findall(r"stablehlo.dot_general.*-> tensor<8x24x(\w+)>", text)
    assert products == [product_dtype] * 5
    assert len(re.findall(r"stablehlo.add .*: tensor<8x24x\w+>", text)) == sums
    # The [m, m] products: G in the iterate's dtype when folded, G^2 always accumulated in fp32.
    grams = re.findall(r"stablehlo.dot_general.*-> tensor<8x8x(\w+)>", text)
    assert grams == [product_dtype, "f32"] * 5


def test_folded_iteration_of_a_tall_stack_is_the_transposed_iteration():
    # tall=True iterates Y^T as stored: in float64 the same numbers as transposing in and
    # out, and in bf16 as near the fp32 result as the transposed iteration.
    table = ns_lib._coefficient_schedule("quintic", 5)
    x = _rng_matrix(5, 3, 9, 4)
    with jax.enable_x64(True):
        start = x.astype(np.float64) / np.linalg.norm(x, axis=(-2, -1), keepdims=True)
        x64 = jnp.asarray(start)
        kwargs = dict(steps=table, precision=jax.lax.Precision.HIGHEST, acc_dtype=jnp.float64)
        stored = np.asarray(ns_lib._iterate_folded(x64, tall=True, **kwargs))
        transposed = np.asarray(
            ns_lib._iterate_folded(jnp.swapaxes(x64, -1, -2), **kwargs)
        ).swapaxes(-1, -2)
    np.testing.assert_allclose(stored, transposed, rtol=0, atol=1e-12)
    assert np.abs(stored - start).max() > 0.1  # the iteration did something
    kwargs = dict(steps=table, precision=jax.lax.Precision.DEFAULT, acc_dtype=jnp.float32)
    y = jnp.asarray(x / np.linalg.norm(x, axis=(-2, -1), keepdims=True)).astype(jnp.bfloat16)
    with jax.disable_jit():
        stored = np.asarray(ns_lib._iterate_folded(y, tall=True, **kwargs).astype(jnp.float32))
        transposed = np.asarray(
            ns_lib._iterate_folded(jnp.swapaxes(y, -1, -2), **kwargs).astype(jnp.float32)
        )
    np.testing.assert_allclose(stored, transposed.swapaxes(-1, -2), rtol=0, atol=2e-2)


@pytest.mark.parametrize("shape", [(2, 12, 5), (2, 5, 12)], ids=["tall", "wide"])
def test_newton_schulz_cuda_branch_is_megatrons_result_up_to_rounding(monkeypatch, shape):
    # The CUDA branch (normalisation, then the folded iteration, tall matrices as stored)
    # run here on the CPU in fp32: the same numbers as Megatron's order up to rounding. The
    # input is far from unit norm, so a branch that skipped the normalisation would diverge.
    x = jnp.asarray(_rng_matrix(7, *shape) * 30)
    megatron = np.asarray(newton_schulz(x, precision="highest"))
    monkeypatch.setattr(jax.lax, "platform_dependent", lambda *args, cuda, default: cuda(*args))
    on_cuda = np.asarray(newton_schulz(x, precision="highest"))
    np.testing.assert_allclose(on_cuda, megatron, rtol=0, atol=2e-5)
    assert np.abs(megatron).max() > 0.1


@pytest.mark.parametrize(
    "platform, transposes, products",
    [
        ("cuda", 0, ["8x8xbf16", "8x8xf32", "24x8xbf16"]),
        ("cpu", 7, ["8x8xf32", "8x8xf32", "8x24xf32"]),
    ],
)
def test_newton_schulz_on_cuda_iterates_a_tall_matrix_as_stored(platform, transposes, products):
    # Off CUDA a tall matrix is transposed in and out (Megatron's order); on CUDA the
    # products contract the axes they need, with no transpose pass, and each update comes
    # out [24, 8].
    fn = jax.jit(lambda x: newton_schulz(x, "quintic", precision="medium"))
    text = jax.export.export(fn, platforms=[platform])(jnp.ones((24, 8), jnp.float32)).mlir_module()
    assert len(re.findall("stablehlo.transpose", text)) == transposes
    assert re.findall(r"stablehlo.dot_general.*-> tensor<(\w+)>", text) == products * 5


@pytest.mark.parametrize("coefficient_type", COEFFICIENT_TYPES)
def test_newton_schulz_on_cuda_stays_as_near_fp32_as_megatrons_order(coefficient_type):
    # 24 matrices 64 x 256 whose top singular value takes 0.05..0.99 of the Frobenius norm, the rest
    # equal. In bf16 the folded factor's diagonal rounds mostly one way; tables that cannot take
    # that (polar_express: 1.3x the error here, cans: 2.3x) must run Megatron's order on CUDA.
    # Eager: under jit, XLA on CPU may keep the bf16 intermediates in fp32.
    rng = np.random.default_rng(10)
    m, n = 64, 256
    u, _ = np.linalg.qr(rng.standard_normal((m, m)))
    v, _ = np.linalg.qr(rng.standard_normal((n, m)))
    top = np.linspace(0.05, 0.99, 24)[:, None]
    sigma = np.concatenate([top, np.repeat(np.sqrt((1 - top**2) / (m - 1)), m - 1, axis=1)], axis=1)
    x = jnp.asarray(np.einsum("ij,bj,kj->bik", u, sigma, v), jnp.float32)
    steps = ns_lib._coefficient_schedule(coefficient_type, 5)
    reference = np.asarray(
        ns_lib._iterate_exact(x, steps, precision=jax.lax.Precision.HIGHEST, acc_dtype=jnp.float32)
    )
    on_cuda = (
        ns_lib._iterate_folded
        if coefficient_type in ns_lib._FOLDED_TABLES
        else ns_lib._iterate_exact
    )
    errors = {}
    with jax.disable_jit():
        for name, fn in (("megatron", ns_lib._iterate_exact), ("cuda", on_cuda)):
            out = np.asarray(
                fn(
                    x.astype(jnp.bfloat16),
                    steps,
                    precision=jax.lax.Precision.DEFAULT,
                    acc_dtype=jnp.float32,
                )
            )
            errors[name] = np.sqrt(np.mean((out - reference) ** 2) / np.mean(reference**2))
    assert errors["cuda"] <= 1.1 * errors["megatron"], errors


@pytest.mark.parametrize("precision", ["highest", "medium"])
@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 2, 9, 4)], ids=["wide_b3", "tall_b2x2"])
def test_newton_schulz_batched_equals_per_matrix(shape, precision):
    x = _rng_matrix(1, *shape)
    batched = np.asarray(newton_schulz(jnp.asarray(x), "cans", 6, precision=precision))
    flat_in = x.reshape(-1, *shape[-2:])
    singles = np.stack(
        [np.asarray(newton_schulz(jnp.asarray(m), "cans", 6, precision=precision)) for m in flat_in]
    )
    np.testing.assert_allclose(batched, singles.reshape(shape), rtol=0, atol=1e-6)


@pytest.mark.parametrize("branch", ["default", "cuda"])
@pytest.mark.parametrize("precision", ["highest", "medium"])
def test_newton_schulz_many_is_each_stacks_newton_schulz(monkeypatch, branch, precision):
    # The matrices of every stack of one [m, n] are joined and iterated as one, whatever
    # their leading axes (a lone matrix among them), the others alongside: each comes back
    # as newton_schulz of it alone, in Megatron's order and in the folded CUDA iteration
    # (run here on the CPU).
    if branch == "cuda":
        monkeypatch.setattr(jax.lax, "platform_dependent", lambda *a, cuda, default: cuda(*a))
    shapes = [(2, 5, 7), (9, 4), (2, 5, 7), (2, 3, 5, 7), (9, 4), (1, 9, 4), (2, 3, 5, 7), (6, 6)]
    xs = [jnp.asarray(_rng_matrix(20 + k, *shape) * 3) for k, shape in enumerate(shapes)]
    together = newton_schulz_many(xs, "quintic", 5, precision=precision)
    for x, out in zip(xs, together):
        alone = newton_schulz(x, "quintic", 5, precision=precision)
        assert out.shape == x.shape and out.dtype == alone.dtype
        np.testing.assert_array_equal(np.asarray(out), np.asarray(alone))
    assert newton_schulz_many([]) == []


def test_newton_schulz_many_names_the_stack_it_turns_down():
    with pytest.raises(ValueError, match=r"xs\[1\].dtype=bfloat16"):
        newton_schulz_many([jnp.ones((4, 4)), jnp.ones((4, 4), jnp.bfloat16)])
    with pytest.raises(ValueError, match=r"xs\[0\]"):
        newton_schulz_many([jnp.ones((4,))])


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("coefficient_type", COEFFICIENT_TYPES)
def test_newton_schulz_zero_matrix_stays_exactly_zero(coefficient_type, precision):
    x = np.stack([np.zeros((6, 4), np.float32), _rng_matrix(2, 6, 4)])
    out = np.asarray(newton_schulz(jnp.asarray(x), coefficient_type, 5, precision=precision))
    np.testing.assert_array_equal(out[0], 0.0)
    assert np.abs(out[1]).max() > 0.1


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_newton_schulz_preserves_narrow_dtype(dtype):
    x = jnp.asarray(_NOTES_G).astype(dtype)
    out = newton_schulz(x, precision="highest")
    assert out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), _NOTES_HIGHEST, rtol=0, atol=2e-2)


def test_newton_schulz_jits():
    fn = jax.jit(
        functools.partial(
            newton_schulz, coefficient_type="aol", num_ns_steps=4, precision="highest"
        )
    )
    x = jnp.asarray(_INPUTS["32x8"])
    np.testing.assert_allclose(
        np.asarray(fn(x)), np.asarray(newton_schulz(x, "aol", 4)), rtol=0, atol=1e-6
    )


# --- get_muon_scale_factor ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    _FIXTURE["scale_factors"],
    ids=[f"{c['size_out']}x{c['size_in']}_{c['mode']}" for c in _FIXTURE["scale_factors"]],
)
def test_get_muon_scale_factor_matches_fixture(case):
    value = get_muon_scale_factor(case["size_out"], case["size_in"], case["mode"])
    assert type(value) is float
    assert value == case["value"]


# --- orthogonalize -----------------------------------------------------------------------------


@pytest.mark.parametrize("scale_mode", SCALE_MODES)
@pytest.mark.parametrize("shape", [(12, 5), (5, 12)], ids=["tall", "wide"])
def test_orthogonalize_is_scaled_newton_schulz(shape, scale_mode):
    u = jnp.asarray(_rng_matrix(3, 2, *shape))
    out = orthogonalize(u, scale_mode=scale_mode, extra_scale_factor=0.2, precision="highest")
    expected = np.asarray(newton_schulz(u)) * get_muon_scale_factor(*shape, scale_mode) * 0.2
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6, atol=0)


def _orthogonalize_qkv_by_hand(u, split, **kwargs):
    """Gather each piece's rows with explicit indices, orthogonalise it, scatter it back."""
    total = sum(split)
    groups = u.shape[-2] // total
    out = np.zeros_like(u)
    offset = 0
    for rows in split:
        idx = np.concatenate([g * total + offset + np.arange(rows) for g in range(groups)])
        out[:, idx] = np.asarray(orthogonalize(jnp.asarray(u[:, idx]), **kwargs))
        offset += rows
    return out


@pytest.mark.parametrize(
    "split, scale_mode",
    [
        ((4, 2, 2), "spectral"),
        ((4, 2, 2), "unit_rms_norm"),
        ((4, 4, 2, 2), "unit_rms_norm"),
        ((2, 4, 2), "spectral"),
    ],
    ids=["qkv_spectral", "qkv_unit_rms_norm", "gated_qqkv_unit_rms_norm", "equal_pieces_apart"],
)
def test_orthogonalize_qkv_split_matches_manual_row_blocks(split, scale_mode):
    groups, cols = 3, 10
    u = _rng_matrix(4, 2, groups * sum(split), cols)
    kwargs = dict(scale_mode=scale_mode, extra_scale_factor=0.2, precision="highest")
    out = np.asarray(orthogonalize(jnp.asarray(u), qkv_split_shapes=split, **kwargs))
    np.testing.assert_allclose(
        out, _orthogonalize_qkv_by_hand(u, split, **kwargs), rtol=0, atol=1e-6
    )
    whole = np.asarray(orthogonalize(jnp.asarray(u), **kwargs))
    assert np.abs(out - whole).max() > 1e-2


def test_orthogonalize_qkv_split_rejects_indivisible_rows():
    with pytest.raises(
        ValueError, match=r"orthogonalize: .*divisible by sum\(qkv_split_shapes\)=8.*rows=20"
    ):
        orthogonalize(jnp.ones((20, 6)), qkv_split_shapes=(4, 2, 2))


# --- muon_update -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", _MUON_CASES, ids=[c["id"] for c in _MUON_CASES])
def test_muon_update_matches_fixture_three_steps(case):
    kwargs = case["kwargs"]
    config = _config_from_kwargs(kwargs)
    step = functools.partial(muon_update, config=config)  # eager; jit is covered below
    param = jnp.asarray(np.asarray(case["param_init"], np.float32))
    mom = jnp.zeros_like(param)
    for t in range(3):
        grad = jnp.asarray(np.asarray(case["grads"][t], np.float32))
        param, mom = step(
            param, grad, mom, learning_rate=kwargs["lr"], weight_decay=kwargs["weight_decay"]
        )
        assert param.dtype == mom.dtype == jnp.float32
        # Observed max |error| is 4.5e-8 for params (|P| <= 0.31) and 2.2e-8 for momentum.
        np.testing.assert_allclose(
            np.asarray(param), case["params_after_step"][t], rtol=0, atol=1e-7
        )
        np.testing.assert_allclose(
            np.asarray(mom), case["momentum_after_step"][t], rtol=0, atol=1e-7
        )


@pytest.mark.parametrize("nesterov", [False, True], ids=["plain", "nesterov"])
def test_muon_update_first_step_matches_megatron_notes_formula(nesterov):
    # notes §3: P1 = P0 (1 - lr wd) - lr sqrt(6) extra NS(G), whatever beta and Nesterov are.
    lr, wd, extra = 0.02, 0.1, 0.2
    config = MuonConfig(
        momentum=0.9, nesterov=nesterov, extra_scale_factor=extra, fp32_matmul_prec="highest"
    )
    p0 = _rng_matrix(5, 4, 6)
    p1, m1 = muon_update(
        jnp.asarray(p0),
        jnp.asarray(_NOTES_G),
        jnp.zeros((4, 6)),
        learning_rate=lr,
        weight_decay=wd,
        config=config,
    )
    expected = p0 * (1 - lr * wd) - lr * np.sqrt(6) * extra * _NOTES_HIGHEST
    np.testing.assert_allclose(np.asarray(p1), expected, rtol=0, atol=2e-7)
    np.testing.assert_allclose(np.asarray(m1), 0.1 * _NOTES_G, rtol=1e-6, atol=0)


def test_muon_update_jit_with_traced_hyperparameters_matches_eager():
    config = MuonConfig(nesterov=True, fp32_matmul_prec="highest", extra_scale_factor=0.2)
    p, g, m = (jnp.asarray(_rng_matrix(s, 3, 8, 5)) for s in (6, 7, 8))
    eager = muon_update(p, g, m, learning_rate=0.01, weight_decay=0.1, config=config)

    @jax.jit
    def step(p, g, m, lr, wd):
        return muon_update(p, g, m, learning_rate=lr, weight_decay=wd, config=config)

    jitted = step(p, g, m, jnp.float32(0.01), jnp.float32(0.1))
    for a, b in zip(jitted, eager):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_muon_update_batched_equals_per_matrix():
    config = MuonConfig(nesterov=True, fp32_matmul_prec="highest")
    p, g, m = (_rng_matrix(s, 4, 6, 9) for s in (9, 10, 11))
    bp, bm = muon_update(
        *map(jnp.asarray, (p, g, m)), learning_rate=0.02, weight_decay=0.01, config=config
    )
    for i in range(4):
        sp, sm = muon_update(
            *map(jnp.asarray, (p[i], g[i], m[i])),
            learning_rate=0.02,
            weight_decay=0.01,
            config=config,
        )
        np.testing.assert_allclose(np.asarray(bp[i]), np.asarray(sp), rtol=0, atol=1e-7)
        np.testing.assert_allclose(np.asarray(bm[i]), np.asarray(sm), rtol=0, atol=0)


def test_muon_update_zero_grad_only_decays():
    p = _rng_matrix(12, 2, 6, 4)
    zeros = jnp.zeros_like(p)
    new_p, new_m = muon_update(
        jnp.asarray(p), zeros, zeros, learning_rate=0.5, weight_decay=0.1, config=MuonConfig()
    )
    np.testing.assert_array_equal(np.asarray(new_m), 0.0)
    np.testing.assert_allclose(np.asarray(new_p), p - 0.05 * p, rtol=1e-7, atol=0)


@pytest.mark.parametrize("split_qkv", [True, False], ids=["split", "no_split"])
def test_muon_update_passes_qkv_split_only_when_enabled(split_qkv):
    config = MuonConfig(split_qkv=split_qkv, fp32_matmul_prec="highest")
    g = _rng_matrix(13, 16, 6)
    new_p, _ = muon_update(
        jnp.zeros((16, 6)),
        jnp.asarray(g),
        jnp.zeros((16, 6)),
        learning_rate=1.0,
        weight_decay=0.0,
        config=config,
        qkv_split_shapes=(4, 2, 2),
    )
    expected = orthogonalize(
        jnp.asarray(0.05 * g),
        precision="highest",
        qkv_split_shapes=(4, 2, 2) if split_qkv else None,
    )
    np.testing.assert_allclose(np.asarray(new_p), -np.asarray(expected), rtol=0, atol=1e-6)


@pytest.mark.parametrize("nesterov", [False, True])
def test_muon_polar_skip_hands_back_the_momentum_bit_for_bit(nesterov):
    config = MuonConfig(nesterov=nesterov)
    momentum = _rng_matrix(11, 2, 6, 8)
    momentum[0, 0, :3] = [
        -0.0,
        1e-40,
        -1e-41,
    ]  # bits arithmetic would not keep (CPU flushes subnormals)
    grad = _rng_matrix(12, 2, 6, 8)
    grad[1, 2, 3] = np.nan
    _, kept = muon_polar(
        jnp.asarray(grad), jnp.asarray(momentum), config=config, skip=jnp.asarray(True)
    )
    assert np.asarray(kept).tobytes() == momentum.tobytes()
    grad[1, 2, 3] = 0.5
    want = muon_polar(jnp.asarray(grad), jnp.asarray(momentum), config=config)
    got = muon_polar(
        jnp.asarray(grad), jnp.asarray(momentum), config=config, skip=jnp.asarray(False)
    )
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("precision, stored", [("medium", jnp.bfloat16), ("highest", jnp.float32)])
def test_muon_polar_keeps_newton_schulz_dtype_and_apply_polar_makes_the_direction(
    precision, stored
):
    # beta = 0.75 and inputs on a 1/16 grid: the momentum and the Nesterov input are exact in fp32,
    # whatever order they are computed in, so every check below can be bitwise or nearly.
    beta, gamma = 0.75, 0.3
    config = MuonConfig(
        momentum=beta,
        nesterov=True,
        scale_mode="unit_rms_norm",
        extra_scale_factor=gamma,
        fp32_matmul_prec=precision,
    )
    g, m = (np.round(_rng_matrix(seed, 2, 16, 6) * 16) / 16 for seed in (21, 22))
    polar, new_m = muon_polar(
        jnp.asarray(g), jnp.asarray(m), config=config, qkv_split_shapes=(4, 2, 2)
    )
    assert polar.dtype == stored and new_m.dtype == jnp.float32
    want_m = beta * m.astype(np.float64) + (1 - beta) * g
    np.testing.assert_array_equal(np.asarray(new_m), want_m)
    # Two query groups of (q, k, v) = (4, 2, 2) rows; each piece is one [2 * rows, 6] matrix
    # over both groups.
    nesterov = (g + beta * (want_m - g)).astype(np.float32).reshape(2, 2, 8, 6)
    polar_groups = np.asarray(polar.astype(jnp.float32)).reshape(2, 2, 8, 6)
    # The direction as apply_polar applies it: -apply_polar(0, Q) with unit learning rate
    # and no decay.
    direction = -apply_polar(
        jnp.zeros(polar.shape, jnp.float32),
        polar,
        learning_rate=1.0,
        weight_decay=0.0,
        config=config,
        qkv_split_shapes=(4, 2, 2),
    )
    assert direction.dtype == jnp.float32
    direction_groups = np.asarray(direction).reshape(2, 2, 8, 6)
    for rows in (slice(0, 4), slice(4, 6), slice(6, 8)):  # q, k, v
        size = 2 * (rows.stop - rows.start)
        q = polar_groups[:, :, rows].reshape(2, size, 6)
        want_q = newton_schulz(
            jnp.asarray(nesterov[:, :, rows].reshape(2, size, 6)), precision=precision
        )
        np.testing.assert_array_equal(
            q, np.asarray(want_q)
        )  # Newton–Schulz's output, not rounded again
        # O = Q s gamma in fp32, s = sqrt(m / n) of the piece (unit_rms_norm).
        want = q.astype(np.float64) * math.sqrt(size / 6) * gamma
        np.testing.assert_allclose(
            direction_groups[:, :, rows].reshape(2, size, 6), want, rtol=1e-6, atol=0
        )
    # Whole matrices: Q is Newton–Schulz's own output, rounded to nothing coarser than it
    # was computed in.
    whole = MuonConfig(fp32_matmul_prec=precision, extra_scale_factor=gamma)
    polar, new_m = muon_polar(jnp.asarray(g), jnp.asarray(m), config=whole)
    direction = -apply_polar(
        jnp.zeros(polar.shape, jnp.float32),
        polar,
        learning_rate=1.0,
        weight_decay=0.0,
        config=whole,
    )
    expected = newton_schulz(new_m, precision=precision) * get_muon_scale_factor(16, 6) * gamma
    np.testing.assert_array_equal(np.asarray(direction), np.asarray(expected))


# --- argument checking -------------------------------------------------------------------------

_X = jnp.ones((4, 6))


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (
            lambda: newton_schulz(_X, "quartic"),
            ValueError,
            r"newton_schulz: coefficient_type .*got coefficient_type='quartic'",
        ),
        (
            lambda: newton_schulz(_X, num_ns_steps=0),
            ValueError,
            r"newton_schulz: num_ns_steps .*got num_ns_steps=0",
        ),
        (
            lambda: newton_schulz(_X, num_ns_steps=2.0),
            TypeError,
            r"newton_schulz: num_ns_steps must be an int",
        ),
        (
            lambda: newton_schulz(jnp.ones(6)),
            ValueError,
            r"newton_schulz: x must have rank >= 2.*x.shape=\(6,\)",
        ),
        (
            lambda: newton_schulz(jnp.ones((4, 6), jnp.int32)),
            TypeError,
            r"newton_schulz: x must .*floating.*int32",
        ),
        (
            lambda: newton_schulz(_X, precision="low"),
            ValueError,
            r"newton_schulz: precision .*got precision='low'",
        ),
        (lambda: newton_schulz(_X, eps=0.0), ValueError, r"newton_schulz: eps .*got eps=0.0"),
        (
            lambda: get_muon_scale_factor(4, 6, "rms"),
            ValueError,
            r"get_muon_scale_factor: mode .*got mode='rms'",
        ),
        (
            lambda: get_muon_scale_factor(0, 6),
            ValueError,
            r"get_muon_scale_factor: size_out .*got size_out=0",
        ),
        (
            lambda: orthogonalize(_X, scale_mode="x"),
            ValueError,
            r"orthogonalize: scale_mode .*got scale_mode='x'",
        ),
        (
            lambda: orthogonalize(_X, qkv_split_shapes=(4, 0)),
            ValueError,
            r"orthogonalize: qkv_split_shapes",
        ),
        (
            lambda: orthogonalize(_X, qkv_split_shapes=4),
            TypeError,
            r"orthogonalize: qkv_split_shapes .*int",
        ),
        (
            lambda: muon_update(_X, _X, _X, learning_rate=1.0, weight_decay=0.0, config={}),
            TypeError,
            r"muon_update: config must be a MuonConfig",
        ),
        (
            lambda: muon_update(
                _X, _X.T, _X, learning_rate=1.0, weight_decay=0.0, config=MuonConfig()
            ),
            ValueError,
            r"muon_update: .*grad.shape=\(6, 4\)",
        ),
        (
            lambda: muon_polar(_X, _X[:3], config=MuonConfig()),
            ValueError,
            r"muon_polar: grad, momentum must share a shape; .*momentum.shape=\(3, 6\)",
        ),
        (
            lambda: apply_polar(
                _X, jnp.ones(6), learning_rate=1.0, weight_decay=0.0, config=MuonConfig()
            ),
            ValueError,
            r"apply_polar: polar must have rank >= 2",
        ),
        (
            lambda: muon_polar(_X, _X, config=None),
            TypeError,
            r"muon_polar: config must be a MuonConfig",
        ),
        (
            lambda: apply_polar(_X, _X, learning_rate=1.0, weight_decay=0.0, config=None),
            TypeError,
            r"apply_polar: config must be a MuonConfig",
        ),
        (
            lambda: apply_polar(_X, _X.T, learning_rate=1.0, weight_decay=0.0, config=MuonConfig()),
            ValueError,
            r"apply_polar: param, polar must share a shape; .*polar.shape=\(6, 4\)",
        ),
    ],
    ids=[
        "ns_coefficient_type",
        "ns_steps_zero",
        "ns_steps_float",
        "ns_rank1",
        "ns_int_dtype",
        "ns_precision",
        "ns_eps",
        "scale_mode",
        "scale_size",
        "orth_scale_mode",
        "orth_split_zero",
        "orth_split_int",
        "update_config",
        "update_shapes",
        "polar_shapes",
        "apply_rank1",
        "polar_config",
        "apply_config",
        "apply_shapes",
    ],
)
def test_bad_arguments_raise_naming_the_argument(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("scale_mode", "rms", ValueError),
        ("coefficient_type", "custom", ValueError),
        ("fp32_matmul_prec", "low", ValueError),
        ("num_ns_steps", 0, ValueError),
        ("num_ns_steps", 5.0, TypeError),
        ("momentum", 1.0, ValueError),
        ("momentum", float("nan"), ValueError),
        ("nesterov", 1, TypeError),
        ("split_qkv", "yes", TypeError),
        ("extra_scale_factor", "0.2", TypeError),
    ],
    ids=[
        "scale_mode",
        "coefficient_type",
        "precision",
        "ns_steps_zero",
        "ns_steps_float",
        "momentum_one",
        "momentum_nan",
        "nesterov_int",
        "split_qkv_str",
        "extra_scale_str",
    ],
)
def test_muon_config_rejects_bad_fields(field, value, error):
    with pytest.raises(error, match=rf"^MuonConfig\.{field} must"):
        MuonConfig(**{field: value})


def test_muon_config_is_hashable_and_frozen():
    config = MuonConfig()
    assert hash(config) == hash(MuonConfig())
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.momentum = 0.9


def test_muon_module_docstring_examples_run():
    for module in (muon, ns_lib):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("optax_name,ours", [("standard", "simple"), ("dion", "quintic")])
def test_optax_coefficient_names_are_aliases_of_the_same_tables(optax_name, ours):
    """optax.contrib.muon's presets orthogonalise as lwjax's tables of the other name do."""
    import optax

    assert MuonConfig(coefficient_type=optax_name).coefficient_type == ours
    g = jax.random.normal(jax.random.key(0), (16, 24))
    tx = optax.contrib.muon(
        learning_rate=1.0, ns_coeffs=optax_name, ns_steps=5, beta=0.0, weight_decay=0.0
    )
    (update,), _ = tx.update([g], tx.init([g]), [g])
    update = -update  # optax returns the step, -lr times the direction
    for name in (optax_name, ours):
        polar = ns_lib.newton_schulz(g, coefficient_type=name, precision="highest")
        cosine = jnp.sum(update * polar) / (jnp.linalg.norm(update) * jnp.linalg.norm(polar))
        assert float(cosine) > 1 - 1e-5, (name, float(cosine))


# --- blocks of split matrices, without a mesh ---------------------------------------------------


def _sum_over_blocks(x):
    """A ``psum`` without a mesh: the blocks of each matrix lie on the last batch axis
    (``[..., blocks, m, n]``); each becomes their sum."""
    return jnp.broadcast_to(jnp.sum(x, axis=-3, keepdims=True), x.shape)


def _blocks(x, count, dim):
    """``[..., m, n]`` cut along ``dim`` into ``[..., count, m', n']``."""
    return jnp.stack(jnp.split(x, count, axis=dim), axis=-3)


def _joined(blocks, dim):
    """The inverse of :func:`_blocks`."""
    return jnp.concatenate([blocks[..., j, :, :] for j in range(blocks.shape[-3])], axis=dim)


@dataclasses.dataclass(frozen=True)
class _StackedBlocks:
    """A ``lwjax.muon._BlockExchange`` without a mesh: ``count`` blocks of each matrix,
    split along ``dim``, on the last batch axis; Newton–Schulz iterates on them, its sums reduced
    over the blocks (the ``distributed`` mode's arithmetic)."""

    count: int
    dim: int

    def orthogonalizer(self, ns):
        return functools.partial(ns, sharded=(_sum_over_blocks, self.dim))

    def whole_shape(self, shape):
        m, n = shape
        return (m * self.count, n) if self.dim == -2 else (m, n * self.count)


_QUINTIC_5 = [c for c in _NS_CASES if c["coefficient_type"] == "quintic" and c["steps"] == 5]


@pytest.mark.parametrize("dim", [-2, -1], ids=["rows", "cols"])
@pytest.mark.parametrize("case", _QUINTIC_5, ids=[c["id"] for c in _QUINTIC_5])
def test_newton_schulz_on_blocks_with_a_plain_reduce_matches_fp64_reference(case, dim):
    with jax.enable_x64(True):
        x = jnp.asarray(_INPUTS[case["input"]].astype(np.float64))
        out = newton_schulz(
            _blocks(x, 2, dim),
            case["coefficient_type"],
            case["steps"],
            eps=case["eps"],
            precision="highest",
            sharded=(_sum_over_blocks, dim),
        )
        out = np.asarray(_joined(out, dim))
    np.testing.assert_allclose(out, np.asarray(case["output_fp64_reference"]), rtol=0, atol=1e-12)


def test_newton_schulz_sharded_takes_a_reduce_not_an_axis_name():
    with pytest.raises(TypeError, match=r"sharded=\(reduce, dim\) takes a callable"):
        newton_schulz(_X, sharded=("tp", -1))


@pytest.mark.parametrize("dim, split", [(-1, (4, 2, 2)), (-2, None)], ids=["cols_qkv", "rows"])
def test_muon_halves_on_blocks_equal_muon_update_of_the_whole_in_float64(dim, split):
    config = MuonConfig(
        nesterov=True,
        scale_mode="unit_rms_norm",
        extra_scale_factor=0.3,
        fp32_matmul_prec="highest",
    )
    exchange = _StackedBlocks(2, dim)

    # Each side jitted whole: one compilation instead of one per eager op and shape (float64
    # leaves rounding far below the tolerances either way).
    @jax.jit
    def whole(p, g, m):
        return muon_update(
            p, g, m, learning_rate=0.1, weight_decay=0.05, config=config, qkv_split_shapes=split
        )

    @jax.jit
    def on_blocks(p, g, m):
        polar, got_m = muon_polar(
            _blocks(g, 2, dim),
            _blocks(m, 2, dim),
            config=config,
            qkv_split_shapes=split,
            exchange=exchange,
        )
        got_p = apply_polar(
            _blocks(p, 2, dim),
            polar,
            learning_rate=0.1,
            weight_decay=0.05,
            config=config,
            qkv_split_shapes=split,
            exchange=exchange,
        )
        return _joined(got_p, dim), _joined(got_m, dim)

    with jax.enable_x64(True):
        p, g, m = (jnp.asarray(_rng_matrix(seed, 3, 16, 12), jnp.float64) for seed in (31, 32, 33))
        want_p, want_m = whole(p, g, m)
        got_p, got_m = (np.asarray(x) for x in on_blocks(p, g, m))
    np.testing.assert_allclose(got_m, np.asarray(want_m), rtol=0, atol=1e-15)
    np.testing.assert_allclose(got_p, np.asarray(want_p), rtol=0, atol=1e-12)
