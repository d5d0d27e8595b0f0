"""Cross-check with torch.distributed.pipelining (imported here only): for the schedules both
have, our builders' per-rank compute order equals torch's. torch's schedule objects are built
with mock stages (no process group: ``pipeline_order`` is computed in the constructor).

Differences, each pinned by a test below:
* ``Schedule1F1B.pipeline_order`` numbers the last rank's forwards 1..M (an off-by-one in its
  grid builder); its runtime ``_step_microbatches`` runs 0..M-1, which is our order.
* ``ScheduleDualPipeV`` has overlapped ``(F;B)OVERLAP_F_B`` actions; ours are the two
  sub-actions in order (``builders.dualpipev``).
* torch's grids carry ``REDUCE_GRAD`` (our ``G``) right after a stage's last backward; we add
  ``G`` with ``comm.add_step`` after that backward's send; compute orders ignore it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
# after the importorskip: without torch.distributed.pipelining the module skips instead of failing
from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping  # noqa: E402

from torchrec_swp.pp.builders import (  # noqa: E402 (after the importorskip above)
    dualpipev,
    gpipe,
    interleaved_1f1b,
    interleaved_zero_bubble,
    one_f_one_b,
    zb_h1,
    zbv,
)

COMPUTE = {"F", "B", "I", "W"}


def mock_stages(num_ranks: int, per_rank: int, rank: int, style: str) -> list[SimpleNamespace]:
    n = num_ranks * per_rank
    return [
        SimpleNamespace(
            num_stages=n,
            group_size=num_ranks,
            group_rank=rank,
            stage_index=s,
            submod=None,
            is_first=s == 0,
            is_last=s == n - 1,
        )
        for s in generate_rank_to_stage_mapping(num_ranks, n, style)[rank]
    ]


def torch_order(cls: type, R: int, M: int, per_rank: int = 1, style: str = "loop") -> list[list[str]]:
    stages = mock_stages(R, per_rank, 0, style)
    sched = cls(stages[0], M) if issubclass(cls, schedules.PipelineScheduleSingle) else cls(stages, M)
    out = []
    for r in range(R):
        actions: list[str] = []
        for a in sched.pipeline_order[r]:
            if a is None:
                continue
            parts = a.sub_actions if a.sub_actions is not None else (a,)
            actions += [str(p) for p in parts if p.computation_type.value in COMPUTE]
        out.append(actions)
    return out


def ours(program) -> list[list[str]]:
    return [[str(a) for a in r] for r in program.ranks]


CASES = [
    ("GPipe", schedules.ScheduleGPipe, gpipe, 1, "loop", lambda R, M: True),
    ("Interleaved1F1B", schedules.ScheduleInterleaved1F1B, interleaved_1f1b, 2, "loop",
     lambda R, M: M % max(1, M // R) == 0),
    ("InterleavedZB", schedules.ScheduleInterleavedZeroBubble, interleaved_zero_bubble, 2, "loop",
     lambda R, M: M % max(1, M // R) == 0),
    ("ZB-H1", schedules.ScheduleInterleavedZeroBubble, zb_h1, 1, "loop", lambda R, M: M % max(1, M // R) == 0),
    ("ZBV", schedules.ScheduleZBVZeroBubble, zbv, 2, "v", lambda R, M: True),
    ("DualPipeV", schedules.ScheduleDualPipeV, dualpipev, 2, "v", lambda R, M: M >= 2 * R),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_compute_order_equals_torch(case: tuple) -> None:
    _, cls, builder, per_rank, style, supported = case
    checked = 0
    for R in range(2, 6):
        for M in range(1, 13):
            if not supported(R, M):
                continue
            assert ours(builder(R, M)) == torch_order(cls, R, M, per_rank, style), (R, M)
            checked += 1
    assert checked >= 15


def test_1f1b_equals_torch_runtime_not_its_grid() -> None:
    for R in range(2, 6):
        for M in range(R, 13):  # torch's 1F1B needs M >= R
            mine, theirs = ours(one_f_one_b(R, M)), torch_order(schedules.Schedule1F1B, R, M)
            assert mine[:-1] == theirs[:-1], (R, M)
            last = R - 1  # torch's grid: F1..FM on the last rank; its runtime and ours: F0..F(M-1)
            shifted = [
                f"{a[: -len(a.split('F')[-1])]}{int(a.split('F')[-1]) + 1}" if "F" in a else a for a in mine[last]
            ]
            assert shifted == theirs[last], (R, M)


def test_torch_rejects_what_we_accept() -> None:
    with pytest.raises(ValueError):
        torch_order(schedules.Schedule1F1B, 4, 3)  # we build 1F1B for any M
    with pytest.raises(ValueError):
        torch_order(
            schedules.ScheduleInterleavedZeroBubble, 4, 9
        )  # ZB-H1: rounds do not matter with one stage per rank
    assert ours(zb_h1(4, 9))


def test_every_action_kind_torch_has_round_trips_through_torchs_own_parser() -> None:
    from torch.distributed.pipelining.schedules import _Action

    from torchrec_swp.pp import TORCH_KINDS, Action, PPError, from_torch_text, to_torch_text
    from torchrec_swp.pp.actions import PER_STEP, Kind

    for kind in TORCH_KINDS:
        ours = Action(1, kind, None if kind in PER_STEP else 3)
        text = to_torch_text(ours)
        assert str(_Action.from_str(text)) == text  # torch reads and writes it back unchanged
        assert from_torch_text(text) == ours
    assert to_torch_text(Action(0, Kind.SEND_F, 2)) == "0SEND_F2"
    for kind in (Kind.SPARSE, Kind.STEP):
        with pytest.raises(PPError, match="no torch.distributed.pipelining counterpart"):
            to_torch_text(Action(0, kind, None if kind in PER_STEP else 0))
    with pytest.raises(PPError, match="unsupported torch action '0UNSHARD'"):
        from_torch_text("0UNSHARD")
