"""The upper-tile Gram kernel (lwjax.gram), run in Pallas' interpreter on the CPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwjax import gram
from lwjax import newton_schulz as ns_lib


@pytest.fixture
def small_grams(monkeypatch):
    """Let the kernel take 256-edge Gram matrices (two tiles a side) and run it interpreted."""
    monkeypatch.setattr(gram, "MIN_SIZE", 2 * gram.BLOCK)
    monkeypatch.setattr(gram, "upper_gram", functools.partial(gram.upper_gram, interpret=True))
    monkeypatch.setattr(gram, "polynomial", functools.partial(gram.polynomial, interpret=True))
    monkeypatch.setattr(gram, "upper_grams", functools.partial(gram.upper_grams, interpret=True))
    monkeypatch.setattr(gram, "polynomials", functools.partial(gram.polynomials, interpret=True))


def _bf16(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.bfloat16)


@pytest.mark.parametrize(
    "axis, shape", [(-1, (2, 256, 192)), (-2, (2, 3, 320, 256))], ids=["wide", "tall_2x3"]
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_upper_gram_matches_float64_and_is_exactly_symmetric(small_grams, axis, shape, dtype):
    x = _bf16(0, *shape)
    out = np.asarray(gram.upper_gram(x, axis, dtype), np.float64)
    x64 = np.asarray(x, np.float64)
    expected = x64 @ np.swapaxes(x64, -1, -2) if axis == -1 else np.swapaxes(x64, -1, -2) @ x64
    assert out.shape == expected.shape
    np.testing.assert_array_equal(out, np.swapaxes(out, -1, -2))
    # fp32 accumulation of exact bf16 products; a bf16 output rounds once more (8 bits).
    rtol = 2.0**-7 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(out, expected, rtol=rtol, atol=rtol * np.abs(expected).max())


@pytest.mark.parametrize("shape", [(2, 256, 256), (2, 3, 384, 384)], ids=["2", "2x3"])
def test_polynomial_is_the_factor_xla_forms_from_the_fp32_square(small_grams, shape):
    """The kernel's ``a I + b A + c A A^T`` against the same sums formed by XLA from
    ``upper_gram``'s fp32 square (the previous step), and against float64: symmetric
    exactly, and within the one bf16 rounding both share."""
    x = _bf16(1, *shape[:-1], 512)
    a_mat = gram.upper_gram(x, -1, jnp.bfloat16) / 512
    a_mat = a_mat.astype(jnp.bfloat16)
    a, b, c = 3.4445, -4.7750, 2.0315
    out = np.asarray(gram.polynomial(a_mat, (a, b, c)), np.float64)
    square = gram.upper_gram(a_mat, -1, jnp.float32)
    eye = jnp.eye(shape[-1], dtype=jnp.float32)
    xla = np.asarray((a * eye + b * a_mat.astype(jnp.float32) + c * square).astype(jnp.bfloat16))
    np.testing.assert_array_equal(out, np.swapaxes(out, -1, -2))
    np.testing.assert_array_equal(out, xla.astype(np.float64))
    a64 = np.asarray(a_mat, np.float64)
    expected = a * np.eye(shape[-1]) + b * a64 + c * a64 @ a64
    np.testing.assert_allclose(out, expected, rtol=2.0**-7, atol=2.0**-7 * np.abs(expected).max())


def test_polynomial_rejects_a_stack_that_is_not_square():
    with pytest.raises(ValueError, match=r"gram.shape=\(2048, 4096\)"):
        gram.polynomial(jnp.zeros((2048, 4096), jnp.bfloat16), (1.0, 1.0, 1.0))


@pytest.mark.parametrize(
    "shape, axis, dtype, takes",
    [
        ((4, 2048, 16384), -1, jnp.bfloat16, True),
        ((16384, 2048), -2, jnp.bfloat16, True),
        ((2048, 16384), -1, jnp.float32, False),
        ((1024, 4096), -1, jnp.bfloat16, False),
        ((2100, 4096), -1, jnp.bfloat16, False),
        ((2048, 4100), -1, jnp.bfloat16, False),
        ((2048, 4096), 0, jnp.bfloat16, False),
        ((2048,), -1, jnp.bfloat16, False),
    ],
)
def test_fits_takes_only_big_aligned_bf16_stacks(shape, axis, dtype, takes):
    assert gram.fits(shape, axis, dtype) is takes


@pytest.mark.parametrize(
    "size, depth, share",
    [(2048, 16384, 17 / 32), (4096, 4096, 33 / 64), (1024, 4096, 1.0), (2048, 4100, 1.0)],
)
def test_computed_share_counts_the_tiles_on_and_above_the_diagonal(size, depth, share):
    tiles = size // gram.BLOCK
    upper = sum(1 for i in range(tiles) for j in range(tiles) if i <= j)
    assert gram.computed_share(size, depth) == pytest.approx(share)
    if share < 1:
        assert share == upper / tiles**2


def test_upper_gram_rejects_a_stack_it_does_not_fit():
    with pytest.raises(ValueError, match=r"x.shape=\(1024, 4096\)"):
        gram.upper_gram(jnp.zeros((1024, 4096), jnp.bfloat16), -1, jnp.float32)


@pytest.mark.parametrize(
    "shape, tall", [((2, 256, 448), False), ((2, 448, 256), True)], ids=["wide", "tall"]
)
def test_folded_newton_schulz_with_the_kernel_stays_as_near_fp32(
    small_grams, monkeypatch, shape, tall
):
    # The CUDA iteration with both symmetric products from the kernel, against the same
    # iteration with XLA's products: as close to an fp32 run of Megatron's order (on the
    # transpose, for a tall stack).
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    y = np.swapaxes(x, -1, -2) if tall else x
    y /= np.linalg.norm(y, axis=(-2, -1), keepdims=True)
    steps = ns_lib._coefficient_schedule("quintic", 5)
    reference = np.asarray(
        ns_lib._iterate_exact(
            jnp.asarray(y), steps, precision=jax.lax.Precision.HIGHEST, acc_dtype=jnp.float32
        )
    )
    reference = np.swapaxes(reference, -1, -2) if tall else reference
    start = jnp.asarray(np.swapaxes(y, -1, -2) if tall else y, jnp.bfloat16)
    run = functools.partial(
        ns_lib._iterate_folded,
        start,
        steps,
        precision=jax.lax.Precision.DEFAULT,
        acc_dtype=jnp.float32,
        tall=tall,
    )
    calls = []
    monkeypatch.setattr(
        gram, "upper_gram", lambda *a, _f=gram.upper_gram, **k: calls.append(a[1]) or _f(*a, **k)
    )
    monkeypatch.setattr(
        gram, "polynomial", lambda *a, _f=gram.polynomial, **k: calls.append(a[1]) or _f(*a, **k)
    )
    outs = {}
    with jax.disable_jit():
        outs["kernel"] = np.asarray(run(), np.float32)
        assert calls == [x for abc in steps for x in (-2 if tall else -1, abc)]
        monkeypatch.setattr(gram, "fits", lambda *a: False)
        outs["xla"] = np.asarray(run(), np.float32)
    errors = {
        name: np.sqrt(np.mean((out - reference) ** 2) / np.mean(reference**2))
        for name, out in outs.items()
    }
    assert errors["kernel"] <= 1.05 * errors["xla"], errors
    assert errors["xla"] < 0.01, errors


def test_kernel_is_built_once_per_stack_shape_in_a_traced_step(small_grams, monkeypatch):
    """Five Newton-Schulz steps trace one Pallas call per distinct stack shape (X and A),
    not two per step: the step's tracing and lowering then grow with the shapes, not the calls."""
    built = []
    pallas_call = gram.pl.pallas_call
    monkeypatch.setattr(
        gram.pl, "pallas_call", lambda *a, **k: built.append(1) or pallas_call(*a, **k)
    )
    steps = ns_lib._coefficient_schedule("quintic", 5)
    x = jnp.zeros((2, 256, 512), jnp.bfloat16)
    jax.clear_caches()  # the kernels' jits may hold these shapes from other tests
    jax.jit(
        lambda x: ns_lib._iterate_folded(
            x, steps, precision=jax.lax.Precision.DEFAULT, acc_dtype=jnp.float32
        )
    ).lower(x)
    assert len(built) == 2


@pytest.mark.parametrize("axis", [-1, -2], ids=["wide", "tall"])
def test_every_schedule_gives_the_same_bits(small_grams, monkeypatch, axis):
    """Either program order (matrices inner or outer) gives both kernels' outputs bit for bit:
    the schedule picked per orientation (``gram._schedule``) is free to change with speed."""
    x = _bf16(2, 3, 256, 384) if axis == -1 else _bf16(2, 3, 384, 256)
    a_mat = (gram.upper_gram(x, axis, jnp.bfloat16) / 384).astype(jnp.bfloat16)
    outs = []
    for inner in (True, False):
        jax.clear_caches()  # the kernels' jits hold the schedule they were traced with
        schedule = gram._Schedule(matrices_inner=inner, stages=3)
        monkeypatch.setattr(gram, "_schedule", lambda transposed, given=schedule: given)
        outs.append(
            (gram.upper_gram(x, axis, jnp.bfloat16), gram.polynomial(a_mat, (3.4, -4.7, 2.0)))
        )
    for first, second in zip(*outs):
        np.testing.assert_array_equal(np.asarray(first), np.asarray(second))


def test_stacks_launched_together_give_each_stack_alone_bit_for_bit(small_grams):
    """One launch over stacks of other depths, orientations and matrix counts (the deeper
    ones first, the programs matrix after matrix) computes every tile as a launch per stack,
    into one array; one factor launch over it writes each stack's factors apart."""
    xs = [
        _bf16(4, 2, 256, 640),
        _bf16(5, 3, 256, 256),
        _bf16(6, 512, 256),
        _bf16(7, 2, 2, 256, 128),
    ]
    axes = [-1, -1, -2, -1]
    counts = [2, 3, 1, 4]
    joined = gram.upper_grams(xs, axes, jnp.bfloat16)
    assert joined.shape == (sum(counts), 256, 256)
    alone = [gram.upper_gram(x, axis, jnp.bfloat16) for x, axis in zip(xs, axes)]
    np.testing.assert_array_equal(
        np.asarray(joined), np.concatenate([np.asarray(a).reshape(-1, 256, 256) for a in alone])
    )
    coefficients = (3.4, -4.7, 2.0)
    scaled = (joined / 640).astype(jnp.bfloat16)
    factors = gram.polynomials(scaled, coefficients, counts)
    ends = np.cumsum(counts)
    for out, count, end in zip(factors, counts, ends):
        assert out.shape == (count, 256, 256)
        by_itself = gram.polynomial(scaled[end - count : end], coefficients)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(by_itself))


def test_stacks_launched_together_are_checked_by_index():
    with pytest.raises(ValueError, match=r"one or more stacks, one axis each"):
        gram.upper_grams([jnp.zeros((2048, 2048), jnp.bfloat16)], [-1, -1], jnp.bfloat16)
    with pytest.raises(ValueError, match=r"one or more stacks"):
        gram.upper_grams([], [], jnp.bfloat16)
    with pytest.raises(ValueError, match=r"xs\[1\].shape=\(1024, 4096\)"):
        gram.upper_grams(
            [jnp.zeros((2048, 2048), jnp.bfloat16), jnp.zeros((1024, 4096), jnp.bfloat16)],
            [-1, -1],
            jnp.bfloat16,
        )
    with pytest.raises(ValueError, match=r"one Gram edge; xs\[0\] has 2048 and xs\[1\] has 4096"):
        gram.upper_grams(
            [jnp.zeros((2048, 2048), jnp.bfloat16), jnp.zeros((4096, 2048), jnp.bfloat16)],
            [-1, -1],
            jnp.bfloat16,
        )
    with pytest.raises(ValueError, match=r"joined.shape=\(2048, 4096\)"):
        gram.polynomials(jnp.zeros((2048, 4096), jnp.bfloat16), (1.0, 0.0, 0.0), [1])
    with pytest.raises(ValueError, match=r"joined a \[matrices, s, s\] stack"):
        gram.polynomials(jnp.zeros((2048, 2048), jnp.bfloat16), (1.0, 0.0, 0.0), [1])
    joined = jnp.zeros((2, 2048, 2048), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"summing to joined's 2 matrices; got \(1, 2\)"):
        gram.polynomials(joined, (1.0, 0.0, 0.0), [1, 2])
    for counts in (2, [], [True, True], [2, 0], [1.0, 1.0]):
        with pytest.raises(ValueError, match=r"counts a non-empty sequence of positive ints"):
            gram.polynomials(joined, (1.0, 0.0, 0.0), counts)


def test_newton_schulz_of_stacks_together_is_each_stack_alone_bit_for_bit(small_grams):
    """The CUDA iteration of several stacks in lockstep (the kernels of every stack of one
    Gram edge in one launch a step; here edges 256 and 384) against each stack's own: the
    same bits, kernel stacks and a stack the kernel does not take alike (an empty stack
    among them, which launches nothing)."""
    steps = ns_lib._coefficient_schedule("quintic", 5)
    shapes = [(2, 256, 384), (3, 384, 256), (256, 512), (2, 64, 128), (384, 640), (0, 256, 256)]
    talls = [m > n for *_, m, n in shapes]
    ys = []
    for k, shape in enumerate(shapes):
        y = np.random.default_rng(10 + k).standard_normal(shape).astype(np.float32)
        ys.append(jnp.asarray(y / np.linalg.norm(y, axis=(-2, -1), keepdims=True), jnp.bfloat16))
    options = dict(precision=jax.lax.Precision.DEFAULT, acc_dtype=jnp.float32)
    together = ns_lib._iterate_folded_together(ys, talls, steps, **options)
    for y, tall, out in zip(ys, talls, together):
        alone = ns_lib._iterate_folded(y, steps, tall=tall, **options)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(alone))
