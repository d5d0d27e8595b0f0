"""Lowering one rank onto engine threads: golden text, and every builder's ranks replay through
the lowered threads without blocking, in an order that keeps every dependency."""

from __future__ import annotations

import pytest

from tests.unit.test_pp_builders import check_golden
from torchrec_swp.compile.program import format_program
from torchrec_swp.pp import SCHEDULES, PPError, build, simulate
from torchrec_swp.pp.builders import maglev_1f1b
from torchrec_swp.pp.lower_rank import lower_rank, replay


def test_golden_lowered_maglev_1f1b() -> None:
    program = maglev_1f1b(2, 2, recv_ahead=True)
    text = program.to_text() + "".join(
        f"\n# rank {r}, P2P on 'comm'\n{format_program(lower_rank(program, r))}\n" for r in range(2)
    )
    split = {"RF": "recv", "RB": "recv", "SF": "send", "SB": "send"}
    text += f"\n# rank 1, receives on 'recv', sends on 'send'\n{format_program(lower_rank(program, 1, split))}\n"
    check_golden("lower_Maglev1F1BRecvAhead_r2_m2", text)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_builder_lowers_without_blocking(name: str) -> None:
    maps = [None, {"SF": "send", "SB": "send", "RF": "recv", "RB": "recv", "G": "dp"}, lambda a: f"stage{a.stage}"]
    for R, M in ((2, 4), (4, 8)):
        if not SCHEDULES[name].supports(R, M):
            continue
        program = build(name, R, M, recv_ahead=1)
        simulate(program)
        for r in range(R):
            for threads in maps:
                ran = replay(lower_rank(program, r, threads))  # type: ignore[arg-type]
                assert sorted(ran) == sorted(map(str, program.ranks[r]))
                at = {x: k for k, x in enumerate(ran)}
                for a in program.ranks[r]:
                    if a.is_p2p and a.kind.value.startswith("S"):  # a send after its compute
                        producer = next(
                            str(x)
                            for x in program.ranks[r]
                            if x.stage == a.stage
                            and x.microbatch == a.microbatch
                            and x.kind.value in ("BI" if a.direction == "B" else "F")
                        )
                        assert at[producer] < at[str(a)], (name, r, a)
                    if a.is_p2p and a.kind.value.startswith("R"):  # a compute after its receive
                        consumer = next(
                            str(x)
                            for x in program.ranks[r]
                            if x.is_compute
                            and x.stage == a.stage
                            and x.microbatch == a.microbatch
                            and x.kind.value in ("BI" if a.direction == "B" else "F")
                        )
                        assert at[str(a)] < at[consumer], (name, r, a)
                if threads is None:  # compute stays on one thread, in program order
                    compute = [str(a) for a in program.ranks[r] if not a.is_p2p]
                    assert [x for x in ran if x in set(compute)] == compute


def test_lowering_errors() -> None:
    with pytest.raises(PPError, match="rank 5 does not exist"):
        lower_rank(build("1F1B", 2, 2), 5)
