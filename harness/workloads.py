"""Workloads to test and compare the searches on: plans with made-up task durations.

* ``torchrec_workloads()``: four TorchRec pipelines' plans (``catalog.torchrec``, pure data)
  with CPU durations in milliseconds typical of a small DLRM step. Their plans leave one
  ordering to fire order that a search must keep: ``ZeroGrad(b)`` after
  ``OptimizerStep(b - 1)``; it is added as a dependency.
* ``random_workload(seed)``: a random task graph: a source, random same-batch dependencies,
  dependencies on earlier batches, a comm group, and the three anchors Forward -> Backward ->
  OptimizerStep at the end; everything starts on one thread at one stage.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from torchrec_swp.autosched.problem import Problem
from torchrec_swp.catalog import torchrec as plans
from torchrec_swp.plan import Dep, PipelinePlan, PipelineTask, TaskSchedule

#: Milliseconds of CPU time per TorchRec task (made up, in proportion to a small DLRM step).
TORCHREC_MS = {
    "H2D": 2.0,
    "InputDistStart": 1.0,
    "InitPipelinedModules": 1.0,
    "InputDistWait": 1.5,
    "ZeroGrad": 0.3,
    "WaitBatch": 0.5,
    "Forward": 4.0,
    "Backward": 6.0,
    "OptimizerStep": 2.5,
    "Dequeue": 0.1,
    "EmbLookup": 2.0,
    "EmbPrefetch": 1.5,
    "EmbBackward": 1.0,
    "ClearDataDistInputs": 0.2,
}


@dataclass(frozen=True)
class Workload:
    """A plan, its CPU durations, and the search limits to use on it."""

    name: str
    plan: PipelinePlan
    durations: Mapping[str, float] = field(hash=False)
    max_threads: int = 4
    max_in_flight: int = 5

    def problem(self) -> Problem:
        return Problem(self.plan, self.durations, max_threads=self.max_threads, max_in_flight=self.max_in_flight)


def _with_zero_grad_after_step(plan: PipelinePlan) -> PipelinePlan:
    dep = Dep("ZeroGrad", "OptimizerStep", 1)
    if dep in plan.deps:
        return plan
    return plan.replace(inter_iter_deps=[*(d for d in plan.explicit_deps if d.distance != 0), dep])


def torchrec_workloads() -> tuple[Workload, ...]:
    chosen = (
        plans.sparse_dist_plan(),
        plans.fused_sparse_dist_plan(),
        plans.semi_sync_plan(),
        plans.prefetch_sparse_dist_plan(),
    )
    return tuple(
        Workload(p.name, _with_zero_grad_after_step(p), {t: TORCHREC_MS[t] for t in p.fire_order}) for p in chosen
    )


def _anchors() -> list[PipelineTask]:
    """Forward, Backward and OptimizerStep, anchors (OptimizerStep writes the output)."""
    return [
        PipelineTask("Forward", anchor=True),
        PipelineTask("Backward", anchor=True),
        PipelineTask("OptimizerStep", writes=("output",), anchor=True),
    ]


def random_workload(seed: int, tasks: int = 12, *, max_threads: int = 3, max_in_flight: int = 3) -> Workload:
    """``tasks`` tasks (at least 5): ``Load`` (the source), ``P1..`` random preparation tasks,
    then Forward, Backward, OptimizerStep. Every task depends on one or two earlier ones in the
    same batch; a third of the preparation tasks also depend on a later task of an earlier batch
    (distance 1 or 2); about a third of all tasks are in comm group ``world``. Durations are
    uniform in [0.5, 5)."""
    if tasks < 5:
        raise ValueError(f"a random workload needs at least 5 tasks, got {tasks}")
    rng = random.Random(seed)
    names = ["Load", *(f"P{k}" for k in range(1, tasks - 3)), "Forward", "Backward", "OptimizerStep"]
    intra: list[tuple[str, str]] = []
    for k, name in enumerate(names[1:], 1):
        for producer in rng.sample(names[:k], min(k, rng.choice((1, 2)))):
            intra.append((name, producer))
    intra += [("Backward", "Forward"), ("OptimizerStep", "Backward")]
    inter: list[tuple[str, str, int]] = [("Forward", "OptimizerStep", 1)]
    for name in names[1 : tasks - 3]:
        if rng.random() < 1 / 3:
            producer = rng.choice(names[names.index(name) + 1 :])
            inter.append((name, producer, rng.choice((1, 2))))
    schedule = {n: TaskSchedule(0, comm_group="world" if n != "Load" and rng.random() < 1 / 3 else None) for n in names}
    plan = PipelinePlan(
        schedule=schedule,
        intra_iter_deps=list(dict.fromkeys(intra)),
        inter_iter_deps=list(dict.fromkeys(inter)),
        tasks=[PipelineTask("Load", writes=("batch",)), *_anchors()],
        source="Load",
        output="output",
        name=f"random{seed}",
    )
    durations = {n: round(rng.uniform(0.5, 5.0), 2) for n in names}
    return Workload(plan.name, plan, durations, max_threads=max_threads, max_in_flight=max_in_flight)


def sleep_workload() -> Workload:
    """The close-the-loop demo: a seven-task step all on the calling thread at one stage, with
    durations in seconds for ``harness.sleep.SleepWorkload`` (Load -> Decode -> H2D ->
    Dist -> Forward -> Backward -> OptimizerStep; Dist, Forward and Backward are collectives;
    Forward follows the previous OptimizerStep)."""
    names = ["Load", "Decode", "H2D", "Dist", "Forward", "Backward", "OptimizerStep"]
    ms = {"Load": 2.0, "Decode": 3.0, "H2D": 2.0, "Dist": 2.0, "Forward": 4.0, "Backward": 5.0, "OptimizerStep": 2.0}
    comm = {"Dist", "Forward", "Backward"}
    plan = PipelinePlan(
        schedule={n: TaskSchedule(0, comm_group="world" if n in comm else None) for n in names},
        intra_iter_deps=list(zip(names[1:], names[:-1], strict=True)),
        inter_iter_deps=[("Forward", "OptimizerStep")],
        tasks=[PipelineTask("Load", writes=("batch",)), *_anchors()],
        source="Load",
        output="output",
        name="sleep_demo",
    )
    return Workload(plan.name, plan, {n: v / 1000 for n, v in ms.items()})
