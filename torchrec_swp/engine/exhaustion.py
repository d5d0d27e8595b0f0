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
rank lacks is the common end, where every rank's draw raises StopIteration, so every rank stops
after the same batch and trains only batches every rank trains. The all-reduce is issued by the
thread that draws (the source task's thread, or the load threads with ``loads=``; draws take
turns in batch order, so every rank issues them in the same order), not by the training thread
where the plan draws elsewhere. An item a rank drew for the common end (it had one, a peer did
not) is not trained: it is dropped, and the engine's ledger counts it (``ledger.past_end``);
the rank's later items stay undrawn in its iterator. A draw that fails with another exception
issues no all-reduce: the peers' pending one fails after the group's timeout
(``engine_timeout_s``) instead of hanging.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

OPTION = "sync_dataloader_exhaustion"


class ExhaustionSync:
    """The collective behind ``sync_dataloader_exhaustion``: ``agree(have)`` is True when every
    rank has its batch. ``seconds`` and ``calls`` count the time spent in it, by thread name."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.calls = 0
        self.seconds: dict[str, float] = {}

    @classmethod
    def create(cls, owner: str, timeout_s: float) -> ExhaustionSync | None:
        """The sync of a pipeline ``owner`` being built, on a new gloo group over every rank (a
        collective: every rank builds its pipelines in the same order); None in a world of one,
        where nothing needs agreeing. Without an initialized process group: ValueError in one line.
        ``timeout_s`` bounds each all-reduce (a peer that never draws again fails it, not hangs)."""
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                f"{owner}({OPTION}=True) needs torch.distributed's default process group: call "
                "torch.distributed.init_process_group() before building the pipeline"
            )
        if dist.get_world_size() == 1:
            return None
        return cls(dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)))

    def agree(self, have: bool) -> bool:
        """Whether every rank has its batch (this rank: ``have``); a MIN all-reduce on the group."""
        start = time.perf_counter()
        flag = torch.tensor([1 if have else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        thread = threading.current_thread().name
        self.seconds[thread] = self.seconds.get(thread, 0.0) + time.perf_counter() - start
        self.calls += 1
        return bool(flag.item())

    def draw(self, pull: Callable[[], T], dropped: Callable[[T], None] | None = None) -> T:
        """``pull()``, then agree: its item where every rank has one; StopIteration on every rank
        as soon as one rank's pull raised it (the item this rank pulled then goes to ``dropped``)."""
        try:
            item = pull()
        except StopIteration:
            self.agree(False)
            raise
        if not self.agree(True):
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

