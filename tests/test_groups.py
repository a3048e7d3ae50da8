"""Sharding groups (Megatron's num_optimizer_shards): a layout over the devices of one group,
optimizer state replicated across groups, against the unsharded reference."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from test_optimizer import CONFIG, LR, MUON
from test_param_groups import _tied_loss, _tied_params, assert_trains_like_the_reference

from lwjax import LayoutConfig, RoutingRules, to_logical
from lwjax.optimizer import layerwise_muon
from lwjax.train import make_train_step, value_and_grad


def _grouped_mesh(replicas=2, shards=4):
    devices = np.array(jax.devices()[: replicas * shards]).reshape(replicas, shards)
    return Mesh(devices, ("replica", "dp"))


def _batches(steps=3, size=32):
    rng = np.random.default_rng(5)
    return [
        (rng.integers(0, 32, size).astype(np.int32), rng.integers(0, 32, size).astype(np.int32))
        for _ in range(steps)
    ]


def _optimizer(params, mesh, **options):
    return layerwise_muon(
        params,
        mesh,
        learning_rate=LR,
        muon=MUON,
        config=CONFIG,
        layout=LayoutConfig(bucket_size=600),
        routing=RoutingRules(tied=["wte/embedding"]),
        **options,
    )


def test_groups_train_like_the_unsharded_reference_with_state_split_within_a_group():
    params, batches = _tied_params(), _batches()
    opt = _optimizer(params, _grouped_mesh(), replica_axis="replica")
    assert opt.data_axes == ("replica", "dp") and opt.num_data == 8
    assert {b.dp for b in opt.plan.buffers} == {4}  # laid out over the 4 devices of a group
    state = opt.init(params)
    for master in jax.tree.leaves(state.masters):  # 1/4 of a buffer per device, not 1/8
        assert {s.data.shape[0] for s in master.addressable_shards} == {master.shape[0] // 4}
    assert_trains_like_the_reference(opt, params, state, batches)


def test_groups_in_the_optax_form_and_across_group_sizes():
    """The optax form with per-device gradients gives the per-device step's result, and the
    logical state moves between 2 groups of 4 and 1 group of 8."""
    params, batches = _tied_params(), _batches(steps=2)
    grouped = _optimizer(params, _grouped_mesh(), replica_axis="replica")
    flat = _optimizer(params, Mesh(np.array(jax.devices()[:8]), ("dp",)))
    grad_fn = value_and_grad(_tied_loss, grouped)

    @jax.jit
    def optax_step(p, s, batch):
        _, grads = grad_fn(p, batch)
        updates, s = grouped.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    step = make_train_step(_tied_loss, grouped, donate=False)
    a, sa = params, grouped.init(params)
    b, sb = params, grouped.init(params)
    for batch in batches:
        a, sa = optax_step(a, sa, batch)
        b, sb, _ = step(b, sb, batch)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
    from lwjax.logical import from_logical

    moved = to_logical(flat, from_logical(flat, to_logical(grouped, sb)))
    for x, y in zip(jax.tree.leaves(moved), jax.tree.leaves(to_logical(grouped, sb))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_group_axis_errors_name_the_axes():
    import pytest

    params = {"w": jnp.zeros((8, 8))}
    with pytest.raises(ValueError, match="no sharding-group axis 'groups'"):
        layerwise_muon(params, _grouped_mesh(), replica_axis="groups")
    with pytest.raises(ValueError, match="must differ; got axis='dp', replica_axis='dp'"):
        layerwise_muon(params, _grouped_mesh(), replica_axis="dp")


def test_group_mesh_splits_the_axis_into_groups_of_consecutive_devices():
    import pytest

    from lwjax.optimizer import group_mesh

    flat = Mesh(np.array(jax.devices()[:8]), ("dp",))
    mesh = group_mesh(flat, 4)
    assert mesh.axis_names == ("replica", "dp") and dict(mesh.shape) == {"replica": 2, "dp": 4}
    assert [d.id for d in mesh.devices[1]] == [d.id for d in jax.devices()[4:8]]
    with pytest.raises(ValueError, match="shards must be a positive divisor of dp=8; got 3"):
        group_mesh(flat, 3)
    with pytest.raises(ValueError, match="already has an axis named 'dp'"):
        group_mesh(flat, 4, replica_axis="dp")


def test_auto_groups_builds_the_chosen_groups_and_policy():
    """``auto_groups`` gives the mesh and layout policy ``choose_groups`` chooses for the routed
    parameters, and the optimizer built on them lays out over that group size."""
    import pytest

    from lwjax.groups import choose_groups
    from lwjax.optimizer import auto_groups, route_params
    from lwjax.routing import param_specs

    rng = np.random.default_rng(0)
    shapes = [(96, 64), (96, 64), (64, 64), (64, 64), (64, 64), (64, 64)]
    params = {
        f"w{i}": jnp.asarray(rng.standard_normal(s), jnp.float32) for i, s in enumerate(shapes)
    }
    params["b"] = jnp.zeros(64)
    flat = Mesh(np.array(jax.devices()[:8]), ("dp",))
    grouped, layout = auto_groups(params, flat)
    want = choose_groups(param_specs(route_params(params)), 8)
    assert want.shards < 8 and want.padding <= 0.05  # the question is not trivial here
    assert dict(grouped.shape) == {"replica": 8 // want.shards, "dp": want.shards}
    assert layout.policy == want.policy
    opt = layerwise_muon(params, grouped, replica_axis="replica", layout=layout)
    assert {b.dp for b in opt.plan.buffers} == {want.shards}
    with pytest.raises(ValueError, match="auto_groups: mesh has axes"):
        auto_groups(params, flat, axis="data")


# --------------------------------------------------------------------------- layouts (pure Python)


def _llama8b():
    from lwjax.tools.presets import preset_specs

    return preset_specs("llama8b")  # Llama-3-8B shapes, 32 layers


def test_automatic_groups_keep_padding_under_5_percent_from_dp_64_to_1024():
    from lwjax.groups import choose_groups, sharding_option

    specs = _llama8b()
    for dp in (64, 128, 256, 512, 1024):
        plain = sharding_option(specs, dp, dp)  # one group: every rank in the layout
        chosen = choose_groups(specs, dp)
        assert dp % chosen.shards == 0 and chosen.replicas == dp // chosen.shards
        assert chosen.padding <= 0.05, (dp, chosen.shards, chosen.policy, chosen.padding)
        assert chosen.state_numel_per_device * chosen.shards >= chosen.real_numel
        if dp >= 128:  # where one group pads past the model itself
            assert plain.padding > 0.99 and chosen.numel < plain.numel / 1.9
    # dp 1,024 (1,411% padding in one group): 32 groups of 32 under size_matching, no padding.
    chosen = choose_groups(specs, 1024)
    assert (chosen.shards, chosen.policy, chosen.padding) == (32, "size_matching", 0.0)


def test_group_traffic_reduce_scatters_first():
    """Reduce-scatter in the group, then all-reduce the 1/G shard across groups, sends less
    than all-reducing the whole buffer first (and equals the plain reduce-scatter at one
    group)."""
    from lwjax.groups import sharding_option

    specs = _llama8b()
    one = sharding_option(specs, 64, 64)
    assert one.reduced_numel_per_device == 63 / 64 * one.numel
    grouped = sharding_option(specs, 64, 16)
    n, g, r = grouped.numel, 16, 4
    all_reduce_first = 2 * (r - 1) / r * n + (g - 1) / g * n
    assert grouped.reduced_numel_per_device < all_reduce_first


def test_bad_group_sizes_are_named():
    import pytest

    from lwjax.groups import choose_groups, sharding_option

    specs = _llama8b()[:4]
    with pytest.raises(ValueError, match=r"group size must be a divisor of dp=8; got 3"):
        sharding_option(specs, 8, 3)
    with pytest.raises(ValueError, match="max_padding must be a number >= 0"):
        choose_groups(specs, 8, max_padding=-1)


def test_cli_layout_groups_shows_every_size_and_the_choice(capsys):
    import json

    from lwjax.tools.cli import main

    assert main(["layout", "--preset", "llama8b", "--dp", "1024", "--groups", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 11 * 3  # the divisors of 1,024, three policies each
    (chosen,) = [r for r in rows if r["chosen"]]
    assert (chosen["shards"], chosen["policy"], chosen["padding"]) == (32, "size_matching", 0.0)
    assert main(["layout", "--preset", "llama8b", "--dp", "1024", "--groups"]) == 0
    assert "chosen: groups of 32 (size_matching)" in " ".join(capsys.readouterr().out.split())
