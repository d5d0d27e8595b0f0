"""A draw that fails is retried with the same item, or reported: never silently lost.

The user's loop catches the error and calls ``step()`` (``progress()``) again. Where the item can
be drawn again (the iterator goes back with ``load_state_dict()``, a split draw's ``claim()`` is
kept for the next ``fetch()``, or the failure came after the iterator's ``next()`` returned), the
retry trains it: every item once, in order. Where it cannot (a plain iterator whose ``next()``
raised), one ``FailedDrawWarning`` line and ``ledger.failed_draws`` name the draw.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.unit.engine_fixtures import S, load_dist_train_plan
from torchrec_swp.data import MapSource
from torchrec_swp.engine import Engine, EngineError
from torchrec_swp.engine.errors import FailedDrawWarning
from torchrec_swp.plan import PipelinePlan

N = 12
BAD = 7


class Transient(OSError):
    """What a flaky read raises."""


class Plain:
    """A plain iterator over ``range(N)`` whose ``next()`` raises ``failures`` times at item
    ``BAD``; ``consumes``: the failed call took the item (it is gone), else it stays next."""

    def __init__(self, failures: int = 1, consumes: bool = True) -> None:
        self.i = 0
        self.failures = failures
        self.consumes = consumes

    def __iter__(self) -> Plain:
        return self

    def __next__(self) -> int:
        if self.i >= N:
            raise StopIteration
        i = self.i
        if i == BAD and self.failures > 0:
            self.failures -= 1
            if self.consumes:
                self.i += 1
            raise Transient(f"read error at item {i}")
        self.i += 1
        return i


class Rewinding(Plain):
    """A plain iterator with a position (``state_dict``/``load_state_dict``): it can go back."""

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]


class Split:
    """A split draw (``claim()`` in order, ``fetch(token)`` anywhere) whose fetch of ``BAD`` fails
    ``failures`` times, as a map-style dataset over a flaky store would."""

    def __init__(self, failures: int = 1) -> None:
        self.next_index = 0
        self.failures = failures
        self.fetched: list[int] = []

    def __iter__(self) -> Split:
        return self

    def __next__(self) -> int:
        return self.fetch(self.claim())

    def claim(self) -> int:
        if self.next_index >= N:
            raise StopIteration
        self.next_index += 1
        return self.next_index - 1

    def fetch(self, index: int) -> int:
        if index == BAD and self.failures > 0:
            self.failures -= 1
            raise Transient(f"read error at item {index}")
        self.fetched.append(index)
        return index


def plan(loads: int, thread: str) -> PipelinePlan:
    load = S(0) if thread == "main" else S(0, thread_group="io")
    p = load_dist_train_plan({"Load": load, "Dist": S(1), "Train": S(2)})
    return p if loads == 1 else p.with_loads(loads, lookahead=2)


def bindings(after_draw: Callable[[int], None] | None = None) -> dict[str, Callable[..., Any]]:
    def load(b: int, data: Iterator[int]) -> int:
        item = next(data)
        if after_draw is not None:
            after_draw(item)
        return item

    return {"Load": load, "Dist": lambda b, x: x, "Train": lambda b, y: y}


def train_retrying(engine: Engine, data: Iterator[int], retries: int = 5) -> tuple[list[int], list[str]]:
    """The user's loop: ``step(data)`` until StopIteration, catching the loader's error and
    calling again; the items trained and the errors caught."""
    trained: list[int] = []
    caught: list[str] = []
    while True:
        try:
            trained.append(engine.step(data))
        except StopIteration:
            return trained, caught
        except Transient as e:
            caught.append(str(e))
            assert len(caught) <= retries, f"still failing after {retries} retries"


SETUPS = [(1, "main"), (1, "io"), (2, "main"), (2, "io")]
IDS = [f"loads{n}-{t}" for n, t in SETUPS]


@pytest.mark.parametrize(("loads", "thread"), SETUPS, ids=IDS)
@pytest.mark.parametrize("failures", [1, 2])
@pytest.mark.parametrize("make", [Rewinding, Split], ids=["rewinding", "split"])
def test_an_iterator_that_can_draw_the_item_again_trains_every_item_once(
    make: Callable[[int], Any], failures: int, loads: int, thread: str
) -> None:
    engine = Engine(plan(loads, thread), bindings())
    with warnings.catch_warnings():
        warnings.simplefilter("error", FailedDrawWarning)
        trained, caught = train_retrying(engine, make(failures))
    assert trained == list(range(N))
    assert caught == [f"read error at item {BAD}"] * failures
    ledger = engine.ledger
    assert (ledger.drawn, ledger.trained, ledger.dropped, ledger.failed_draws) == (N, N, [], [])
    engine.close()


@pytest.mark.parametrize(("loads", "thread"), SETUPS, ids=IDS)
def test_a_failure_after_the_draw_hands_the_same_item_to_the_retry(loads: int, thread: str) -> None:
    """The source's call failed after ``next()`` returned (a copy, a transform): the item it drew
    is kept and the retry gets it, from any iterator, a plain one too."""
    failures = [2]

    def transform(item: int) -> None:
        if item == BAD and failures[0] > 0:
            failures[0] -= 1
            raise Transient(f"copy of item {item} failed")

    engine = Engine(plan(loads, thread), bindings(after_draw=transform))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FailedDrawWarning)
        trained, caught = train_retrying(engine, Plain(failures=0))
    assert trained == list(range(N))
    assert caught == [f"copy of item {BAD} failed"] * 2
    assert (engine.ledger.drawn, engine.ledger.failed_draws) == (N, [])
    engine.close()


@pytest.mark.parametrize(("loads", "thread"), SETUPS, ids=IDS)
def test_a_plain_iterator_that_lost_the_item_is_named_in_one_warning_and_the_ledger(loads: int, thread: str) -> None:
    engine = Engine(plan(loads, thread), bindings())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trained, caught = train_retrying(engine, Plain(failures=1, consumes=True))
    assert trained == [i for i in range(N) if i != BAD]  # the iterator lost it: nothing can bring it back
    assert caught == [f"read error at item {BAD}"]
    lines = [str(w.message) for w in seen if issubclass(w.category, FailedDrawWarning)]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert f"raised Transient('read error at item {BAD}') drawing batch {BAD} of the epoch (serial {BAD})" in lines[0]
    assert engine.ledger.failed_draws == [(BAD, f"Transient('read error at item {BAD}')")]
    assert (engine.ledger.drawn, engine.ledger.trained, engine.ledger.dropped) == (N - 1, N - 1, [])
    engine.close()


def test_a_plain_iterator_that_kept_the_item_trains_it_and_the_warning_says_if_any() -> None:
    """A plain iterator cannot say whether its failed ``next()`` took the item: the warning says
    "if any", and where the iterator kept it the retry trains it."""
    engine = Engine(plan(1, "main"), bindings())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trained, _ = train_retrying(engine, Plain(failures=1, consumes=False))
    assert trained == list(range(N))
    assert [w.category for w in seen] == [FailedDrawWarning]
    assert "the item that call took, if any, is not trained" in str(seen[0].message)
    engine.close()


def test_a_generator_that_raised_is_finished_and_the_warning_says_the_data_ends() -> None:
    """A generator that raises is finished (Python's rule): the retry finds the end of the data,
    which the warning says instead of promising the next item."""

    def items() -> Iterator[int]:
        for i in range(N):
            if i == BAD:
                raise Transient(f"read error at item {i}")
            yield i

    engine = Engine(plan(1, "main"), bindings())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trained, caught = train_retrying(engine, items())
    assert trained == list(range(BAD)) and caught == [f"read error at item {BAD}"]
    assert [w.category for w in seen] == [FailedDrawWarning]
    assert "it is a generator, which an exception ends" in str(seen[0].message)
    assert engine.ledger.failed_draws == [(BAD, f"Transient('read error at item {BAD}')")]
    engine.close()


@pytest.mark.parametrize(("loads", "thread"), SETUPS, ids=IDS)
def test_always_failing_then_reset_drops_the_kept_item_in_the_ledger(loads: int, thread: str) -> None:
    """An item that always fails after its draw: every retry raises the same error, nothing
    hangs, and ``reset()`` drops the item kept for the retry, named in the ledger."""

    def transform(item: int) -> None:
        if item == BAD:
            raise Transient(f"item {item} is corrupt")

    engine = Engine(plan(loads, thread), bindings(after_draw=transform), timeout_s=20)
    data = Plain(failures=0)
    with pytest.raises(AssertionError, match="still failing after 3 retries"):
        train_retrying(engine, data, retries=3)
    ledger = engine.ledger
    assert ledger.trained < BAD and ledger.failed_draws == []  # what the draw ran ahead of trained
    engine.reset()
    dropped = [serial for serial, _ in ledger.dropped]
    assert BAD in dropped
    assert dict(ledger.dropped)[BAD] == "drawn, its source call failed, not retried before reset()"
    assert ledger.drawn == ledger.trained + len(ledger.dropped)
    rest, caught = train_retrying(engine, data)  # the data goes on after what was drawn
    assert caught == [] and rest == list(range(rest[0], N)) and rest[0] > BAD
    engine.close()


def test_a_checkpoint_after_the_retry_neither_skips_nor_repeats_the_item() -> None:
    """A cut is refused while the failed step waits for its retry (the engine's rule); after the
    retry the cut's position is the one before the first untrained batch, whichever way the
    failed draw was undone, so the resumed run trains every item once."""
    engine = Engine(plan(1, "main"), bindings())
    data = Rewinding(1)
    trained: list[int] = []
    while True:
        try:
            trained.append(engine.step(data))
        except Transient:
            with pytest.raises(EngineError, match="not at a cut"):
                engine.state_dict()
            trained.append(engine.step(data))  # the retry
            break
    state = engine.state_dict()
    engine.close()
    resumed = Rewinding(failures=0)
    resumed.load_state_dict(state["loader"])
    fresh = Engine(plan(1, "main"), bindings())
    fresh.load_state_dict(state)
    rest, _ = train_retrying(fresh, resumed)
    assert trained + rest == list(range(N))
    fresh.close()


@pytest.mark.parametrize(("loads", "thread"), SETUPS, ids=IDS)
def test_a_map_source_over_a_flaky_dataset_retries_the_same_index(loads: int, thread: str) -> None:
    """``torchrec_swp.data.MapSource`` (claim an index, fetch ``dataset[index]``) over a dataset
    whose read of one index fails once: the retry fetches that index again."""
    reads: list[int] = []

    class Flaky:
        def __len__(self) -> int:
            return N

        def __getitem__(self, i: int) -> int:
            reads.append(i)
            if i == BAD and reads.count(BAD) == 1:
                raise Transient(f"read error at item {i}")
            return i

    engine = Engine(plan(loads, thread), bindings())
    with warnings.catch_warnings():
        warnings.simplefilter("error", FailedDrawWarning)
        trained, caught = train_retrying(engine, MapSource(Flaky()))
    assert trained == list(range(N)) and caught == [f"read error at item {BAD}"]
    assert reads.count(BAD) == 2 and engine.ledger.failed_draws == []
    engine.close()
