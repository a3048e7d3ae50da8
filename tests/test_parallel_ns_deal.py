"""lwjax.parallel.ns_deal: which device orthogonalises which split matrix, and the work per device.

The busiest device's Newton–Schulz FLOPs are computed from plans of Llama-shaped models on
64 devices (no device needed: a plan is built from abstract leaves and their tensor dims);
the step that runs the deal is checked against the unsharded reference at dp 2 x fsdp 4.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from reference import Reference

import lwjax
from lwjax.config import OptimizerConfig
from lwjax.cost import ns_flops
from lwjax.layout import LayoutConfig
from lwjax.muon import MuonConfig
from lwjax.optimizer import route_params
from lwjax.parallel.axes import MeshAxes
from lwjax.parallel.mesh import resolved_layout
from lwjax.parallel.ns_deal import device_ns_flops, is_joint, ns_critical_path, region_ns_flops
from lwjax.planner import plan_params, plan_step
from lwjax.routing import RoutingRules

STACKED = RoutingRules(stacked={"layers/*": 1})


def _llama(layers, hidden, heads, kv_heads, ffn, head_dim=128):
    """A scanned Llama's matrices (``[L, in, out]``; fc1 is gate and up together) and norms."""
    leaf = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
    return {
        "layers/q": leaf(layers, hidden, heads * head_dim),
        "layers/k": leaf(layers, hidden, kv_heads * head_dim),
        "layers/v": leaf(layers, hidden, kv_heads * head_dim),
        "layers/o": leaf(layers, heads * head_dim, hidden),
        "layers/fc1": leaf(layers, hidden, 2 * ffn),
        "layers/fc2": leaf(layers, ffn, hidden),
        "layers/norm": leaf(layers, hidden),
    }


LLAMA_8B = dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336)
LLAMA_70B = dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672)


def _fsdp_plan(params, dp, fsdp, muon=MuonConfig()):
    """The step plan of ``params`` split over ``fsdp`` on their last axis beside ``dp``, with
    the default layout as :func:`lwjax.layerwise_muon` resolves it."""
    axes = MeshAxes("dp", dp_size=dp, tp=("fsdp",), tp_sizes=(fsdp,))
    dims = [(len(leaf.shape) - 1,) for leaf in jax.tree.leaves(params)]
    layout = resolved_layout(LayoutConfig(), axes, muon)
    plan = plan_params(params, axes, layout, STACKED, tensor_dims=dims)
    return plan_step(plan, OptimizerConfig(), muon, None, 0.01, None)


@pytest.mark.parametrize(
    "model, dp, fsdp",
    [(LLAMA_8B, 8, 8), (LLAMA_70B, 8, 8), (LLAMA_70B, 2, 32), (LLAMA_70B, 1, 64)],
    ids=["8B-dp8xfsdp8", "70B-dp8xfsdp8", "70B-dp2xfsdp32", "70B-fsdp64"],
)
def test_newton_schulz_critical_path_is_near_its_share(model, dp, fsdp):
    """The step's Newton–Schulz critical path (each region's busiest device, summed) <= 1.25 x
    max(total / devices, largest matrix) by default, and every matrix computed once: the
    per-device table sums to each matrix's FLOPs, nothing for padding. (0.4.0 ran every slot
    group's width, padding included, on every device: 6.8-12.5x here; dealt bucket by bucket,
    each bucket waiting for its busiest device, the path was 6.8x, 8.0x, 12.4x and 1.02x.)"""
    params = _llama(**model)
    plan = _fsdp_plan(params, dp, fsdp)
    table = device_ns_flops(plan)
    assert np.shape(table) == (dp, fsdp)
    matrices = [leaf.shape for leaf in jax.tree.leaves(params) if len(leaf.shape) == 3]
    total = sum(layers * ns_flops((m, n)) for layers, m, n in matrices)
    assert sum(map(sum, table)) == total
    largest = max(ns_flops((m, n)) for _, m, n in matrices)
    assert max(map(max, table)) <= ns_critical_path(plan)
    assert ns_critical_path(plan) <= 1.25 * max(total / (dp * fsdp), largest)


def test_device_ns_flops_counts_what_each_mode_computes():
    """dp 2 x tp 2: three [64, 64] matrices split on their columns (rank 0 owns two, rank 1
    one) and a whole [16, 16] gate (rank 1's; rank 0 runs a spare zero slot for it).
    ``duplicated`` computes each split matrix once, on the device it is dealt to (rank 0's two
    on its two devices); ``blockwise`` every slot of the group's width on the blocks (rank 1's
    spare slot too); the gate's group runs on both devices of each rank. The critical path
    adds each region's busiest device."""
    params = {
        "layers/w": jax.ShapeDtypeStruct((3, 64, 64), jnp.float32),
        "gate": jax.ShapeDtypeStruct((16, 16), jnp.float32),
    }
    axes = MeshAxes("dp", dp_size=2, tp=("tp",), tp_sizes=(2,))

    def plan(mode):
        plan = plan_params(params, axes, routing=STACKED, tensor_dims=[(None,), (2,)])
        return plan_step(plan, OptimizerConfig(), MuonConfig(tp_mode=mode), None, 0.01, None)

    gate_group, split_group = plan("duplicated").buffers[0].slot_groups
    assert [len(n) for n in split_group.names] == [2, 1] and gate_group.names == ((), ("gate",))
    split, gate, block = ns_flops((64, 64)), ns_flops((16, 16)), ns_flops((64, 32))
    assert device_ns_flops(plan("duplicated")) == [[split + gate] * 2, [split + gate, gate]]
    assert device_ns_flops(plan("blockwise")) == [[2 * block + gate] * 2] * 2
    # Regions: the dealt matrices together (busiest device: one), then the bucket's gate group.
    assert ns_critical_path(plan("duplicated")) == split + gate
    assert ns_critical_path(plan("blockwise")) == 2 * block + gate


@pytest.mark.parametrize("dp", [1, 2])
def test_whole_matrices_join_the_joint_pass_at_one_data_parallel_rank(dp):
    """With one data-parallel rank no gather waits for a bucket's update, so every whole
    matrix runs in the step's joint pass (one region of Newton–Schulz FLOPs); at dp 2 each
    bucket's stay in its update, where its gather can hide under the next bucket's."""
    params = _llama(layers=4, hidden=256, heads=2, kv_heads=1, ffn=512)
    axes = MeshAxes("dp", dp_size=dp)
    layout = LayoutConfig(bucket_size=2**16)
    plan = plan_step(
        plan_params(params, axes, layout, STACKED),
        OptimizerConfig(),
        MuonConfig(),
        None,
        0.01,
        None,
    )
    groups = [(g, b) for b in plan.buffers if b.key.is_layer_wise for g in b.slot_groups]
    assert len({g.bucket for g, _ in groups}) > 1
    assert [is_joint(g, b) for g, b in groups] == [dp == 1] * len(groups)
    regions = region_ns_flops(plan)
    assert (list(regions) == ["joint"]) is (dp == 1)


D, FFN = 16, 32


def _two_steps_match_the_reference(params, opt, muon, placed, put):
    """Two steps of ``opt`` from ``placed`` (``params`` as the optimizer holds them), each
    step's gradients placed by ``put``, equal the unsharded optimizer's (clip 1.0). Returns
    the jitted step ``(grads, state, params) -> (params, state)``, the last gradients, the
    state and the parameters."""
    ref = Reference(
        params,
        route_params(params, STACKED),
        lr=0.02,
        weight_decay=0.01,
        clip_grad=1.0,
        muon_config=muon,
        in_out=True,
    )
    step = jax.jit(
        lambda g, s, p: (lambda u, s: (jax.tree.map(jnp.add, p, u), s))(*opt.update(g, s, p))
    )
    state, current = opt.init(placed), placed
    for seed in (1, 2):
        draw = np.random.default_rng(seed)
        grads = {k: draw.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
        ref.step(jax.tree.leaves(grads))
        current, state = step(put(grads), state, current)
    for k, want in ref.params().items():
        np.testing.assert_allclose(np.asarray(current[k]), want, atol=2e-6, err_msg=k)
    return step, put(grads), state, current


def _put(tree, specs, mesh):
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}


@pytest.mark.parametrize("dp, bucket_size", [(1, None), (2, 256)], ids=["dp1", "dp2-4buckets"])
def test_dealt_step_matches_the_unsharded_reference_and_skips_padding(dp, bucket_size):
    """fsdp 4 beside dp 1 or 2: stacks of 5 and 3 matrices split over ``fsdp`` (uneven counts
    per rank and per device) and a whole norm, in one bucket or (dp 2) four. Two steps equal
    the unsharded optimizer (the reference). Every device runs only its own matrices: the
    compiled step switches (``conditional``) between branches of the counts dealt, with no
    Newton–Schulz on a zero fill (0.4.0 ran ceil(count / 4) matrices on every device, zeros
    included). The dealt matrices of all buckets are exchanged together: one ``all_to_all``
    out and one back per shape of block, however many buckets hold it (with four buckets,
    bucket by bucket took one pair per slot group: five)."""
    rng = np.random.default_rng(0)
    leaves = {
        "layers/up": ((5, D, FFN), P(None, None, "fsdp")),
        "layers/down": ((3, FFN, D), P(None, "fsdp")),
        "norm": ((D,), P()),
    }
    params = {k: (rng.standard_normal(s) / 4).astype(np.float32) for k, (s, _) in leaves.items()}
    specs = {k: spec for k, (_, spec) in leaves.items()}
    mesh = Mesh(np.array(jax.devices()[: 4 * dp]).reshape(dp, 4), ("dp", "fsdp"))
    muon = MuonConfig(fp32_matmul_prec="highest")
    sharded = _put(params, specs, mesh)
    layout = LayoutConfig() if bucket_size is None else LayoutConfig(bucket_size=bucket_size)
    opt = lwjax.layerwise_muon(
        sharded, mesh, param_axes="fsdp", muon=muon, routing=STACKED, layout=layout
    )
    groups = [g for b in opt.plan.buffers for g in b.slot_groups]
    assert len({g.bucket for g in groups}) == (1 if bucket_size is None else 4)
    counts = {
        sum(d == device for d in row)
        for b in opt.plan.buffers
        for g in b.slot_groups
        for row in g.ns_devices
        for device in range(4)
    }
    assert len(counts) > 1  # devices assemble different numbers of matrices
    step, grads, state, current = _two_steps_match_the_reference(
        params, opt, muon, sharded, lambda g: _put(g, specs, mesh)
    )
    hlo = step.lower(grads, state, current).compile().as_text()
    switched = set(re.findall(r"= \(f32\[\d+,(\d+),(\d+)\]\S*\) conditional\(", hlo))
    assert switched == {("32", "16"), ("16", "32")}  # each shape's whole matrices, switched
    assert len({g.shape for g in groups}) == 2
    assert len(re.findall(r" all-to-all\(", hlo)) == 2 * 2


@pytest.mark.parametrize("dp", [1, 2])
def test_whole_matrices_of_every_bucket_run_together_at_one_rank(monkeypatch, dp):
    """Stacks of two shapes (a tall one) and a norm in five buckets. At dp 1 every matrix's
    Newton–Schulz runs in the joint pass, in one ``newton_schulz_many`` over the stacks of
    all buckets, and no bucket's update computes a direction; at dp 2 each bucket computes
    its own. Two steps equal the unsharded optimizer either way."""
    from lwjax import bucket_update
    from lwjax import muon as muon_lib

    computed, together = [], []
    monkeypatch.setattr(
        bucket_update,
        "muon_directions",
        lambda *a, _f=bucket_update.muon_directions, **k: computed.append(1) or _f(*a, **k),
    )
    monkeypatch.setattr(
        muon_lib,
        "newton_schulz_many",
        lambda xs, *a, _f=muon_lib.newton_schulz_many, **k: (
            together.append([x.shape for x in xs]) or _f(xs, *a, **k)
        ),
    )
    rng = np.random.default_rng(0)
    shapes = {"layers/up": (6, D, FFN), "layers/down": (4, FFN, D), "norm": (D,)}
    params = {k: (rng.standard_normal(s) / 4).astype(np.float32) for k, s in shapes.items()}
    mesh = Mesh(np.array(jax.devices()[:dp]), ("dp",))
    muon = MuonConfig(fp32_matmul_prec="highest")
    opt = lwjax.layerwise_muon(
        params, mesh, muon=muon, routing=STACKED, layout=LayoutConfig(bucket_size=1024)
    )
    assert len({g.bucket for b in opt.plan.buffers for g in b.slot_groups}) == 5
    _two_steps_match_the_reference(params, opt, muon, params, lambda g: g)
    if dp == 1:  # each trace of the step: one call over every bucket's up and down stacks
        assert computed == [] and together
        for shapes in together:
            assert sum(s[0] for s in shapes if s[1:] == (D, FFN)) == 6
            assert sum(s[0] for s in shapes if s[1:] == (FFN, D)) == 4
    else:
        assert computed and together == []


def test_exchange_in_rounds_is_the_same_step(monkeypatch):
    """With a round of one chunk position at a time (``EXCHANGE_ROUND_BYTES`` = 1 byte) the
    dealt matrices' exchange runs one ``all_to_all`` pair per position, each round's Newton–
    Schulz between them, and the step is the one exchange's up to fp32 rounding (a batch of
    one matrix sums its products in another order than a batch of two; in bf16, "medium",
    that can move a few elements by a bf16 step). Rounds bound the exchange buffers: two fp32
    copies of every dealt fc1 of 8B at fsdp 8 were the optimizer's peak, 3.8 GB per device."""
    from lwjax.parallel import exchange

    rng = np.random.default_rng(0)
    leaves = {"layers/up": ((5, D, FFN), P(None, None, "fsdp")), "norm": ((D,), P())}
    params = {k: (rng.standard_normal(s) / 4).astype(np.float32) for k, (s, _) in leaves.items()}
    specs = {k: spec for k, (_, spec) in leaves.items()}
    grads = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("dp", "fsdp"))
    sharded = _put(params, specs, mesh)
    muon = MuonConfig(fp32_matmul_prec="highest")
    opt = lwjax.layerwise_muon(sharded, mesh, param_axes="fsdp", muon=muon, routing=STACKED)

    def step():
        fn = jax.jit(lambda g, s, p: opt.update(g, s, p))
        args = (_put(grads, specs, mesh), opt.init(sharded), sharded)
        hlo = fn.lower(*args).compile().as_text()
        return fn(*args), len(re.findall(r" all-to-all\(", hlo))

    whole, pairs = step()
    monkeypatch.setattr(exchange, "EXCHANGE_ROUND_BYTES", 1)
    rounds, pairs_in_rounds = step()
    assert pairs == 2 and pairs_in_rounds == 2 * 2  # 5 matrices over 4 devices: 2 positions
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(rounds)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
