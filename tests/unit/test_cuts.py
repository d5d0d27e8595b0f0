"""Engine checkpoints: state_dict() cuts at the batches trained, and a new engine over an
iterator restored at the cut's position trains exactly the batches an uninterrupted run trains."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.unit.engine_fixtures import load_dist_train_plan
from torchrec_swp.engine import Engine, EngineError
from torchrec_swp.plan import PhasedPlan, PipelinePlan, TaskSchedule

S = TaskSchedule
N = 12


class Stateful:
    """An iterator over 0..n-1 with a position, as a StatefulDataLoader's iterator has."""

    def __init__(self, n: int) -> None:
        self.n, self.i = n, 0

    def __iter__(self) -> Stateful:
        return self

    def __next__(self) -> int:
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return self.i - 1

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]


def plan(**changes: Any) -> PipelinePlan:
    """Load(0) -> Dist(1) -> Train(2); Train folds every batch into the model in order."""
    schedule = {
        "Load": S(0, "memcpy"),
        "Dist": S(1, "data_dist", comm_group="world"),
        "Train": S(2, comm_group="world"),
    }
    return load_dist_train_plan(schedule, **{"name": "cut_toy", **changes})


class Model:
    def __init__(self) -> None:
        self.state = 0
        self.numbers: list[int] = []

    def bindings(self, engine_ref: Callable[[], Engine]) -> dict[str, Callable[..., Any]]:
        def load(b: int, data: Any) -> int:
            self.numbers.append(engine_ref().book.number_of(b))
            return next(data)

        def train(b: int, y: int) -> tuple[int, int]:
            self.state = self.state * 31 + y + 1
            return y, self.state

        return {"Load": load, "Dist": lambda b, x: x * 10, "Train": train}


def make(p: PipelinePlan | PhasedPlan, model: Model) -> Engine:
    holder: list[Engine] = []
    engine = Engine(p, model.bindings(lambda: holder[0]), timeout_s=10)
    holder.append(engine)
    return engine


def run(engine: Engine, data: Any, steps: int | None = None) -> list[tuple[int, int]]:
    outs = []
    while steps is None or len(outs) < steps:
        try:
            outs.append(engine.step(data))
        except StopIteration:
            break
    return outs


PLANS = {
    "one thread": plan(),
    "by stream": plan().with_thread_map("by_stream"),
    "lookahead 2 on a thread": plan(lookahead=2).with_thread_map({"Load": "load"}),
    "2 loads": plan().with_thread_map({"Load": "load"}).with_loads(2, lookahead=1),
}


@pytest.mark.parametrize("name", list(PLANS))
@pytest.mark.parametrize("k", [1, 5, N - 1, N])
def test_resume_from_a_cut_trains_what_an_uninterrupted_run_trains(name: str, k: int) -> None:
    p = PLANS[name]
    whole = Model()
    engine = make(p, whole)
    expected = run(engine, Stateful(N))
    engine.close()
    assert [o[0] for o in expected] == [10 * i for i in range(N)]

    first = Model()
    engine = make(p, first)
    data = Stateful(N)
    head = run(engine, data, k)
    state = engine.state_dict()
    assert state["ledger"]["trained"] == k and state["ledger"]["drawn"] == k
    # the batches in flight are drawn again: the position is the one before batch k
    assert state["loader"] == {"i": k}
    engine.close()

    second = Model()
    second.state = first.state  # the model restored from the same cut
    engine = make(p, second)
    engine.load_state_dict(state)
    resumed = Stateful(N)
    resumed.load_state_dict(state["loader"])
    tail = run(engine, resumed)
    engine.close()
    assert head + tail == expected
    assert second.state == whole.state
    assert engine.ledger.trained == N and engine.ledger.drawn >= N


def test_batch_numbers_go_on_after_the_cut_so_phases_switch_where_they_did() -> None:
    phased = PhasedPlan([(0, plan(name="cut_toy")), (4, plan(name="cut_toy"))])
    model = Model()
    engine = make(phased, model)
    run(engine, Stateful(N), 3)
    state = engine.state_dict()
    assert state["batch_number"] == 3
    engine.close()
    again = Model()
    engine = make(phased, again)
    engine.load_state_dict(state)
    data = Stateful(N)
    data.load_state_dict(state["loader"])
    run(engine, data)
    engine.close()
    assert again.numbers[0] == 3 and again.numbers[: N - 3] == list(range(3, N))


def test_the_cut_carries_the_batches_trained_since_reset_for_the_trained_clock() -> None:
    # after an epoch of 3 the index clock counts 4 calls (the one that found no batch), the
    # trained clock 3: a resumed engine goes on with the trained clock's number
    phased = PhasedPlan([(0, plan(name="cut_toy")), (1, plan(name="cut_toy"))], clock="trained", cycle=(1, 1))
    engine = make(phased, Model())
    run(engine, Stateful(3))
    engine.new_data()
    run(engine, Stateful(N), 2)
    state = engine.state_dict()
    assert (state["trained_number"], state["batch_number"]) == (5, 6)
    engine.close()
    engine = make(phased, Model())
    engine.load_state_dict(state)
    assert engine.trained_since_reset == 5
    engine.close()


def test_an_iterator_without_state_dict_is_refused_not_silently_lost() -> None:
    engine = make(plan(), Model())
    run(engine, iter(range(N)), 2)
    with pytest.raises(EngineError, match=r"has no state_dict\(\).*StatefulDataLoader"):
        engine.state_dict()
    engine.close()


def test_a_cut_before_any_progress_says_where_the_position_is() -> None:
    engine = make(plan(), Model())
    with pytest.raises(EngineError, match="none was given yet"):
        engine.state_dict()
    engine.close()


def test_a_state_of_another_plan_or_a_running_engine_is_refused() -> None:
    engine = make(plan(), Model())
    run(engine, Stateful(N), 2)
    state = engine.state_dict()
    with pytest.raises(EngineError, match="only before the first progress"):
        engine.load_state_dict(state)
    engine.close()
    other = make(plan(name="other"), Model())
    with pytest.raises(EngineError, match="cut from plan 'cut_toy'.*runs plan 'other'"):
        other.load_state_dict(state)
    with pytest.raises(EngineError, match="not an engine state"):
        other.load_state_dict({"loader": 3})
    other.close()
