"""How far apart runs that should agree end: the demo's tiny GPT, 20 steps, 8 virtual CPU devices.

For each Newton–Schulz precision (``MuonConfig(fp32_matmul_prec=...)``) it trains the same
model from the same weights on the same batches three times: ``make_train_step`` at dp 1 and at
dp 8, and the optax form (``jax.grad`` and ``opt.update`` under ``jax.jit``) at dp 8, and prints
the largest parameter difference of each pair. Numbers: docs/troubleshooting.md
("Reproducibility"). Run: ``python3 docs/scripts/reproducibility.py`` (about 2 minutes on 2 CPU
cores). ``tests/test_reproducibility.py`` checks the same on a small MLP.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import lwjax  # noqa: E402
from lwjax.tools.demo.data import load_stdlib_corpus, train_batches  # noqa: E402
from lwjax.tools.demo.model import GPT, MODEL_SIZES, make_loss_fn  # noqa: E402

STEPS = 20
graphdef, PARAMS, rest = nnx.split(GPT(MODEL_SIZES["tiny"], rngs=nnx.Rngs(0)), nnx.Param, ...)
loss_fn = make_loss_fn(graphdef, rest)
_batches = train_batches(load_stdlib_corpus(max_bytes=200_000).train, 16, 64, seed=0)
BATCHES = [next(_batches) for _ in range(STEPS)]


def run(dp: int, precision: str, optax_form: bool = False):
    """The parameters after ``STEPS`` steps at ``dp`` devices."""
    mesh = Mesh(np.array(jax.devices()[:dp]), ("dp",))
    muon = lwjax.MuonConfig(fp32_matmul_prec=precision)
    opt = lwjax.layerwise_muon(PARAMS, mesh, learning_rate=0.02, muon=muon)
    params, state = PARAMS, opt.init(PARAMS)
    if not optax_form:
        step = lwjax.make_train_step(loss_fn, opt, donate=False)
        for batch in BATCHES:
            params, state, _ = step(params, state, batch)
        return params

    @jax.jit
    def optax_step(params, state, batch):
        updates, state = opt.update(jax.grad(loss_fn)(params, batch), state, params)
        return optax.apply_updates(params, updates), state

    for batch in BATCHES:
        params, state = optax_step(
            params, state, jax.device_put(batch, NamedSharding(mesh, P("dp")))
        )
    return params


def max_difference(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


if __name__ == "__main__":
    for precision in ("highest", "medium"):
        dp8 = run(8, precision)
        print(
            f"{precision}: dp 8 against dp 1 {max_difference(dp8, run(1, precision)):.2g}, "
            f"make_train_step against the optax form "
            f"{max_difference(dp8, run(8, precision, optax_form=True)):.2g}, "
            f"parameters moved by up to {max_difference(dp8, PARAMS):.2g}"
        )
