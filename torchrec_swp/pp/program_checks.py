"""Static checks of a program: what must hold before anything runs.

``validate(program)`` raises ``PPError`` naming rank, step and action, with the program grid
appended and the culprit cell marked ``>...<``. Rules, in the order they are checked:

  1. Every action's stage exists and lives on the rank that runs it; microbatches are
     ``< num_microbatches``.
  2. No action appears twice.
  3. Every stage runs, for every microbatch, one ``F`` and either one ``B`` or one ``I`` and
     one ``W``; ``E`` for all microbatches of a stage or for none.
  4. On its rank: ``E`` before its ``F``, ``F`` before its ``B``/``I``, ``I`` before its ``W``,
     and an input from a stage on the same rank before its consumer (``F`` of ``s - 1`` before
     ``F`` of ``s``; ``B``/``I`` of ``s + 1`` before ``B``/``I`` of ``s``).
  5. A send follows its producer (``sSF m`` after ``sF m``, ``sSB m`` after ``sB``/``sI m``); a
     receive precedes its consumer; P2P only across ranks.
  6. Every cross-rank input has its receive, every receive its send on the peer rank, and vice
     versa (a program without any P2P is *compute-only*: cross-rank inputs then need none).
  7. On every channel (sender rank, receiver rank, direction) the sends and the receives come in
     the same order: NCCL and gloo match point-to-point operations in issue order.
  8. ``sG`` after all of stage ``s``'s ``B``/``W``; ``sO`` after them and after ``sG``; at most
     one of each per stage.
"""

from __future__ import annotations

from collections import defaultdict

from torchrec_swp.pp.actions import (
    INPUT_GRAD,
    P2P,
    RECVS,
    SENDS,
    WEIGHT_GRAD,
    Action,
    B,
    E,
    F,
    G,
    I,
    O,
    Program,
    W,
)
from torchrec_swp.pp.comm import needs_p2p
from torchrec_swp.pp.errors import PPError
from torchrec_swp.pp.grid import format_grid


def fail(program: Program, message: str, rank: int | None = None, step: int | None = None) -> PPError:
    """A PPError about ``program`` with the grid appended, ``(rank, step)`` marked."""
    action = None
    where = ""
    if rank is not None and step is not None:
        actions = program.ranks[rank]
        action = str(actions[step]) if step < len(actions) else None
        where = f"rank {rank}, step {step}" + (f" ({action})" if action else " (end of program)") + ": "
    mark = (rank, step) if rank is not None and step is not None else None
    grid = format_grid(program, mark)
    return PPError(f"{program.name}: {where}{message}\n\n{grid}", rank=rank, step=step, action=action)


def validate(program: Program) -> None:
    """Raise PPError at the first broken rule (module docstring), else return None."""
    at: dict[Action, tuple[int, int]] = {}
    S, M = program.num_stages, program.num_microbatches
    # rules 1 and 2
    for r, actions in enumerate(program.ranks):
        for k, a in enumerate(actions):
            if a.stage >= S:
                raise fail(program, f"stage {a.stage} does not exist (the program has {S} stages)", r, k)
            if program.rank_of(a.stage) != r:
                raise fail(program, f"stage {a.stage} lives on rank {program.rank_of(a.stage)}, not here", r, k)
            if a.microbatch is not None and a.microbatch >= M:
                raise fail(program, f"microbatch {a.microbatch} does not exist (the program has {M})", r, k)
            if a in at:
                r0, k0 = at[a]
                raise fail(program, f"{a} runs twice (also rank {r0}, step {k0})", r, k)
            at[a] = (r, k)
    # rule 3
    for s in range(S):
        home = program.rank_of(s)
        end = len(program.ranks[home])
        sparse = [m for m in range(M) if Action(s, E, m) in at]
        if sparse and len(sparse) != M:
            absent = next(m for m in range(M) if Action(s, E, m) not in at)
            raise fail(program, f"stage {s} has sparse forwards (E) but not {Action(s, E, absent)}", home, end)
        for m in range(M):
            if Action(s, F, m) not in at:
                raise fail(program, f"{Action(s, F, m)} is missing", home, end)
            full, split = Action(s, B, m) in at, (Action(s, I, m) in at, Action(s, W, m) in at)
            if full and any(split):
                which = Action(s, I, m) if split[0] else Action(s, W, m)
                raise fail(program, f"{Action(s, B, m)} and {which}: a backward is either full or split", *at[which])
            if not full and split != (True, True):
                missing = Action(s, B, m) if not any(split) else Action(s, W if split[0] else I, m)
                raise fail(program, f"{missing} is missing", home, end)
    # rules 4 and 5
    p2p = program.has_p2p()
    for a, (r, k) in at.items():
        for before in _local_inputs(program, a, at):
            rb, kb = at[before]
            if rb == r and kb > k:
                raise fail(program, f"{a} runs before {before}, which it needs", r, k)
        if a.kind in P2P:
            peer = a.peer_stage
            if not 0 <= peer < S or program.rank_of(peer) == r:
                raise fail(program, f"{a} has no peer stage on another rank", r, k)
            partner = _p2p_partner(a, at)
            if partner is None:
                kind = "producer" if a.kind in SENDS else "consumer"
                raise fail(program, f"{a} has no {kind} on this rank", r, k)
            if (a.kind in SENDS) != (at[partner][1] < k):
                order = "after" if a.kind in SENDS else "before"
                raise fail(program, f"{a} must come {order} {partner}", r, k)
    # rule 6
    if p2p:
        for a, (r, k) in at.items():
            if a.kind in P2P:
                if a.matching() not in at:
                    raise fail(
                        program, f"{a} has no matching {a.matching()} on rank {program.rank_of(a.peer_stage)}", r, k
                    )
            elif a.kind in (F, B, I):
                recvs, sends = needs_p2p(program, a)
                for c in recvs:
                    if c not in at:
                        raise fail(program, f"{a} needs {c} before it (its input comes from another rank)", r, k)
                for c in sends:
                    if c not in at:
                        raise fail(program, f"{a} needs {c} after it (its output goes to another rank)", r, k)
    # rule 7
    channels: dict[tuple[int, int, str], tuple[list[Action], list[Action]]] = defaultdict(lambda: ([], []))
    for r, actions in enumerate(program.ranks):
        for a in actions:
            if a.kind in SENDS:
                channels[(r, program.rank_of(a.peer_stage), a.direction)][0].append(a)
            elif a.kind in RECVS:
                channels[(program.rank_of(a.peer_stage), r, a.direction)][1].append(a.matching())
    for (src, dst, d), (sends, recvs) in channels.items():
        for n, (s_, r_) in enumerate(zip(sends, recvs, strict=False)):
            if s_ != r_:
                recv = r_.matching()
                raise fail(
                    program,
                    f"channel rank {src} -> rank {dst} ({'activations' if d == 'F' else 'gradients'}): "
                    f"receive #{n} is {recv} but send #{n} is {s_}; P2P operations match in issue order",
                    *at[recv],
                )
    # rule 8
    for s in range(S):
        grads = [at[a][1] for a in at if a.stage == s and a.kind in WEIGHT_GRAD]
        last = max(grads, default=-1)
        sync, step = at.get(Action(s, G)), at.get(Action(s, O))
        if sync is not None and sync[1] < last:
            raise fail(program, f"{Action(s, G)} runs before stage {s}'s last weight gradient", *sync)
        if step is not None and (step[1] < last or (sync is not None and step[1] < sync[1])):
            raise fail(program, f"{Action(s, O)} runs before stage {s}'s gradients are final", *step)


def _local_inputs(program: Program, a: Action, at: dict[Action, tuple[int, int]]) -> list[Action]:
    """What ``a`` needs that is (or must be) computed on its own rank (rule 4)."""
    s, m, S = a.stage, a.microbatch, program.num_stages
    here = program.rank_of(s)
    out: list[Action] = []
    if a.kind is F:
        if Action(s, E, m) in at:
            out.append(Action(s, E, m))
        if s > 0 and program.rank_of(s - 1) == here:
            out.append(Action(s - 1, F, m))
    elif a.kind in INPUT_GRAD:
        out.append(Action(s, F, m))
        if s < S - 1 and program.rank_of(s + 1) == here:
            out += [x for x in (Action(s + 1, B, m), Action(s + 1, I, m)) if x in at]
    elif a.kind is W:
        out.append(Action(s, I, m))
    return [x for x in out if x in at]


def _p2p_partner(a: Action, at: dict[Action, tuple[int, int]]) -> Action | None:
    """The compute action a send follows or a receive precedes."""
    s, m = a.stage, a.microbatch
    candidates = (Action(s, F, m),) if a.direction == "F" else (Action(s, B, m), Action(s, I, m))
    return next((c for c in candidates if c in at), None)
