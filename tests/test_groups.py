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
from lwjax.layout import ParamSpec
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
    grouped, layout, choice = auto_groups(params, flat)
    want = choose_groups(param_specs(route_params(params)), 8).option
    assert choice.option.shards == want.shards < 8  # the question is not trivial here
    assert dict(grouped.shape) == {"replica": 8 // want.shards, "dp": want.shards}
    assert layout.policy == want.policy
    opt = layerwise_muon(params, grouped, replica_axis="replica", layout=layout)
    assert {b.dp for b in opt.plan.buffers} == {want.shards}
    with pytest.raises(ValueError, match="auto_groups: mesh has axes"):
        auto_groups(params, flat, axis="data")


def _train(opt, params, batches, loss):
    step = make_train_step(loss, opt, donate=False)
    state = opt.init(params)
    for batch in batches:
        params, state, _ = step(params, state, batch)
    return params, state


def test_replica_axis_auto_trains_like_the_explicit_groups_bitwise():
    """``replica_axis="auto"`` builds the optimizer on the grouped mesh it chose, takes a batch
    split over the user's flat ``dp`` axis, and steps bitwise like ``group_mesh`` with the same
    group size and policy."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from lwjax.optimizer import group_mesh

    params = _tied_params()  # four Muon matrices on 8 devices: one each in groups of 4
    flat = Mesh(np.array(jax.devices()[:8]), ("dp",))
    on_flat = NamedSharding(flat, P("dp"))
    batches = [tuple(jax.device_put(x, on_flat) for x in b) for b in _batches(steps=2)]
    auto = _optimizer(params, flat, replica_axis="auto")
    choice = auto.groups
    assert choice.holds_bounds and not choice.notes
    assert (choice.option.shards, choice.ns_ratio()) == (4, 1.0) and choice.option.padding < 0.05
    assert dict(auto.mesh.shape) == {"replica": 2, "dp": 4}
    assert auto.data_axes == ("replica", "dp")
    explicit = layerwise_muon(
        params,
        group_mesh(flat, 4),
        replica_axis="replica",
        learning_rate=LR,
        muon=MUON,
        config=CONFIG,
        layout=LayoutConfig(policy=choice.option.policy, bucket_size=600),
        routing=RoutingRules(tied=["wte/embedding"]),
    )
    assert auto.plan.layout == explicit.plan.layout
    a, sa = _train(auto, params, batches, _tied_loss)
    b, sb = _train(explicit, params, batches, _tied_loss)
    for x, y in zip(jax.tree.leaves((a, sa)), jax.tree.leaves((b, sb))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_replica_axis_auto_weighs_hosts_and_the_param_axes_of_the_mesh():
    """On 2-device hosts the four-matrix model's groups of 4 span 2 hosts, and the warning
    says why (groups of 2 inside a host do twice the NS work); beside an fsdp axis of 2 each
    rank's matrices are dealt out to its 2 devices, so groups of 2 already reach the least."""
    import pytest

    from lwjax.groups import AutoGroups
    from lwjax.parallel.mesh import mesh_hosts

    params = _tied_params()
    flat = Mesh(np.array(jax.devices()[:8]), ("dp",))
    assert [mesh_hosts(flat, "dp", 2)(g) for g in (1, 2, 4, 8)] == [1, 1, 2, 4]
    assert [mesh_hosts(flat, "dp")(g) for g in (1, 8)] == [1, 1]  # one process
    strided = Mesh(np.array(jax.devices()[:8]).reshape(2, 4).T, ("dp", "fsdp"))
    assert mesh_hosts(strided, "dp", 4)(1) == 2  # a rank's fsdp devices on two hosts
    match = (
        r"groups of 4 ranks span 2 hosts: the best inside a host, G=2 \(\w+\), pads [\d.]+% with"
    )
    with pytest.warns(UserWarning, match=match):
        opt = _optimizer(params, flat, replica_axis=AutoGroups(devices_per_host=2))
    assert opt.groups.option.shards == 4 and opt.groups.option.hosts == 2

    two_d = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("dp", "fsdp"))
    with pytest.warns(UserWarning, match="no parameter's sharding splits over it"):
        opt = layerwise_muon(params, two_d, replica_axis="auto", param_axes="fsdp")
    choice = opt.groups
    assert dict(opt.mesh.shape) == {"replica": 2, "dp": 2, "fsdp": 2}
    assert (choice.option.shards, choice.option.devices_per_rank, choice.ns_ratio()) == (2, 2, 1)
    assert {o.shards for o in choice.options} == {1, 2}  # 2 ranks x 2 devices: one matrix each
    assert choice.option.max_device_ns_flops * 2 == choice.option.max_rank_ns_flops


def test_replica_axis_auto_errors_name_the_rule():
    import pytest

    from lwjax.groups import AutoGroups

    params = _tied_params()
    with pytest.raises(ValueError, match="already has an axis named 'replica'"):
        layerwise_muon(params, _grouped_mesh(), replica_axis="auto")
    experts = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("dp", "ep"))
    with pytest.raises(ValueError, match=r"does not choose groups beside an expert_axis \('ep'\)"):
        layerwise_muon(params, experts, expert_axis="ep", replica_axis="auto")
    with pytest.raises(
        ValueError, match="devices_per_host must be a positive integer; got devices_per_host=0"
    ):
        AutoGroups(devices_per_host=0)
    with pytest.raises(ValueError, match="max_ns_ratio must be a number >= 1; got 0.5"):
        AutoGroups(max_ns_ratio=0.5)
    with pytest.raises(ValueError, match="AutoGroups.policies must be a non-empty tuple"):
        AutoGroups(policies=("fastest",))


# --------------------------------------------------------------------------- layouts (pure Python)


def _llama8b():
    from lwjax.tools.presets import preset_specs

    return preset_specs("llama8b")  # Llama-3-8B shapes, 32 layers


def _llama70b():
    from lwjax.tools.presets import transformer_specs

    return transformer_specs(
        layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128, ffn=28672, vocab=128256
    )


def _ns_floor(specs, dp, devices_per_rank=1):
    """No layout of whole matrices over any divisor of ``dp`` gives its busiest device less
    NS work than the largest matrix or than its share of all of them."""
    from lwjax.cost import ns_flops

    work = [ns_flops(s.shape) for s in specs if s.is_muon]
    return max(max(work), sum(work) / (dp * devices_per_rank))


DP_TABLE = (64, 128, 256, 512, 1024, 2048, 4096)


def test_groups_hold_padding_and_ns_bounds_where_any_layout_can_8b():
    """Llama-3-8B shapes on plain data parallelism: no group size holds both bounds (below 64
    a rank does at least 1/32 of all NS work, twice linear_fc1's; from 64 linear_fc1's bucket
    pads at least 6.6%): the choice keeps NS within 1.25x of the least and the padding at
    that floor, where 0.4's chooser did twice the NS work."""
    from lwjax.groups import choose_groups, divisors

    specs = _llama8b()
    muon = [s.numel for s in specs if s.is_muon]
    real = sum(s.numel for s in specs)
    least = _ns_floor(specs, 64)
    for g in divisors(4096):  # the floors rule out every group size
        assert _ns_floor(specs, g) > 1.25 * least or (g * max(muon) - sum(muon)) / real > 0.05
    for dp in DP_TABLE:
        choice = choose_groups(specs, dp)
        o = choice.option
        assert o.max_device_ns_flops <= 1.25 * _ns_floor(specs, dp), (dp, o.shards, o.policy)
        assert o.padding <= (64 * max(muon) - sum(muon)) / real + 0.002, (dp, o.padding)
        assert not choice.holds_bounds
        assert "no layout of whole matrices holds both" in choice.notes[0]


def test_groups_hold_padding_and_ns_bounds_70b():
    """Llama-3-70B shapes: both bounds hold at dp 64 and 128; from dp 256 the least is one
    linear_fc1 (82.5 T, at 256 ranks and 73% padding) and no layout over 128 ranks gets under
    1.25x of it (the next test), so the choice misses it by at most 2% (0.4 chose 9.8x)."""
    from lwjax.groups import choose_groups

    specs = _llama70b()
    for dp in DP_TABLE:
        choice = choose_groups(specs, dp)
        o = choice.option
        slack = 1 if dp < 256 else 1.02
        assert o.padding <= 0.05, (dp, o.shards, o.policy, o.padding)
        assert o.max_device_ns_flops <= 1.25 * slack * _ns_floor(specs, dp), (dp, o.shards)
        assert choice.holds_bounds == (dp < 256)


def test_no_layout_of_70b_over_128_ranks_holds_the_ns_bound():
    """Why 70B misses the NS bound from dp 256. Cap 1.25 x fc1: fc1 (82.5 T) shares a rank
    with neither fc1 nor fc2 (44 T) nor two small matrices (qkv 19.2 T, proj 16.5 T); two fc2
    leave no room for a small one, one fc2 room for 3, none for 7. The 48 ranks without fc1
    hold the 80 fc2 (x with two, y with one, z with none: 2x + y = 80, x + y + z = 48), so the
    160 small ones fit in at most 80 + 3y + 6z places."""
    from lwjax.cost import ns_flops

    shapes = ((57344, 8192), (8192, 28672), (10240, 8192), (8192, 8192))
    fc1, fc2, qkv, proj = (ns_flops(s) for s in shapes)
    cap = 1.25 * fc1
    small, large = sorted((qkv, proj))
    assert fc1 + fc2 > cap and fc1 + small + large > cap and fc1 + large <= cap
    assert 2 * fc2 + small > cap and 3 * fc2 > cap
    assert fc2 + 4 * small > cap >= fc2 + 3 * large
    assert 7 * small > cap
    for x in range(32, 41):  # y = 80 - 2x >= 0 and z = x - 32 >= 0
        y, z = 80 - 2 * x, x - 32
        assert 80 + 3 * y + 6 * z < 160


def test_fsdp_devices_change_the_ns_estimate_and_the_pick():
    """With 8 fsdp devices per rank each rank's matrices are dealt out to them: the busiest
    device does the largest load of its rank's deal, and groups of at most 16 (no padding)
    reach the least that plain data parallelism needs groups of 64 (6.7%) for."""
    from lwjax.cost import deal, device_loads, ns_flops
    from lwjax.groups import choose_groups

    specs = _llama8b()
    plain, fsdp = choose_groups(specs, 64), choose_groups(specs, 64, devices_per_rank=8)
    assert plain.option.shards == 64 and plain.option.padding > 0.05
    assert fsdp.holds_bounds and fsdp.option.padding == 0.0 and fsdp.option.shards <= 16
    assert fsdp.least_ns_flops == max(ns_flops(s.shape) for s in specs if s.is_muon)
    o = fsdp.option
    (buffer,) = [b for b in o.layout.layouts.values() if b.is_layer_wise]
    shapes = {s.name: s.shape for s in specs}
    ranks = [[] for _ in range(o.shards)]
    for name in buffer.param_index_map:
        ranks[buffer.shard_of(name)].append(ns_flops(shapes[name]))
    busiest = max(max(device_loads(work, deal(work, 8), 8)) for work in ranks)
    assert o.max_device_ns_flops == busiest < o.max_rank_ns_flops == max(map(sum, ranks))


def test_groups_inside_a_host_first_or_say_why_not():
    """Among options that hold both bounds the one spanning the fewest hosts wins; when only
    groups wider than a host hold them, the note names the best inside one."""
    from lwjax.groups import choose_groups, consecutive_hosts

    assert [consecutive_hosts(64, 4, 8)(g) for g in (1, 2, 4, 16)] == [1, 1, 2, 8]
    assert consecutive_hosts(12, 1, 8)(6) == 2  # devices 6-11 cross the edge at 8
    specs = _llama8b()
    hosts = consecutive_hosts(64, 4, 8)
    anywhere = choose_groups(specs, 64, devices_per_rank=4)
    by_host = choose_groups(specs, 64, devices_per_rank=4, hosts=hosts)
    assert anywhere.holds_bounds and by_host.holds_bounds
    fewest = min(o.hosts for o in by_host.options if by_host.overshoot(o) <= 1)
    assert by_host.option.hosts == fewest < hosts(anywhere.option.shards)
    (note,) = by_host.notes
    assert note.startswith(f"groups of {by_host.option.shards} ranks span {fewest} hosts: the")
    assert "best inside a host, G=2 (size_matching), pads 0.0% with NS 8.00x the least." in note
    matrices = [ParamSpec(f"w{i}", (64, 64), is_muon=True) for i in range(8)]
    inside = choose_groups(matrices, 16, hosts=consecutive_hosts(16, 1, 8))
    assert (inside.option.shards, inside.option.hosts, inside.notes) == (8, 1, ())


def test_chooser_is_fast_at_dp_4096():
    import time

    from lwjax.groups import choose_groups

    specs = _llama70b()
    start = time.perf_counter()
    choose_groups(specs, 4096, devices_per_rank=8)
    choose_groups(specs, 4096)
    assert time.perf_counter() - start < 4.0  # about 0.7 s on one core


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
    assert len(rows) == 8 * 4  # the divisors of 1,024 up to 128 matrices, four policies each
    (chosen,) = [r for r in rows if r["chosen"]]
    assert (chosen["shards"], chosen["policy"], chosen["ns_ratio"]) == (64, "ns_cost", 1.0)
    assert main(["layout", "--preset", "llama8b", "--dp", "1024", "--groups"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "chosen: groups of 64 (ns_cost), misses padding <= 5% and NS <= 1.25x" in out
    assert "at G <= 32 NS >= 2.00x the least, at G >= 64 padding >= 6.7%" in out
    args = ["--devices-per-rank", "8", "--devices-per-host", "8", "--json"]
    assert main(["layout", "--preset", "llama8b", "--dp", "64", "--groups", *args]) == 0
    (chosen,) = [r for r in json.loads(capsys.readouterr().out) if r["chosen"]]
    assert (chosen["shards"], chosen["hosts"], chosen["padding"]) == (8, 8, 0.0)
