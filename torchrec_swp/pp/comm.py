"""Passes that add what is not compute to a compute-only program. Pure ``Program -> Program``.

``add_p2p`` (sends and receives), rules:
  1. A stage boundary crossed by a microbatch between two ranks gets a pair: ``F`` of stage
     ``s`` is followed on its rank by ``sSF m`` and preceded on stage ``s + 1``'s rank by
     ``(s+1)RF m``; ``B``/``I`` of stage ``s`` is followed by ``sSB m`` and preceded on stage
     ``s - 1``'s rank by ``(s-1)RB m``. Boundaries inside one rank get nothing.
  2. Each send comes right after its producer; each receive right before its consumer (the
     order Maglev1F1B uses: "each receive is posted immediately before the operation that
     consumes it"). Receives are posts that do not block; the consumer waits for the data.
  3. A receive never comes after one that its sender sends later on the same channel (sender
     rank, receiver rank, direction): if a rank consumes microbatches in another order than
     its peer produces them (CP-SAT's optimal orders do), the receives are posted in send
     order, those for later consumers earlier than their consumers. P2P operations match in
     issue order on a channel (NCCL), so this is what makes such orders runnable.
  4. So with ``simulate``'s default (async) P2P a program that is deadlock-free as compute stays
     deadlock-free: no rank waits for anything its consumer would not wait for anyway. Stricter
     models are not always met (tests/unit/test_pp_comm.py pins which builders pass): with
     synchronous batched P2P (``comm="rendezvous"``) GPipe, 1F1B, ZB-H1 and the sparse-hoist
     split pass, interleaved and V schedules deadlock (Megatron fuses a send with the next
     receive to avoid that); with channels created on first use (``lazy_init``) only
     InterleavedZB deadlocks, on the wrap-around channel from the last rank back to rank 0.

``recv_ahead`` (Maglev1F1BRecvAhead's placement), rules:
  1. Every receive moves before the ``ahead``-th compute action preceding its consumer (to the
     start of the program when there are fewer), so the transfer lands while that compute runs.
  2. Receives keep their order (one moves no later than the receives after it): each
     channel's order is unchanged.
  3. With ``ahead=1`` on 1F1B this is exactly Maglev1F1BRecvAhead's order, including its rule
     that a gradient receive is never posted during warm-up (the first ``RB`` lands right
     before the first steady forward). ``ahead=2`` on 1F1B, or ``ahead=1`` on GPipe, posts a
     gradient receive during the forwards: with ``lazy_init`` that deadlocks, as Maglev's
     class docstring warns.

``add_step``: ``sG`` (the data-parallel gradient sync) after each stage's last ``B``/``W`` and
that action's send (or before the send, ``sync_before_send=True``: what DDP inside Maglev's
last backward does), then every stage's ``O`` at the end of its rank's program.
"""

from __future__ import annotations

from torchrec_swp.pp.actions import (
    COMPUTE,
    INPUT_GRAD,
    P2P,
    RB,
    RECVS,
    RF,
    SB,
    SF,
    WEIGHT_GRAD,
    Action,
    F,
    G,
    O,
    Program,
)
from torchrec_swp.pp.errors import PPError


def needs_p2p(program: Program, a: Action) -> tuple[list[Action], list[Action]]:
    """The receives ``a`` consumes and the sends it produces under rule 1."""
    s, m, S = a.stage, a.microbatch, program.num_stages
    here = program.rank_of(s)
    recvs: list[Action] = []
    sends: list[Action] = []
    if a.kind is F:
        if s > 0 and program.rank_of(s - 1) != here:
            recvs.append(Action(s, RF, m))
        if s < S - 1 and program.rank_of(s + 1) != here:
            sends.append(Action(s, SF, m))
    elif a.kind in INPUT_GRAD:
        if s < S - 1 and program.rank_of(s + 1) != here:
            recvs.append(Action(s, RB, m))
        if s > 0 and program.rank_of(s - 1) != here:
            sends.append(Action(s, SB, m))
    return recvs, sends


def add_p2p(program: Program) -> Program:
    """Sends right after producers, receives right before consumers (module rules 1-4)."""
    for r, actions in enumerate(program.ranks):
        for k, a in enumerate(actions):
            if a.kind in P2P:
                raise PPError(
                    f"rank {r}, step {k}: add_p2p takes a program without P2P, found {a}", rank=r, step=k, action=str(a)
                )
    sends: list[list[tuple[Action, list[Action]]]] = []
    channel: dict[tuple[int, int, str], list[Action]] = {}  # receives of a channel, in send order
    for r, actions in enumerate(program.ranks):
        new: list[tuple[Action, list[Action]]] = []
        for a in actions:
            out = needs_p2p(program, a)[1] if a.kind in COMPUTE else []
            for x in out:
                channel.setdefault((r, program.rank_of(x.peer_stage), x.direction), []).append(x.matching())
            new.append((a, out))
        sends.append(new)
    posted: set[Action] = set()
    ranks = []
    for r, with_sends in enumerate(sends):
        new_rank: list[Action] = []
        for a, out in with_sends:
            for x in needs_p2p(program, a)[0] if a.kind in COMPUTE else []:
                queue = channel[(program.rank_of(x.peer_stage), r, x.direction)]
                for y in queue[: queue.index(x) + 1]:  # rule 3: never after a receive sent later
                    if y not in posted:
                        posted.add(y)
                        new_rank.append(y)
            new_rank += [a, *out]
        ranks.append(new_rank)
    return program.replace(ranks=ranks)


def recv_ahead(program: Program, ahead: int = 1) -> Program:
    """Post every receive ``ahead`` compute actions before its consumer (module rules 1-3)."""
    if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
        raise PPError(f"ahead must be an int >= 0, got {ahead!r}")
    out = []
    for r, actions in enumerate(program.ranks):
        compute_at = [k for k, a in enumerate(actions) if a.kind in COMPUTE]
        targets: list[tuple[int, Action]] = []
        for k, a in enumerate(actions):
            if a.kind not in RECVS:
                continue
            consumer = _consumer(actions, k)
            if consumer is None:
                raise PPError(
                    f"rank {r}, step {k}: receive {a} has no consumer after it", rank=r, step=k, action=str(a)
                )
            n = compute_at.index(consumer)
            targets.append((compute_at[max(0, n - ahead)], a))
        before: dict[int, list[Action]] = {}  # compute position -> receives posted right before it
        earliest = len(actions)
        for target, a in reversed(targets):  # rule 2: no later than the receives after it
            earliest = min(earliest, target)
            before.setdefault(earliest, []).insert(0, a)
        new: list[Action] = []
        for k, a in enumerate(actions):
            if a.kind in RECVS:
                continue
            new += before.get(k, [])
            new.append(a)
        out.append(new)
    return program.replace(ranks=out)


def _consumer(actions: tuple[Action, ...], k: int) -> int | None:
    """Position of the compute action that consumes the receive at ``k``."""
    recv = actions[k]
    wanted = (F,) if recv.kind is RF else tuple(INPUT_GRAD)
    for j in range(k + 1, len(actions)):
        a = actions[j]
        if a.stage == recv.stage and a.microbatch == recv.microbatch and a.kind in wanted:
            return j
    return None


def add_step(program: Program, *, sync_before_send: bool = False) -> Program:
    """``G`` after each stage's last ``B``/``W`` (and its send), ``O`` per stage at the end."""
    out = []
    for r, actions in enumerate(program.ranks):
        if any(a.kind in (G, O) for a in actions):
            raise PPError(f"rank {r} already has a gradient sync or an optimizer step", rank=r)
        last: dict[int, int] = {}
        for k, a in enumerate(actions):
            if a.kind in WEIGHT_GRAD:
                last[a.stage] = k
        after: dict[int, list[Action]] = {}
        for s, k in last.items():
            at = k
            if not sync_before_send:
                while at + 1 < len(actions) and actions[at + 1].kind in (SF, SB) and actions[at + 1].stage == s:
                    at += 1
            after.setdefault(at, []).append(Action(s, G))
        new: list[Action] = []
        for k, a in enumerate(actions):
            new.append(a)
            new += after.get(k, [])
        new += [Action(s, O) for s in program.stages_of(r)]
        out.append(new)
    return program.replace(ranks=out)
