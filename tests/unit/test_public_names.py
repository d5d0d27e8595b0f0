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
        "bad = [m for m in sys.modules\n"
        "       if m in ('torch', 'torchrec_swp.plan') or m.startswith(('torch.', 'torchrec_swp.plan.'))]\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_every_pipeline_class_upstream_defines_has_a_drop_in_here() -> None:
    # TorchRec's train_pipeline package, read as installed: every class its pipeline modules define
    # that is a TrainPipeline (or the accumulation wrapper), but the abstract base, is exported here
    # under the same name and subclasses upstream's
    import importlib
    import inspect

    from torchrec.distributed.train_pipeline.train_pipelines import TrainPipeline

    modules = ["train_pipelines", "experimental_pipelines", "pec_train_pipeline", "gradient_accumulation"]
    upstream: dict[str, type] = {}
    for name in modules:
        try:
            module = importlib.import_module(f"torchrec.distributed.train_pipeline.{name}")
        except ImportError:  # pec_train_pipeline: TorchRec 1.9 on
            continue
        for cls_name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__ or cls is TrainPipeline or cls_name.startswith("_"):
                continue
            if issubclass(cls, TrainPipeline) or cls_name == "GradientAccumulationWrapper":
                upstream[cls_name] = cls
    assert {"TrainPipelineSparseDist", "TrainEvalHybridPipelineBase", "GradientAccumulationWrapper"} <= set(upstream)
    for cls_name, cls in upstream.items():
        ours = getattr(torchrec_swp, cls_name)
        assert issubclass(ours, cls) and ours is not cls, cls_name
