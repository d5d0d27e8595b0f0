"""Checkpoints: a consistent cut at the batches trained so far.

``state_dict()`` cuts at batch ``c``, the first batch not yet returned by ``step()``: batches
before ``c`` were trained; ``c`` and the batches drawn after it are in flight and must be drawn
and run again after a resume. The data position is the iterator's ``state_dict()`` recorded just
before ``c`` was drawn (``Draws.positions``), or, when ``c`` was not drawn yet, the iterator's
state now (nothing draws while the cut is taken: the workers are quiesced first). With it go the
batch number of ``c`` (the phases' clock and TorchRec's context index), the batches trained
before ``c`` since the engine was built or reset (the clock ``"trained"``), the ledger and the
plan's name. ``load_state_dict()`` on a fresh engine starts its first epoch at that number; the data
the next ``step(data)`` gets is the caller's iterator restored at that position.
"""

from __future__ import annotations

import time
from typing import Any

from torchrec_swp.engine.batches import BatchLedger
from torchrec_swp.engine.epochs import Epochs
from torchrec_swp.engine.errors import EngineError, EngineTimeout
from torchrec_swp.engine.interpreter import WalkState

STATE_VERSION = 1


class Cuts(Epochs):
    """``state_dict()`` / ``load_state_dict()`` of an ``Engine``."""

    def quiesce(self) -> None:
        """Return once no thread can go on without a later ``step()``: every worker waits for
        something only a later call provides (credit, the caller's request), or has stopped.
        Between calls the workers otherwise keep running ahead within their credit."""
        workers = [w for w in self._walkers.values() if w is not self._main]
        board = self.board

        def quiet() -> bool:
            running = [w for w in workers if w.state is WalkState.RUNNING]
            return all(self._workers[w.name].thread.ident in board.blocked for w in running)

        began = board.wait_began()
        while True:  # threads do not announce that they block: look every millisecond
            with board.lock:
                if quiet() or self.failures:
                    return
                stalled = board.patience(began, self.timeout_s) <= 0  # no thread made progress
            if stalled:
                raise EngineTimeout(self._timeout_report())
            time.sleep(0.001)

    def state_dict(self) -> dict[str, Any]:
        """The cut at the first batch not yet returned: ``{"loader": position, "plan": name,
        "batch_number": n, "trained_number": t, "ledger": {...}, "version": 1}``.

        Raises EngineError when the position cannot be taken: no ``step(data)`` has drawn from
        an iterator yet, the iterator has no ``state_dict()``, or a failure is pending."""
        if self.failures or self._failure_raised:
            raise EngineError("state_dict(): a task failed and its step was not resumed; the batches in flight are not at a cut")
        self.quiesce()
        book = self.book
        c = book.returned
        draws = self._draws_for(c)
        if draws is None:
            raise EngineError(
                "state_dict() takes the data position from the iterator given to progress(); none was given "
                "yet (before the first progress() call, save the loader's own state_dict())"
            )
        if not draws.stateful:
            raise EngineError(
                f"state_dict(): the iterator given to progress() ({type(draws.iterator).__name__}) has no "
                f"state_dict(), so the data position of the {len(book.in_flight())} batch(es) in flight "
                "cannot be saved and they would be lost on resume; use an iterator that has one, e.g. of "
                "torchdata's StatefulDataLoader"
            )
        with self.board.lock:
            position = draws.positions.get(c)
            if position is None:  # c not drawn yet: the iterator is where c will be drawn from
                position = draws.iterator.state_dict()  # type: ignore[attr-defined]
            ledger = self.ledger
            return {
                "version": STATE_VERSION,
                "plan": self.phased.name,
                "loader": position,
                "batch_number": book.number_of(c),
                "trained_number": book.first_trained + c,
                "ledger": {
                    "drawn": book.serial(c),
                    "trained": ledger.trained,
                    "dropped": [list(d) for d in ledger.dropped],
                },
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from a cut: the next batch drawn gets the cut's batch number and serial. Only on
        an engine with nothing in flight that has not stepped since it was built or reset."""
        if not isinstance(state, dict) or "batch_number" not in state or "ledger" not in state:
            raise EngineError(f"load_state_dict(): not an engine state (a dict from state_dict()), got {type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise EngineError(f"load_state_dict(): state version {state.get('version')!r}, this engine reads {STATE_VERSION}")
        if state.get("plan") != self.phased.name:
            raise EngineError(
                f"load_state_dict(): the state was cut from plan {state.get('plan')!r}, this pipeline runs "
                f"plan {self.phased.name!r}"
            )
        book = self.book
        if book.requested or self.in_flight():
            raise EngineError("load_state_dict(): only before the first progress() (or right after reset())")
        ledger = state["ledger"]
        self.ledger = BatchLedger(
            drawn=int(ledger["drawn"]),
            trained=int(ledger["trained"]),
            dropped=[(int(s), str(r)) for s, r in ledger["dropped"]],
        )
        self._pulls = int(state["batch_number"])
        self.forget_data()
        # a state cut before the clock "trained" existed: its batch number (the same in a first epoch)
        self._start_epoch(first_trained=int(state.get("trained_number", state["batch_number"])))
