"""lwjax.parallel.exchange: what each tensor-parallel mode does with a split matrix (no mesh)."""

import functools
import warnings

import pytest

from lwjax.parallel.exchange import SplitExchange, TensorSplit, split_exchange, tensor_split
from lwjax.plan import MeshAxes, SlotGroup

_COLS = TensorSplit(cols=(("tp", 2),))


def _ns(x, **options):
    return x, options


@pytest.mark.parametrize(
    "mode, whole", [("duplicated", (4, 12)), ("distributed", (4, 12)), ("blockwise", None)]
)
def test_split_exchange_whole_shape_scales_by_the_whole_matrix_except_blockwise(mode, whole):
    assert SplitExchange(_COLS, mode).whole_shape((4, 6)) == whole


def test_split_exchange_blockwise_runs_newton_schulz_on_each_block():
    assert SplitExchange(_COLS, "blockwise").orthogonalizer(_ns) is _ns


def test_split_exchange_distributed_reduces_over_the_splitting_axes():
    ns = SplitExchange(TensorSplit(rows=(("fsdp", 2), ("tp", 2))), "distributed").orthogonalizer(
        _ns
    )
    reduce, dim = ns("x")[1]["sharded"]
    assert dim == -2 and reduce.keywords == {"axis_name": ("fsdp", "tp")}


def test_split_exchange_distributed_needs_a_one_sided_split():
    split = TensorSplit(rows=(("fsdp", 2),), cols=(("tp", 2),))
    with pytest.raises(ValueError, match="needs each matrix split on one side"):
        SplitExchange(split, "distributed").orthogonalizer(_ns)


def test_split_exchange_duplicated_assembles_the_whole_matrices():
    ns = SplitExchange(_COLS, "duplicated").orthogonalizer(_ns)
    assert isinstance(ns, functools.partial) and ns.args == (_ns, _COLS)


def test_tensor_split_reads_the_group_as_take_reads_it():
    axes = MeshAxes("dp", dp_size=2, tp=("fsdp", "tp"), tp_sizes=(2, 4))
    group = SlotGroup(0, (8, 6), None, ((0,),), (("w",),), tensor_split=((1,), (0,)))
    assert tensor_split(axes, group) == TensorSplit((("tp", 4),), (("fsdp", 2),))
    assert tensor_split(axes, group, transpose=True) == TensorSplit((("fsdp", 2),), (("tp", 4),))
    whole = SlotGroup(0, (8, 6), None, ((0,),), (("w",),))
    assert (
        tensor_split(axes, whole) is None
        and split_exchange(axes, whole, False, "duplicated") is None
    )


def test_moved_names_stay_importable_from_their_old_paths():
    from lwjax import muon, step
    from lwjax.parallel import counted

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert muon.TensorSplit is TensorSplit
        assert step.tensor_split is tensor_split
        assert step.counted_elements is counted.counted_elements
    assert [w.category for w in caught] == [DeprecationWarning] * 3
