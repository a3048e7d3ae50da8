"""The training-step benchmark: its Llama forward against a naive reference, its steps against ground truth, the CLI."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lwjax import train_bench as tb
from lwjax.bench import PGLE_RUNS, workload_shapes
from lwjax.cli import main
from lwjax.muon import MuonConfig
from lwjax.optimizer import OptimizerConfig, layerwise_muon, to_logical

# fp32 everywhere and fp32 Newton–Schulz, so that the dp=4 and the single-device steps agree to rounding.
CFG = tb.TrainBenchConfig(workload="small", layers=1, seq_len=16, micro_batch=2, param_dtype="float32",
                          ns_precision="highest", clip_grad=None)
TINY = tb.ModelConfig(hidden=32, heads=4, groups=2, ffn=24, vocab=50, layers=2, dtype="float32")


LOSS = jax.jit(tb.loss_fn, static_argnums=2)
GRAD = jax.jit(jax.grad(tb.loss_fn), static_argnums=2)


def mesh_of(dp):
    return Mesh(np.array(jax.devices()[:dp]), ("dp",))


def tiny_shapes(c):
    rows = (c.heads + 2 * c.groups) * c.head_dim
    layers = {"linear_qkv": (c.layers, rows, c.hidden), "linear_proj": (c.layers, c.hidden, c.hidden),
              "linear_fc1": (c.layers, 2 * c.ffn, c.hidden), "linear_fc2": (c.layers, c.hidden, c.ffn),
              "input_layernorm": (c.layers, c.hidden), "pre_mlp_layernorm": (c.layers, c.hidden)}
    return {"embedding": (c.vocab, c.hidden), "output_layer": (c.vocab, c.hidden), "final_layernorm": (c.hidden,),
            "layers": layers}


def naive_loss(params, batch, c):
    """Float64 numpy Llama, one query head at a time, reading Megatron's per-group QKV rows by hand."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    tokens, targets = batch[:, :-1], batch[:, 1:]
    (batch_size, seq), d, per_group = tokens.shape, c.head_dim, c.heads // c.groups
    angles = np.arange(seq)[:, None] * c.rope_base ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(angles), np.sin(angles)

    def rope(v):  # [T, d]: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
        v1, v2 = v[:, : d // 2], v[:, d // 2 :]
        return np.concatenate([v1 * cos - v2 * sin, v2 * cos + v1 * sin], axis=-1)

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.norm_eps) * w

    x = p["embedding"][tokens]
    causal = np.triu(np.ones((seq, seq), bool), 1)
    for layer in range(c.layers):
        lp = {k: v[layer] for k, v in p["layers"].items()}
        y = norm(x, lp["input_layernorm"])
        attn = np.zeros((batch_size, seq, c.heads * d))
        for head in range(c.heads):
            group, j = divmod(head, per_group)
            rows = lp["linear_qkv"][group * (per_group + 2) * d :][: (per_group + 2) * d]  # this group's rows
            wq, wk, wv = rows[j * d : (j + 1) * d], rows[per_group * d :][:d], rows[(per_group + 1) * d :][:d]
            for b in range(batch_size):
                scores = rope(y[b] @ wq.T) @ rope(y[b] @ wk.T).T / math.sqrt(d)
                scores[causal] = -np.inf
                weights = np.exp(scores - scores.max(-1, keepdims=True))
                attn[b, :, head * d : (head + 1) * d] = weights / weights.sum(-1, keepdims=True) @ (y[b] @ wv.T)
        x = x + attn @ lp["linear_proj"].T
        gate, up = np.split(norm(x, lp["pre_mlp_layernorm"]) @ lp["linear_fc1"].T, 2, axis=-1)
        x = x + (gate / (1 + np.exp(-gate)) * up) @ lp["linear_fc2"].T
    logits = norm(x, p["final_layernorm"]) @ p["output_layer"].T
    top = logits.max(-1, keepdims=True)
    logz = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    return np.mean(logz - np.take_along_axis(logits, targets[..., None], -1)[..., 0])


def tiny_params(seed=0, config=TINY):
    """Larger-than-init weights (norm weights near 1), so attention is far from uniform and every head matters."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tiny_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree_util.tree_unflatten(treedef, [
        ("layernorm" in jax.tree_util.keystr(path)) + 0.3 * jax.random.normal(k, shape)
        for k, (path, shape) in zip(keys, leaves)])


def tiny_batch(batch_size=2, seq=12, seed=0):
    return np.random.default_rng(seed).integers(0, TINY.vocab, (batch_size, seq + 1), dtype=np.int32)


def test_init_params_has_the_workload_tree():
    shapes, _ = workload_shapes("small", 2)
    params = tb.init_params(shapes, jax.random.key(0))
    got = jax.tree.map(lambda x: x.shape, params)
    assert got == jax.tree.map(tuple, shapes, is_leaf=lambda x: isinstance(x, tuple))
    assert np.all(np.asarray(params["layers"]["input_layernorm"]) == 1)
    assert float(jnp.std(params["layers"]["linear_fc2"])) == pytest.approx(0.02 / 2, rel=0.05)  # 0.02 / sqrt(2 L)


def test_loss_fn_matches_naive_per_head_reference():
    params, batch = tiny_params(), tiny_batch()
    want = naive_loss(params, batch, TINY)
    got = float(LOSS(params, batch, TINY))
    assert got == pytest.approx(want, rel=1e-5)
    swapped = dict(params, layers=dict(params["layers"]))  # k and v rows of group 0 swapped: the loss must move
    qkv = np.array(params["layers"]["linear_qkv"])
    d, per_group = TINY.head_dim, TINY.heads // TINY.groups
    k_rows, v_rows = slice(per_group * d, (per_group + 1) * d), slice((per_group + 1) * d, (per_group + 2) * d)
    qkv[:, k_rows], qkv[:, v_rows] = qkv[:, v_rows].copy(), qkv[:, k_rows].copy()
    swapped["layers"]["linear_qkv"] = jnp.asarray(qkv)
    assert abs(naive_loss(swapped, batch, TINY) - want) > 1e-3


def test_loss_fn_remat_keeps_loss_and_grads():
    one_layer = dataclasses.replace(TINY, layers=1)
    params, batch = tiny_params(1, one_layer), tiny_batch(seed=1)
    value_and_grad = jax.jit(jax.value_and_grad(tb.loss_fn), static_argnums=2)
    remat = value_and_grad(params, batch, dataclasses.replace(one_layer, remat=True))
    _assert_trees_close(remat, value_and_grad(params, batch, one_layer), 1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loss_at_init_is_log_vocab(dtype):
    shapes, _ = workload_shapes("small", 2)
    model = tb.ModelConfig.of_workload("small", 2, dtype=dtype)
    params = tb.init_params(shapes, jax.random.key(0), dtype)
    batch = tb.synthetic_batch(mesh_of(1), 4, 32, model.vocab)
    loss = float(LOSS(params, batch, model))
    assert loss == pytest.approx(math.log(model.vocab), abs=0.15)


def test_model_config_resolves_and_checks_attention():
    assert TINY.attention_implementation() == "xla"  # CPU; "auto" is cuDNN on GPU for bf16/fp16 only
    assert dataclasses.replace(TINY, attention="cudnn").attention_implementation() == "cudnn"
    with pytest.raises(ValueError, match="ModelConfig.attention must be one of"):
        dataclasses.replace(TINY, attention="flash")


def test_model_flops_per_token_counts_matmuls_and_causal_attention():
    model = tb.ModelConfig.of_workload("1b")
    shapes, _ = workload_shapes("1b")
    matmul = sum(math.prod(s) for k, s in shapes["layers"].items() if k.startswith("linear")) + math.prod(
        shapes["output_layer"])
    assert tb.model_flops_per_token(model, 2048) == 6 * matmul + 6 * 16 * 2048 * 2048


def _one_step(contender, params, batch, dp):
    """One step of a benchmark contender at ``dp``: new params and the state (logical for lwjax)."""
    mesh = mesh_of(dp)
    _, split = workload_shapes(CFG.workload, CFG.layers)
    loss = lambda p, b: tb.loss_fn(p, b, CFG.model())  # noqa: E731
    batch = jax.device_put(batch, NamedSharding(mesh, P("dp")))
    if contender == tb.ADAMW_REPLICATED:
        tx = tb.optax_adamw(CFG)
        new, state, _ = tb.optax_step(loss, tx, mesh)(params, tx.init(params), batch)
        return new, state, None
    opt = tb.lwjax_optimizer(params, mesh, split, CFG, muon=contender == tb.MUON)
    new, state, _, grad_norm = tb.lwjax_step(loss, opt)(params, opt.init(params), batch)
    return new, to_logical(opt, state), grad_norm


def _assert_trees_close(got, want, tol, where=None):
    """Per leaf, max |got - want| over max |want| is at most ``tol`` (only at elements ``where`` is true)."""
    where = jax.tree.leaves(where) if where is not None else [True] * len(jax.tree.leaves(want))
    for (path, a), b, mask in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), where):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err = np.max(np.abs(a - b) * mask) / max(np.max(np.abs(b)), 1e-30)
        assert err <= tol, (jax.tree_util.keystr(path), err)


def _adam_well_conditioned(grads, eps=1e-8):
    """Where Adam's first step :math:`g / (|g| + \\epsilon)` is insensitive to rounding of ``g``.

    Gradients agree to ~1e-6 of the largest one, whatever the batch split; at
    elements with :math:`0 < |g| < 100 \\epsilon` that rounding moves the update by up to
    the learning rate, so those few are left out (zero gradients are exact on both sides).
    """
    return jax.tree.map(lambda g: (np.abs(np.asarray(g)) > 100 * eps) | (np.asarray(g) == 0), grads)


@pytest.mark.parametrize("contender", [tb.ADAMW_SHARDED, tb.ADAMW_REPLICATED])
def test_adamw_step_at_dp4_is_the_single_device_full_batch_step(contender):
    """Ground truth: full-batch mean gradient on one device, then optax AdamW (decay on matrices only)."""
    shapes, _ = workload_shapes(CFG.workload, CFG.layers)
    params = tb.init_params(shapes, jax.random.key(0))
    batch = np.asarray(tb.synthetic_batch(mesh_of(4), CFG.micro_batch, CFG.seq_len, CFG.model().vocab))
    grads = GRAD(params, batch, CFG.model())
    decay = {"embedding": True, "output_layer": True, "final_layernorm": False,
             "layers": {k: k.startswith("linear") for k in shapes["layers"]}}
    tx = optax.adamw(CFG.learning_rate, b1=0.9, b2=0.999, eps=1e-8, weight_decay=CFG.weight_decay, mask=decay)
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    want = optax.apply_updates(params, updates)

    got, got_state, _ = _one_step(contender, params, batch, dp=4)
    _assert_trees_close(got, want, 1e-5, where=_adam_well_conditioned(grads))
    # Adam's first moment is (1 - b1) g: the gradient itself, mean over the global batch (Adam's step is scale-free).
    mu = got_state.elementwise.mu if contender == tb.ADAMW_SHARDED else got_state[0].mu
    _assert_trees_close(mu, state[0].mu, 1e-5)


def test_muon_step_at_dp4_is_the_single_device_full_batch_step():
    shapes, split = workload_shapes(CFG.workload, CFG.layers)
    params = tb.init_params(shapes, jax.random.key(1))
    batch = np.asarray(tb.synthetic_batch(mesh_of(4), CFG.micro_batch, CFG.seq_len, CFG.model().vocab, seed=1))

    mesh = mesh_of(1)  # the reference: one device, full-batch gradients, layerwise_muon built directly
    opt = layerwise_muon(params, mesh, learning_rate=CFG.learning_rate,
                         muon=MuonConfig(fp32_matmul_prec="highest"),
                         config=OptimizerConfig(clip_grad=None, matrix_convention="out_in"),
                         stacked={"layers/*": 1}, qkv_split=split)
    grads = GRAD(params, batch, CFG.model())
    step = jax.jit(jax.shard_map(lambda g, s, p: opt.update(g, s, p)[:2], mesh=mesh,
                                 in_specs=(P(), opt.state_specs, P()), out_specs=(P(), opt.state_specs),
                                 check_vma=False))
    want, want_state = step(grads, opt.init(params), params)
    assert sum(r.is_muon for r in opt.plan.routes) == 4  # qkv, proj, fc1, fc2

    got, got_state, grad_norm = _one_step(tb.MUON, params, batch, dp=4)
    assert float(grad_norm) == pytest.approx(float(optax.tree.norm(grads)), rel=1e-5)  # the full-batch gradient's
    masks = jax.tree.leaves(_adam_well_conditioned(grads))  # Adam leaves where conditioned, Muon matrices everywhere
    where = [np.ones(m.shape, bool) if r.is_muon else m for r, m in zip(opt.plan.routes, masks)]
    _assert_trees_close(got, want, 1e-5, where=where)
    _assert_trees_close(got_state.momenta, to_logical(opt, want_state).momenta, 1e-5)  # (1 - beta) g


def test_cli_train_step_writes_bench_json(tmp_path, capsys):
    code = main(["bench", "--train-step", "--workload", "small", "--layers", "1", "--dp", "2", "--seq-len", "16",
                 "--micro-batch", "1", "--iters", "1", "--warmup", "0", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    records = json.loads((tmp_path / "bench.json").read_text())
    assert [r["contender"] for r in records] == [*tb.CONTENDERS, tb.FORWARD_BACKWARD]
    muon = records[0]
    assert set(muon["muon_overhead_pct"]) == {tb.ADAMW_SHARDED, tb.ADAMW_REPLICATED}
    for r in records:
        assert r["dp"] == 2 and r["tokens_per_step"] == 32 and r["step_ms"] > 0 and r["tokens_per_s"] > 0
        assert (r["iters"], r["warmup"]) == (1, 0)
    assert "Training step" in out and "Muon overhead" in out and tb.ADAMW_REPLICATED in out


class _Recorded:
    """A jitted step that notes, at each call through jit, whether PGLE is on."""

    def __init__(self, step, calls):
        self.step, self.calls = step, calls

    def lower(self, *args):
        return self.step.lower(*args)

    def __call__(self, *args):
        self.calls.append(jax.config.jax_enable_pgle)
        return self.step(*args)


def _run_recorded(cfg, monkeypatch):
    """run_train_bench, with each contender's calls through jit and whether each lwjax update speculates."""
    calls, speculates = [], set()  # calls: per step built, in contender order; speculates: (muon, "recomputed")
    lwjax_optimizer = tb.lwjax_optimizer

    def recorded(make):
        def build(*args, **kwargs):
            calls.append([])
            return _Recorded(make(*args, **kwargs), calls[-1])
        return build

    def optimizer(*args, muon=True, **kwargs):
        opt = lwjax_optimizer(*args, muon=muon, **kwargs)

        def update(grads, state, params):
            new_params, new_state, metrics = opt.update(grads, state, params)
            speculates.add((muon, "recomputed" in metrics))
            return new_params, new_state, metrics
        return opt._replace(update=update)

    with monkeypatch.context() as patch:
        patch.setattr(tb, "lwjax_optimizer", optimizer)
        for name in ("lwjax_step", "optax_step", "forward_backward_step"):
            patch.setattr(tb, name, recorded(getattr(tb, name)))
        records = tb.run_train_bench(cfg)
    return records, calls, speculates


@pytest.mark.filterwarnings("ignore:PGLE collected an empty trace")  # no kernel trace on CPU; the paths still run
def test_train_step_pipelined_under_pgle_trains_as_the_serial_step(monkeypatch):
    """--train-step --pipeline-muon --pgle: the same steps (the jit path PGLE recompiles, speculation and all)."""
    cfg = dataclasses.replace(CFG, dp_sizes=(2,), iters=1, warmup=3, baselines=False, clip_grad=1.0)
    (serial, serial_calls, serial_updates), (pipelined, calls, updates) = (
        _run_recorded(dataclasses.replace(cfg, pipeline_muon=on, pgle=on), monkeypatch) for on in (False, True))
    assert [(r["pipeline_muon"], r["pgle"]) for r in pipelined] == [(True, True)] * 3
    # The flags took effect. Serial: every call goes to the executable compiled up front, and Muon's
    # update does not speculate. PGLE: every contender's calls go through jit with PGLE on, enough of
    # them to profile and recompile; pipelined: Muon's update speculates (AdamW has no Muon bucket).
    assert serial_calls == [[], [], []] and serial_updates == {(True, False), (False, False)}
    assert len(calls) == 3 and not jax.config.jax_enable_pgle
    for contender_calls in calls:
        assert all(contender_calls) and len(contender_calls) > PGLE_RUNS
    assert updates == {(True, True), (False, False)}
    for a, b in zip(serial, pipelined):
        assert a["contender"] == b["contender"]
        if "loss" in a:  # after warmup + iters + 1 steps each
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        if a["contender"] in (tb.MUON, tb.ADAMW_SHARDED):
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5) and a["grad_norm"] > 0


@pytest.mark.parametrize("argv, message", [
    ("bench --seq-len 16", "lwjax bench: --seq-len, --micro-batch and --remat apply to --train-step only."),
    ("bench --train-step --profile /tmp/x", "lwjax bench: --megatron, --profile and --grad-std apply to the optimizer "
                                            "step only"),
    ("bench --train-step --micro-batch 0", "lwjax bench: TrainBenchConfig.micro_batch must be >= 1; got 0."),
], ids=["seq_len_without_train_step", "profile_with_train_step", "micro_batch_zero"])
def test_cli_train_step_user_errors(argv, message, capsys):
    code = main(argv.split())
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.startswith(message) and err.count("\n") == 1
