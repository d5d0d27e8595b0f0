"""A drop-in's default plan is named in two places, its row in ``torchrec_swp.drop_ins`` (the
catalog function and its arguments, from which the docs' table, the golden plans and
``default_plans()`` come) and its class (``_swp_default_plan``, what a built pipeline runs): every
class built with its defaults runs its row's plan."""

from __future__ import annotations

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
