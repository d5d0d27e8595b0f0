"""The end of data is one state machine (``torchrec_swp.engine.end_of_data``): every (state, event)
pair of its table, driven through ``Batches`` (its owner), as the engine drives it; the questions
it answers in each state; and no other module reads its fields."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

from torchrec_swp.engine.batches import Batches
from torchrec_swp.engine.end_of_data import TRANSITIONS, EndEvent, EndOfData, EndState, Then
from torchrec_swp.engine.errors import EngineError, Stopped

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "torchrec_swp"
M = 3  # where the end is seen

# every (state, event) pair: the state it leads to, or "-" where it is illegal (EngineError)
TABLE = """
event                        | running  | draining | drained  | stopped
end seen at 3                | draining | draining | drained  | stopped
end seen at 3 under a stop   | stopped  | draining | drained  | stopped
common end at 3              | running  | -        | -        | -
new data                     | running  | draining | drained  | running
StopIteration raised         | -        | -        | drained  | stopped
the next epoch               | -        | -        | running  | -
reset()                      | running  | running  | running  | running
load_state_dict()            | running  | -        | -        | -
adopt()                      | running  | -        | running  | running
"""

EVENTS: dict[str, tuple[EndEvent, Callable[[Batches], object]]] = {
    "end seen at 3": (EndEvent.END, lambda b: b.found_end(M, False)),
    "end seen at 3 under a stop": (EndEvent.STOP, lambda b: b.found_end(M, True)),
    "common end at 3": (EndEvent.COMMON_END, lambda b: b.count_dropped_past_end(M)),
    "new data": (EndEvent.NEW_DATA, lambda b: b.new_data()),
    "StopIteration raised": (EndEvent.REPORT, lambda b: b.report_end()),
    "the next epoch": (EndEvent.EPOCH, lambda b: b.new_epoch(EndEvent.EPOCH, 0, None, 0)),
    "reset()": (EndEvent.RESET, lambda b: b.new_epoch(EndEvent.RESET, 0, 0, 0)),
    "load_state_dict()": (EndEvent.LOAD, lambda b: b.new_epoch(EndEvent.LOAD, 0, 0, 0)),
    "adopt()": (EndEvent.ADOPT, lambda b: b.new_epoch(EndEvent.ADOPT, 2, None, 0)),
}


def _table() -> list[tuple[str, EndState, EndState | None]]:
    lines = [[c.strip() for c in line.split("|")] for line in TABLE.strip().splitlines()]
    states = [EndState(s) for s in lines[0][1:]]
    return [
        (row[0], state, None if cell == "-" else EndState(cell))
        for row in lines[1:]
        for state, cell in zip(states, row[1:], strict=True)
    ]


def in_state(state: EndState) -> Batches:
    """Batches whose end of data is in ``state``: batches 0..2 drawn, the end seen at 3 (drained:
    0..2 returned)."""
    batches = Batches()
    if state is EndState.RUNNING:
        return batches
    for b in range(M):
        batches.open_slot(b)
        batches.drawn(b)
    batches.found_end(M, stop=state is EndState.STOPPED)
    if state is EndState.DRAINED:
        for d in range(M):
            batches.retire(d, None, 0, frozenset(), 0, ())
    assert batches.end.state is state
    return batches


def test_the_table_covers_every_pair() -> None:
    pairs = {(state, name) for name, state, _ in _table()}
    assert pairs == {(s, n) for s in EndState for n in EVENTS}


@pytest.mark.parametrize("event, state, after", _table(), ids=lambda x: getattr(x, "value", x))
def test_every_state_and_event(event: str, state: EndState, after: EndState | None) -> None:
    batches = in_state(state)
    kind, fire = EVENTS[event]
    assert ((state, kind) in TRANSITIONS) == (after is not None)  # the module's table says the same
    if after is None:
        book = batches.book
        with pytest.raises(EngineError, match=rf"end of data: {_re(kind.value)} is not expected while {state.value}"):
            fire(batches)
        assert batches.end.state is state and batches.book is book  # an illegal event changes nothing
        return
    fire(batches)
    assert batches.end.state is after
    assert TRANSITIONS[(state, kind)] is after


def _re(text: str) -> str:
    return text.replace("(", r"\(").replace(")", r"\)")


def test_what_new_data_tells_the_owner_in_each_state() -> None:
    expected = {
        EndState.RUNNING: Then.NOTHING,
        EndState.DRAINING: Then.NOTHING,
        EndState.DRAINED: Then.NEXT_EPOCH,
        EndState.STOPPED: Then.GO_ON,
    }
    for state, then in expected.items():
        batches = in_state(state)
        assert batches.new_data() is then, state
        assert batches.end.restarts() is (state is EndState.DRAINING)
    stopped = in_state(EndState.STOPPED)
    stopped.new_data()
    assert stopped.book.renumbered == 1  # the call that found the stop took a batch number


def test_the_questions_in_each_state() -> None:
    # exists(b) for b = -1, 0 (drawn), 3 (the end), 4; past_end(3); ended(); beyond_stop(M + 1)
    expected = {
        EndState.RUNNING: ((False, None, None, None), False, False, False),
        EndState.DRAINING: ((False, True, False, False), True, False, False),
        EndState.DRAINED: ((False, True, False, False), True, True, False),
        EndState.STOPPED: ((False, True, None, None), False, True, True),
    }
    for state, (exists, past_end, ended, beyond_stop) in expected.items():
        end = in_state(state).end
        assert tuple(end.exists(b) for b in (-1, 0, M, M + 1)) == exists, state
        assert (end.past_end(M), end.ended(), end.beyond_stop(M + 1)) == (past_end, ended, beyond_stop), state
    running = in_state(EndState.RUNNING).end
    assert running.end_at() is None and in_state(EndState.STOPPED).end.end_at() == M


def test_a_stop_parks_instances_beyond_it_and_those_it_leaves_unknown() -> None:
    end = in_state(EndState.STOPPED).end
    assert end.exists_at(0, M) is True
    with pytest.raises(Stopped):
        end.exists_at(0, M + 1)  # iteration beyond the stop
    with pytest.raises(Stopped):
        end.exists_at(M, M)  # not known while stopped
    with pytest.raises(Stopped):
        end.walks_to(M + 1, 0)
    draining = in_state(EndState.DRAINING).end
    assert draining.walks_to(M + 5, M - 1) and not draining.walks_to(M + 5, M)


def test_draining_becomes_drained_when_the_last_batch_is_returned() -> None:
    batches = in_state(EndState.DRAINING)
    for d in range(M):
        assert batches.end.state is EndState.DRAINING and not batches.end.ended()
        batches.retire(d, None, 0, frozenset(), 0, ())
    assert batches.end.state is EndState.DRAINED and batches.end.ended()


def test_an_end_seen_again_later_changes_nothing_one_seen_earlier_is_a_bug() -> None:
    batches = in_state(EndState.DRAINING)
    batches.found_end(M + 2, False)  # a lane whose turn came after the end
    assert batches.end.end_at() == M
    with pytest.raises(EngineError, match="end of data seen at batch 1, before batch 3"):
        batches.found_end(1, False)


def test_a_new_epoch_starts_running_and_forgets_the_report() -> None:
    batches = in_state(EndState.DRAINED)
    batches.report_end()
    assert batches.end.reported()
    batches.new_epoch(EndEvent.EPOCH, 0, None, 0)
    assert batches.end.state is EndState.RUNNING and not batches.end.reported()
    assert batches.end.exists(0) is None  # the new book's batches


def _reads_outside(module: Path, names: set[str]) -> list[str]:
    """``x.name`` for a name of ``names`` on anything but ``self``, in ``module``."""
    found = []
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in names:
            if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                found.append(f"{module.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_other_module_reads_the_end_of_datas_fields() -> None:
    fields = set(EndOfData.__slots__)
    home = PACKAGE / "engine" / "end_of_data.py"
    found = [r for f in sorted(PACKAGE.rglob("*.py")) if f != home for r in _reads_outside(f, fields)]
    assert found == []
