"""A drop-in's default plan: its row in ``torchrec_swp.drop_ins`` names the catalog function and
the arguments of the docs' table, the golden plans and ``default_plans()``; its class
(``_swp_default_plan``) calls the row's function (``_swp_row_plan``) with the options it was built
with. Every class built with its defaults runs its row's plan."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from torchrec.distributed.train_pipeline.pipeline_stage import PipelineStage

import torchrec_swp
from tests.unit.test_engine_options import build, global_configs_restored  # noqa: F401  (the fixture)
from torchrec_swp import drop_ins
from torchrec_swp.catalog import torchrec as catalog
from torchrec_swp.integrations.torchrec import pipelines

ROWS = {row.name: row for row in drop_ins.drop_ins()}


def _staged_as_its_row() -> Any:
    """StagedTrainPipeline with the row's stages: its plan's streams are the stages' names (the
    user's stages say which streams; the row's arguments name those of upstream's example)."""
    args = ROWS["StagedTrainPipeline"].plan_arguments
    stages = [
        PipelineStage(name, lambda b: b, torch.Stream(device="cpu"), fill_callback=(lambda: None) if fill else None)
        for name, fill in zip(args["stage_names"], args["fill_callbacks"])
    ]
    return torchrec_swp.StagedTrainPipeline(stages)


@pytest.mark.usefixtures("global_configs_restored")
@pytest.mark.parametrize("name", pipelines.__all__)
def test_a_pipeline_built_with_its_defaults_runs_its_rows_plan(name: str) -> None:
    row = ROWS[name]
    pipeline = _staged_as_its_row() if name == "StagedTrainPipeline" else build(name)
    try:
        if name == "StagedTrainPipeline":
            args = dict(row.plan_arguments, stage_streams=row.plan_arguments["stage_names"])
            expected = getattr(catalog, row.plan)(**args)
        else:
            expected = catalog.default_plan(row)
        assert pipeline.plan == expected, f"{name}: the default plan is not its row's:\n{pipeline.plan.to_text()}"
    finally:
        pipeline.close()


def test_a_row_whose_arguments_differ_from_the_class_is_caught() -> None:
    """The comparison sees a difference the row could make: SemiSync's start_batch."""
    row = ROWS["TrainPipelineSemiSync"]
    pipeline = build("TrainPipelineSemiSync")
    try:
        other = getattr(catalog, row.plan)(**{**row.plan_arguments, "start_batch": 3})
        assert pipeline.plan != other
    finally:
        pipeline.close()


def test_the_class_takes_its_catalog_function_from_its_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """The row alone names the catalog function (``PlanDriven._swp_row_plan``): a row naming another
    function changes what a built pipeline runs; the class gives the options it was built with."""
    calls: list[dict[str, Any]] = []

    def mine(**arguments: Any) -> Any:
        calls.append(arguments)
        return catalog.eval_sparse_dist_plan(**arguments)

    monkeypatch.setattr(catalog, "my_eval_plan", mine, raising=False)
    row = ROWS["EvalPipelineSparseDist"]
    monkeypatch.setitem(drop_ins.DROP_INS, row.name, replace(row, plan="my_eval_plan"))
    pipeline = build("EvalPipelineSparseDist")
    try:
        assert calls == [{"clear_data_dist_inputs": False}]
        assert pipeline.plan == catalog.eval_sparse_dist_plan()
    finally:
        pipeline.close()


def test_a_users_subclass_takes_its_drop_ins_row() -> None:
    class Mine(torchrec_swp.TrainPipelineSparseDist):
        pass

    assert drop_ins.row_of(Mine) is ROWS["TrainPipelineSparseDist"]
    assert drop_ins.row_of(torchrec_swp.TrainPipelinePrefetchEMS) is ROWS["TrainPipelinePrefetchEMS"]
    assert drop_ins.row_of(int) is None
