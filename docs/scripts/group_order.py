"""Sharding groups on 4 GPUs (2 groups of 2): the collectives of one bucket in either order.

Reduce-scatter in the group then all-reduce of the shard across groups (lwjax's order), against
all-reduce across groups first; the same buffer reduce-scattered over one group of 4 as the
reference, and the all-gathers of both. Prints JSON (docs/benchmarks.md, "sharding groups").
Run on a host with at least 4 GPUs: ``python3 docs/scripts/group_order.py``.
"""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

DEVICES = np.array(jax.devices()[:4])
GROUPS = Mesh(DEVICES.reshape(2, 2), ("replica", "dp"))
ONE_GROUP = Mesh(DEVICES, ("dp",))


def per_device(fn, mesh, axes):
    """``fn`` on each device's row of a ``[devices, n]`` array."""
    spec = P(axes)
    return jax.jit(
        jax.shard_map(lambda x: fn(x[0])[None], mesh=mesh, in_specs=spec, out_specs=spec)
    )


def median_ms(fn, x, iters=20):
    fn(x).block_until_ready()
    fn(x).block_until_ready()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def main():
    both = ("replica", "dp")
    rs_then_ar = per_device(
        lambda g: lax.psum(lax.psum_scatter(g, "dp", tiled=True), "replica"), GROUPS, both
    )
    ar_then_rs = per_device(
        lambda g: lax.psum_scatter(lax.psum(g, "replica"), "dp", tiled=True), GROUPS, both
    )
    rs_one_group = per_device(lambda g: lax.psum_scatter(g, "dp", tiled=True), ONE_GROUP, "dp")
    ag_group = per_device(lambda s: lax.all_gather(s, "dp", tiled=True), GROUPS, both)
    ag_one_group = per_device(lambda s: lax.all_gather(s, "dp", tiled=True), ONE_GROUP, "dp")
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    for numel in (64 << 20, 256 << 20):  # fp32 elements per device
        x = jnp.ones((4, numel), jnp.float32)
        np.testing.assert_allclose(np.asarray(rs_then_ar(x)), np.asarray(ar_then_rs(x)))
        out[f"{numel * 4 >> 20} MiB per device"] = {
            "rs_in_group_then_ar_across_ms": median_ms(rs_then_ar, x),
            "ar_across_then_rs_in_group_ms": median_ms(ar_then_rs, x),
            "rs_one_group_of_4_ms": median_ms(rs_one_group, x),
            "ag_in_group_of_2_ms": median_ms(ag_group, jnp.ones((4, numel // 2), jnp.float32)),
            "ag_one_group_of_4_ms": median_ms(ag_one_group, jnp.ones((4, numel // 4), jnp.float32)),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
