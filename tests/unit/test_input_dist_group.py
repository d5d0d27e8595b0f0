"""The input dist's own comm group: the plan edit ``with_input_dist_group`` (pure) and the checks
of ``input_dist_group.py`` and of the drop-ins' option that need no distributed world."""

from __future__ import annotations

from collections import deque

import pytest
import torch
from torch import nn

from torchrec_swp.catalog import torchrec as plans
from torchrec_swp.catalog.transforms import with_input_dist_group
from torchrec_swp.plan import PhasedPlan, PipelinePlan

INPUT_DIST_TASKS = {"InitPipelinedModules", "InputDistStart", "InputDistWait"}
# no input dist, or one without collectives (EvalPipelineCPUSparse: data-parallel tables)
WITHOUT_INPUT_DIST = {"TrainPipelineBase", "TrainPipelinePT2", "StagedTrainPipeline", "EvalPipelineCPUSparse"}
EDITED = {name: plan for name, plan in plans.default_plans().items() if name not in WITHOUT_INPUT_DIST}


def _phases(plan: PipelinePlan | PhasedPlan) -> tuple[PipelinePlan, ...]:
    return plan.plans if isinstance(plan, PhasedPlan) else (plan,)


def _comm(plan: PipelinePlan) -> dict[str, str]:
    return {t: s.comm_group for t, s in plan.schedule.items() if s.comm_group is not None}


def test_sparse_dist_input_dist_tasks_move_to_their_own_comm_group() -> None:
    before = plans.sparse_dist_plan()
    after = with_input_dist_group(before)
    assert isinstance(after, PipelinePlan)
    assert _comm(before) == {
        "InitPipelinedModules": "world",
        "InputDistStart": "world",
        "Forward": "world",
        "InputDistWait": "world",
        "Backward": "world",
    }
    assert _comm(after) == {
        "InitPipelinedModules": "input_dist",
        "InputDistStart": "input_dist",
        "Forward": "world",
        "InputDistWait": "input_dist",
        "Backward": "world",
    }
    assert with_input_dist_group(before, group="sdd").schedule["InputDistWait"].comm_group == "sdd"
    assert type(after).from_text(after.to_text()) == after


@pytest.mark.parametrize("name", sorted(EDITED))
def test_only_the_input_dist_comm_groups_change(name: str) -> None:
    """Fire order, stages, streams, threads, guards, reads/writes and deps stay: on one thread the
    plan makes the same calls in the same order as before."""
    before = EDITED[name]
    after = with_input_dist_group(before)
    assert type(after) is type(before) and after.name == before.name
    if isinstance(before, PhasedPlan):
        assert [s for s, _ in after.phases] == [s for s, _ in before.phases]
    for old, new in zip(_phases(before), _phases(after), strict=True):
        assert new.fire_order == old.fire_order and new.explicit_deps == old.explicit_deps
        assert new.tasks == old.tasks and new.pipeline_depth == old.pipeline_depth
        moved = INPUT_DIST_TASKS & set(old.schedule)
        assert moved, f"{name}: no input dist task"
        for task, schedule in old.schedule.items():
            if task in moved:
                assert new.schedule[task] == schedule.replace(comm_group="input_dist"), task
            else:
                assert new.schedule[task] == schedule, task


@pytest.mark.parametrize("name", sorted(WITHOUT_INPUT_DIST))
def test_plans_without_an_input_dist_are_refused(name: str) -> None:
    plan = plans.default_plans()[name]
    with pytest.raises(ValueError, match=f"plan {name} has no input dist task"):
        with_input_dist_group(plan)


def _reaches(plan: PipelinePlan, start: tuple[str, int], goal: tuple[str, int], max_batch: int) -> bool:
    """Whether ``start`` runs after ``goal`` (task instances ``(task, batch)``): through the plan's
    dependencies (``consumer(b)`` after ``producer(b - distance)``) and each task's own earlier
    instance (a task runs on one thread, its batches in order)."""
    producers: dict[str, list[tuple[str, int]]] = {}
    for d in plan.deps:
        producers.setdefault(d.consumer, []).append((d.producer, d.distance))
    seen = {start}
    todo = deque([start])
    while todo:
        task, b = todo.popleft()
        if (task, b) == goal:
            return True
        for nxt in [(p, b - k) for p, k in producers.get(task, ())] + [(task, b - 1)]:
            if 0 <= nxt[1] <= max_batch and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


@pytest.mark.parametrize("name", sorted(EDITED))
def test_every_other_collective_task_follows_the_first_input_dist(name: str) -> None:
    """The first input dist (batch 0) runs on the model's process group while holding
    ``input_dist`` tickets: safe because every instance of every task of another comm group runs
    after InputDistWait of batch 0 (which runs after InitPipelinedModules of batch 0)."""
    for plan in _phases(with_input_dist_group(EDITED[name])):
        assert any(d.consumer == "InputDistWait" and d.producer == "InitPipelinedModules" for d in plan.deps)
        others = [t for t, s in plan.schedule.items() if s.comm_group not in (None, "input_dist")]
        assert others, plan.name
        for task in others:
            for b in range(4):
                assert _reaches(plan, (task, b), ("InputDistWait", 0), max_batch=8), f"{plan.name}: {task}({b})"


# ------------------------------------------------------------------ without a distributed world
class _Sharded(nn.Module):
    """Stands for a sharded module: ``_input_dists`` whose ``_dist`` is what the test gives."""

    def __init__(self, dist_module: nn.Module | None, initialized: bool = True) -> None:
        super().__init__()
        self._has_uninitialized_input_dist = not initialized
        holder = nn.Module()
        if dist_module is not None:
            holder._dist = dist_module
        self._input_dists = nn.ModuleList([holder])


def test_input_dists_not_created_yet_or_of_an_unknown_kind_are_refused() -> None:
    from torchrec_swp.integrations.torchrec.input_dist_group import input_dist_all_to_alls

    with pytest.raises(RuntimeError, match=r"0 \(_Sharded\) has not created its input dists yet"):
        input_dist_all_to_alls([_Sharded(None, initialized=False)])
    with pytest.raises(TypeError, match=r"0._input_dists\[0\]._dist is a Linear, not a KJTAllToAll"):
        input_dist_all_to_alls([_Sharded(nn.Linear(1, 1))])
    assert input_dist_all_to_alls([_Sharded(None)]) == []  # data parallel: no collective


def test_the_option_needs_a_distributed_world_and_a_bool_or_a_group() -> None:
    import torch.distributed as dist

    import torchrec_swp
    from torchrec_swp.integrations.torchrec.input_dist_group import new_input_dist_group

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="input_dist_group: the input dist group needs a distributed world"):
        new_input_dist_group()
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"TrainPipelineSparseDist\(input_dist_group=True\): the input dist group"):
        torchrec_swp.TrainPipelineSparseDist(model, optimizer, torch.device("cpu"), input_dist_group=True)
    with pytest.raises(TypeError, match="input_dist_group must be a bool or a ProcessGroup, got str"):
        torchrec_swp.TrainPipelineSparseDist(model, optimizer, torch.device("cpu"), input_dist_group="yes")
