"""Every schedule builder: golden grids (program order and simulated timeline), validated and
simulated deadlock-free over a range of sizes, and the upstream orders they must reproduce
(Maglev1F1B / Maglev1F1BRecvAhead's progress(), the backed-out sparse-hoist split's tables).

Regenerate the goldens after an intended change with ``SWP_UPDATE_GOLDEN=1 pytest tests/unit``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torchrec_swp.pp import SCHEDULES, ActionDurations, PPError, Program, build, format_grid, simulate, validate
from torchrec_swp.pp.actions import COMPUTE, Kind
from torchrec_swp.pp.builders import maglev_1f1b, maglev_base, sparse_hoist_1f1b

GOLDEN = Path(__file__).parent.parent / "golden" / "pp"
UNIT = ActionDurations(F=1, E=1, B=2, I=1, W=1)


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("SWP_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no golden file {path}; run with SWP_UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), f"{path} differs; diff it, and regenerate with SWP_UPDATE_GOLDEN=1 if intended"


def schedule_golden(name: str, ranks: int = 4, microbatches: int = 8) -> str:
    compute = SCHEDULES[name].build(ranks, microbatches)
    result = simulate(build(name, ranks, microbatches), UNIT)
    return (
        f"# {name}: {ranks} ranks, {microbatches} microbatches, placement {','.join(map(str, compute.placement))}\n"
        f"# compute order per rank (pp.builders):\n{format_grid(compute)}\n"
        f"# simulated with P2P added, {UNIT}: {result.summary()}\n{result.grid()}"
    )


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_golden_grid(name: str) -> None:
    check_golden(f"{name}_r4_m8", schedule_golden(name))


@pytest.mark.parametrize("recv_ahead", [False, True])
def test_golden_maglev(recv_ahead: bool) -> None:
    program = maglev_1f1b(4, 8, recv_ahead=recv_ahead)
    validate(program)
    check_golden(f"{program.name}_r4_m8", f"{program.to_text()}\n{format_grid(program)}")


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_size_validates_and_simulates_without_deadlock(name: str) -> None:
    schedule = SCHEDULES[name]
    sizes = 0
    for R in range(1, 6):
        for M in range(1, 11):
            if not schedule.supports(R, M):
                with pytest.raises(PPError):
                    schedule.build(R, M)
                continue
            compute = schedule.build(R, M)
            validate(compute)
            assert all(a.kind in COMPUTE for r in compute.ranks for a in r)
            per_stage = compute.num_stages * M
            fwd = sum(a.kind is Kind.FORWARD for r in compute.ranks for a in r)
            assert fwd == per_stage, (name, R, M)
            full = build(name, R, M)
            validate(full)
            plain = simulate(compute, UNIT)
            with_p2p = simulate(full, UNIT)
            assert with_p2p.makespan == plain.makespan  # free P2P: same timeline as compute alone
            assert 0 <= with_p2p.bubble < 1
            sizes += 1
    assert sizes >= 20


def test_maglev_orders_are_upstreams_progress() -> None:
    """Derived by hand from torchrec 1.9.2 maglev/pipeline.py: Maglev1F1B.progress (l.252-303)
    posts each receive just before its consumer (start_recv_act in _forward, start_recv_grad
    in _backward); Maglev1F1BRecvAhead.progress (l.326-383) seeds one activation receive, posts
    the next one before each warm-up forward, and in steady state posts the gradient receive
    before the forward and the next activation receive (the next gradient one on the last
    steady iteration) before the backward. Stage 1 of 4, 8 microbatches (w = 2)."""
    plain = maglev_1f1b(4, 8).ranks[1]
    ahead = maglev_1f1b(4, 8, recv_ahead=True).ranks[1]
    assert " ".join(map(str, plain)) == (
        "1RF0 1F0 1SF0 1RF1 1F1 1SF1 1RF2 1F2 1SF2 1RB0 1B0 1SB0 1RF3 1F3 1SF3 1RB1 1B1 1SB1 "
        "1RF4 1F4 1SF4 1RB2 1B2 1SB2 1RF5 1F5 1SF5 1RB3 1B3 1SB3 1RF6 1F6 1SF6 1RB4 1B4 1SB4 "
        "1RF7 1F7 1SF7 1RB5 1B5 1SB5 1RB6 1B6 1SB6 1RB7 1B7 1G 1SB7 1O"
    )
    seed, warmup = "1RF0", "1RF1 1F0 1SF0 1RF2 1F1 1SF1"
    steady = " ".join(f"1RB{i} 1F{2 + i} 1SF{2 + i} 1RF{3 + i} 1B{i} 1SB{i}" for i in range(5))
    last = "1RB5 1F7 1SF7 1RB6 1B5 1SB5"
    cooldown = "1RB7 1B6 1SB6 1B7 1G 1SB7 1O"
    assert " ".join(map(str, ahead)) == f"{seed} {warmup} {steady} {last} {cooldown}"
    with pytest.raises(PPError, match="at least one microbatch per stage"):
        maglev_1f1b(4, 3)


def test_maglev_base_is_upstreams_one_microbatch_pass() -> None:
    """MaglevPipelineBase.progress (torchrec 1.9.2 maglev/pipeline.py): start_recv_act, the
    forward (its send started inside), start_recv_grad right before the backward, drain, step."""
    program = maglev_base(3)
    assert program.to_text() == (
        "program MaglevBase microbatches=1 placement=0,1,2\n"
        "rank 0: 0F0 0SF0 0RB0 0B0 0G 0O\n"
        "rank 1: 1RF0 1F0 1SF0 1RB0 1B0 1G 1SB0 1O\n"
        "rank 2: 2RF0 2F0 2B0 2G 2SB0 2O\n"
    )
    validate(program)
    assert simulate(program).bubble > 0


# run_1f1b_split's docstring tables (git show 376cac6a^:torchrec/distributed/maglev/pipeline.py),
# with upstream's S (sparse) as E and D (dense) as F.
SPLIT_TABLES = {
    4: [
        "S0 D0 S1 D1 S2 D2 S3 D3 B0 B1 B2 B3",
        "S0 S1 D0 S2 D1 S3 D2 B0 D3 B1 B2 B3",
        "S0 S1 S2 D0 S3 D1 B0 D2 B1 D3 B2 B3",
        "S0 S1 S2 S3 D0 B0 D1 B1 D2 B2 D3 B3",
    ],
    8: [
        "S0 S1 S2 S3 S4 D0 S5 D1 S6 D2 S7 D3 B0 D4 B1 D5 B2 D6 B3 D7 B4 B5 B6 B7",
        "S0 S1 S2 S3 S4 S5 D0 S6 D1 S7 D2 B0 D3 B1 D4 B2 D5 B3 D6 B4 D7 B5 B6 B7",
        "S0 S1 S2 S3 S4 S5 S6 D0 S7 D1 B0 D2 B1 D3 B2 D4 B3 D5 B4 D6 B5 D7 B6 B7",
        "S0 S1 S2 S3 S4 S5 S6 S7 D0 B0 D1 B1 D2 B2 D3 B3 D4 B4 D5 B5 D6 B6 D7 B7",
    ],
}


@pytest.mark.parametrize("microbatches", [4, 8])
def test_sparse_hoist_split_is_upstreams_table(microbatches: int) -> None:
    program = sparse_hoist_1f1b(4, microbatches)
    for r, row in enumerate(SPLIT_TABLES[microbatches]):
        mine = " ".join(f"{a.kind.value}{a.microbatch}" for a in program.ranks[r])
        assert mine == row.replace("S", "E").replace("D", "F")


def test_sparse_hoist_split_runs_every_lookup_before_the_first_backward() -> None:
    for R in range(1, 6):
        for M in range(1, 11):
            for r, actions in enumerate(sparse_hoist_1f1b(R, M).ranks):
                kinds = [a.kind for a in actions]
                first_b = kinds.index(Kind.BACKWARD)
                assert Kind.SPARSE not in kinds[first_b:], (R, M, r)


def test_sparse_hoist_costs_memory_not_time_when_lookups_are_free() -> None:
    """Hoisting only moves lookups: with free lookups the split runs as 1F1B does; its live
    activations (a hoisted lookup's output is held until the backward) are higher."""
    free_lookup = ActionDurations(F=1, E=0, B=2)
    split = simulate(build("1F1B-split", 4, 8), free_lookup)
    plain = simulate(build("1F1B", 4, 8), free_lookup)
    assert split.makespan == plain.makespan == 33
    assert plain.peak_activations == (4, 3, 2, 1)
    assert split.peak_activations == (8, 8, 8, 8)


def test_program_replace_keeps_placement() -> None:
    p = build("1F1B", 2, 2)
    q = p.replace(name="renamed")
    assert isinstance(q, Program) and q.placement == p.placement and q.name == "renamed"
