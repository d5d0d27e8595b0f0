"""One-shot task graphs (a DAG run once, e.g. a pipeline-parallel schedule) and the greedy
list scheduler.

A ``Dag`` has tasks on resources (a device, a thread), precedence edges, and memory: a
``Memory(start, end, amount)`` is held on ``start``'s resource from the moment ``start`` begins
until ``end`` ends (an activation lives from its forward to the end of its backward).
Durations are integers (CP-SAT needs them).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torchrec_swp.solve.replay import peak_held


class DagError(ValueError):
    """A malformed DAG or schedule; the message names the culprit."""


@dataclass(frozen=True, slots=True)
class DagTask:
    name: str
    resource: str
    duration: int


@dataclass(frozen=True, slots=True)
class Memory:
    """``amount`` held on ``start``'s resource from the start of ``start`` to the end of ``end``."""

    start: str
    end: str
    amount: int = 1


@dataclass(frozen=True)
class Dag:
    """Tasks (in declaration order), edges ``(before, after)``, memory uses. Validated: names
    are unique, edges and memory name known tasks, durations are ints >= 0, no cycle."""

    tasks: tuple[DagTask, ...]
    edges: tuple[tuple[str, str], ...] = ()
    memory: tuple[Memory, ...] = ()

    def __post_init__(self) -> None:
        names = [t.name for t in self.tasks]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise DagError(f"task {dup!r} is declared twice")
        for t in self.tasks:
            if isinstance(t.duration, bool) or not isinstance(t.duration, int) or t.duration < 0:
                raise DagError(f"task {t.name}: duration must be an int >= 0, got {t.duration!r}")
        known = set(names)
        for a, b in self.edges:
            for n in (a, b):
                if n not in known:
                    raise DagError(f"edge {a} -> {b} names unknown task {n!r}")
        for m in self.memory:
            for n in (m.start, m.end):
                if n not in known:
                    raise DagError(f"memory {m} names unknown task {n!r}")
        self.topological()

    @property
    def task_map(self) -> dict[str, DagTask]:
        return {t.name: t for t in self.tasks}

    @property
    def resources(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.resource for t in self.tasks))

    def predecessors(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {t.name: [] for t in self.tasks}
        for a, b in self.edges:
            out[b].append(a)
        return out

    def topological(self) -> list[str]:
        """Task names in a topological order (Kahn, declaration order among ready tasks)."""
        preds = self.predecessors()
        rank = {t.name: k for k, t in enumerate(self.tasks)}
        missing = {n: len(p) for n, p in preds.items()}
        succ: dict[str, list[str]] = {n: [] for n in preds}
        for a, b in self.edges:
            succ[a].append(b)
        ready = [(rank[n], n) for n, c in missing.items() if c == 0]
        heapq.heapify(ready)
        out = []
        while ready:
            _, n = heapq.heappop(ready)
            out.append(n)
            for s in succ[n]:
                missing[s] -= 1
                if missing[s] == 0:
                    heapq.heappush(ready, (rank[s], s))
        if len(out) != len(self.tasks):
            stuck = sorted(n for n, c in missing.items() if c > 0)
            raise DagError(f"the edges form a cycle through {stuck[:5]}")
        return out


@dataclass(frozen=True)
class DagSchedule:
    """Start times of every task of ``dag``."""

    dag: Dag
    starts: Mapping[str, int] = field(hash=False)

    @property
    def makespan(self) -> int:
        tasks = self.dag.task_map
        return max((s + tasks[n].duration for n, s in self.starts.items()), default=0)

    def order(self, resource: str) -> list[str]:
        """Tasks of ``resource`` by start time."""
        return sorted((t.name for t in self.dag.tasks if t.resource == resource), key=lambda n: (self.starts[n], n))

    def peak_memory(self) -> dict[str, int]:
        """Largest memory held at once on each resource (freed before allocated at equal times)."""
        tasks = self.dag.task_map
        events: dict[str, list[tuple[int, int]]] = {r: [] for r in self.dag.resources}
        for m in self.dag.memory:
            r = tasks[m.start].resource
            events[r].append((self.starts[m.start], m.amount))
            events[r].append((self.starts[m.end] + tasks[m.end].duration, -m.amount))
        return {r: peak_held(evs) for r, evs in events.items()}

    def check(self) -> None:
        """Raise DagError if an edge or a resource is violated."""
        tasks = self.dag.task_map
        for a, b in self.dag.edges:
            if self.starts[b] < self.starts[a] + tasks[a].duration:
                raise DagError(
                    f"{b} starts at {self.starts[b]}, before {a} ends at {self.starts[a] + tasks[a].duration}"
                )
        for r in self.dag.resources:
            order = self.order(r)
            for x, y in itertools.pairwise(order):
                if self.starts[y] < self.starts[x] + tasks[x].duration:
                    raise DagError(f"{x} and {y} overlap on resource {r}")


def list_schedule(dag: Dag, priority: Callable[[DagTask], Any] | None = None) -> DagSchedule:
    """Greedy list scheduling: whenever a resource is idle, it starts its ready task (every
    predecessor ended) that comes first by ``priority`` (default: declaration order - for a
    pipeline declared microbatch by microbatch, the oldest microbatch first, "finish what you
    started"). Time advances to the next task end."""
    declared = {t.name: k for k, t in enumerate(dag.tasks)}
    rank: Callable[[DagTask], Any] = priority or (lambda t: declared[t.name])
    preds = dag.predecessors()
    succ: dict[str, list[str]] = {t.name: [] for t in dag.tasks}
    for a, b in dag.edges:
        succ[a].append(b)
    tasks = dag.task_map
    missing = {n: len(p) for n, p in preds.items()}
    ready_at = dict.fromkeys(tasks, 0)
    ready: dict[str, list[str]] = {r: [] for r in dag.resources}
    for n, c in missing.items():
        if c == 0:
            ready[tasks[n].resource].append(n)
    free = dict.fromkeys(dag.resources, 0)
    starts: dict[str, int] = {}
    ends: list[tuple[int, str]] = []
    now = 0
    while len(starts) < len(tasks):
        for r in dag.resources:
            if free[r] > now:
                continue
            candidates = [n for n in ready[r] if ready_at[n] <= now]
            if not candidates:
                continue
            n = min(candidates, key=lambda x: rank(tasks[x]))
            ready[r].remove(n)
            starts[n] = now
            free[r] = now + tasks[n].duration
            heapq.heappush(ends, (free[r], n))
        if not ends:
            raise DagError("list scheduling is stuck: no task is running and none is ready")
        now = ends[0][0]
        while ends and ends[0][0] <= now:
            t, n = heapq.heappop(ends)
            for s in succ[n]:
                missing[s] -= 1
                ready_at[s] = max(ready_at[s], t)
                if missing[s] == 0:
                    ready[tasks[s].resource].append(s)
    return DagSchedule(dag, starts)


def interleaved_pipeline(
    devices: int = 4, chunks: int = 2, microbatches: int = 8, forward: int = 5, backward: int = 10
) -> Dag:
    """The interleaved 1F1B problem of docs/autosched.md: ``devices * chunks`` layers, layer ``l`` on device
    ``l % devices``; microbatch ``m`` runs ``F{m}.L0 .. F{m}.L{n-1}`` then ``B{m}.L{n-1} .. B{m}.L0``;
    each forward's activation lives until its backward ends. Declared microbatch by microbatch."""
    layers = devices * chunks
    tasks: list[DagTask] = []
    edges: list[tuple[str, str]] = []
    memory: list[Memory] = []
    for m in range(microbatches):
        for layer in range(layers):
            tasks.append(DagTask(f"F{m}.L{layer}", f"D{layer % devices}", forward))
            if layer:
                edges.append((f"F{m}.L{layer - 1}", f"F{m}.L{layer}"))
        for layer in reversed(range(layers)):
            tasks.append(DagTask(f"B{m}.L{layer}", f"D{layer % devices}", backward))
            edges.append((f"F{m}.L{layer}" if layer == layers - 1 else f"B{m}.L{layer + 1}", f"B{m}.L{layer}"))
            memory.append(Memory(f"F{m}.L{layer}", f"B{m}.L{layer}"))
    return Dag(tuple(tasks), tuple(edges), tuple(memory))
