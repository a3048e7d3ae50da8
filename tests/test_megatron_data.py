"""Megatron's data order against megatron-core 0.19.2's own: its IndexedDatasetBuilder wrote
the dataset, its GPTDataset built the indices and samples
(tests/fixtures/megatron/make_gpt_data.py)."""

import json
import pathlib
import shutil

import numpy as np
import pytest

from lwjax.megatron import import_megatron
from lwjax.megatron.data_order import megatron_batches
from lwjax.megatron.gpt_data import gpt_sample_order, sample_index
from lwjax.megatron.indexed_data import IndexedData

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "megatron"
DATA = FIXTURES / "gpt_data"
PREFIX = DATA / "docs"
CASES = json.loads((DATA / "cases.json").read_text())


@pytest.fixture(scope="module")
def expected():
    with np.load(DATA / "gpt_dataset.npz") as arrays:
        return dict(arrays)


def _order(case):
    c = CASES[case]
    return gpt_sample_order(
        IndexedData(PREFIX),
        seed=c["seed"],
        sequence_length=c["seq_length"],
        num_samples=c["train_samples"],
        split=c["split"],
    )


def test_reader_reads_what_megatrons_builder_wrote(expected):
    data = IndexedData(PREFIX)
    lengths = expected["written/sequence_lengths"]
    assert data.dtype == np.uint16 and len(data) == len(lengths)
    np.testing.assert_array_equal(data.sequence_lengths, lengths)
    np.testing.assert_array_equal(data.document_boundaries, expected["written/document_boundaries"])
    np.testing.assert_array_equal(data.tokens, expected["written/tokens"])
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for s in (0, 7, len(lengths) - 1):
        np.testing.assert_array_equal(
            data.get(s), expected["written/tokens"][starts[s] : starts[s + 1]]
        )
    assert (
        data.get(7, 1, 2).tolist()
        == expected["written/tokens"][starts[7] + 1 : starts[7] + 3].tolist()
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_indices_are_gpt_datasets(case, expected):
    order = _order(case)
    assert order.epochs == CASES[case]["epochs"] and len(order) == CASES[case]["length"]
    for name in ("document_index", "sample_index", "shuffle_index"):
        want = expected[f"{name}/{case}"]
        got = getattr(order, name)
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(got, want, err_msg=name)
    no_extra = sample_index(
        order.data.sequence_lengths, order.document_index, order.sequence_length, 0
    )
    np.testing.assert_array_equal(no_extra, expected[f"sample_index_no_extra/{case}"])


def test_cases_cover_the_last_epoch_shuffled_apart_and_with_the_others():
    """The fixture's multi-epoch cases take both branches of the 80% rule."""
    for case, apart in (("final_epoch_apart", True), ("epochs", False)):
        order = _order(case)
        tokens = int(order.data.sequence_lengths[: CASES[case]["train_sequences"][1]].sum())
        before_final = ((order.epochs - 1) * tokens - 1) // order.sequence_length
        assert order.epochs > 1
        tail = order.shuffle_index[before_final:]
        assert bool(np.all(tail >= before_final)) is apart, case


def test_sample_index_equals_build_sample_idx_on_random_streams(expected):
    cases = sorted({k.split("/")[1] for k in expected if k.startswith("stress/")}, key=int)
    assert len(cases) >= 20
    for c in cases:
        seq_length, extra = expected[f"stress/{c}/settings"]
        got = sample_index(
            expected[f"stress/{c}/sizes"],
            expected[f"stress/{c}/documents"],
            int(seq_length),
            int(extra),
        )
        want = expected[f"stress/{c}/sample_index"]
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want, err_msg=f"stress case {c}")


@pytest.mark.parametrize("case", ["epochs", "final_epoch_apart"])
def test_batches_from_consumed_samples_are_gpt_datasets_samples(case, expected):
    """1,000 samples (400 in the second case) from a resumed consumed_train_samples, in
    Megatron's sampler order, give GPTDataset's tokens and labels."""
    c = CASES[case]
    args = {
        "seed": c["seed"],
        "seq_length": c["seq_length"],
        "global_batch_size": 8,
        "split": c["split"],
        "train_samples": c["train_samples"],
        "consumed_train_samples": c["consumed"],
    }
    batches = megatron_batches(PREFIX, args)
    rows = c["count"] // 8
    pairs = [pair for pair, _ in zip(batches, range(rows))]
    tokens = np.concatenate([t for t, _ in pairs])
    labels = np.concatenate([y for _, y in pairs])
    assert tokens.shape == (c["count"], c["seq_length"]) and tokens.dtype == np.int32
    np.testing.assert_array_equal(tokens, expected[f"tokens/{case}"])
    np.testing.assert_array_equal(labels, expected[f"labels/{case}"])
    assert len(batches) == (c["length"] - c["consumed"]) // 8


def test_import_megatron_data_continues_the_checkpoints_run(expected):
    """resume_muon stopped after 3 iterations of 4 samples; its args store no seed, split or
    consumed_train_samples, so Megatron-LM's defaults and iteration x batch apply."""
    imported = import_megatron(FIXTURES / "resume_muon")
    batches = imported.data(PREFIX)
    tokens = np.concatenate([t for t, _ in list(batches)[:3]])
    np.testing.assert_array_equal(tokens, expected["tokens/resume_muon"])
    report = batches.report()
    for line in (
        "seed                   = 1234  (default: Megatron-LM's --seed)",
        "train_samples          = 24  (args.train_iters x global_batch_size)",
        "consumed_train_samples = 12  (iteration 3 x global_batch_size)",
        "seq_length             = 16  (args.seq_length)",
    ):
        assert line in report, report
    assert imported.data(PREFIX, consumed_train_samples=0).settings["consumed_train_samples"] == (
        0,
        "argument",
    )


def _copy(tmp_path):
    for suffix in (".bin", ".idx"):
        shutil.copy(f"{PREFIX}{suffix}", tmp_path / f"docs{suffix}")
    return tmp_path / "docs"


@pytest.mark.parametrize(
    "offset, value, message",
    [
        (0, b"MMIDIDY", "not a Megatron index file"),
        (9, b"\x02", "index version 2"),
        (17, b"\x09", "unknown token dtype code 9"),
        (18, b"\xff\xff", "truncated"),
        (26, b"\x05", "document boundaries end at"),
    ],
)
def test_bad_idx_is_an_error_naming_the_file(tmp_path, offset, value, message):
    prefix = _copy(tmp_path)
    raw = bytearray(pathlib.Path(f"{prefix}.idx").read_bytes())
    raw[offset : offset + len(value)] = value
    pathlib.Path(f"{prefix}.idx").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=message) as err:
        IndexedData(prefix)
    assert f"{prefix}.idx" in str(err.value)


def test_empty_idx_is_an_error_naming_the_file(tmp_path):
    prefix = _copy(tmp_path)
    pathlib.Path(f"{prefix}.idx").write_bytes(b"")
    with pytest.raises(ValueError, match=r"docs\.idx: not a Megatron index file"):
        IndexedData(prefix)


def test_missing_or_short_bin_is_an_error_naming_the_file(tmp_path):
    prefix = _copy(tmp_path)
    with pytest.raises(ValueError, match="no such file"):
        IndexedData(tmp_path / "other")
    pathlib.Path(f"{prefix}.bin").write_bytes(pathlib.Path(f"{prefix}.bin").read_bytes()[:-2])
    with pytest.raises(
        ValueError, match=r"docs\.bin: 9414 bytes, but .*docs\.idx places a sequence"
    ):
        IndexedData(prefix)


@pytest.mark.parametrize(
    "args, message",
    [
        ({"data_path": ["0.3", "a", "0.7", "b"]}, "a blend of datasets"),
        ({"rampup_batch_size": [4, 4, 100]}, "args.rampup_batch_size"),
        ({"dataloader_type": "cyclic"}, "args.dataloader_type='cyclic'"),
        ({"seq_length": None}, "seq_length: the checkpoint's args do not store it"),
        ({"consumed_train_samples": 285}, "consumed_train_samples=285 .*none left"),
        ({"split": "0, 1, 0"}, "train split of 239 sequences is empty"),
        (
            {"global_batch_size": "4"},
            r"global_batch_size \(from args.global_batch_size\): expected",
        ),
    ],
)
def test_settings_lwjax_cannot_follow_are_errors(args, message):
    base = {"seq_length": 16, "global_batch_size": 4, "train_iters": 6, "split": "969, 30, 1"}
    with pytest.raises(ValueError, match=message):
        megatron_batches(PREFIX, {**base, **args})


def test_a_stored_zero_consumed_train_samples_resumes_at_the_iteration_as_megatron_lm():
    args = {"seq_length": 16, "global_batch_size": 4, "train_iters": 6, "consumed_train_samples": 0}
    resumed = megatron_batches(PREFIX, args, iteration=3)
    assert resumed.settings["consumed_train_samples"] == (12, "iteration 3 x global_batch_size")
    stored = megatron_batches(PREFIX, {**args, "consumed_train_samples": 8}, iteration=3)
    assert stored.settings["consumed_train_samples"] == (8, "args.consumed_train_samples")
