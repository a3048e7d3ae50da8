"""An unsharded, per-leaf reference of the layer-wise optimizer's algorithm (for tests)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lwjax import muon as muon_lib


def reference_run(params, grads_per_step, routes, *, lr, weight_decay, clip_grad, muon_config, adam=(0.9, 0.999, 1e-8)):
    """Apply len(grads_per_step) steps; each entry is a list of per-device grad pytrees.

    Muon leaves use lwjax.muon.muon_update (checked against emerging_optimizers'
    fixtures in test_muon.py) on each stacked matrix; other leaves use optax.adamw
    with weight decay masked off 1-D parameters. Gradients are averaged over devices,
    clipped by the global norm, in float32.
    """
    leaves, treedef = jax.tree_util.tree_flatten(params)
    leaves = [jnp.asarray(x, jnp.float32) for x in leaves]
    muon_idx = [i for i, r in enumerate(routes) if r.is_muon]
    adam_idx = [i for i, r in enumerate(routes) if not r.is_muon]
    momenta = {i: jnp.zeros_like(leaves[i]) for i in muon_idx}
    b1, b2, eps = adam
    adamw = optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                        mask=[len(routes[i].param_shape) >= 2 for i in adam_idx])
    adam_state = adamw.init([leaves[i] for i in adam_idx])
    for device_grads in grads_per_step:
        flat = [jax.tree_util.tree_leaves(g) for g in device_grads]
        g = [sum(jnp.asarray(d[i], jnp.float32) for d in flat) / len(flat) for i in range(len(leaves))]
        norm = jnp.sqrt(sum(jnp.sum(x * x) for x in g))
        if clip_grad:
            coef = jnp.minimum(1.0, clip_grad / (norm + 1e-6))
            g = [x * coef for x in g]
        for i in muon_idx:
            leaves[i], momenta[i] = muon_lib.muon_update(
                leaves[i], g[i], momenta[i], learning_rate=lr, weight_decay=weight_decay,
                config=muon_config, qkv_split_shapes=routes[i].qkv_split_shapes,
            )
        updates, adam_state = adamw.update([g[i] for i in adam_idx], adam_state, [leaves[i] for i in adam_idx])
        for i, u in zip(adam_idx, updates):
            leaves[i] = leaves[i] + u
    return jax.tree_util.tree_unflatten(treedef, [np.asarray(x) for x in leaves])
