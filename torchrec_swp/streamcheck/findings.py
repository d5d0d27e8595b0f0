"""What the stream checker reports: the accesses it saw and the three kinds of findings.

* ``UnsyncedAccess``: two accesses to one storage, at least one a write, on different lanes (a
  lane is one stream as enqueued by one CPU thread) with no happens-before edge between them.
* ``EarlyFree``: a storage freed while a use on a stream other than its allocation stream is
  covered neither by ``record_stream`` nor by a wait, and a later allocation on the allocation
  stream is not ordered after that use: the CUDA caching allocator could hand it the block
  before the use ran.
* ``HostOrder``: a stream waited on (or the host synchronised with) an event whose record is not
  ordered before the wait on the CPU side: in another interleaving of the threads the wait runs
  first and orders nothing.

Every finding has a ``signature`` (what it is, without the batch numbers) used to count repeats:
the checker keeps the first occurrence of each signature and how often it happened.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class Access:
    """One read or write of a storage by one aten op."""

    kind: Literal["read", "write"]
    task: str | None  # None: outside any labelled task
    batch: int | None
    thread: str
    stream: str
    op: str
    arg: str
    shape: tuple[int, ...]

    def where(self) -> str:
        if self.task is None:
            return f"outside tasks on stream {self.stream!r} (thread {self.thread})"
        batch = "" if self.batch is None else f" batch {self.batch}"
        return f"task {self.task}{batch} on stream {self.stream!r} (thread {self.thread})"

    def __str__(self) -> str:
        return f"{self.kind} of {self.arg} {list(self.shape)} by {self.op} in {self.where()}"

    def signature(self) -> tuple[str, ...]:
        return (self.kind, self.task or "-", self.thread, self.stream, self.op, self.arg)


@dataclass(frozen=True, slots=True)
class UnsyncedAccess:
    """``later`` is not ordered after ``earlier`` (both on one storage, at least one a write)."""

    earlier: Access
    later: Access

    @property
    def kind(self) -> str:
        return f"{self.earlier.kind[0].upper()}/{self.later.kind[0].upper()}"  # "W/R", "R/W", "W/W"

    def __str__(self) -> str:
        if self.earlier.stream == self.later.stream:
            why = (
                f"both are on stream {self.later.stream!r} but enqueued by threads {self.earlier.thread} and "
                f"{self.later.thread} with no CPU-side edge between them, so their order on the stream is not fixed"
            )
        else:
            why = (
                f"no wait_stream / event wait makes stream {self.later.stream!r} wait for stream "
                f"{self.earlier.stream!r} after the {self.earlier.kind}"
            )
        return f"unsynchronised {self.kind}: {self.later}\n    is not ordered after {self.earlier}\n    ({why})"

    def signature(self) -> tuple[str, ...]:
        return ("unsynced", *self.earlier.signature(), *self.later.signature())


@dataclass(frozen=True, slots=True)
class EarlyFree:
    """A storage allocated on ``alloc_stream`` was freed while ``use`` (on another stream) was
    covered neither by ``record_stream`` nor by a wait of the allocation stream, and a later
    allocation on ``alloc_stream`` (``reused_by``) is not ordered after that use either."""

    use: Access
    alloc_stream: str
    nbytes: int
    freed_in: str
    reused_by: str = "-"

    def __str__(self) -> str:
        return (
            f"early free: a storage of {self.nbytes} bytes allocated on stream {self.alloc_stream!r} was freed "
            f"{self.freed_in}\n    while its {self.use}\n    was covered neither by record_stream({self.use.stream!r}) "
            f"nor by a wait of stream {self.alloc_stream!r} for it, and the next allocation on {self.alloc_stream!r}, "
            f"{self.reused_by},\n    could get the block from the CUDA caching allocator "
            f"before that {self.use.kind} ran"
        )

    def signature(self) -> tuple[str, ...]:
        return ("free", self.alloc_stream, *self.use.signature())


@dataclass(frozen=True, slots=True)
class HostOrder:
    """A wait (or host synchronisation) on an event whose record is not ordered before it on the
    CPU side, or which was never recorded at all."""

    action: str  # e.g. "stream 'default' waits on", "host synchronises with"
    event: str
    waiter: str  # where the wait ran: task/batch/thread
    recorder: str | None  # where the last record ran; None: never recorded
    waiter_task: str = "-"  # the waiter's task and thread without the batch (for the signature)
    recorder_task: str = "-"

    def __str__(self) -> str:
        if self.recorder is None:
            return (
                f"host order: {self.waiter}: {self.action} event {self.event}, which was never recorded before "
                "(a wait on an unrecorded event orders nothing)"
            )
        return (
            f"host order: {self.waiter}: {self.action} event {self.event}, recorded {self.recorder} "
            "with no CPU-side edge (cpu_release/cpu_acquire) from that record to this wait: in another interleaving "
            "the wait runs first and orders nothing"
        )

    def signature(self) -> tuple[str, ...]:
        return ("host", self.action, self.waiter_task, self.recorder_task)


Finding = UnsyncedAccess | EarlyFree | HostOrder


class StreamCheckError(AssertionError):
    """Raised by ``StreamChecker.check()`` (or at the op, with ``fail_fast``) when the checker found
    something. ``findings`` holds the distinct findings, ``counts`` how often each happened."""

    def __init__(self, findings: Sequence[Finding], counts: Sequence[int], dropped: int = 0) -> None:
        self.findings = list(findings)
        self.counts = list(counts)
        lines = [f"stream check: {len(self.findings)} distinct finding(s), {sum(self.counts)} in all"]
        for i, (f, n) in enumerate(zip(self.findings, self.counts, strict=True)):
            if i == 20:
                lines.append(f"... and {len(self.findings) - 20} more")
                break
            times = "" if n == 1 else f" [x{n}]"
            lines.append(f"{i + 1}.{times} {f}")
        if dropped:
            lines.append(f"({dropped} more distinct findings were dropped: max_findings reached)")
        super().__init__("\n".join(lines))


class StreamCheckUsageError(RuntimeError):
    """The checker was used wrongly (two checkers installed, a stream of another checker, ...)."""
