"""Stress: many internal iterations over random thread maps and random task delays.

Every run must give the single-thread results (outputs, state, collective order), never
deadlock (every wait is bounded by the engine timeout, which would fail the test), and keep
memory flat over a long run. Marked slow; CI runs it.
"""

from __future__ import annotations

import gc
import random
import threading
import time
import tracemalloc
from typing import Any

import pytest

from torchrec_swp.engine import Engine
from torchrec_swp.plan import PipelinePlan, PipelineTask, TaskSchedule
from torchrec_swp.sim import check_happens_before, simulate

S = TaskSchedule
RUNS = 25
BATCHES = 400  # 25 runs x (400 + 2) iterations = 10,050 internal iterations


def wide_plan() -> PipelinePlan:
    """Seven tasks over four stages, two comm groups, same-iteration and distance-2 deps."""
    return PipelinePlan(
        schedule={
            "Fwd": S(3, comm_group="world"),
            "Bwd": S(3, comm_group="world"),
            "Opt": S(3),
            "Lookup": S(2, "emb", comm_group="world"),
            "DistWait": S(1, "data_dist", comm_group="pg2"),
            "DistStart": S(1, "data_dist", comm_group="pg2"),
            "H2D": S(0, "memcpy"),
        },
        tasks=[
            PipelineTask("H2D", writes=("x",)),
            PipelineTask("DistStart", reads=("x",), writes=("d",)),
            PipelineTask("DistWait", reads=("d",), writes=("e",)),
            PipelineTask("Lookup", reads=("e",), writes=("emb",)),
            PipelineTask("Fwd", reads=("emb",), writes=("out",)),
            PipelineTask("Bwd", reads=("out",), writes=("grad",)),
            PipelineTask("Opt", reads=("grad",)),
        ],
        fire_order=["Fwd", "Lookup", "DistStart", "Bwd", "DistWait", "H2D", "Opt"],
        inter_iter_deps=[("Fwd", "Opt"), ("Lookup", "Bwd", 2)],
        source="H2D",
        output="out",
        name="wide",
    )


class Model:
    """Order-sensitive arithmetic: any reordering of dependent tasks changes the numbers."""

    def __init__(self, n: int, jitter: random.Random | None) -> None:
        self.data = iter(range(n))
        self.w = 1
        self.emb = 7
        self.jitter = jitter
        self.lock = threading.Lock()
        self.collectives: dict[str, list[tuple[str, int]]] = {"world": [], "pg2": []}

    def _pause(self) -> None:
        if self.jitter is not None:
            with self.lock:
                d = self.jitter.random()
            if d < 0.3:
                time.sleep(d * 1e-4)

    def bindings(self, plan: PipelinePlan) -> dict[str, Any]:
        def coll(task: str, b: int) -> None:
            group = plan.task(task).comm_group
            assert group is not None
            self.collectives[group].append((task, b))

        def h2d(b: int, data: Any = None) -> int:
            self._pause()
            return next(self.data if data is None else data)

        def dist_start(b: int, x: int) -> int:
            coll("DistStart", b)
            self._pause()
            return x * 3 + 1

        def dist_wait(b: int, d: int) -> int:
            coll("DistWait", b)
            self._pause()
            return d - 2

        def lookup(b: int, e: int) -> int:
            coll("Lookup", b)
            self._pause()
            return (e * self.emb) % 1_000_003

        def fwd(b: int, emb: int) -> int:
            coll("Fwd", b)
            self._pause()
            return (emb + self.w) % 1_000_003

        def bwd(b: int, out: int) -> int:
            coll("Bwd", b)
            self._pause()
            self.emb = (self.emb * 5 + out) % 1_000_003
            return out % 97

        def opt(b: int, grad: int) -> None:
            self._pause()
            self.w = (self.w * 31 + grad) % 1_000_003

        return {
            "H2D": h2d,
            "DistStart": dist_start,
            "DistWait": dist_wait,
            "Lookup": lookup,
            "Fwd": fwd,
            "Bwd": bwd,
            "Opt": opt,
        }


def random_thread_map(rng: random.Random, plan: PipelinePlan) -> dict[str, str]:
    threads = ["default", "t1", "t2", "t3"][: rng.randint(1, 4)]
    return {t: rng.choice(threads) for t in plan.fire_order}


def random_run_ahead(rng: random.Random, plan: PipelinePlan) -> PipelinePlan:
    """A random lookahead (0-2), and 2 loads where the source is alone on a worker thread."""
    plan = plan.replace(lookahead=rng.randint(0, 2))
    group = plan.task("H2D").thread_group
    alone = group != "default" and all(plan.task(t).thread_group != group for t in plan.fire_order if t != "H2D")
    if alone and rng.random() < 0.5:
        plan = plan.with_loads(2, lookahead=max(plan.lookahead, 1))
    return plan


def run_over(engine: Engine, n: int) -> list[Any]:
    """Every output of ``engine`` over the data ``range(n)`` (reaching the source as ``data``)."""
    data = iter(range(n))
    outs = []
    while True:
        try:
            outs.append(engine.step(data))
        except StopIteration:
            return outs


@pytest.mark.slow
def test_ten_thousand_iterations_over_random_thread_maps_match_one_thread() -> None:
    plan = wide_plan()
    reference = Model(BATCHES, None)
    expected = Engine(plan, reference.bindings(plan)).run_to_end()
    rng = random.Random(2026)
    iterations = 0
    for run in range(RUNS):
        thread_map = random_thread_map(rng, plan)
        threaded = random_run_ahead(rng, plan.with_thread_map(thread_map))
        model = Model(BATCHES, random.Random(run))
        engine = Engine(threaded, model.bindings(threaded), timeout_s=30)
        assert run_over(engine, BATCHES) == expected, f"run {run}, thread map {thread_map}, {threaded!r}"
        assert (model.w, model.emb) == (reference.w, reference.emb)
        assert model.collectives == reference.collectives, f"collective order differs, thread map {thread_map}"
        iterations += engine.iteration
        engine.close()
        # the simulator agrees: no deadlock, a happens-before edge for every dependency
        check_happens_before(simulate(threaded, {t: 1.0 + (hash(t) % 5) for t in plan.fire_order}, 12), threaded)
    assert iterations >= 10_000


@pytest.mark.slow
def test_memory_stays_flat_over_a_long_threaded_run() -> None:
    plan = wide_plan().with_thread_map("per_task")
    model = Model(6000, None)
    engine = Engine(plan, model.bindings(plan), timeout_s=30)

    def steps(n: int) -> int:
        for _ in range(n):
            engine.step()
        for log in model.collectives.values():
            log.clear()  # the test's own record, not the engine's
        gc.collect()
        return tracemalloc.get_traced_memory()[0]

    tracemalloc.start()
    try:
        early = steps(1000)
        late = steps(4000)
    finally:
        tracemalloc.stop()
        engine.close()
    assert late - early < 64 * 1024, f"memory grew by {late - early} bytes over 4000 iterations"
    assert len(engine.slots) <= plan.pipeline_depth + plan.lookahead
    assert len(engine.book.device_events) == 0
    assert len(engine.board.latches) <= len(plan.fire_order) * plan.pipeline_depth
