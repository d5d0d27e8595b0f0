"""What the engine tests share: a toy 3-stage plan whose numbers depend on order, task functions
that record collective order (``Toy``), and the thread maps every ordering test runs over."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from torchrec_swp.plan import PipelinePlan, PipelineTask, TaskSchedule

S = TaskSchedule


def toy_plan(**changes: object) -> PipelinePlan:
    """A 3-stage pipeline whose numbers depend on order: Fwd(b) folds in the state Opt(b-1) left."""
    args: dict[str, object] = dict(
        schedule={
            "Fwd": S(2, comm_group="world"),
            "Dist": S(1, "data_dist", comm_group="world"),
            "H2D": S(0, "memcpy"),
            "Opt": S(2, comm_group="world"),
        },
        tasks=[
            PipelineTask("H2D", writes=("x",)),
            PipelineTask("Dist", reads=("x",), writes=("y",)),
            PipelineTask("Fwd", reads=("y",), writes=("out",)),
            PipelineTask("Opt", reads=("out",)),
        ],
        intra_iter_deps=[("Opt", "Fwd")],
        inter_iter_deps=[("Fwd", "Opt")],
        source="H2D",
        output="out",
        name="toy",
    )
    args.update(changes)
    return PipelinePlan(**args)  # type: ignore[arg-type]


class Toy:
    """Task functions with random sleeps that record the order collectives are issued in."""

    def __init__(self, n: int, jitter_s: float = 0.0, seed: int = 0) -> None:
        self.data: Iterator[int] = iter(range(n))
        self.state = 0
        self.jitter = jitter_s
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.collectives: list[tuple[str, int]] = []
        self.finished: set[tuple[str, int]] = set()

    def _sleep(self) -> None:
        if self.jitter:
            with self.lock:
                d = self.rng.random() * self.jitter
            time.sleep(d)

    def _done(self, task: str, b: int, needs: list[tuple[str, int]] = ()) -> None:  # type: ignore[assignment]
        with self.lock:
            missing = [n for n in needs if n not in self.finished]
            assert not missing, f"{task}({b}) ran before {missing}"
            self.finished.add((task, b))

    def _collective(self, task: str, b: int) -> None:
        with self.lock:
            self.collectives.append((task, b))

    def bindings(self) -> dict[str, Callable[..., Any]]:
        def h2d(b: int) -> int:
            self._sleep()
            v = next(self.data)
            self._done("H2D", b)
            return v

        def dist(b: int, x: int) -> int:
            self._collective("Dist", b)
            self._sleep()
            self._done("Dist", b, [("H2D", b)])
            return x * 10

        def fwd(b: int, y: int) -> int:
            self._collective("Fwd", b)
            self._sleep()
            self._done("Fwd", b, [("Dist", b)] + ([("Opt", b - 1)] if b else []))
            return y + self.state

        def opt(b: int, out: int) -> None:
            self._collective("Opt", b)
            self._sleep()
            self._done("Opt", b, [("Fwd", b)])
            self.state = self.state * 3 + out + 1

        return {"H2D": h2d, "Dist": dist, "Fwd": fwd, "Opt": opt}


THREAD_MAPS: list[Any] = ["main", "by_stream", "per_task", {"H2D": "io"}, {"Dist": "io", "Opt": "io"}]


def drawing(toy: Toy) -> dict[str, Callable[..., Any]]:
    """The toy's tasks, its source drawing from the engine's data (draws then take turns in batch
    order, whatever lane loads: what parallel loads need)."""
    bindings = toy.bindings()

    def h2d(b: int, data: Iterator[int]) -> int:
        v = next(data)
        toy._done("H2D", b)
        return v

    return {**bindings, "H2D": h2d}


def run(engine: Any, steps: int | None = None, n: int = 14) -> list[int]:
    """``steps`` steps of ``engine`` (all of them: None) over ``range(n)``, given on the first call."""
    data = None if engine.draws is not None else iter(range(n))
    if steps is None:
        out = []
        while True:
            try:
                out.append(engine.step(data))
            except StopIteration:
                return out
            data = None
    out = []
    for _ in range(steps):
        out.append(engine.step(data))
        data = None
    return out


def load_dist_train_plan(schedule: dict[str, TaskSchedule], **changes: Any) -> PipelinePlan:
    """Load -> Dist -> Train (``schedule`` places them), Train folding every batch in order."""
    args: dict[str, Any] = dict(
        schedule=schedule,
        tasks=[
            PipelineTask("Load", writes=("x",)),
            PipelineTask("Dist", reads=("x",), writes=("y",)),
            PipelineTask("Train", reads=("y",), writes=("out",)),
        ],
        inter_iter_deps=[("Train", "Train")],
        source="Load",
        output="out",
    )
    args.update(changes)
    return PipelinePlan(**args)
