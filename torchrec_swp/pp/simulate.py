"""Replay every rank of a program together, with durations: the test oracle for programs.

``simulate(program, durations)`` returns per-rank timelines, the makespan, the bubble fraction
and the peak of live activations per rank, or raises ``PPDeadlock`` naming each stuck rank's
action and what it waits for. Semantics, rules:

  1. A rank runs its actions in order, one at a time, each as early as its inputs allow; an
     action occupies the rank for its duration (``ActionDurations``).
  2. A compute action waits for its inputs: the actions it needs on its own rank (which must
     have run: a later one is never waited for, that is a deadlock), and the data of a
     cross-rank input. In a program with P2P, that input arrives through its receive:
     ``latency`` after both the send and the receive are posted. In a compute-only program
     it arrives ``latency`` after the producer ends (no P2P actions needed).
  3. ``comm="async"`` (default; torch's runtime and Maglev: isend/irecv): posting a send or a
     receive never blocks. ``comm="rendezvous"`` (synchronous P2P): a run of consecutive P2P
     actions is one batch (``batch_isend_irecv``); the rank waits at the batch until every
     operation in it has met its partner and transferred. Sends and receives meet by their
     labels (``0SF1`` with ``1RF1``): in rendezvous mode, two ranks that issue one channel's
     operations in different orders deadlock (``validate`` rule 7 rejects such programs).
  4. ``lazy_init=True``: the first operation of each side of a channel (sender rank, receiver
     rank, direction) blocks until the other side has reached its own first one (a 2-rank
     communicator created on first use, as NCCL does; Maglev's note on gradient receives).
  5. Live activations of a rank: a (stage, microbatch) is live from the start of its first
     ``E``/``F`` to the end of its last ``B``/``W`` (freed before allocated at equal times).
  6. Bubble fraction: ``1 - sum(busy) / (ranks * makespan)``, ``busy`` a rank's summed action
     durations (waiting excluded).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Literal

from torchrec_swp.pp.actions import COMPUTE, P2P, SENDS, WEIGHT_GRAD, Action, B, E, F, I, Kind, Program
from torchrec_swp.pp.errors import PPDeadlock, PPError, Stuck
from torchrec_swp.pp.grid import format_grid, format_ticks
from torchrec_swp.solve.replay import peak_held, sweep

Comm = Literal["async", "rendezvous"]


@dataclass(frozen=True, slots=True)
class ActionDurations:
    """How long each kind of action occupies its rank; ``latency`` is a transfer's flight time.
    ``stage_scale[s]`` multiplies stage ``s``'s compute (unbalanced stages; default 1).
    Text form (``str``/``ActionDurations.from_text``): ``F=1 E=1 B=2 I=1 W=1 P2P=0 G=0 O=0 latency=0``."""

    F: float = 1.0
    E: float = 1.0
    B: float = 2.0
    I: float = 1.0  # noqa: E741 - the action letters (Kind) name the fields, as in the text form
    W: float = 1.0
    P2P: float = 0.0
    G: float = 0.0
    O: float = 0.0  # noqa: E741
    latency: float = 0.0
    stage_scale: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "stage_scale":
                continue
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise PPError(f"duration {f.name} must be a number >= 0, got {v!r}")
        object.__setattr__(self, "stage_scale", tuple(self.stage_scale))

    def of(self, a: Action) -> float:
        if a.kind in P2P:
            return self.P2P
        base = getattr(self, a.kind.value)
        if a.kind in COMPUTE and a.stage < len(self.stage_scale):
            return base * self.stage_scale[a.stage]
        return base

    def __str__(self) -> str:
        parts = [f"{f.name}={getattr(self, f.name):g}" for f in fields(self) if f.name != "stage_scale"]
        if self.stage_scale:
            parts.append("stage_scale=" + ",".join(f"{x:g}" for x in self.stage_scale))
        return " ".join(parts)

    @staticmethod
    def from_text(text: str) -> ActionDurations:
        kv: dict[str, object] = {}
        names = {f.name for f in fields(ActionDurations)}
        for part in text.split():
            key, sep, value = part.partition("=")
            if not sep or key not in names or not re.match(r"[0-9.,e+-]+\Z", value):
                raise PPError(f"bad duration {part!r}: expected NAME=NUMBER with NAME in {sorted(names)}")
            kv[key] = tuple(float(x) for x in value.split(",")) if key == "stage_scale" else float(value)
        # (the ignore below: names checked against the fields and values parsed just above)
        return ActionDurations(**kv)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Span:
    """``action`` occupied (or, for P2P in rendezvous mode and first uses, blocked) its rank
    from ``start`` to ``end``."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class ProgramSimResult:
    program: Program
    durations: ActionDurations
    timelines: tuple[tuple[Span, ...], ...]
    makespan: float
    busy: tuple[float, ...]
    peak_activations: tuple[int, ...]

    @property
    def bubble(self) -> float:
        """Share of rank time spent idle (rule 6)."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)

    def grid(self, tick: float = 1.0) -> str:
        """Rank x tick text grid of what runs when (``grid.format_ticks``)."""
        return format_ticks([[(str(s.action), s.start, s.end) for s in t] for t in self.timelines], tick)

    def summary(self) -> str:
        peaks = ",".join(map(str, self.peak_activations))
        return f"makespan {self.makespan:g}, bubble {self.bubble:.4f}, peak activations {peaks}"


def simulate(
    program: Program, durations: ActionDurations | None = None, *, comm: Comm = "async", lazy_init: bool = False
) -> ProgramSimResult:
    """Replay ``program`` (module rules 1-6). Raises PPDeadlock, or PPError for a program whose
    receives have no send (run ``validate`` first for a full diagnosis)."""
    if comm not in ("async", "rendezvous"):
        raise PPError(f"comm must be 'async' or 'rendezvous', got {comm!r}")
    return _Replay(program, durations or ActionDurations(), comm, lazy_init).run()


class _Replay:
    def __init__(self, program: Program, d: ActionDurations, comm: Comm, lazy_init: bool) -> None:
        self.p, self.d, self.comm, self.lazy = program, d, comm, lazy_init
        R = program.num_ranks
        self.pc = [0] * R
        self.clock = [0.0] * R
        self.spans: list[list[Span]] = [[] for _ in range(R)]
        self.end: dict[Action, float] = {}
        self.reached: dict[Action, float] = {}  # P2P: when its rank arrived at it
        self.posted: dict[Action, float] = {}  # P2P: when its post completed
        self.with_p2p = program.has_p2p()
        self.where: dict[Action, tuple[int, int]] = {
            a: (r, k) for r, acts in enumerate(program.ranks) for k, a in enumerate(acts)
        }
        # rule 4: the first operation of each side of each channel
        self.first: dict[Action, Action | None] = {}
        seen: dict[tuple[int, int, str, bool], Action] = {}
        for r, acts in enumerate(program.ranks):
            for a in acts:
                if a.kind in P2P:
                    peer = program.rank_of(a.peer_stage) if 0 <= a.peer_stage < program.num_stages else -1
                    key = (r, peer, a.direction, a.kind in SENDS) if a.kind in SENDS else (peer, r, a.direction, False)
                    seen.setdefault(key, a)
        for (src, dst, d_, is_send), a in seen.items():
            other = seen.get((src, dst, d_, not is_send))
            self.first[a] = other

    # ------------------------------------------------------------------ driver
    def run(self) -> ProgramSimResult:
        R = self.p.num_ranks
        sweep(range(R), lambda r: self.pc[r] < len(self.p.ranks[r]) and self._step(r) is None)
        if any(self.pc[r] < len(self.p.ranks[r]) for r in range(R)):
            raise self._deadlock()
        makespan = max(self.clock, default=0.0)
        busy = tuple(sum(self.d.of(s.action) for s in spans) for spans in self.spans)
        return ProgramSimResult(self.p, self.d, tuple(tuple(s) for s in self.spans), makespan, busy, self._peaks())

    def _step(self, r: int) -> str | None:
        """Run rank ``r``'s next action (or P2P batch); None on success, else what it waits for."""
        a = self.p.ranks[r][self.pc[r]]
        if a.kind in P2P:
            return self._p2p(r)
        ready = self.clock[r]
        for need, when in self._inputs(a):
            if when is None:
                return need
            ready = max(ready, when)
        self._run(r, a, ready, ready + self.d.of(a))
        return None

    def _run(self, r: int, a: Action, start: float, end: float) -> None:
        self.spans[r].append(Span(a, start, end))
        self.end[a] = end
        self.clock[r] = end
        self.pc[r] += 1

    # ------------------------------------------------------------------ compute inputs
    def _inputs(self, a: Action) -> list[tuple[str, float | None]]:
        """(what, when available or None) for each input of compute action ``a`` (rule 2)."""
        p, s, m = self.p, a.stage, a.microbatch
        out: list[tuple[str, float | None]] = []
        here = p.rank_of(s)

        def local(x: Action) -> None:
            if x in self.where:
                out.append((f"{x} (later on this rank)", self.end.get(x)))

        def remote(producer: list[Action], recv: Action) -> None:
            if self.with_p2p:
                if recv not in self.where:
                    raise PPError(f"{a} needs {recv}, which the program does not have", action=str(a))
                send = recv.matching()
                if recv not in self.posted:
                    out.append((f"{recv} (later on this rank)", None))
                elif send not in self.posted:
                    out.append((f"{send} on rank {p.rank_of(send.stage)}", None))
                else:
                    out.append((str(send), max(self.posted[send], self.posted[recv]) + self.d.latency))
            else:
                x = next((x for x in producer if x in self.where), producer[0])
                t = self.end.get(x)
                out.append((f"{x} on rank {p.rank_of(x.stage)}", None if t is None else t + self.d.latency))

        match a.kind:
            case Kind.FORWARD:
                local(Action(s, E, m))
                if s > 0:
                    up = Action(s - 1, F, m)
                    local(up) if p.rank_of(s - 1) == here else remote([up], Action(s, Kind.RECV_F, m))
            case Kind.BACKWARD | Kind.BACKWARD_INPUT:
                local(Action(s, F, m))
                if s < p.num_stages - 1:
                    downs = [Action(s + 1, B, m), Action(s + 1, I, m)]
                    if p.rank_of(s + 1) == here:
                        for x in downs:
                            local(x)
                    else:
                        remote(downs, Action(s, Kind.RECV_B, m))
            case Kind.BACKWARD_WEIGHT:
                local(Action(s, I, m))
            case Kind.SPARSE | Kind.GRAD_SYNC | Kind.STEP:
                pass
            case _:
                raise PPError(f"cannot simulate {a}", action=str(a))
        return out

    # ------------------------------------------------------------------ P2P
    def _p2p(self, r: int) -> str | None:
        acts = self.p.ranks[r]
        k = self.pc[r]
        batch = [acts[k]]
        if self.comm == "rendezvous":
            while k + len(batch) < len(acts) and acts[k + len(batch)].kind in P2P:
                batch.append(acts[k + len(batch)])
        t = self.clock[r]
        for a in batch:
            self.reached.setdefault(a, t)
        for a in batch:  # producers of sends must have run (they are earlier on this rank)
            if a.kind in SENDS:
                prod = [x for x in _producers(a) if x in self.where]
                if not prod or prod[0] not in self.end:
                    return f"{prod[0] if prod else 'a producer'} (later on this rank)"
        # rule 4: a first use waits for the peer's first use
        start = t
        for a in batch:
            if self.lazy and a in self.first:
                other = self.first[a]
                if other is None:
                    return f"the first operation of rank {self._peer(a)} on this channel (it has none)"
                if other not in self.reached:
                    return f"{other} (first use of the channel) on rank {self._peer(a)}"
                start = max(start, self.reached[other])
        end = start
        for a in batch:
            end += self.d.of(a)
            self.posted.setdefault(a, end)
        if self.comm == "rendezvous":
            for a in batch:
                other = a.matching()
                if other not in self.posted:
                    return f"{other} on rank {self._peer(a)}"
                end = max(end, max(self.posted[a], self.posted[other]) + self.d.latency)
        for a in batch:
            self.spans[r].append(Span(a, self.reached[a], end if self.comm == "rendezvous" else self.posted[a]))
            self.end[a] = end
        self.clock[r] = end
        self.pc[r] += len(batch)
        return None

    def _peer(self, a: Action) -> str:
        s = a.peer_stage
        return str(self.p.rank_of(s)) if 0 <= s < self.p.num_stages else "?"

    # ------------------------------------------------------------------ results
    def _deadlock(self) -> PPDeadlock:
        stuck = []
        for r, acts in enumerate(self.p.ranks):
            if self.pc[r] < len(acts):
                why = self._step(r) or "nothing (it could run)"
                stuck.append(Stuck(r, self.pc[r], str(acts[self.pc[r]]), why))
        marked = stuck[0]
        lines = "\n".join(f"  {s}" for s in stuck)
        grid = format_grid(self.p, (marked.rank, marked.step))
        return PPDeadlock(
            f"{self.p.name}: deadlock ({self.comm} P2P{', lazy channel init' if self.lazy else ''}): "
            f"no rank can proceed\n{lines}\n\n{grid}",
            tuple(stuck),
        )

    def _peaks(self) -> tuple[int, ...]:
        born: dict[tuple[int, int], float] = {}
        dead: dict[tuple[int, int], float] = {}
        for spans in self.spans:
            for sp in spans:
                a = sp.action
                if a.microbatch is None:
                    continue
                key = (a.stage, a.microbatch)
                if a.kind in (E, F):
                    born[key] = min(born.get(key, sp.start), sp.start)
                elif a.kind in WEIGHT_GRAD:
                    dead[key] = max(dead.get(key, sp.end), sp.end)
        events: list[list[tuple[float, int]]] = [[] for _ in self.p.ranks]
        for key, t in born.items():
            r = self.p.rank_of(key[0])
            events[r].append((t, 1))
            events[r].append((dead.get(key, float("inf")), -1))
        return tuple(peak_held(ev) for ev in events)


def _producers(send: Action) -> list[Action]:
    s, m = send.stage, send.microbatch
    return [Action(s, F, m)] if send.kind is Kind.SEND_F else [Action(s, B, m), Action(s, I, m)]
