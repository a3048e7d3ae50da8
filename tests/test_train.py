"""``jit_shard_map``: donated buffers are paired with their own outputs by JAX, not by
byte size in XLA, unread parameters included."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lwjax.parallel.jit import jit_shard_map
from lwjax.tools import bench


def _aliases(lowered_text: str) -> tuple[list[tuple[str, str]], str]:
    """``(argument type, type of the output it is aliased to)`` per aliased argument,
    and ``main``'s signature."""
    main = next(line for line in lowered_text.splitlines() if "func.func public @main" in line)
    args, results = main.split(") -> (")
    result_types = re.findall(r"tensor<[^>]*>", results)
    pairs = []
    for arg in args.split("%arg")[1:]:
        out = re.search(r"tf\.aliasing_output = (\d+)", arg)
        if out:
            pairs.append((re.search(r"tensor<[^>]*>", arg)[0], result_types[int(out[1])]))
    return pairs, main


def _workload(pipeline_muon=False):
    config = bench.workload_config("small", 2)
    shapes = bench.workload_shapes(config)
    mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
    params = bench.constant_params(shapes, mesh, jnp.bfloat16)
    opt = bench.workload_optimizer(
        params,
        mesh,
        config,
        ns_precision="medium",
        grad_reduce_in_fp32=True,
        policy="ns_cost",
        bucket_size="auto",
        pipeline_muon=pipeline_muon,
    )
    return mesh, params, opt, bench.local_grads(shapes, mesh, jnp.bfloat16, 1e-2)


def _pointers(tree) -> list[list[int]]:
    return [
        [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]
        for x in jax.tree.leaves(tree)
    ]


def test_donated_parameters_and_state_are_aliased_when_the_parameters_are_not_read():
    """The benchmark's step never reads its parameters (it rebuilds them from the masters).

    Without ``out_shardings`` JAX marks every donated buffer ``jax.buffer_donor``
    and leaves the pairing to XLA, which pairs by size and crosses; without
    ``keep_unused`` JAX prunes the unread parameters, and the new ones have no donor.
    """
    mesh, params, opt, grads = _workload(pipeline_muon=True)
    state = opt.init(params)
    # The pipelined step is two steps the host chooses between (each also returns its
    # speculation flag apart from the state), neither with the conditional over the whole
    # step that the one-program form has.
    steps = bench.optimizer_step(opt).compiled
    assert set(steps) == {True, False}
    one_program = jit_shard_map(
        lambda p, s, g: opt.local_update(jax.tree.map(lambda x: x[0], g), s, p)[:2],
        mesh,
        (P(), opt.state_specs, P("dp")),
        (P(), opt.state_specs),
        donate_argnums=(0, 1),
    )

    def conditionals(step):
        return step.lower(params, state, grads).compile().as_text().count(" conditional(")

    for step in steps.values():
        pairs, main = _aliases(step.lower(params, state, grads).as_text())
        assert "jax.buffer_donor" not in main
        donated = len(jax.tree.leaves(params)) + len(jax.tree.leaves(state))
        assert len(pairs) == donated and all(a == r for a, r in pairs)
        # The flag returned apart from the state (the last output) takes no donated buffer:
        # the state's own flag does.
        outputs = len(re.findall(r"tensor<[^>]*>", main.split(") -> (")[1]))
        assert not re.search(rf"tf\.aliasing_output = {outputs - 1}\b", main)
        assert conditionals(step) < conditionals(one_program)


def test_train_step_signature_aliases_parameters_and_state():
    """A step that reads its parameters (forward and backward) donates and aliases
    parameters and state alike."""
    mesh, params, opt, grads = _workload()
    state = opt.init(params)

    def local_step(p, s, batch):
        def loss(q):
            squares = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(q))
            return squares * batch[0, 0]

        value, g = jax.value_and_grad(loss)(p)
        p, s, _ = opt.local_update(g, s, p)
        return p, s, jax.lax.pmean(value, "dp")

    step = jit_shard_map(
        local_step,
        mesh,
        (P(), opt.state_specs, P("dp")),
        (P(), opt.state_specs, P()),
        donate_argnums=(0, 1),
    )
    pairs, main = _aliases(step.lower(params, state, jnp.ones((4, 2))).as_text())
    assert "jax.buffer_donor" not in main
    assert len(pairs) == len(jax.tree.leaves(params)) + len(jax.tree.leaves(state))
    assert all(a == r for a, r in pairs)


def test_a_step_that_does_not_read_its_parameters_writes_every_output_in_place():
    """Each new parameter and state buffer lands where its donated argument was, call
    after call: a buffer that moves makes XLA re-record the step's CUDA graph on GPU."""
    _, params, opt, grads = _workload()
    step = bench.optimizer_step(opt)
    args = step(params, opt.init(params), grads)
    before = _pointers(args)
    args = step(*args, grads)
    assert _pointers(args) == before
