"""The life of every batch: drawn, in its slot, trained or dropped; epochs; the ledger.

One ``BatchBook`` per epoch owns the batches in flight: their slots (the values tasks write
and read), the device events recorded after their tasks, what the source found (batches drawn,
the end of data), and how far the caller has got (batches requested and returned). The
``BatchLedger`` outlives epochs: every batch the source drew, trained or dropped with a reason.

Batches are numbered per epoch from 0 (``b``, the index tasks get); their ``serial`` numbers them
over the engine's life in drawing order (the ledger's numbers), their ``number`` counts the
source's calls since the engine was built or reset - the call that found the end of data
included, as TorchRec's context index counts them - and picks the phase of a PhasedPlan (or, for
``clock="trained"``, ``first_trained + b``: the batches trained before it since then).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class BatchLedger:
    """What became of every batch the source drew, across epochs and resets.

    Batches are numbered by ``serial`` in the order they were drawn (0, 1, ... over the
    engine's life). A batch is trained once it left the highest stage; one that never will is
    listed in ``dropped`` with the reason. ``past_end`` counts the items drawn for the common end
    of uneven data (``sync_dataloader_exhaustion``: this rank had one, another had none): never
    batches, never trained, not counted in ``drawn``.
    """

    drawn: int = 0
    trained: int = 0
    dropped: list[tuple[int, str]] = field(default_factory=list)
    past_end: int = 0


@dataclass
class BatchBook:
    """The batches of one epoch (numbered ``b`` = 0, 1, ...).

    ``first_number``: the batch number of batch 0; ``first_serial``: its serial; ``first_trained``:
    the batches trained since the engine was built or reset before this epoch; ``start``: the
    internal iteration the threads start at (0, or the highest stage when batches were adopted);
    ``slots``: batch -> its values (one dict for the engine's life, emptied per epoch); ``numbers``:
    batch -> its number; ``loaded``: batches the source drew (or that were adopted);
    ``events``: (task, batch) -> the device event recorded after it; ``num_batches`` (M): set
    when the source found the end of data at batch M; ``stopped``: the plan stopped there
    (``on_exhausted="stop"``); ``renumbered``: source calls of this epoch that found the end
    under a stop and were followed by more data (each took a batch number); ``next_claim``: the
    batch whose draw is next (several loads take turns); ``requested`` / ``returned``: batches
    ``step()`` was asked for / handed out; ``end_reported``: the last step() raised
    StopIteration for the end of data; ``restart_after_drain``: new data came while draining.
    """

    first_number: int = 0
    first_serial: int = 0
    first_trained: int = 0
    start: int = 0
    slots: dict[int, dict[str, Any]] = field(default_factory=dict)
    loaded: set[int] = field(default_factory=set)
    numbers: dict[int, int] = field(default_factory=dict)
    events: dict[tuple[str, int], Any] = field(default_factory=dict)
    num_batches: int | None = None
    stopped: bool = False
    renumbered: int = 0
    next_claim: int = 0
    requested: int = 0
    returned: int = 0
    end_reported: bool = False
    restart_after_drain: bool = False

    def number(self, b: int) -> int:
        """Batch ``b``'s number (its source call since the engine was built or reset)."""
        return self.first_number + b + self.renumbered

    def number_of(self, b: int) -> int:
        """The number batch ``b`` was drawn with (``number(b)`` if not drawn yet)."""
        return self.numbers.get(b, self.number(b))

    def serial(self, b: int) -> int:
        return self.first_serial + b

    def in_flight(self) -> list[int]:
        """Batches drawn and not yet returned, in order."""
        return sorted(b for b in self.loaded if b >= self.returned)

    @property
    def ended(self) -> bool:
        """The data is exhausted and no batch is left to return (or the plan stopped)."""
        return self.stopped or (self.num_batches is not None and self.returned >= self.num_batches)

    def exists(self, b: int) -> bool | None:
        """Whether batch ``b`` was drawn (True), will never be (False), or is not known yet (None:
        the source has not looked for it). While stopped, nothing at or past the end is known."""
        if b in self.loaded or 0 <= b < self.returned:
            return True
        if b < 0:
            return False
        m = self.num_batches
        if m is not None and b >= m and not self.stopped:
            return False
        return None
