"""Exposed time: which tasks the end of an iteration waited for, and for how long.

Rules (``exposed_times``), walking backwards from the end of the iteration:

1. Start at the event (run or wait) that ended last on any thread: the calling thread's own last
   task, or the worker it joined last at the iteration barrier.
2. A run is exposed for the part of it that lies inside the iteration and before the cursor;
   the walk then continues with the previous event on the same thread.
3. A wait whose producer ended after the wait began hands the walk to the producer's run on
   its thread (the waiting thread was blocked on it); otherwise the wait cost nothing and the
   walk continues on the same thread.
4. A run in a comm group whose thread was idle before it (it waited for its collective ticket)
   hands the walk to the run of the same comm group on another thread that ended last in that
   idle gap, if there is one.
5. What the walk does not attribute (dispatch and wake-up latencies, gaps between calls) is the
   iteration's ``unattributed`` time; the exposed times and it add up to the iteration time.

On one thread every run is exposed in full. Across threads, the exposed times are the chain of
runs the iteration's end depended on: a task off that chain can grow without slowing the step.
"""

from __future__ import annotations

from collections.abc import Mapping

from torchrec_swp.profiler.events import IterationRecord, RunEvent, WaitEvent

# Tolerance (s) when matching a wait's end or a ticket's release to the run that caused it.
_SLACK_S = 1e-4

Event = RunEvent | WaitEvent


def exposed_times(record: IterationRecord, comm_group: Mapping[str, str | None]) -> tuple[dict[str, float], float]:
    """``({task: exposed seconds}, unattributed seconds)`` for one iteration (rules above).

    ``comm_group`` maps tasks to their comm group (None or absent: not a collective).
    """
    threads: dict[str, list[Event]] = {}
    every: list[Event] = [*record.runs, *record.waits]
    for e in every:
        threads.setdefault(e.thread, []).append(e)
    position: dict[int, tuple[str, int]] = {}
    for thread, events in threads.items():
        events.sort(key=lambda e: (e.start, e.end))
        for k, e in enumerate(events):
            position[id(e)] = (thread, k)
    last_run = {r.task: r for r in sorted(record.runs, key=lambda r: r.end)}
    exposed: dict[str, float] = {}
    events_all = [e for events in threads.values() for e in events]
    cur: Event | None = max(events_all, key=lambda e: e.end, default=None)
    cursor = record.end
    seen: set[int] = set()
    while cur is not None and id(cur) not in seen and cursor > record.start:
        seen.add(id(cur))
        thread, k = position[id(cur)]
        previous = threads[thread][k - 1] if k > 0 else None
        match cur:
            case RunEvent(task=task, start=start, end=end):
                share = min(end, cursor) - max(start, record.start)
                if share > 0:
                    exposed[task] = exposed.get(task, 0.0) + share
                cursor = min(cursor, start)
                group = comm_group.get(task)
                idle_since = previous.end if previous is not None else record.start
                if group is not None:
                    rivals = [
                        r
                        for r in record.runs
                        if r.thread != thread
                        and comm_group.get(r.task) == group
                        and idle_since < r.end <= start + _SLACK_S
                        and id(r) not in seen
                    ]
                    if rivals:
                        previous = max(rivals, key=lambda r: r.end)
                cur = previous
            case WaitEvent(producer=producer, start=start, end=end):
                run = last_run.get(producer)
                if run is not None and run.end > start and run.end <= end + _SLACK_S and id(run) not in seen:
                    cursor = min(cursor, run.end)
                    cur = run
                else:
                    cursor = min(cursor, start)
                    cur = previous
    unattributed = max(0.0, record.duration - sum(exposed.values()))
    return exposed, unattributed
