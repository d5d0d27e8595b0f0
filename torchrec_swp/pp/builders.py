"""Schedule builders: pure functions of a few integers returning compute-only programs.

Every builder returns, for every rank, the order of its compute actions (``F``, ``E``, ``B``,
``I``, ``W``); ``comm.add_p2p`` then adds the sends and receives and ``comm.add_step`` the
gradient sync and optimizer step (``build`` does all three). Programs are checked by
``validate`` and replayed by ``simulate``; the tests run every builder over a range of sizes.

Where torch.distributed.pipelining has the same schedule, the builder's per-rank compute order
equals torch's (tests/unit/test_pp_torch.py builds torch's with mock stages and compares):

==========================  =============================================  ================
builder                     torch 2.13                                      placement
==========================  =============================================  ================
``gpipe``                   ``ScheduleGPipe``                               1 stage per rank
``one_f_one_b``             ``Schedule1F1B`` (its runtime order, see fn)    1 stage per rank
``interleaved_1f1b``        ``ScheduleInterleaved1F1B``                     loop, v per rank
``interleaved_zero_bubble`` ``ScheduleInterleavedZeroBubble`` (ZB1P)        loop, v per rank
``zb_h1``                   ``ScheduleInterleavedZeroBubble``, v = 1        1 stage per rank
``zbv``                     ``ScheduleZBVZeroBubble``                       V, 2 per rank
``dualpipev``               ``ScheduleDualPipeV`` (F&B overlap flattened)   V, 2 per rank
``sparse_hoist_1f1b``       none: TorchRec's backed-out ``run_1f1b_split``  1 stage per rank
==========================  =============================================  ================
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from torchrec_swp.pp.actions import Action, B, E, F, I, Kind, Program, W, check_positive, loop_placement, v_placement
from torchrec_swp.pp.errors import PPError


def gpipe(num_ranks: int, num_microbatches: int) -> Program:
    """All forwards, then all backwards in microbatch order (fill-drain). Peak activations: M."""
    check_positive(num_ranks=num_ranks, num_microbatches=num_microbatches)
    m = range(num_microbatches)
    ranks = [[Action(r, F, k) for k in m] + [Action(r, B, k) for k in m] for r in range(num_ranks)]
    return Program("GPipe", num_microbatches, loop_placement(num_ranks), tuple(map(tuple, ranks)))


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Program:
    """PipeDream-flush: rank ``r`` runs ``w = min(R - r - 1, M)`` warm-up forwards, then one
    forward and one backward until the forwards run out, then the ``w`` remaining backwards.

    This is the order Maglev1F1B's ``progress()`` and torch's ``Schedule1F1B._step_microbatches``
    run. torch's ``Schedule1F1B.pipeline_order`` (the grid it prints) differs on the last rank: it
    numbers that rank's forwards 1..M instead of 0..M-1 (its ``forward_mb`` is incremented before
    the first steady forward even when there was no warm-up forward); the runtime does not.
    """
    check_positive(num_ranks=num_ranks, num_microbatches=num_microbatches)
    ranks = []
    for r in range(num_ranks):
        w = min(num_ranks - r - 1, num_microbatches)
        order = [Action(r, F, k) for k in range(w)]
        for k in range(num_microbatches - w):
            order += [Action(r, F, w + k), Action(r, B, k)]
        order += [Action(r, B, k) for k in range(num_microbatches - w, num_microbatches)]
        ranks.append(order)
    return Program("1F1B", num_microbatches, loop_placement(num_ranks), tuple(map(tuple, ranks)))


def interleaved_1f1b(num_ranks: int, num_microbatches: int, virtual_stages: int = 2) -> Program:
    """Megatron's interleaved 1F1B (arXiv 2104.04473) with ``virtual_stages`` stages per rank,
    stage ``s`` on rank ``s % R``; torch's flexible variant: microbatches go in rounds of
    ``M // max(1, M // R)`` (M must be a multiple of the number of rounds). Rank ``r`` warms up
    with ``(v - 1) * round + 2 * (R - 1 - r)`` forwards, then alternates one forward and one
    backward; forwards visit the local stages in increasing order one round at a time,
    backwards in decreasing order. Bubble ``(R - 1) / (v M + R - 1)`` at M a multiple of R."""
    return _interleaved("Interleaved1F1B", num_ranks, num_microbatches, virtual_stages, zero_bubble=False)


def interleaved_zero_bubble(num_ranks: int, num_microbatches: int, virtual_stages: int = 2) -> Program:
    """ZB1P (arXiv 2401.10241) as torch builds it: interleaved 1F1B with a warm-up of
    ``(v - 1) * round + (R - 1 - r)`` forwards, backwards split into ``I`` (on the critical
    path) and ``W``; rank ``r`` holds back its first ``r`` ``W``s and then runs one ``W`` after
    each ``I``, so the held-back ones fill the cool-down bubble."""
    return _interleaved("InterleavedZB", num_ranks, num_microbatches, virtual_stages, zero_bubble=True)


def zb_h1(num_ranks: int, num_microbatches: int) -> Program:
    """ZB-H1: the zero-bubble schedule with 1F1B's memory (one stage per rank): 1F1B's order with
    each ``B`` split into ``I`` + ``W`` and rank ``r``'s first ``r`` ``W``s deferred to the end.
    Bubble ``(R - 1)(F + I - W)`` per rank (1F1B: ``(R - 1)(F + I + W)``)."""
    return _interleaved("ZB-H1", num_ranks, num_microbatches, 1, zero_bubble=True)


def _interleaved(name: str, num_ranks: int, num_microbatches: int, v: int, *, zero_bubble: bool) -> Program:
    check_positive(num_ranks=num_ranks, num_microbatches=num_microbatches, virtual_stages=v)
    rounds = max(1, num_microbatches // num_ranks)
    if v == 1:  # rounds only shape the stage rotation; torch still rejects such M with one stage per rank
        rounds = 1
    if num_microbatches % rounds:
        raise PPError(
            f"{name}: {num_microbatches} microbatches do not split into {rounds} rounds "
            f"(M must be a multiple of max(1, M // R) = {rounds})"
        )
    per_round = num_microbatches // rounds
    ranks = [_interleaved_rank(r, num_ranks, num_microbatches, v, per_round, zero_bubble) for r in range(num_ranks)]
    return Program(name, num_microbatches, loop_placement(num_ranks, v), tuple(map(tuple, ranks)))


def _interleaved_rank(rank: int, R: int, M: int, v: int, per_round: int, zero_bubble: bool) -> list[Action]:
    ops = v * M
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (R - 1 - rank), ops)
    backward = I if zero_bubble else B
    held_back = rank if zero_bubble else None  # ZB1P: rank r holds back its first r W's

    def fwd_stage(op: int) -> int:
        return (op // per_round) % v * R + rank

    def bwd_stage(op: int) -> int:
        return (v - 1 - (op - warmup) // per_round % v) * R + rank

    nxt: dict[tuple[int, Kind], int] = defaultdict(int)

    def take(stage: int, kind: Kind) -> Action:
        k = nxt[(stage, kind)]
        nxt[(stage, kind)] = k + 1
        return Action(stage, kind, k)

    order: list[Action] = []
    backwards: list[int] = []  # stage of each backward, in order: where the W's go
    weights = 0
    for op in range(ops + warmup):
        if op < ops:
            order.append(take(fwd_stage(op), F))
        if op >= warmup:
            stage = bwd_stage(op)
            order.append(take(stage, backward))
            backwards.append(stage)
            if held_back is not None and op - warmup >= held_back:
                order.append(take(backwards[weights], W))
                weights += 1
    if zero_bubble:
        order += [take(s, W) for s in backwards[weights:]]
    return order


def zbv(num_ranks: int, num_microbatches: int) -> Program:
    """ZB-V (arXiv 2401.10241, section 6) as torch builds it: rank ``r`` holds stages ``r`` and
    ``2R - 1 - r``; warm-up ``2(R - r) - 1`` forwards of the first, ``r`` pairs of forwards, then
    ``F I W`` on the second; steady state alternates the two stages' ``F I W``; cool-down runs the
    remaining ``I``s then the ``W``s. Zero bubble in steady state when F = I = W."""
    check_positive(num_ranks=num_ranks, num_microbatches=num_microbatches)
    R, M = num_ranks, num_microbatches
    ranks = []
    for r in range(R):
        s0, s1 = r, 2 * R - 1 - r
        n = max(2 * R - 1, M)  # torch plans for at least 2R - 1 microbatches, then drops the extra
        order: list[Action] = []
        f0 = f1 = b0 = b1 = 0
        for _ in range(2 * (R - r) - 1):
            order.append(Action(s0, F, f0))
            f0 += 1
        for _ in range(r):
            order += [Action(s1, F, f1), Action(s0, F, f0)]
            f0, f1 = f0 + 1, f1 + 1
        for _ in range(R - r):
            order += [Action(s1, F, f1), Action(s1, I, b1), Action(s1, W, b1)]
            f1, b1 = f1 + 1, b1 + 1
        while f1 < f0 or f0 < n:
            if f0 < n:
                order.append(Action(s0, F, f0))
                f0 += 1
            order += [Action(s0, I, b0), Action(s0, W, b0), Action(s1, F, f1), Action(s1, I, b1), Action(s1, W, b1)]
            b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
        w0, w1 = b0, b1
        for _ in range(r):
            order += [Action(s0, I, b0), Action(s1, I, b1)]
            b0, b1 = b0 + 1, b1 + 1
        for _ in range(R - r):
            order += [Action(s0, I, b0), Action(s0, W, w0)]
            b0, w0 = b0 + 1, w0 + 1
        order += [Action(s1, W, k) for k in range(w1, b1)]
        order += [Action(s0, W, k) for k in range(w0, b0)]
        ranks.append([a for a in order if a.microbatch is not None and a.microbatch < M])
    return Program("ZBV", M, v_placement(R), tuple(map(tuple, ranks)))


def dualpipev(num_ranks: int, num_microbatches: int) -> Program:
    """DualPipeV (DeepSeek's DualPipe folded into a V, arXiv 2412.19437) as torch builds it:
    rank ``r`` holds stages ``r`` and ``2R - 1 - r``; its main phase pairs a forward of one stage
    with a full backward of the other (torch's ``OVERLAP_F_B``, meant to run overlapped); the
    tail splits backwards into ``I`` and ``W`` to fill the cool-down. Needs ``M >= 2R``.

    Programs here have no overlapped action: each ``(F;B)OVERLAP_F_B`` of torch is its two
    sub-actions in order, ``F`` then ``B`` (what torch's runtime does without a custom overlap
    function), so ``simulate`` charges ``F + B`` for the pair; an overlap would shorten it.
    """
    check_positive(num_ranks=num_ranks, num_microbatches=num_microbatches)
    R, M = num_ranks, num_microbatches
    if M < 2 * R:
        raise PPError(f"DualPipeV needs at least as many microbatches as stages: got {M} for {2 * R} stages")
    ranks = []
    for r in range(R):
        s0, s1 = r, 2 * R - 1 - r
        e = _Emitter()
        for _ in range(2 * (R - r - 1)):
            e.add(s0, F)
        for _ in range(r + 1):
            e.add(s0, F)
            e.add(s1, F)
        for _ in range(R - r - 1):
            e.add(s1, I)
            e.add_w()
            e.add(s1, F)
        for _ in range(M - 2 * R + r + 1):
            e.add(s0, F)  # torch overlaps this pair, except the very first one on the last rank
            e.add(s1, B)
            e.add(s1, F)  # overlapped pair
            e.add(s0, B)
        for _ in range(R - r - 1):
            e.add(s1, B)
            e.add(s1, F)  # overlapped pair
            e.add(s0, B)
        split = False
        for i in range(r + 1):  # the second half of the last backwards is split into I and W
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            e.add(s1, I if split else B)
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            e.add(s0, I if split else B)
        for _ in range(R - r - 1):
            e.add_w()
            e.add(s0, I if split else B)
        for _ in range(r + 1):
            e.add_w()
        ranks.append(e.order)
    return Program("DualPipeV", M, v_placement(R), tuple(map(tuple, ranks)))


class _Emitter:
    """DualPipeV's bookkeeping: the next microbatch of each (stage, kind) (a full ``B`` counts as
    that stage's ``I`` and ``W``), and the ``W``s owed by earlier ``I``s, oldest first."""

    def __init__(self) -> None:
        self.order: list[Action] = []
        self.next: dict[tuple[int, Kind], int] = defaultdict(int)
        self.owed: list[tuple[int, int]] = []

    def add(self, stage: int, kind: Kind) -> None:
        key = (stage, I if kind is B else kind)
        k = self.next[key]
        self.order.append(Action(stage, kind, k))
        self.next[key] = k + 1
        if kind is I:
            self.owed.append((stage, k))

    def add_w(self) -> None:
        if self.owed:
            stage, k = self.owed.pop(0)
            self.order.append(Action(stage, W, k))


def sparse_hoist_1f1b(num_ranks: int, num_microbatches: int) -> Program:
    """TorchRec's "1F1B split" (``run_1f1b_split``, merged then backed out upstream in #4606):
    1F1B on the dense forwards ``F``, with each microbatch's sparse forward ``E`` (embedding
    lookup, which needs no activation from stage - 1) hoisted ahead. With ``w = min(R - r - 1, M)``
    and ``h = min(max(r + 1, M - w), M)``, rank ``r`` runs ``E0 .. E(h-1)``, then for each warm-up
    forward ``F j`` followed by ``E(j + h)`` (while there is one), then 1F1B's steady state and
    cool-down. Every ``E`` runs before the rank's first ``B``, so under a fused (in-backward)
    embedding optimizer all lookups of a step read the same pre-step weights (SGD-exact); the
    price is the hoisted lookups' outputs held live (more activation memory)."""
    check_positive(num_ranks=num_ranks, num_microbatches=num_microbatches)
    R, M = num_ranks, num_microbatches
    ranks = []
    for r in range(R):
        w = min(R - r - 1, M)
        hoist = min(max(r + 1, M - w), M)
        order = [Action(r, E, k) for k in range(hoist)]
        for j in range(w):
            order.append(Action(r, F, j))
            if j + hoist < M:
                order.append(Action(r, E, j + hoist))
        order += [Action(r, E, k) for k in range(min(hoist + w, M), M)]  # never runs (kept as upstream)
        for k in range(M - w):
            order += [Action(r, F, w + k), Action(r, B, k)]
        order += [Action(r, B, k) for k in range(M - w, M)]
        ranks.append(order)
    return Program("1F1B-split", M, loop_placement(R), tuple(map(tuple, ranks)))


# ----------------------------------------------------------------------------- registry
@dataclass(frozen=True, slots=True)
class Schedule:
    """A builder with what it needs: ``supports(R, M)`` says whether it accepts the sizes."""

    name: str
    build: Callable[[int, int], Program]
    supports: Callable[[int, int], bool]


def _rounds_ok(R: int, M: int) -> bool:
    return M % max(1, M // R) == 0


SCHEDULES: dict[str, Schedule] = {
    s.name: s
    for s in (
        Schedule("GPipe", gpipe, lambda R, M: True),
        Schedule("1F1B", one_f_one_b, lambda R, M: True),
        Schedule("Interleaved1F1B", interleaved_1f1b, _rounds_ok),
        Schedule("InterleavedZB", interleaved_zero_bubble, _rounds_ok),
        Schedule("ZB-H1", zb_h1, lambda R, M: True),
        Schedule("ZBV", zbv, lambda R, M: True),
        Schedule("DualPipeV", dualpipev, lambda R, M: M >= 2 * R),
        Schedule("1F1B-split", sparse_hoist_1f1b, lambda R, M: True),
    )
}


def build(name: str, num_ranks: int, num_microbatches: int, *, recv_ahead: int = 0, step: bool = True) -> Program:
    """Schedule ``name`` with its sends and receives (``recv_ahead`` > 0: posted that many
    compute actions ahead) and, with ``step``, each stage's gradient sync and optimizer step."""
    from torchrec_swp.pp import comm

    if name not in SCHEDULES:
        raise PPError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    program = comm.add_p2p(SCHEDULES[name].build(num_ranks, num_microbatches))
    if recv_ahead:
        program = comm.recv_ahead(program, recv_ahead)
    return comm.add_step(program) if step else program


def maglev_1f1b(num_ranks: int, num_microbatches: int, *, recv_ahead: bool = False) -> Program:
    """TorchRec 1.9.2's ``Maglev1F1B`` (``recv_ahead=False``) or ``Maglev1F1BRecvAhead``, one
    rank per stage, as their ``progress()`` runs it (torchrec/distributed/maglev/pipeline.py):
    1F1B's compute order; each send right after its compute (``forward_micro`` /
    ``backward_micro`` start it, the next one finishes it); receives right before their consumer,
    or one compute ahead; the gradient sync inside the last backward (DDP's reducer, armed by
    the last forward running outside ``no_sync``), so before that backward's send; after
    ``drain_sends`` the optimizer step."""
    from torchrec_swp.pp import comm

    if num_microbatches < num_ranks:
        raise PPError(f"Maglev1F1B needs at least one microbatch per stage: got {num_microbatches} for {num_ranks}")
    program = comm.add_p2p(one_f_one_b(num_ranks, num_microbatches))
    if recv_ahead:
        program = comm.recv_ahead(program, 1)
    name = "Maglev1F1BRecvAhead" if recv_ahead else "Maglev1F1B"
    return comm.add_step(program, sync_before_send=True).replace(name=name)


def maglev_base(num_ranks: int) -> Program:
    """TorchRec 1.9.2's ``MaglevPipelineBase``: one microbatch, forward then backward, each
    receive right before its consumer, the gradient sync inside the backward, then the step."""
    from torchrec_swp.pp import comm

    return comm.add_step(comm.add_p2p(one_f_one_b(num_ranks, 1)), sync_before_send=True).replace(name="MaglevBase")
