"""Run-ahead: a source with lookahead draws beyond single-thread order between step() calls, k
loads draw at once and deliver in order, and no collective is ever issued outside step()."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.unit.engine_fixtures import load_dist_train_plan
from torchrec_swp.data import MapSource
from torchrec_swp.engine import Engine
from torchrec_swp.plan import PipelinePlan, TaskSchedule

S = TaskSchedule
N = 10


def plan(**changes: Any) -> PipelinePlan:
    """Load(0, thread load) -> Dist(1, thread dist, comm group world) -> Train(2)."""
    schedule = {
        "Load": S(0, thread_group="load"),
        "Dist": S(1, "data_dist", thread_group="dist", comm_group="world"),
        "Train": S(2, comm_group="world"),
    }
    return load_dist_train_plan(schedule, **{"name": "ahead", **changes})


class Recorder:
    def __init__(self, load_s: float = 0.0) -> None:
        self.load_s = load_s
        self.lock = threading.Lock()
        self.in_step = False
        self.outside: list[tuple[str, int]] = []  # collectives issued while no step() ran
        self.loading = 0
        self.most_loading = 0
        self.loaded: list[int] = []

    def bindings(self) -> dict[str, Any]:
        def load(b: int, data: Any) -> Any:
            with self.lock:
                self.loading += 1
                self.most_loading = max(self.most_loading, self.loading)
            try:
                return next(data)
            finally:
                with self.lock:
                    self.loading -= 1
                    self.loaded.append(b)

        def dist(b: int, x: int) -> int:
            with self.lock:
                if not self.in_step:
                    self.outside.append(("Dist", b))
            return x + 100

        return {"Load": load, "Dist": dist, "Train": lambda b, y: y}

    def step(self, engine: Engine, data: Any) -> Any:
        self.in_step = True
        try:
            return engine.step(data)
        finally:
            self.in_step = False


class Slow:
    """A map-style dataset whose items take ``delay_s`` each."""

    def __init__(self, n: int, delay_s: float) -> None:
        self.n, self.delay_s = n, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k: int) -> int:
        time.sleep(self.delay_s)
        return k


class Counted:
    """``range(n)`` as an iterator that records, at each draw, how many ``step()`` calls the test
    had begun (``started``), and sets ``drawn_up_to[k]`` when batch k is drawn."""

    def __init__(self, n: int) -> None:
        self._items = iter(range(n))
        self.started = 0
        self.draws: list[tuple[int, int]] = []
        self.drawn_up_to = [threading.Event() for _ in range(n)]

    def __iter__(self) -> Counted:
        return self

    def __next__(self) -> int:
        k = next(self._items)
        self.draws.append((k, self.started))
        self.drawn_up_to[k].set()
        return k


def test_a_source_with_lookahead_draws_ahead_between_calls_but_collectives_wait_for_the_call() -> None:
    rec = Recorder()
    engine = Engine(plan(lookahead=2), rec.bindings(), timeout_s=10)
    data = Counted(N)
    data.started = 1
    assert rec.step(engine, data) == 100
    # between the calls the source runs ahead: batches 0..4 (depth 3 + lookahead 2) ...
    assert data.drawn_up_to[4].wait(5)
    outs = [100]
    for _ in range(N - 1):
        data.started += 1
        outs.append(rec.step(engine, data))
    with pytest.raises(StopIteration):
        rec.step(engine, data)
    engine.close()
    assert outs == [100 + k for k in range(N)]
    assert rec.outside == []
    # ... and never further: each draw, whenever it came, came after the step() call that made
    # room for it (the n-th call lets batch n + 3 be drawn), so a late over-draw fails here too
    assert [k for k, _ in data.draws] == list(range(N))
    assert [(k, started) for k, started in data.draws if k > started + 3] == []


def test_two_loads_draw_at_once_and_deliver_in_order() -> None:
    rec = Recorder()
    p = plan().with_loads(2, lookahead=2)
    engine = Engine(p, rec.bindings(), timeout_s=10)
    data = MapSource(Slow(N, 0.03))
    outs = []
    while True:
        try:
            outs.append(rec.step(engine, data))
        except StopIteration:
            break
    engine.close()
    assert outs == [100 + k for k in range(N)]
    assert rec.most_loading == 2
    assert rec.outside == []
    assert engine.ledger.trained == N and engine.ledger.drawn == N


def test_a_failing_load_on_a_lane_is_named_and_nothing_is_lost() -> None:
    class Failing(Slow):
        def __getitem__(self, k: int) -> int:
            if k == 5:
                raise OSError("disk on fire")
            return super().__getitem__(k)

    rec = Recorder()
    engine = Engine(plan().with_loads(2, lookahead=1), rec.bindings(), timeout_s=10)
    data = MapSource(Failing(N, 0.005))
    outs = []
    with pytest.raises(OSError, match="disk on fire") as failed:
        while True:
            outs.append(rec.step(engine, data))
    assert failed.value.swp_task == "Load" and failed.value.swp_batch == 5
    assert failed.value.swp_thread in ("load", "load.1")
    assert outs == [100 + k for k in range(len(outs))]
    engine.close()
