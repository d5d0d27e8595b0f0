"""Checkpoints: a consistent cut at the batches trained so far.

``state_dict()`` cuts at batch ``c``, the first batch not yet returned by ``step()``: batches
before ``c`` were trained; ``c`` and the batches drawn after it are in flight and must be drawn
and run again after a resume. The data position is the iterator's ``state_dict()`` recorded just
before ``c`` was drawn (``Draws.positions``), or, when ``c`` was not drawn yet, the iterator's
state now (nothing draws while the cut is taken: ``wait_until_blocked`` first). With it go
the batch number of ``c`` (the phases' clock and TorchRec's context index), the batches trained
before ``c`` since the engine was built or reset (the clock ``"trained"``), the ledger and the
plan's name. ``load_state_dict()`` on a fresh engine starts its first epoch at that number; the data
the next ``step(data)`` gets is the caller's iterator restored at that position.

``take`` writes a cut, ``read`` checks one; the engine's threads are blocked around them.
"""

from __future__ import annotations

from typing import Any

from torchrec_swp.engine.batches import Batches, BatchLedger
from torchrec_swp.engine.errors import EngineError
from torchrec_swp.engine.source import Feed

STATE_VERSION = 1


def take(batches: Batches, feed: Feed, plan: str) -> dict[str, Any]:
    """The cut at the first batch not yet returned: ``{"loader": position, "plan": name,
    "batch_number": n, "trained_number": t, "ledger": {...}, "version": 1}``.

    Raises EngineError when the position cannot be taken: no ``step(data)`` has drawn from
    an iterator yet, or the iterator has no ``state_dict()``."""
    book = batches.book
    c = book.returned
    draws = feed.draws_for(c)
    if draws is None:
        raise EngineError(
            "state_dict() takes the data position from the iterator given to progress(); none was given "
            "yet (before the first progress() call, save the loader's own state_dict())"
        )
    if not draws.stateful:
        raise EngineError(
            f"state_dict(): the iterator given to progress() ({type(draws.iterator).__name__}) has no "
            f"state_dict(), so the data position of the {len(book.in_flight)} batch(es) in flight "
            "cannot be saved and they would be lost on resume; use an iterator that has one, e.g. of "
            "torchdata's StatefulDataLoader"
        )
    position = draws.positions.get(c)
    if position is None:  # c not drawn yet: the iterator is where c will be drawn from
        # (the ignore below: the user's iterator: duck-typed, checked where used)
        position = draws.iterator.state_dict()  # type: ignore[attr-defined]
    ledger = batches.ledger
    return {
        "version": STATE_VERSION,
        "plan": plan,
        "loader": position,
        "batch_number": book.number_of(c),
        "trained_number": book.first_trained + c,
        "ledger": {
            "drawn": book.serial(c),
            "trained": ledger.trained,
            "dropped": [list(d) for d in ledger.dropped],
            "failed_draws": [list(d) for d in ledger.failed_draws],
        },
    }


def read(state: dict[str, Any], plan: str) -> tuple[BatchLedger, int, int]:
    """The ledger, batch number and trained number of a cut taken from plan ``plan``
    (EngineError when it is not one)."""
    if not isinstance(state, dict) or "batch_number" not in state or "ledger" not in state:
        raise EngineError(
            f"load_state_dict(): not an engine state (a dict from state_dict()), got {type(state).__name__}"
        )
    if state.get("version") != STATE_VERSION:
        raise EngineError(
            f"load_state_dict(): state version {state.get('version')!r}, this engine reads {STATE_VERSION}"
        )
    if state.get("plan") != plan:
        raise EngineError(
            f"load_state_dict(): the state was cut from plan {state.get('plan')!r}, this pipeline runs plan {plan!r}"
        )
    ledger = state["ledger"]
    restored = BatchLedger(
        drawn=int(ledger["drawn"]),
        trained=int(ledger["trained"]),
        dropped=[(int(s), str(r)) for s, r in ledger["dropped"]],
        failed_draws=[(int(s), str(r)) for s, r in ledger.get("failed_draws", [])],  # an older cut: none
    )
    # a state cut before the clock "trained" existed: its batch number (the same in a first epoch)
    return restored, int(state["batch_number"]), int(state.get("trained_number", state["batch_number"]))
