"""Lower bounds on the steady-state iteration time.

``plan_bounds(plan, durations)`` bounds one plan; ``search_bounds(problem)`` bounds every plan
the search may propose for a problem (what its efficiency is measured against). Each bound is
valid for any schedule that runs every task once per iteration:

* ``thread`` / ``stream`` / ``comm``: a resource does one thing at a time - a CPU thread runs
  its tasks, a stream its device work, a comm group its collectives (serialized by tickets
  even on different threads and streams): the period is at least the resource's load.
  ``search_bounds`` uses the total CPU load over ``max_threads`` threads and the longest task.
* ``cycle``: a dependency cycle across iterations with total distance ``D`` fits in ``D``
  periods: the period is at least the cycle's duration over ``D`` (the maximum cycle ratio,
  found by Lawler's parametric search).
* ``latency``: one batch's critical path of CPU calls (same-batch dependencies) spans at most as
  many periods as there are batches in flight (the iteration barrier holds the CPU calls of a
  batch within its stages' iterations). Device time is not in it: nothing on the CPU waits for a
  batch's device work, which may finish periods later (streams pipeline; the ``stream`` bound
  covers their load).
* ``iteration``: the engine's iteration barrier: dependencies whose producer runs in the same
  iteration (``lead == 0``) form a chain inside one iteration. For a plan, with its stages; for
  the search, the chain the anchors form (they all sit at the highest stage).

The binding bound is the largest; ``BoundReport.format`` says which it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torchrec_swp.autosched.problem import Problem
from torchrec_swp.plan import DEFAULT_STREAM, Dep, PipelinePlan


@dataclass(frozen=True, slots=True)
class Bound:
    """``value`` bounds the iteration time from below because of ``what`` (of ``kind``)."""

    kind: str
    what: str
    value: float


@dataclass(frozen=True)
class BoundReport:
    """Every bound computed, largest first. ``value`` is the binding (largest) one."""

    bounds: tuple[Bound, ...]

    @property
    def binding(self) -> Bound:
        return self.bounds[0]

    @property
    def value(self) -> float:
        return self.bounds[0].value

    def format(self, scale: float = 1.0, unit: str = "") -> str:
        """One line per bound, ``*`` on the binding one; times multiplied by ``scale``."""
        lines = [f"lower bound {self.value * scale:.4g}{unit}: {self.binding.kind} {self.binding.what} binds"]
        for b in self.bounds:
            mark = "*" if b is self.binding else " "
            lines.append(f" {mark} {b.value * scale:>10.4g}{unit}  {b.kind:<9} {b.what}")
        return "\n".join(lines)


def _report(bounds: list[Bound]) -> BoundReport:
    return BoundReport(tuple(sorted(bounds, key=lambda b: (-b.value, b.kind, b.what))))


def plan_bounds(
    plan: PipelinePlan, durations: Mapping[str, float], device_durations: Mapping[str, float] | None = None
) -> BoundReport:
    """Lower bounds for ``plan`` as it stands (its threads, streams, stages and batches in flight)."""
    # steady state: a task guarded to run once per epoch costs nothing there
    steady = {t for t in plan.fire_order if plan.task(t).when.in_steady_state}
    cpu = {t: float(durations[t]) if t in steady else 0.0 for t in plan.fire_order}
    device = {t: float(v) if t in steady else 0.0 for t, v in (device_durations or {}).items()}
    out: list[Bound] = []
    for g in plan.thread_groups:
        out.append(Bound("thread", g, sum(cpu[t] for t in plan.fire_order if plan.task(t).thread_group == g)))
    if device:
        for s in plan.streams:
            load = sum(device.get(t, 0.0) for t in plan.fire_order if plan.task(t).stream == s)
            if load > 0:
                out.append(Bound("stream", s, load))
    out.extend(_comm_bounds(plan, cpu))
    out.extend(_cycle_bound(plan, cpu))
    in_flight = plan.max_stage + 1
    out.append(
        Bound("latency", f"one batch's critical path / {in_flight} in flight", _latency(plan, cpu) / in_flight)
    )
    stage = {t: plan.task(t).stage for t in plan.fire_order}
    same = [
        d for d in plan.deps if stage[d.consumer] - stage[d.producer] + d.distance == 0 and d.consumer != d.producer
    ]
    if plan.on_exhausted == "stop" and plan.source is not None:
        src = plan.source
        same += [Dep(t, src) for t in plan.fire_order[plan.fire_index(src) + 1 :]]  # they wait for the source
    length, chain = _longest_chain(list(plan.fire_order), same, cpu)
    out.append(Bound("iteration", "same-iteration chain " + " -> ".join(chain), length))
    return _report(out)


def search_bounds(problem: Problem) -> BoundReport:
    """Lower bounds valid for every plan ``beam_search`` or ``solve_periodic`` may propose."""
    plan = problem.plan
    cpu = dict(zip(problem.tasks, problem.cpu, strict=True))
    device = {
        t: float(v) if problem.plan.task(t).when.in_steady_state else 0.0
        for t, v in (problem.device_durations or {}).items()
    }
    total = sum(cpu.values())
    out = [
        Bound("thread", f"total CPU time / {problem.max_threads} threads", total / problem.max_threads),
        Bound("thread", f"longest task {max(cpu, key=cpu.__getitem__)}", max(cpu.values())),
    ]
    if device:
        anchors = sum(device.get(t, 0.0) for t in problem.anchors)
        if anchors > 0:
            out.append(Bound("stream", f"{DEFAULT_STREAM} (anchors' device time)", anchors))
        out.append(
            Bound(
                "stream", f"device time / {len(problem.streams)} streams", sum(device.values()) / len(problem.streams)
            )
        )
    out.extend(_comm_bounds(plan, cpu))
    out.extend(_cycle_bound(plan, cpu))
    out.append(
        Bound(
            "latency",
            f"one batch's critical path / {problem.max_in_flight} in flight",
            _latency(plan, cpu) / problem.max_in_flight,
        )
    )
    forced = _forced_to_the_top(problem)
    same = [d for d in plan.deps if d.distance == 0 and d.consumer in forced and d.producer in forced]
    if forced:
        length, chain = _longest_chain([t for t in plan.fire_order if t in forced], same, cpu)
        out.append(Bound("iteration", "anchor chain " + " -> ".join(chain), length))
    return _report(out)


# ------------------------------------------------------------------ helpers
def _comm_bounds(plan: PipelinePlan, cpu: Mapping[str, float]) -> list[Bound]:
    groups: dict[str, float] = {}
    for t in plan.fire_order:
        g = plan.task(t).comm_group
        if g is not None:
            groups[g] = groups.get(g, 0.0) + cpu[t]
    return [Bound("comm", g, load) for g, load in groups.items()]


def _latency(plan: PipelinePlan, cpu: Mapping[str, float]) -> float:
    """One batch's critical path of CPU calls through same-batch dependencies (a task's call
    follows its producers' calls)."""
    before: dict[str, list[str]] = {t: [] for t in plan.fire_order}
    for d in plan.deps:
        if d.distance == 0:
            before[d.consumer].append(d.producer)
    cpu_end: dict[str, float] = {}
    for t in _topological(plan.fire_order, before):
        cpu_end[t] = max((cpu_end[p] for p in before[t]), default=0.0) + cpu[t]
    return max(cpu_end.values())


def _topological(tasks: Sequence[str], before: Mapping[str, list[str]]) -> list[str]:
    out: list[str] = []
    done: set[str] = set()

    def visit(t: str) -> None:
        if t in done:
            return
        done.add(t)
        for p in before[t]:
            visit(p)
        out.append(t)

    for t in tasks:
        visit(t)
    return out


def _longest_chain(tasks: Sequence[str], deps: Sequence[Dep], cpu: Mapping[str, float]) -> tuple[float, list[str]]:
    """The longest path (sum of CPU times) along ``deps`` (acyclic) among ``tasks``."""
    before: dict[str, list[str]] = {t: [] for t in tasks}
    for d in deps:
        if d.consumer in before and d.producer in before:
            before[d.consumer].append(d.producer)
    end: dict[str, float] = {}
    via: dict[str, str | None] = {}
    for t in _topological(tasks, before):
        prev = max(before[t], key=lambda p: end[p], default=None)
        end[t] = (end[prev] if prev is not None else 0.0) + cpu[t]
        via[t] = prev
    last = max(end, key=end.__getitem__)
    chain = [last]
    while (prev := via[chain[-1]]) is not None:
        chain.append(prev)
    return end[last], chain[::-1]


def _forced_to_the_top(problem: Problem) -> set[str]:
    """The anchors and every task that consumes one of them in the same batch (transitively):
    such a task can be neither ahead of its producer nor above the highest stage."""
    forced = set(problem.anchors)
    grew = True
    while grew:
        grew = False
        for d in problem.plan.deps:
            if d.distance == 0 and d.producer in forced and d.consumer not in forced:
                forced.add(d.consumer)
                grew = True
    return forced


def _cycle_bound(plan: PipelinePlan, cpu: Mapping[str, float]) -> list[Bound]:
    """The maximum cycle ratio (sum of CPU times / sum of distances) over dependency cycles,
    with the cycle that attains it; none when the dependencies have no cycle."""
    nodes = list(plan.fire_order)
    edges = [(d.producer, d.consumer, d.distance) for d in plan.deps]
    if _positive_cycle(nodes, edges, cpu, -1.0) is None:
        return []
    lo, hi = 0.0, sum(cpu.values()) + 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if _positive_cycle(nodes, edges, cpu, mid) is not None:
            lo = mid
        else:
            hi = mid
    cycle = _positive_cycle(nodes, edges, cpu, lo - 1e-9 * (1 + lo))
    assert cycle is not None  # a positive cycle exists below the ratio found
    tasks, distance = cycle
    first = min(range(len(tasks)), key=lambda k: plan.fire_index(tasks[k]))
    tasks = tasks[first:] + tasks[:first]  # start the cycle at its first task in fire order
    value = sum(cpu[t] for t in tasks) / distance
    return [Bound("cycle", f"{' -> '.join([*tasks, tasks[0]])} (distance {distance})", value)]


def _positive_cycle(
    nodes: list[str], edges: list[tuple[str, str, int]], cpu: Mapping[str, float], ratio: float
) -> tuple[list[str], int] | None:
    """A cycle whose ``sum(cpu) - ratio * sum(distance)`` is positive (Bellman-Ford on the
    longest path), as ``(tasks in dependency order, total distance)``; None if there is none."""
    dist = dict.fromkeys(nodes, 0.0)
    pred: dict[str, tuple[str, int] | None] = dict.fromkeys(nodes, None)
    updated: str | None = None
    for _ in range(len(nodes)):
        updated = None
        for u, v, k in edges:
            w = cpu[u] - ratio * k
            if dist[u] + w > dist[v] + 1e-12:
                dist[v] = dist[u] + w
                pred[v] = (u, k)
                updated = v
        if updated is None:
            return None
    assert updated is not None  # relaxed in every one of len(nodes) rounds: a positive cycle
    node: str = updated
    for _ in range(len(nodes)):
        step = pred[node]
        assert step is not None
        node = step[0]
    cycle: list[str] = [node]
    distance, cur = 0, node
    while True:
        step = pred[cur]
        assert step is not None
        cur, k = step
        distance += k
        if cur == node:
            break
        cycle.append(cur)
    return cycle[::-1], distance
