"""An unsharded, per-leaf reference of the layer-wise optimizer's algorithm (for tests).

Muon leaves use lwjax.muon.muon_update (checked against emerging_optimizers'
fixtures in test_muon.py) on each stacked matrix (expert stacks included) of the
leaf's matrix view (its axes reordered and merged as its route says); other
leaves use Adam with decoupled weight decay masked off 1-D parameters. Per leaf,
``lr_mult`` and ``wd_mult`` scale the learning rate and weight decay. Gradients
are clipped per norm group (the main norm, and one per ``grad_norm_group``) by
that group's norm, in float32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lwjax import muon as muon_lib


def _to_view(x, route):
    """A leaf as the batch of matrices Muon sees (the route's ``axes_order`` and ``view``)."""
    if route.axes_order is not None:
        x = jnp.transpose(x, route.axes_order)
    return x.reshape(route.view) if route.view is not None else x


def _from_view(x, route):
    """Inverse of :func:`_to_view`."""
    order = route.axes_order or tuple(range(len(route.shape)))
    x = x.reshape([route.shape[a] for a in order])
    return jnp.transpose(x, np.argsort(order)) if route.axes_order is not None else x


class Reference:
    """Unsharded state: fp32 leaves, Muon momenta, per-leaf Adam state, over global
    (logical) shapes."""

    def __init__(
        self,
        params,
        routes,
        *,
        lr,
        weight_decay,
        clip_grad,
        muon_config,
        adam=(0.9, 0.999, 1e-8),
        in_out=False,
    ):
        """``in_out``: Muon matrices are stored ``[in, out]`` and read transposed (rows are
        outputs for the scale and the QKV split), as ``matrix_convention="in_out"`` does."""
        self.in_out = in_out
        leaves, self.treedef = jax.tree_util.tree_flatten(params)
        self.leaves = [jnp.asarray(x, jnp.float32) for x in leaves]
        self.routes, self.lr, self.weight_decay, self.clip_grad, self.muon = (
            routes,
            lr,
            weight_decay,
            clip_grad,
            muon_config,
        )
        self.muon_idx = [i for i, r in enumerate(routes) if r.is_muon]
        self.adam_idx = [i for i, r in enumerate(routes) if not r.is_muon]
        self.momenta = {i: jnp.zeros_like(self.leaves[i]) for i in self.muon_idx}
        self.adam = optax.scale_by_adam(*adam)
        self.adam_state = self.adam.init([self.leaves[i] for i in self.adam_idx])

    def params(self):
        return jax.tree_util.tree_unflatten(self.treedef, [np.asarray(x) for x in self.leaves])

    def step(self, grads, update=None):
        """One step from the global mean gradient leaves; returns ``{group: norm}`` and
        the zero count. ``update``: :meth:`update` or a jitted copy of it."""
        g = [jnp.asarray(x, jnp.float32) for x in grads]
        self.leaves, self.momenta, self.adam_state, norms = (update or self.update)(
            self.leaves, self.momenta, self.adam_state, g
        )
        zeros = sum(int(np.sum(np.asarray(x) == 0)) for x in grads)
        return {name: float(n) for name, n in norms.items()}, zeros

    def update(self, leaves, momenta, adam_state, g):
        """The step as a function of the state: new ``(leaves, momenta, adam_state)`` and
        ``{group: norm}`` of the unclipped gradients ``g``."""
        leaves, momenta = list(leaves), dict(momenta)
        groups = {}
        for i, r in enumerate(self.routes):
            groups.setdefault(r.grad_norm_group, []).append(i)
        norms = {
            name: jnp.sqrt(sum(jnp.sum(g[i] * g[i]) for i in idx)) for name, idx in groups.items()
        }
        if self.clip_grad:
            g = list(g)
            for name, idx in groups.items():
                coef = jnp.minimum(1.0, self.clip_grad / (norms[name] + 1e-6))
                for i in idx:
                    g[i] = g[i] * coef
        flip = (lambda x: jnp.swapaxes(x, -1, -2)) if self.in_out else (lambda x: x)  # noqa: E731
        for i in self.muon_idx:
            r = self.routes[i]
            leaf, momentum = muon_lib.muon_update(
                flip(_to_view(leaves[i], r)),
                flip(_to_view(g[i], r)),
                flip(_to_view(momenta[i], r)),
                learning_rate=self.lr * r.lr_mult,
                weight_decay=self.weight_decay * r.wd_mult,
                config=self.muon,
                qkv_split_shapes=r.qkv_split_shapes,
            )
            leaves[i] = _from_view(flip(leaf), r)
            momenta[i] = _from_view(flip(momentum), r)
        updates, adam_state = self.adam.update([g[i] for i in self.adam_idx], adam_state)
        for i, u in zip(self.adam_idx, updates):
            r = self.routes[i]
            decay = self.weight_decay * r.wd_mult if len(r.param_shape) >= 2 else 0.0
            leaves[i] = leaves[i] - (self.lr * r.lr_mult) * (u + decay * leaves[i])
        return leaves, momenta, adam_state, norms

    def logical(self):
        """``(masters, momenta, mu, nu)`` as parameter-shaped trees, ``None`` where a
        leaf has no such state."""
        n = len(self.leaves)
        mu, nu = [None] * n, [None] * n
        for k, i in enumerate(self.adam_idx):
            mu[i], nu[i] = self.adam_state.mu[k], self.adam_state.nu[k]
        momenta = [self.momenta.get(i) for i in range(n)]
        tree = lambda xs: jax.tree_util.tree_unflatten(self.treedef, xs)  # noqa: E731
        return tree(self.leaves), tree(momenta), tree(mu), tree(nu)


def reference_run(
    params,
    grads_per_step,
    routes,
    *,
    lr,
    weight_decay,
    clip_grad,
    muon_config,
    adam=(0.9, 0.999, 1e-8),
):
    """Apply len(grads_per_step) steps; each entry is a list of per-device grad
    pytrees (averaged)."""
    ref = Reference(
        params,
        routes,
        lr=lr,
        weight_decay=weight_decay,
        clip_grad=clip_grad,
        muon_config=muon_config,
        adam=adam,
    )
    for device_grads in grads_per_step:
        flat = [jax.tree_util.tree_leaves(g) for g in device_grads]
        ref.step(
            [
                sum(jnp.asarray(d[i], jnp.float32) for d in flat) / len(flat)
                for i in range(len(ref.leaves))
            ]
        )
    return ref.params()


def reference_train(params, loss_fn, batches, routes, **options):
    """Train on whole batches with ``jax.grad(loss_fn)``; returns the
    :class:`Reference` and per-step statistics."""
    ref = Reference(params, routes, **options)
    grad_fn = jax.jit(jax.grad(loss_fn))
    # One compiled program per step instead of hundreds of small ones, op by op.
    update = jax.jit(ref.update)
    stats = []
    for batch in batches:
        grads = jax.tree_util.tree_leaves(
            grad_fn(jax.tree_util.tree_unflatten(ref.treedef, ref.leaves), batch)
        )
        stats.append(ref.step(grads, update))
    return ref, stats
