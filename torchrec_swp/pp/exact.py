"""Exact mode: makespan-optimal PP programs with OR-Tools CP-SAT (imported on first use).

The problem is a one-shot DAG (``pp_dag``) solved by ``torchrec_swp.solve.cpsat.solve_dag``
(interval variables, NoOverlap per rank, a Cumulative per rank for activations): the same model
that reproduces the 285 of docs/autosched.md's interleaved example for the plan-level DAG, not a
second one. Per (stage, microbatch): ``F``, then ``B`` or (``split_backward``) ``I`` and ``W``;
edges ``F(s-1) -> F(s)``, ``F(S-1) -> B/I(S-1)``, ``B/I(s+1) -> B/I(s)``, ``I -> W``; an
activation is held from its ``F``'s start to the end of its ``B``/``W``. A cross-rank edge with
``latency > 0`` goes through a transfer task of that length on a resource of its own.

Per-rank activation caps ride on ``solve_dag``'s single ``memory_limit``: with ``L`` the least
common multiple of the caps, an activation on rank ``r`` weighs ``L / cap[r]``, so the shared
limit ``L`` allows exactly ``cap[r]`` of them on rank ``r``.

``solve`` returns the optimal per-rank compute orders as a program with P2P added
(``comm.add_p2p``), which ``validate`` accepts and ``simulate`` replays in exactly the solver's
makespan (ASAP replay of the optimal orders cannot be longer, nor shorter than the optimum).
ActionDurations must be integers (CP-SAT's); ``greedy`` is the list scheduler on the same DAG.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torchrec_swp.pp.actions import Action, B, F, I, Program, W, check_positive
from torchrec_swp.pp.comm import add_p2p
from torchrec_swp.pp.errors import PPError
from torchrec_swp.pp.simulate import ActionDurations
from torchrec_swp.solve.dag import Dag, DagSchedule, DagTask, Memory, list_schedule


def pp_dag(
    num_microbatches: int,
    placement: Sequence[int],
    durations: ActionDurations,
    *,
    split_backward: bool = False,
    activation_caps: int | Sequence[int] | None = None,
) -> tuple[Dag, int | None]:
    """The DAG of one step (module docstring) and the memory limit encoding the caps.

    Tasks are named by their action text (``0F3``) on resources ``rank0``...; declared microbatch
    by microbatch, forwards up the stages then backwards down (the list scheduler's priority).
    """
    check_positive(num_microbatches=num_microbatches)
    S = len(placement)
    R = max(placement) + 1
    caps = _caps(activation_caps, R)
    weight = [1] * R
    limit = None
    if caps is not None:
        limit = math.lcm(*caps)
        weight = [limit // c for c in caps]
    tasks: list[DagTask] = []
    edges: list[tuple[str, str]] = []
    memory: list[Memory] = []
    latency = _int(durations.latency, "latency")

    def task(a: Action) -> str:
        tasks.append(DagTask(str(a), f"rank{placement[a.stage]}", _int(durations.of(a), str(a))))
        return str(a)

    def edge(a: str, b: str, cross: bool) -> None:
        if cross and latency:
            link = f"{a}>{b}"
            tasks.append(DagTask(link, f"link:{link}", latency))
            edges.extend([(a, link), (link, b)])
        else:
            edges.append((a, b))

    back = I if split_backward else B
    for m in range(num_microbatches):
        for s in range(S):
            f = task(Action(s, F, m))
            if s:
                edge(str(Action(s - 1, F, m)), f, placement[s - 1] != placement[s])
        for s in reversed(range(S)):
            b = task(Action(s, back, m))
            if s == S - 1:
                edge(str(Action(s, F, m)), b, False)
            else:
                edge(str(Action(s + 1, back, m)), b, placement[s + 1] != placement[s])
            last = b
            if split_backward:
                last = task(Action(s, W, m))
                edges.append((b, last))
            memory.append(Memory(str(Action(s, F, m)), last, weight[placement[s]]))
    return Dag(tuple(tasks), tuple(edges), tuple(memory)), limit


@dataclass(frozen=True)
class ExactSolution:
    """The solver's program (P2P added), its makespan, whether that is proven optimal, the
    solver's wall time, and the peak activations per rank of the solved schedule."""

    program: Program
    makespan: int
    optimal: bool
    seconds: float
    peak_activations: tuple[int, ...]


def solve(
    num_microbatches: int,
    placement: Sequence[int],
    durations: ActionDurations,
    *,
    split_backward: bool = False,
    activation_caps: int | Sequence[int] | None = None,
    time_limit_s: float = 10.0,
    workers: int = 2,
    name: str = "Exact",
) -> ExactSolution:
    """Minimize the makespan of one step. Raises PPError when CP-SAT finds no schedule in time
    (or the caps make the step infeasible)."""
    from torchrec_swp.solve.cpsat import solve_dag

    dag, limit = pp_dag(
        num_microbatches, placement, durations, split_backward=split_backward, activation_caps=activation_caps
    )
    try:
        sol = solve_dag(dag, memory_limit=limit, minimize_memory=False, time_limit_s=time_limit_s, workers=workers)
    except RuntimeError as e:
        raise PPError(f"{name}: {e}") from None
    program = add_p2p(_orders(sol.schedule, num_microbatches, placement, name))
    return ExactSolution(program, sol.makespan, sol.makespan_optimal, sol.seconds, _peaks(sol.schedule, placement))


def greedy(
    num_microbatches: int, placement: Sequence[int], durations: ActionDurations, *, split_backward: bool = False
) -> tuple[Program, int]:
    """Greedy list scheduling of the same DAG (oldest microbatch first): program and makespan."""
    dag, _ = pp_dag(num_microbatches, placement, durations, split_backward=split_backward)
    schedule = list_schedule(dag)
    return add_p2p(_orders(schedule, num_microbatches, placement, "Greedy")), schedule.makespan


def _orders(schedule: DagSchedule, num_microbatches: int, placement: Sequence[int], name: str) -> Program:
    R = max(placement) + 1
    ranks = [[Action.from_text(n) for n in schedule.order(f"rank{r}")] for r in range(R)]
    return Program(name, num_microbatches, tuple(placement), tuple(map(tuple, ranks)))


def _peaks(schedule: DagSchedule, placement: Sequence[int]) -> tuple[int, ...]:
    # count activations, whatever their weight in the model
    unit = Dag(schedule.dag.tasks, schedule.dag.edges, tuple(Memory(m.start, m.end) for m in schedule.dag.memory))
    peaks = DagSchedule(unit, schedule.starts).peak_memory()
    return tuple(peaks.get(f"rank{r}", 0) for r in range(max(placement) + 1))


def _caps(caps: int | Sequence[int] | None, R: int) -> list[int] | None:
    if caps is None:
        return None
    out = [caps] * R if isinstance(caps, int) else list(caps)
    if len(out) != R or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in out):
        raise PPError(f"activation caps must be one int >= 1 or one per rank ({R}), got {caps!r}")
    return out


def _int(value: float, what: str) -> int:
    if value != int(value):
        raise PPError(f"exact mode needs integer durations: {what} is {value:g} (scale them)")
    return int(value)
