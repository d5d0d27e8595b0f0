"""Exact mode (CP-SAT, through autosched's solve_dag): the interleaved example of docs/autosched.md (CP-SAT
285 against greedy list scheduling's 320, Megatron's schedule also 285), and the optimum never
above any builder's makespan on the same durations, placement and activation caps."""

from __future__ import annotations

import pytest

pytest.importorskip("ortools")

from torchrec_swp.pp import ActionDurations, PPError, loop_placement, simulate, validate
from torchrec_swp.pp.actions import COMPUTE
from torchrec_swp.pp.builders import SCHEDULES, interleaved_1f1b, one_f_one_b
from torchrec_swp.pp.exact import greedy, solve

SEED = ActionDurations(F=5, B=10)
# the example's charts: the layers (stages) each device runs, in order
SEED_GREEDY = ["00004444000044400404444044400400", "11115555111515511515155555511511",
               "22226666626262226222666666622622", "33337777773737333333777777373733"]  # fmt: skip
SEED_MEGATRON = ["00004444000404444440400044440000", "11115555151515155151515155551111",
                 "22226666662626222262626666662222", "33337777777733333333777777773333"]  # fmt: skip


def stages(program, rank: int) -> str:
    return "".join(str(a.stage) for a in program.ranks[rank] if a.is_compute)


def test_seed_002_anchor() -> None:
    placement = loop_placement(4, 2)
    exact = solve(8, placement, SEED, time_limit_s=30)
    validate(exact.program)
    assert exact.makespan == 285 and exact.optimal
    assert simulate(exact.program, SEED).makespan == 285
    program, makespan = greedy(8, placement, SEED)
    validate(program)
    assert makespan == 320 == simulate(program, SEED).makespan
    assert [stages(program, r) for r in range(4)] == SEED_GREEDY
    megatron = interleaved_1f1b(4, 8)
    assert [stages(megatron, r) for r in range(4)] == SEED_MEGATRON
    result = simulate(megatron, SEED)
    assert result.makespan == 285 and result.peak_activations == (11, 9, 7, 5)
    print(f"interleaved example: CP-SAT 285 proven in {exact.seconds:.2f}s, greedy 320, Megatron 285")


def test_seed_002_with_at_most_8_activations_per_rank() -> None:
    exact = solve(8, loop_placement(4, 2), SEED, activation_caps=8, time_limit_s=30)
    assert exact.makespan == 285 and exact.optimal
    result = simulate(exact.program, SEED)
    assert result.makespan == 285 and max(result.peak_activations) <= 8


SIZES = [(2, 4), (3, 6)]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_optimum_is_never_above_a_builder(name: str) -> None:
    for R, M in SIZES:
        if not SCHEDULES[name].supports(R, M):
            continue
        program = SCHEDULES[name].build(R, M)
        split = any(a.kind.value == "I" for r in program.ranks for a in r)
        if split and R == 2 and program.num_stages > R:
            continue  # 2-rank V/looped split problems take CP-SAT seconds to prove
        d = ActionDurations(F=1, B=2, I=1, W=1, E=0)
        built = simulate(program, d)
        exact = solve(M, program.placement, d, split_backward=split, time_limit_s=10)
        validate(exact.program)
        assert exact.makespan <= built.makespan, (name, R, M, exact.makespan, built.makespan)
        assert simulate(exact.program, d).makespan == exact.makespan
        print(f"{name} R={R} M={M}: builder {built.makespan:g}, CP-SAT {exact.makespan} "
              f"({'optimal' if exact.optimal else 'not proven'}, {exact.seconds:.2f}s)")  # fmt: skip


def test_zbv_is_optimal_at_equal_f_i_w() -> None:
    d = ActionDurations(F=1, I=1, W=1)
    zbv = SCHEDULES["ZBV"].build(3, 6)
    exact = solve(6, zbv.placement, d, split_backward=True, time_limit_s=10)
    assert exact.optimal and exact.makespan == simulate(zbv, d).makespan == 38


def test_activation_caps_and_latency() -> None:
    d = ActionDurations(F=1, B=2)
    caps = (3, 2, 1)  # 1F1B's own peaks on 3 ranks
    exact = solve(6, loop_placement(3), d, activation_caps=caps, time_limit_s=10)
    result = simulate(exact.program, d)
    assert all(p <= c for p, c in zip(result.peak_activations, caps, strict=True))
    assert exact.makespan <= simulate(one_f_one_b(3, 6), d).makespan
    tight = solve(6, loop_placement(3), d, activation_caps=1, time_limit_s=10)
    assert tight.makespan == 6 * 3 * 3  # one microbatch at a time through 3 stages
    # the solver's transfers start when the producer ends: so does a compute-only replay; with
    # receives posted just before their consumers the latency shows (see recv_ahead)
    slow = ActionDurations(F=1, B=2, latency=1)
    exact = solve(6, loop_placement(3), slow, time_limit_s=10)
    compute = exact.program.only(COMPUTE)
    assert exact.makespan == simulate(compute, slow).makespan == 28 <= simulate(one_f_one_b(3, 6), slow).makespan
    assert simulate(exact.program, slow).makespan == 34
    with pytest.raises(PPError, match="integer durations"):
        solve(2, loop_placement(2), ActionDurations(F=1.5))
    with pytest.raises(PPError, match="activation caps"):
        solve(2, loop_placement(2), d, activation_caps=(1,))
