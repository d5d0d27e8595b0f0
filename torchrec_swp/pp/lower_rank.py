"""Lowering one rank's program onto the engine's per-thread instruction lists. Pure.

``lower_rank(program, rank, threads)`` returns the engine's ``IterationProgram`` (one internal
iteration = one optimizer step of the rank) with ``run 0F3`` instructions on the threads that
``threads`` assigns (default: sends and receives on ``"comm"``, the rest on ``"default"``) and
the engine's existing ``wait``/``signal`` instructions, keyed by action text. Rules:

  1. Each thread runs its actions in the rank's program order. With every send and receive on
     one thread, each channel keeps its issue order (``validate`` rule 7).
  2. A data dependency between actions on two threads becomes ``signal X`` right after the
     producer ``X`` and ``wait X`` right before the consumer: a send waits for its compute,
     a compute for its receive (``run 1RF3`` posts the receive; its consumer awaits the data),
     ``G`` for the stage's last ``B``/``W``, ``O`` for ``G``.
  3. A wait already implied by an earlier wait on the same thread (for a later action of the
     producer's thread) is left out; actions nobody waits for signal nothing.
  4. Only data dependencies cross threads: a receive runs as soon as its thread reaches it,
     whatever compute the program put before it (the comm thread's order is its posting
     order); a program's own ``RF``/``RB`` placement matters only for the receive thread.

  5. Collectives take tickets: actions whose kind ``comm_groups`` maps to a group (default: ``G``
     on ``"dp"``) are numbered in program order, ``run 0G #0@dp``, when that group's actions
     run on more than one thread (one thread already issues them in program order; the plan
     compiler's rule). The engine's turnstile then makes every rank issue them in that order.

``run 0F3`` is ``compile.program.RunAction``, the one IR addition this needs (``Run`` runs a
plan task for batch ``P - stage``; a PP action names its stage and microbatch itself); the
engine that runs it is ``torchrec_swp.engine.ProgramEngine`` (``run_program``). ``replay`` runs
the lowered threads in a tiny interpreter (receives land at once) and returns the order actions
ran in, or raises PPError when a thread would block forever: the check that lowering keeps every
dependency and adds no deadlock within a rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torchrec_swp.compile.program import Instr, IterationProgram, RunAction, Signal, WaitTask
from torchrec_swp.plan import MAIN_THREAD
from torchrec_swp.pp.actions import P2P, RB, RF, WEIGHT_GRAD, Action, B, E, F, G, I, Kind, Program
from torchrec_swp.pp.errors import PPError

COMM_THREAD = "comm"


DEFAULT_COMM_GROUPS: Mapping[str, str] = {"G": "dp"}


def run_action(a: Action, ticket: int | None = None, comm_group: str | None = None) -> RunAction:
    """The engine instruction of ``a``: ``run 0F3``; roughly, "forward stage 0, microbatch 3"."""
    return RunAction(str(a), a.kind.value, a.stage, a.microbatch, ticket, comm_group)


def default_threads(a: Action) -> str:
    """Sends and receives on ``"comm"``, everything else on the calling thread."""
    return COMM_THREAD if a.kind in P2P else MAIN_THREAD


def lower_rank(
    program: Program,
    rank: int,
    threads: Mapping[str, str] | Callable[[Action], str] | None = None,
    *,
    comm_groups: Mapping[str, str] = DEFAULT_COMM_GROUPS,
) -> IterationProgram:
    """Per-thread instructions for ``rank`` (module rules 1-5). ``threads``: a callable, or a
    mapping from kind text (``"SF"``, ``"G"``...) to thread name (unlisted kinds: default).
    ``comm_groups``: kind text -> comm group of its collectives (rule 5)."""
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
    members: dict[str, list[Action]] = {}  # comm group -> its actions, in program order
    for a in actions:
        group = comm_groups.get(a.kind.value)
        if group is not None:
            members.setdefault(group, []).append(a)
    ticketed: dict[Action, tuple[int, str]] = {}
    tickets: list[tuple[str, int]] = []
    for group, acts in members.items():
        if len({where[a][0] for a in acts}) > 1:
            ticketed.update({a: (k, group) for k, a in enumerate(acts)})
            tickets.append((group, len(acts)))
    per_thread: dict[str, list[Instr]] = {t: [] for t in count}
    for a in actions:
        instrs = per_thread[where[a][0]]
        instrs += [WaitTask(str(p)) for p in waits.get(a, ())]
        instrs.append(run_action(a, *ticketed.get(a, (None, None))))
        if a in signalled:
            instrs.append(Signal(str(a)))
    return IterationProgram(
        program.stages_of(rank), tuple((t, tuple(instrs)) for t, instrs in per_thread.items()), tuple(tickets)
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
                    ran.append(i.action)
                else:
                    raise PPError(f"unknown instruction {i!r} on thread {t}")
                pcs[t] += 1
                progress = True
    blocked = [f"thread {t} at `{instrs[pcs[t]]}`" for t, instrs in lowered.threads if pcs[t] < len(instrs)]
    if blocked:
        raise PPError("lowered program blocks forever: " + "; ".join(blocked))
    return ran
