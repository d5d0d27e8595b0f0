"""``torchrec_swp.sharding``: a resize refuses, in one line and before any load, a sharding plan
that gives a table another type than the checkpoint's.

TorchRec's planner changes a small table's type with the world size (the model of
``tests/dist/test_resize_own_loop.py``: ``t0`` table-wise on 2 ranks, data-parallel on 1); pinned
by the planner's constraints it keeps it. The DLRM example's checkpoint check uses the same
comparison on another world size (its plans described as ``"table_wise on rank 1"``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.dist.test_resize_own_loop import Tiny, planner, sharder
from torchrec_swp.sharding import check_sharding_types, sharding_types


def _types(world_size: int, *, pinned: bool) -> dict[str, str]:
    return sharding_types(planner(world_size, pinned=pinned).plan(Tiny(), [sharder()]))


def test_the_planner_changes_a_small_tables_type_with_the_world_size_and_a_pin_keeps_it() -> None:
    on_two, on_one = _types(2, pinned=False), _types(1, pinned=False)
    assert on_two == {"t0": "table_wise", "t1": "table_wise"}
    assert on_one == {"t0": "data_parallel", "t1": "table_wise"}
    with pytest.raises(ValueError) as info:
        check_sharding_types(on_two, on_one)
    assert str(info.value) == (
        "table t0 is table_wise in the checkpoint's sharding plan and data_parallel in the new one, which DCP "
        "cannot load (a data_parallel table's optimizer state is in the dense optimizer, a sharded table's in "
        'the fused one): pin its type on every world size: EmbeddingShardingPlanner(..., constraints={"t0": '
        'ParameterConstraints(sharding_types=["table_wise"])})'
    )
    pinned = _types(1, pinned=True)
    assert pinned == on_two
    check_sharding_types(on_two, pinned)  # the tables may move between ranks


def test_another_sharded_type_and_a_table_only_one_plan_holds_are_refused() -> None:
    saved = {"a": "table_wise", "b": "row_wise"}
    cases = {
        "row_wise for a": (
            {"a": "row_wise", "b": "row_wise"},
            "table a is table_wise in the checkpoint's sharding plan and row_wise in the new one, and a resize keeps "
            "each table's type (DCP reshards a table's state between plans of one type; across types its layout "
            'may differ): pin its type on every world size: EmbeddingShardingPlanner(..., constraints={"a": '
            'ParameterConstraints(sharding_types=["table_wise"])})',
        ),
        "a new table": (
            {"a": "table_wise", "b": "row_wise", "c": "row_wise"},
            "table c is in the new sharding plan and not in the checkpoint's (a, b): another model?",
        ),
        "a lost table": (
            {"b": "row_wise"},
            "table a is in the checkpoint's sharding plan and not in the new one: another model?",
        ),
    }
    for case, (new, message) in cases.items():
        with pytest.raises(ValueError) as info:
            check_sharding_types(saved, new)
        assert str(info.value) == message, case
    with pytest.raises(ValueError, match=r"row_wise in the new one, .*: resume with b row_wise$"):
        check_sharding_types(saved, {"a": "row_wise", "b": "row_wise"}, pin="resume with b {new}")


def test_a_table_name_two_modules_shard_cannot_be_pinned_apart() -> None:
    spec = SimpleNamespace(sharding_type="table_wise")
    plan = SimpleNamespace(plan={"sparse.ebc": {"t": spec}, "sparse.weighted_ebc": {"t": spec}})
    with pytest.raises(ValueError) as info:
        sharding_types(plan)
    assert str(info.value) == (
        "sharding_types(): modules sparse.ebc and sparse.weighted_ebc both shard a table 't'; the planner's "
        "constraints, keyed by table name, cannot tell them apart"
    )


def test_the_dlrm_example_refuses_a_resize_that_changes_a_tables_type(tmp_path: Path) -> None:
    from examples.dlrm import checkpoint, train

    small = [
        "--num-sparse", "2", "--num-embeddings", "100", "--embedding-dim", "8",
        "--data-source", "global", "--epoch-batches", "8",
    ]  # fmt: skip
    written = train.fingerprint(train.parse_args(small), 2)  # mixed: t_cat_0 table-wise, t_cat_1 row-wise
    step = tmp_path / "step-000004"
    step.mkdir()
    meta = json.dumps({"step": 4, "fingerprint": written, "written_on": {"world_size": 2}})
    (step / "meta.json").write_text(meta)
    digest = hashlib.sha256(meta.encode()).hexdigest()
    (step / "MANIFEST").write_text(f"{digest} {len(meta.encode())} meta.json\n")
    (tmp_path / "latest").write_text("step-000004\n")
    same = train.fingerprint(train.parse_args(small), 1)
    assert checkpoint.check(tmp_path, same, resume=True, why_not_resizable=None) is not None
    other = train.fingerprint(train.parse_args([*small, "--sharding", "row_wise"]), 1)
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.check(tmp_path, other, resume=True, why_not_resizable=None)
    assert str(info.value) == (
        f"checkpoint {step} was written on 2 ranks, this run has 1: table t_cat_0 is table_wise in the "
        "checkpoint's sharding plan and row_wise in the new one, and a resize keeps each table's type (DCP "
        "reshards a table's state between plans of one type; across types its layout may differ): resume with "
        "the same --sharding"
    )
