"""Storages as the CUDA caching allocator sees them: where each was allocated, its last uses,
the streams given to ``record_stream``, and frees whose block is not yet safe to hand out.

The caching allocator keeps a freed block for the stream it was allocated on and hands it to the
next allocation on that stream from the same pool (blocks of at most 1 MiB and larger ones are
kept apart; a freed block merges with free neighbours, so any request of its pool may get it).
A free is therefore early only if a later allocation on the allocation stream is not ordered
after a use of the block on another stream that ``record_stream`` did not cover. The checker
keeps such a free *pending* and decides at each allocation on that stream: the allocating
thread knows the uses completed or enqueued before (the free was safe; it is dropped), or it
does not (an ``EarlyFree`` naming the use, the free and the allocation that could reuse it).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchrec_swp.streamcheck.lanes import Clock, Use

if TYPE_CHECKING:
    from torchrec_swp.streamcheck.emulated import Stream

#: The caching allocator's small pool: blocks of at most this many bytes (kSmallSize).
SMALL_POOL_BYTES = 1 << 20


def same_pool(a: int, b: int) -> bool:
    """Whether allocations of ``a`` and ``b`` bytes come from the same pool of the allocator."""
    return (a <= SMALL_POOL_BYTES) == (b <= SMALL_POOL_BYTES)


class StorageState:
    """One live storage: allocation stream, size, last write and reads, recorded streams."""

    __slots__ = ("alloc", "host", "nbytes", "reads", "recorded", "ref", "write")

    def __init__(self, alloc: Stream, nbytes: int, host: bool = False) -> None:
        self.alloc = alloc
        # made outside every task (the loader's batches, tensors that existed before): host memory
        # in a CUDA run, whose caching host allocator records its uses itself - no early free
        self.host = host
        self.nbytes = nbytes
        self.write: Use | None = None
        self.reads: dict[int, Use] = {}  # lane id -> last read on that lane since the last write
        self.recorded: set[Stream] = set()  # streams given to record_stream
        self.ref: weakref.ref[Any] | None = None

    def foreign_uses(self) -> list[Use]:
        """The last uses on streams other than the allocation stream, not covered by
        ``record_stream``: what a reuse of the block on the allocation stream must come after."""
        if self.host:
            return []
        uses = [u for u in (self.write, *self.reads.values()) if u is not None]
        return [u for u in uses if u.lane.stream is not self.alloc and u.lane.stream not in self.recorded]


@dataclass(slots=True)
class PendingFree:
    """A freed block whose ``uses`` (on other streams) the freeing thread did not know to be
    ordered before a reuse on ``alloc``."""

    alloc: Stream
    nbytes: int
    uses: list[Use]
    freed_in: str


def unknown_uses(uses: list[Use], known: Clock) -> list[Use]:
    """The uses a thread whose clock of the allocation stream is ``known`` is not ordered after."""
    return [u for u in uses if known.get(u.lane.id, 0) < u.seq]
