"""lwjax.tools.demo: the GPT, the stdlib byte corpus, run_demo and the ``lwjax demo`` command."""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lwjax
from lwjax.tools.cli import main
from lwjax.tools.demo import data
from lwjax.tools.demo.model import GPT, MODEL_SIZES, GPTConfig, lwjax_routing
from lwjax.tools.demo.run import BASELINES, DemoConfig, run_demo

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = dict(model_size="tiny", batch_size=8, seq_len=32, eval_windows=16, progress=False)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-qkv", "separate-qkv"])
def test_gpt_is_causal(fused):
    model = GPT(
        GPTConfig(
            num_layers=1,
            d_model=32,
            num_heads=4,
            num_kv_heads=2,
            fused_qkv=fused,
            tied_embedding=True,
        ),
        rngs=nnx.Rngs(0),
    )
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
    tokens = np.random.default_rng(0).integers(0, 256, (2, 12)).astype(np.int32)
    changed = tokens.copy()
    changed[:, 8:] = 7
    a, b = forward(state, tokens), forward(state, changed)
    assert a.shape == (2, 12, 256) and a.dtype == jnp.float32
    np.testing.assert_array_equal(a[:, :8], b[:, :8])  # the past ignores the future
    assert float(jnp.max(jnp.abs(a[:, 8:] - b[:, 8:]))) > 1e-3


def test_gpt_config_checks_shapes():
    with pytest.raises(ValueError, match="num_kv_heads must divide num_heads"):
        GPTConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="heads of even width"):
        GPTConfig(d_model=36, num_heads=4)
    assert MODEL_SIZES["small"].qkv_split == (64, 32, 32)  # 4 heads of 32 in 2 groups
    assert lwjax_routing(GPTConfig(fused_qkv=False)) == lwjax.RoutingRules()


def test_stdlib_corpus_splits_by_file_and_is_reproducible():
    corpus = data.load_stdlib_corpus()
    files = sorted(data.stdlib_root().glob("*.py"))
    assert corpus.num_files == len(files) and corpus.train.dtype == np.uint8
    assert len(corpus.train) + len(corpus.val) == sum(f.stat().st_size for f in files)
    assert 0.05 < len(corpus.val) / (len(corpus.train) + len(corpus.val)) < 0.35
    first_val_file, first_train_file = files[0].read_bytes(), files[1].read_bytes()
    assert bytes(corpus.val[: len(first_val_file)]) == first_val_file
    assert bytes(corpus.train[: len(first_train_file)]) == first_train_file
    capped = data.load_stdlib_corpus(max_bytes=300_000)
    assert len(capped.train) + len(capped.val) == 300_000
    # Python source: far from uniform (log 256 = 5.55 nats), far from trivial.
    assert 2.5 < corpus.unigram_entropy() < 4.0
    a, b = (
        data.train_batches(corpus.train, 4, 16, seed=3),
        data.train_batches(corpus.train, 4, 16, seed=3),
    )
    batch = next(a)
    np.testing.assert_array_equal(batch["inputs"], next(b)["inputs"])
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    with pytest.raises(ValueError, match="need Python sources"):
        data.load_stdlib_corpus(root=ROOT / "docs")


def test_demo_config_rejects_bad_options():
    with pytest.raises(ValueError, match="DemoConfig.model_size must be one of"):
        DemoConfig(model_size="huge")
    with pytest.raises(ValueError, match="DemoConfig.baseline must be one of"):
        DemoConfig(baseline="sgd")
    with pytest.raises(ValueError, match="DemoConfig.steps must be a positive int"):
        DemoConfig(steps=0)
    assert set(BASELINES) == {"adamw", "optax_muon", "none"}


def test_run_demo_beats_unigram_and_writes_outputs(tmp_path):
    # 60 steps: the two runs' steps are most of this test's time; lwjax still ends about 0.16
    # nats under the bound (2.67 against 2.83).
    metrics = run_demo(DemoConfig(steps=60, eval_every=30, out=str(tmp_path), **TINY))
    unigram = metrics["data"]["unigram_entropy"]
    lwjax_run, adamw = metrics["runs"]["lwjax"], metrics["runs"]["adamw"]
    assert metrics["devices"] == {"platform": "cpu", "count": 8}
    assert [s for s, _ in lwjax_run["val_losses"]] == [0, 30, 60]
    assert lwjax_run["val_losses"][0][1] == adamw["val_losses"][0][1]  # same initial weights
    assert lwjax_run["final_val_loss"] < unigram - 0.3, (lwjax_run["final_val_loss"], unigram)
    assert adamw["final_val_loss"] < adamw["val_losses"][0][1]
    # ZeRO-1-sized state: masters + moments over 8 ranks vs replicated mu and nu.
    assert lwjax_run["state_bytes_per_device"] < adamw["state_bytes_per_device"] / 2
    assert lwjax_run["tokens_per_s"] > 0 and len(lwjax_run["train_losses"]) == 60
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written["runs"]["lwjax"]["final_val_loss"] == lwjax_run["final_val_loss"]
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_command_prints_json_and_writes_files(tmp_path, capsys):
    args = [
        "demo",
        "--steps",
        "2",
        "--model-size",
        "tiny",
        "--batch-size",
        "8",
        "--seq-len",
        "16",
        "--eval-windows",
        "8",
        "--baseline",
        "none",
        "--max-corpus-bytes",
        "100000",
        "--tied-embedding",
        "--no-fused-qkv",
        "--out",
        str(tmp_path),
        "--json",
    ]
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((tmp_path / "metrics.json").read_text())
    assert printed["config"]["tied_embedding"] and not printed["model"]["gpt_config"]["fused_qkv"]
    assert list(printed["runs"]) == ["lwjax"] and (tmp_path / "loss.png").exists()


def test_demo_command_user_errors_exit_2(capsys):
    assert (
        main(["demo", "--batch-size", "12", "--devices", "8", "--steps", "1", "--out", "unused"])
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "lwjax demo: DemoConfig.batch_size must divide by the 8 devices; got batch_size=12" in err
    )
    assert main(["demo", "--model-size", "huge"]) == 2
    assert "DemoConfig.model_size must be one of" in capsys.readouterr().err
    assert main(["demo", "--devices", "64", "--out", "unused"]) == 2
    assert "only 8 cpu devices are available" in capsys.readouterr().err
    assert not pathlib.Path("unused").exists()


def test_demo_config_fields_are_cli_flags():
    from lwjax.tools.cli import _build_parser

    args = vars(_build_parser().parse_args(["demo"]))
    assert {f.name for f in dataclasses.fields(DemoConfig)} <= set(args)
    assert {name: args[name] for name in ("steps", "model_size", "batch_size", "out")} == {
        name: getattr(DemoConfig, name) for name in ("steps", "model_size", "batch_size", "out")
    }
