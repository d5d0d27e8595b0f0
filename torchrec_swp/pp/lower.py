"""Lowering one rank's program onto the engine's per-thread instruction lists. Pure.

``lower_rank(program, rank, threads)`` returns the engine's ``IterationProgram`` (one internal
iteration = one optimizer step of the rank) with ``run 0F3`` instructions on the threads that
``threads`` assigns (default: sends and receives on ``"comm"``, the rest on ``"default"``) and
the engine's existing ``wait``/``signal`` instructions, keyed by action text. Rules:

  1. Each thread runs its actions in the rank's program order. With every send and receive on
     one thread, each channel keeps its issue order (``validate`` rule 7).
  2. A data dependency between actions on two threads becomes ``signal X`` right after the
     producer ``X`` and ``wait X`` right before the consumer: a send waits for its compute,
     a compute for its receive (``run 1RF3`` stands for "receive and wait until it landed"),
     ``G`` for the stage's last ``B``/``W``, ``O`` for ``G``.
  3. A wait already implied by an earlier wait on the same thread (for a later action of the
     producer's thread) is left out; actions nobody waits for signal nothing.
  4. Only data dependencies cross threads: a receive runs as soon as its thread reaches it,
     whatever compute the program put before it (the comm thread's order is its posting
     order); a program's own ``RF``/``RB`` placement matters only for the receive thread.

``run 0F3`` is ``RunAction``, the one IR addition this needs (compile/program.py's ``Run`` runs
a plan task for batch ``P - stage``; a PP action names its stage and microbatch itself): see
``RunAction``. ``replay`` runs the lowered threads in a tiny interpreter (receives land at
once) and returns the order actions ran in, or raises PPError when a thread would block
forever: the check that lowering keeps every dependency and adds no deadlock within a rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torchrec_swp.compile.program import IterationProgram, Signal, WaitTask
from torchrec_swp.plan import MAIN_THREAD
from torchrec_swp.pp.actions import P2P, RB, RF, WEIGHT_GRAD, Action, B, E, F, G, I, Kind, Program
from torchrec_swp.pp.errors import PPError

COMM_THREAD = "comm"


@dataclass(frozen=True, slots=True)
class RunAction:
    """Proposed engine instruction: call the binding of ``action.kind`` with
    ``(action.stage, action.microbatch)``; when done, the action's text is its completion key
    (what ``wait``/``signal`` name). Roughly: ``run 0F3`` = "forward stage 0, microbatch 3"."""

    action: Action

    def __str__(self) -> str:
        return f"run {self.action}"


def default_threads(a: Action) -> str:
    """Sends and receives on ``"comm"``, everything else on the calling thread."""
    return COMM_THREAD if a.kind in P2P else MAIN_THREAD


def lower_rank(
    program: Program, rank: int, threads: Mapping[str, str] | Callable[[Action], str] | None = None
) -> IterationProgram:
    """Per-thread instructions for ``rank`` (module rules 1-4). ``threads``: a callable, or a
    mapping from kind text (``"SF"``, ``"G"``...) to thread name (unlisted kinds: default)."""
    if not 0 <= rank < program.num_ranks:
        raise PPError(f"rank {rank} does not exist (the program has {program.num_ranks} ranks)", rank=rank)
    if threads is None:
        thread_of: Callable[[Action], str] = default_threads
    elif callable(threads):
        thread_of = threads
    else:
        mapping = dict(threads)
        thread_of = lambda a: mapping.get(a.kind.value, MAIN_THREAD)
    actions = program.ranks[rank]
    where = {a: (thread_of(a), k) for k, a in enumerate(actions)}
    position: dict[Action, int] = {}  # index of each action within its thread
    count: dict[str, int] = {MAIN_THREAD: 0}
    for a in actions:
        t = where[a][0]
        position[a] = count.get(t, 0)
        count[t] = position[a] + 1
    waits: dict[Action, list[Action]] = {}
    signalled: set[Action] = set()
    covered: dict[tuple[str, str], int] = {}  # (consumer thread, producer thread) -> last position waited for
    for a in actions:
        t = where[a][0]
        for p in _producers(program, a, where):
            u = where[p][0]
            if u == t or covered.get((t, u), -1) >= position[p]:
                continue
            covered[(t, u)] = position[p]
            waits.setdefault(a, []).append(p)
            signalled.add(p)
    per_thread: dict[str, list[object]] = {t: [] for t in count}
    for a in actions:
        instrs = per_thread[where[a][0]]
        instrs += [WaitTask(str(p)) for p in waits.get(a, ())]
        instrs.append(RunAction(a))
        if a in signalled:
            instrs.append(Signal(str(a)))
    return IterationProgram(
        program.stages_of(rank),
        tuple((t, tuple(instrs)) for t, instrs in per_thread.items()),  # type: ignore[misc]
    )


def _producers(program: Program, a: Action, here: Mapping[Action, object]) -> list[Action]:
    """``a``'s inputs that run on the same rank, in program order."""
    s, m = a.stage, a.microbatch
    match a.kind:
        case Kind.SEND_F:
            cands = [Action(s, F, m)]
        case Kind.SEND_B:
            cands = [Action(s, B, m), Action(s, I, m)]
        case Kind.FORWARD:
            cands = [Action(s, RF, m), Action(s, E, m)] + ([Action(s - 1, F, m)] if s > 0 else [])
        case Kind.BACKWARD | Kind.BACKWARD_INPUT:
            cands = [Action(s, F, m), Action(s, RB, m), Action(s + 1, B, m), Action(s + 1, I, m)]
        case Kind.BACKWARD_WEIGHT:
            cands = [Action(s, I, m)]
        case Kind.GRAD_SYNC:
            cands = [x for x in here if isinstance(x, Action) and x.stage == s and x.kind in WEIGHT_GRAD]
        case Kind.STEP:
            sync = Action(s, G)
            grads = [x for x in here if isinstance(x, Action) and x.stage == s and x.kind in WEIGHT_GRAD]
            cands = [sync] if sync in here else grads
        case Kind.RECV_F | Kind.RECV_B | Kind.SPARSE:
            cands = []
        case _:
            raise PPError(f"cannot lower {a}", action=str(a))
    order = list(here)
    return sorted((c for c in cands if c in here), key=order.index)


def replay(lowered: IterationProgram) -> list[str]:
    """Run the threads (any runnable one, lowest first; receives land at once) and return the
    actions in the order they ran. Raises PPError naming each blocked thread's instruction."""
    pcs = {t: 0 for t, _ in lowered.threads}
    done: set[str] = set()
    ran: list[str] = []
    progress = True
    while progress:
        progress = False
        for t, instrs in lowered.threads:
            while pcs[t] < len(instrs):
                i = instrs[pcs[t]]
                if isinstance(i, WaitTask):
                    if i.task not in done:
                        break
                elif isinstance(i, Signal):
                    done.add(i.task)
                elif isinstance(i, RunAction):
                    ran.append(str(i.action))
                else:
                    raise PPError(f"unknown instruction {i!r} on thread {t}")
                pcs[t] += 1
                progress = True
    blocked = [f"thread {t} at `{instrs[pcs[t]]}`" for t, instrs in lowered.threads if pcs[t] < len(instrs)]
    if blocked:
        raise PPError("lowered program blocks forever: " + "; ".join(blocked))
    return ran
