"""TorchRec 1.9's ``async_inplace_copy`` puts H2D on a thread of its own in the default plan, on every version.

(Parity with upstream, option on and off, is in tests/dist/test_parity_foundation.py.)
"""

from __future__ import annotations

import inspect
from typing import Any
from unittest.mock import MagicMock

import pytest
import torch
from torchrec.distributed.train_pipeline import train_pipelines as upstream

import torchrec_swp
from torchrec_swp.catalog import torchrec as plans
from torchrec_swp.integrations.torchrec.compat import installed

pytestmark = pytest.mark.parity

CPU = torch.device("cpu")


def build(cls: type, *args: Any, **kwargs: Any) -> Any:
    model = MagicMock(spec=torch.nn.Module)
    return cls(model, MagicMock(spec=torch.optim.Optimizer), CPU, *args, **kwargs)


@pytest.mark.parametrize(
    "cls",
    [
        torchrec_swp.TrainPipelineSparseDist,
        torchrec_swp.TrainPipelineSparseDistLite,
        torchrec_swp.PrefetchTrainPipelineSparseDist,
    ],
)
def test_async_inplace_copy_moves_the_in_place_h2d_to_its_own_thread(cls: type) -> None:
    on = build(cls, enable_inplace_copy_batch=True, async_inplace_copy=True)
    assert on.plan.task("H2D").thread_group == "io"
    assert {t.thread_group for t in on.plan.scheduled() if t.name != "H2D"} == {"default"}
    # as upstream: without in-place copy the option changes nothing
    assert build(cls, async_inplace_copy=True).plan.task("H2D").thread_group == "default"
    assert build(cls, enable_inplace_copy_batch=True).plan.task("H2D").thread_group == "default"
    # a user thread_map applies on top
    mine = build(cls, enable_inplace_copy_batch=True, async_inplace_copy=True, thread_map={"H2D": "io"})
    assert mine.plan.task("H2D").thread_group == "io"
    # the choice is the default plan's, as the catalog builds it (print_schedule shows it) ...
    h2d_thread = {"h2d_thread": "io"}
    expected = {
        torchrec_swp.TrainPipelineSparseDist: lambda: plans.sparse_dist_plan(**h2d_thread),
        torchrec_swp.TrainPipelineSparseDistLite: lambda: plans.sparse_dist_lite_plan(**h2d_thread),
        torchrec_swp.PrefetchTrainPipelineSparseDist: lambda: plans.prefetch_sparse_dist_plan(**h2d_thread),
    }[cls]()
    assert on.plan == expected
    # ... so a plan= of the user's keeps its own threads
    theirs = build(cls, enable_inplace_copy_batch=True, async_inplace_copy=True, plan=expected.with_thread_map("main"))
    assert theirs.plan.task("H2D").thread_group == "default"
    for p in (on, mine, theirs):
        p.close()


@pytest.mark.skipif(not installed().has_async_inplace_copy, reason="upstream takes it by position from TorchRec 1.9")
def test_async_inplace_copy_given_by_position_as_upstream_allows() -> None:
    params = list(inspect.signature(upstream.TrainPipelineSparseDist.__init__).parameters)
    position = params.index("async_inplace_copy") - 4  # after self, model, optimizer, device
    inplace = params.index("enable_inplace_copy_batch") - 4
    args: list[Any] = [
        p.default for p in list(inspect.signature(upstream.TrainPipelineSparseDist.__init__).parameters.values())[4:]
    ]
    args[position] = True
    args[inplace] = True
    pipeline = build(torchrec_swp.TrainPipelineSparseDist, *args)
    assert pipeline.plan.task("H2D").thread_group == "io"
    assert not pipeline._async_inplace_copy  # upstream's own background copy stays off: the engine copies
    pipeline.close()


def test_pipelines_without_the_option_refuse_it_as_upstream_does() -> None:
    with pytest.raises(TypeError, match="async_inplace_copy"):
        build(torchrec_swp.TrainPipelineFusedSparseDist, async_inplace_copy=True)
