"""What ``import torchrec_swp`` offers: the plan names and the pipelines, listed for tab completion,
loaded on first use."""

from __future__ import annotations

import subprocess
import sys

import torchrec_swp


def test_plan_names_and_pipelines_import_from_the_package() -> None:
    from torchrec_swp import PhasedPlan, PipelinePlan, TaskSchedule, TrainPipelineSparseDist, load_plan
    from torchrec_swp.plan import load_plan as plan_load_plan

    assert load_plan is plan_load_plan
    assert PipelinePlan.__module__ == "torchrec_swp.plan.plan" and PhasedPlan and TaskSchedule
    assert TrainPipelineSparseDist.__module__.startswith("torchrec_swp.integrations.torchrec.pipelines")


def test_dir_lists_every_public_name() -> None:
    names = dir(torchrec_swp)
    assert {"load_plan", "PipelinePlan", "TrainPipelineSparseDist", "StagedTrainPipeline"} <= set(names)
    assert set(torchrec_swp.__all__) <= set(names)


def test_importing_the_package_loads_neither_the_plan_layer_nor_torch() -> None:
    code = (
        "import sys, torchrec_swp\n"
        "bad = [m for m in sys.modules if m in ('torch', 'torchrec_swp.plan') or m.startswith(('torch.', 'torchrec_swp.plan.'))]\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
