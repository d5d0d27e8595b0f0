"""Ranks whose data runs out unevenly stop together: ``ExhaustionSync`` (the option
``sync_dataloader_exhaustion=True`` of every pipeline).

Without it, a rank whose loader holds fewer batches stops while its peers go on into the next
batch's collectives, which pair up with whatever the stopped rank issues next: gloo aborts the
process ("Received data size doesn't match expected size"), NCCL usually hangs until its
timeout, and where the sizes happen to match the ranks exchange wrong data. That is upstream's
behaviour, and it stays so without the option.

With it, every draw of a batch is followed by one collective: a MIN all-reduce of "I have this
batch" (one int32 on the CPU) on a gloo process group of its own, made when the pipeline is
built. Every rank draws batch ``b`` and learns whether every rank has one; the first batch some
rank lacks is the common end, where every rank stops, so every rank trains only batches every
rank trains. The all-reduces are issued by the threads that draw, in batch order (draws take
turns), so every rank issues them in the same order.

Where the engine draws (``torchrec_swp.engine.source``), the agreement is **deferred**
(``begin``, ``settle``): batch ``b``'s all-reduce starts (``async_op``) right after its
draw and is waited for only where its answer is needed first: before any other task of ``b``
(the ops' gate: ``gated_from``, ``settle``), or before the next draw (``begin``), which keeps at
most one agreement open, so that every rank issues exactly as many as its peers. By
then the peers have drawn ``b`` too (they draw it before their own collectives of the batches
before it), so the wait is usually already over. Where the answer is "not every rank", the
batch this rank drew is **retracted** (the callback ``begin`` was given: it leaves the batches in
flight, is counted in ``ledger.dropped_past_end``, the data ends there, and the pipeline undoes what its
source task's call did outside the batch's slot); nothing of it ran but its draw, and no
collective of it was issued on any rank. A rank whose own draw ends
(StopIteration) agrees "no" and stops; the peers learn it at their gate. ``finish()`` waits for
the last open agreement (before the group is destroyed). Where the answer is needed at once (a
source task that is itself a collective or that the pipeline cannot undo, a plan that stops at
the end), ``draw`` agrees in the draw (blocking), and so do pipelines that draw outside the engine (``SyncedIterator``).

A pipeline may carry one flag of its own on each draw's agreement (``carry``: a ``Carried`` per
item drawn, a second int32 in the same all-reduce, ``every`` known once it is settled): the input
dist cache (``integrations/torchrec/input_dist_cache.py``) agrees there on which batches every
rank reuses, with no collective of its own.

An item a rank drew for the common end (it had one, a peer did not) is not trained: it is
dropped or retracted, and the engine's ledger counts it (``ledger.dropped_past_end``); the rank's later
items stay undrawn in its iterator. A draw that fails with another exception issues no
all-reduce: the peers' pending one fails after the group's timeout (``engine_timeout_s``)
instead of hanging.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

OPTION = "sync_dataloader_exhaustion"


NEVER = sys.maxsize  # no agreement open: no batch is gated


class _Open:
    """An agreement begun and not settled: its batch, this rank's answer, the all-reduce's work
    and tensor, and what to call if the answer is "not every rank" (this rank had the batch)."""

    __slots__ = ("batch", "have", "work", "flag", "retract", "key", "carried")

    def __init__(
        self,
        batch: int,
        have: bool,
        work: Any,
        flag: torch.Tensor,
        retract: Callable[[], None] | None,
        key: Hashable,
        carried: Carried | None = None,
    ) -> None:
        self.batch, self.have, self.work, self.flag, self.retract = batch, have, work, flag, retract
        self.key = key  # the stream checker's hand-off from the thread that began it to the one that settles it
        self.carried = carried


class Carried:
    """One flag of this rank's own that rides on a draw's agreement (``ExhaustionSync.carry``):
    ``mine`` as this rank said it, ``every`` the MIN over every rank once the agreement is settled
    (None before, and where the batch was retracted)."""

    __slots__ = ("mine", "every")

    def __init__(self, mine: bool) -> None:
        self.mine = mine
        self.every: bool | None = None


class ExhaustionSync:
    """The collective behind ``sync_dataloader_exhaustion``: ``agree(have)`` is True when every
    rank has its batch (blocking); ``begin``, ``settle`` and ``finish`` the deferred
    agreement (module docstring). ``seconds`` and ``calls`` count the time spent waiting for
    it, by thread name."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.calls = 0
        self.seconds: dict[str, float] = {}
        #: the batch of the open agreement where this rank had it, else the batch retracted last
        #: (NEVER: neither): a task of batch ``b >= gated_from`` settles before it runs; read
        #: without the lock (one int), so it leaves a retracted batch only for the next agreement
        self.gated_from = NEVER
        self._open: _Open | None = None
        self._last: _Open | None = None  # the last settled: its work and tensor outlive the gloo thread's use
        self._retracted: int | None = None  # the batch retracted last, while its epoch lasts
        self._begun = 0  # agreements begun (names each one's hand-off for the checker)
        self._checker: Any = None
        self._lock = threading.Lock()
        #: what a pipeline's own flag for a drawn item is (``Carried``), agreed in the same
        #: all-reduce as the item (a second int32: no collective of its own); None: nothing carried.
        #: Set on every rank alike before the first draw.
        self.carry: Callable[[Any], Carried] | None = None

    @classmethod
    def create(cls, owner: str, timeout_s: float, required: bool = True) -> ExhaustionSync | None:
        """The sync of a pipeline ``owner`` being built, on a new gloo group over every rank (a
        collective: every rank builds its pipelines in the same order); None in a world of one,
        where nothing needs agreeing. Without an initialized process group: ValueError in one line
        where the sync was asked for (``required``), None where it is only the default.
        ``timeout_s`` bounds each all-reduce (a peer that never draws again fails it, not hangs)."""
        if not dist.is_available() or not dist.is_initialized():
            if not required:
                return None
            raise ValueError(
                f"{owner}({OPTION}=True) needs torch.distributed's default process group: call "
                "torch.distributed.init_process_group() before building the pipeline"
            )
        if dist.get_world_size() == 1:
            return None
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        assert isinstance(group, dist.ProcessGroup)  # (every rank is in it)
        return cls(group)

    def agree(self, have: bool, carried: Carried | None = None) -> bool:
        """Whether every rank has its batch (this rank: ``have``); a MIN all-reduce on the group
        (of ``carried`` too, where something is carried)."""
        start = time.perf_counter()
        work, flag = self._flags(have, carried)
        work.wait()
        self._count(start)
        every = bool(flag[0].item())
        if carried is not None and every:
            carried.every = bool(flag[1].item())
        return every

    def check_with(self, checker: Any) -> None:
        """Tell the stream checker (``torchrec_swp.streamcheck``) that a deferred agreement's
        wait orders the thread that settles it after the thread that began it: its flag, written
        by the all-reduce, is read there (``cpu_release`` / ``cpu_acquire``)."""
        self._checker = checker

    # ------------------------------------------------------------ deferred
    def begin(self, b: int, pull: Callable[[], T], retract: Callable[[], None] | None) -> T:
        """Batch ``b``'s draw: the open agreement settled first (StopIteration, pulling nothing,
        where it or an earlier one retracted a batch before ``b``: the data ended there), then ``pull()``
        and this batch's agreement begun: "yes" with its item (``retract()`` is called if the
        answer is "not every rank"), "no" where ``pull()`` raised StopIteration (raised on)."""
        if not self.settle():
            raise StopIteration
        if self._retracted is not None:
            if b > self._retracted:  # a draw begun before the batch before it was retracted
                raise StopIteration
            self._retracted = None  # batches are numbered from 0 again: a new epoch
        try:
            item = pull()
        except StopIteration:
            self._start(b, False, None)
            raise
        self._start(b, True, retract, None if self.carry is None else self.carry(item))
        return item

    def settle(self) -> bool:
        """Wait for the open agreement, if any; False where it was this rank's batch and not
        every rank had it (its ``retract()`` has been called), else True."""
        with self._lock:
            open_ = self._open
            if open_ is None:
                return True
            start = time.perf_counter()
            open_.work.wait()
            self._count(start)
            if self._checker is not None:
                self._checker.cpu_acquire(open_.key)
            self._open, self._last = None, open_
            if open_.have and not bool(open_.flag[0].item()):
                # gated_from stays at the retracted batch: a task of it that found it in flight
                # before the retraction reads the gate after, settles (nothing open) and asks again
                self._retracted = open_.batch
                if open_.retract is not None:
                    open_.retract()
                return False
            if open_.carried is not None:
                open_.carried.every = bool(open_.flag[1].item())
            self.gated_from = NEVER
            return True

    def finish(self) -> None:
        """The open agreement waited for (its peers' all-reduce completes too), answer unused:
        before the group is destroyed. A wait that fails (the group was shut down already, by
        ``destroy_process_group()``; a peer gone) leaves nothing to wait for: not raised."""
        with self._lock:
            open_ = self._open
            if open_ is not None:
                self._open, self._last = None, open_
                self.gated_from = NEVER
                try:
                    open_.work.wait()
                except Exception:  # noqa: BLE001 - nothing left to agree on: the group is gone
                    pass

    def _issue(self, *flags: bool) -> tuple[Any, torch.Tensor]:
        """The MIN all-reduce of ``flags`` begun: its work and its tensor (the answer once waited for)."""
        flag = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
        return dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group, async_op=True), flag

    def _flags(self, have: bool, carried: Carried | None) -> tuple[Any, torch.Tensor]:
        """The all-reduce begun: of ``have`` alone, or with something carried (every rank
        carries, or none: ``carry`` is set alike) of ``have`` and the carried flag."""
        if self.carry is None:
            return self._issue(have)
        return self._issue(have, bool(have and carried is not None and carried.mine))

    def _start(self, b: int, have: bool, retract: Callable[[], None] | None, carried: Carried | None = None) -> None:
        work, flag = self._flags(have, carried)
        self._begun += 1
        key = ("agreement", id(self), self._begun)
        if self._checker is not None:
            self._checker.cpu_release(key)
        with self._lock:
            self._open = _Open(b, have, work, flag, retract, key, carried)
            if have:
                self.gated_from = b

    def _count(self, start: float) -> None:
        thread = threading.current_thread().name
        self.seconds[thread] = self.seconds.get(thread, 0.0) + time.perf_counter() - start
        self.calls += 1

    # ------------------------------------------------------------ blocking
    def draw(self, pull: Callable[[], T], dropped: Callable[[T], None] | None = None) -> T:
        """``pull()``, then agree: its item where every rank has one; StopIteration on every rank
        as soon as one rank's pull raised it (the item this rank pulled then goes to ``dropped``).
        An open deferred agreement is settled first (StopIteration where it retracted this rank's
        previous batch)."""
        if not self.settle():
            raise StopIteration
        try:
            item = pull()
        except StopIteration:
            self.agree(False)
            raise
        if not self.agree(True, None if self.carry is None else self.carry(item)):
            if dropped is not None:
                dropped(item)
            raise StopIteration
        return item


class SyncedIterator:
    """``iterator`` drawn through ``sync.draw``: every rank stops at the same item (for pipelines
    that draw outside the engine's source, e.g. the Maglev drop-ins' ``take_inputs``). ``dropped``
    counts the items drawn for the common end and not handed out."""

    def __init__(self, iterator: Iterator[Any], sync: ExhaustionSync) -> None:
        self.iterator = iterator
        self.sync = sync
        self.dropped = 0

    def __iter__(self) -> SyncedIterator:
        return self

    def __next__(self) -> Any:
        return self.sync.draw(lambda: next(self.iterator), self._drop)

    def _drop(self, item: Any) -> None:
        self.dropped += 1
