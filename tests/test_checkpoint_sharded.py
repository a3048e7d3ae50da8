"""Checkpoints of split parameters: a device holds its share plus bounded staging, and
checkpoints reshard between fsdp, tensor-parallel and grouped meshes bit for bit.

The per-device peak is measured, not modelled: every program that ``save`` and
``restore`` run is compiled once more for XLA's per-device memory analysis
(arguments already live, outputs, temporaries, donated bytes), and the bytes
that are live in device 0's own memory when it starts are counted from
``jax.live_arrays`` (arrays in host memory are not). A program's outputs count in
full even where they go to host memory: a GPU computes them on the device first.
"""

import collections
import functools
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import lwjax
from lwjax import checkpoint, checkpoint_record, logical
from lwjax import logical_shards as shards
from lwjax.logical import LogicalState, from_logical
from lwjax.routing import RoutingRules

LAYERS, D, FFN, VOCAB = 4, 64, 256, 256
RULES = RoutingRules(stacked={"layers/*": 1})
STAGING = 1 << 16  # bytes: smaller than the state, so save and restore run several chunks
TABLES = 1 << 10  # bytes: XLA's tables of a program's buffers (8 bytes per output, temporary)


def _params(seed=0) -> dict:
    rng = np.random.default_rng(seed)
    shapes = {
        "embed": (VOCAB, D),
        "layers/up": (LAYERS, D, FFN),
        "layers/down": (LAYERS, FFN, D),
        "layers/norm": (LAYERS, D),
    }
    return {k: (rng.standard_normal(s) / 8).astype(np.float32) for k, s in shapes.items()}


# Each mesh: its shape and axis names, the axis the parameters are split over (split on axis 1
# of the stacked leaves, axis 0 of the embedding) and the optimizer's axis options.
MESHES = {
    "fsdp 8": ((1, 8), ("dp", "fsdp"), "fsdp", {"param_axes": "fsdp"}),
    "dp 2 x fsdp 4": ((2, 4), ("dp", "fsdp"), "fsdp", {"param_axes": "fsdp"}),
    "dp 2 x tp 4": ((2, 4), ("dp", "tp"), "tp", {"param_axes": "tp"}),
    "replica 2 x dp 4": ((2, 4), ("replica", "dp"), None, {"replica_axis": "replica"}),
}


@functools.cache
def _optimizer(name):
    """The optimizer of mesh ``name`` (one per mesh for the whole file) and its parameters,
    abstract, with their shardings."""
    shape, names, split, options = MESHES[name]
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), names)

    def spec(k):
        if split is None:
            return P()
        return P(None, split) if k.startswith("layers") else P(split)

    params = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, spec(k)))
        for k, v in _params().items()
    }
    return lwjax.layerwise_muon(params, mesh, routing=RULES, **options), params


@functools.cache
def _logical() -> LogicalState:
    """A logical state of random numbers (second moments positive, a step count): ground
    truth that no conversion made."""
    opt, params = _optimizer("fsdp 8")
    shapes = jax.eval_shape(lambda p: logical.to_logical(opt, opt.init(p)), params)
    rng = np.random.default_rng(1)
    state = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(x.dtype), shapes)
    count = np.int32(7)
    nu = jax.tree.map(np.abs, state.elementwise.nu)
    return state._replace(count=count, elementwise=state.elementwise._replace(count=count, nu=nu))


def _stepped(name):
    """The optimizer of mesh ``name``, its parameters (the masters of :func:`_logical`) and
    its packed state of :func:`_logical`."""
    opt, params = _optimizer(name)
    masters = _logical().masters
    placed = {k: jax.device_put(masters[k], v.sharding) for k, v in params.items()}
    return opt, placed, from_logical(opt, _logical())


def _in_device_memory(arrays, device) -> int:
    """Bytes of the distinct buffers of ``arrays`` in ``device``'s own memory."""
    seen = {}
    for x in arrays:
        if x.sharding.memory_kind not in (None, device.default_memory().kind):
            continue
        for s in x.addressable_shards:
            if s.device == device:
                seen[s.data.unsafe_buffer_pointer()] = s.data.nbytes
    return sum(seen.values())


def _peak(monkeypatch, fn):
    """Run ``fn``; the largest device-0 footprint over the programs it runs: bytes live in its
    memory when a program starts plus the program's outputs and temporaries, less what it
    donates. The conversion programs are built afresh (an empty cache) so that each is seen."""
    device, peaks, jit = jax.devices()[0], [], jax.jit

    def recording(jitted):
        def call(*args, **kwargs):
            if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs))):
                return jitted(*args, **kwargs)  # traced inside another program: nothing runs
            compiled = jitted.lower(*args, **kwargs).compile()
            m = compiled.memory_analysis()
            live = _in_device_memory(jax.live_arrays(), device)
            peaks.append(
                live + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
            )
            return compiled(*args, **kwargs)

        return call

    with monkeypatch.context() as patch:
        patch.setattr(jax, "jit", lambda fun, **options: recording(jit(fun, **options)))
        patch.setattr(logical, "_PROGRAMS", collections.OrderedDict())
        fingerprints = recording(checkpoint_record._fingerprints_jnp)  # jitted when imported
        patch.setattr(checkpoint_record, "_fingerprints_jnp", fingerprints)
        result = fn()
    assert peaks, "no program ran"
    return max(peaks), result


@pytest.mark.parametrize("mesh_name", ["fsdp 8", "dp 2 x fsdp 4"])
def test_save_and_restore_hold_a_devices_share_plus_bounded_staging(
    tmp_path, monkeypatch, mesh_name
):
    """Peak per device while saving: what it held before and at most twice the staging
    budget (the logical state goes to host memory chunk by chunk); while restoring: its
    parameters, its packed state and the same staging (read into host memory, packed chunk
    by chunk). Before, at fsdp 8, the save held 22.5x the packed state above what it held and
    the restore 21.5x above its parameters and packed state: the logical state on the devices
    (1x) and the fingerprints, which gathered every array whole onto every device."""
    opt, placed, state = _stepped(mesh_name)
    monkeypatch.setattr(shards, "STAGING_BYTES", STAGING)
    device = jax.devices()[0]
    gc.collect()
    before = _in_device_memory(jax.live_arrays(), device)
    held_state = _in_device_memory(jax.tree.leaves(state), device)
    held_params = _in_device_memory(jax.tree.leaves(placed), device)
    largest_block = max(shards.staging_bytes(r, jnp.float32) for r in opt.plan.routes)
    staging = 2 * max(STAGING, largest_block) + TABLES

    saved, _ = _peak(
        monkeypatch, functools.partial(checkpoint.save, tmp_path / "c", placed, state, opt)
    )
    assert saved <= before + staging, (saved, before, staging)

    del placed, state
    gc.collect()
    # Arrays other tests left alive in this process (a pytest-xdist worker runs many) count in
    # every program's footprint: measured from what is live now, as the save is.
    others = _in_device_memory(jax.live_arrays(), device)
    restored, (params_back, state_back) = _peak(
        monkeypatch, lambda: checkpoint.restore(tmp_path / "c", opt)
    )
    assert _in_device_memory(jax.tree.leaves(state_back), device) == held_state
    assert restored <= others + held_params + held_state + staging, (
        restored,
        others,
        held_params,
        held_state,
        staging,
    )
    for k, v in params_back.items():  # fp32 parameters: the masters, as saved
        assert v.sharding.spec == opt.leaf_shardings()[k].spec


def _host(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _assert_bitwise(a, b, what):
    a, b = _host(a), _host(b)
    assert len(a) == len(b), what
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape, what
        np.testing.assert_array_equal(x.view(np.uint32), y.view(np.uint32), err_msg=what)


def test_checkpoints_reshard_between_meshes_bit_for_bit(tmp_path):
    """fsdp 8 -> dp 2 x tp 4 -> replica 2 x dp 4 -> fsdp 8, each saved and restored under the
    next: every restore has the parameters that were saved first and the packed state of the
    logical state that was saved first (packed for its mesh straight from the random numbers),
    bit for bit; so, back at fsdp 8, the first packed state and the same next step."""
    first, saved_params, saved_state = _stepped("fsdp 8")
    path = tmp_path / "fsdp 8"
    checkpoint.save(path, saved_params, saved_state, first)
    for name in ("dp 2 x tp 4", "replica 2 x dp 4"):
        opt, _ = _optimizer(name)
        placed, state = checkpoint.restore(path, opt)
        _assert_bitwise(placed, saved_params, f"the parameters at {name}")
        _assert_bitwise(state, from_logical(opt, _logical()), f"the packed state at {name}")
        path = tmp_path / name
        checkpoint.save(path, placed, state, opt)
    placed, state = checkpoint.restore(path, first)
    _assert_bitwise(placed, saved_params, "the parameters back at fsdp 8")
    _assert_bitwise(state, saved_state, "the packed state back at fsdp 8")


def test_conversion_programs_are_built_once_per_optimizer(monkeypatch):
    """A job that saves every N steps traces and compiles the conversions once: converting
    again with the same optimizer builds no program."""
    opt, _, state = _stepped("fsdp 8")
    logical.to_logical(opt, state)
    built, jit = [], jax.jit
    monkeypatch.setattr(jax, "jit", lambda fun, **options: built.append(fun) or jit(fun, **options))
    _assert_bitwise(from_logical(opt, logical.to_logical(opt, state)), state, "a round trip")
    assert built == []


@pytest.mark.parametrize("name", ["dp 2 x fsdp 4", "replica 2 x dp 4"])
def test_packing_writes_pieces_without_scatter(monkeypatch, name):
    """from_logical writes each piece into its bucket shard with a dynamic-update-slice. jnp's
    ``.at[].set`` emits a scatter, and for a piece covering its whole shard that scatter crashed
    XLA's GPU compiler (jax 0.11.2, 2 x H200: an 8B state restored onto dp 2). Here too some
    piece covers its whole shard, and no write program holds a scatter."""
    opt, _ = _optimizer(name)
    whole = [
        p
        for runs in shards.pieces(opt.plan)
        for p in runs
        if p.offset == 0 and p.numel == opt.plan.buffers[p.buffer].shard_sizes[p.bucket]
    ]
    assert whole, "no piece covers its whole shard: the case the test is for is missing"
    texts, program = [], logical._program

    def recorded(optimizer, key, build):
        fn = program(optimizer, key, build)
        if key[0] != "write":
            return fn
        return lambda *args: texts.append(fn.lower(*args).as_text(dialect="hlo")) or fn(*args)

    monkeypatch.setattr(logical, "_program", recorded)
    jax.block_until_ready(from_logical(opt, _logical()))
    assert texts and all("dynamic-update-slice" in t for t in texts)
    assert not [t for t in texts if " scatter(" in t]
