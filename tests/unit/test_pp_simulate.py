"""The all-rank simulator: textbook bubble fractions over a range of sizes, deadlocks it must
report (naming every stuck rank's action), P2P models (latency, rendezvous, lazy channel
creation) and what they say about receive placement."""

from __future__ import annotations

import itertools

import pytest

from torchrec_swp.pp import (
    ActionDurations,
    PPDeadlock,
    PPError,
    Program,
    add_p2p,
    build,
    recv_ahead,
    simulate,
    validate,
)
from torchrec_swp.pp.builders import SCHEDULES, gpipe, interleaved_1f1b, maglev_1f1b, one_f_one_b, zb_h1, zbv


def close(a: float, b: float) -> bool:
    return abs(a - b) < 1e-9


@pytest.mark.parametrize("fb", [(1, 1), (1, 2), (2, 3)])
def test_gpipe_and_1f1b_bubble_is_s_minus_1_over_m_plus_s_minus_1(fb: tuple[int, int]) -> None:
    d = ActionDurations(F=fb[0], B=fb[1])
    for S in range(1, 7):
        for M in range(1, 13):
            expected = (S - 1) / (M + S - 1)
            for builder in (gpipe, one_f_one_b):
                result = simulate(add_p2p(builder(S, M)), d)
                assert close(result.bubble, expected), (builder.__name__, S, M, result.bubble, expected)
                assert result.makespan == (M + S - 1) * (fb[0] + fb[1])


@pytest.mark.parametrize("fb", [(1, 1), (1, 2), (2, 3)])
def test_interleaved_bubble_is_divided_by_the_virtual_stages(fb: tuple[int, int]) -> None:
    """Megatron: (S - 1) / (v M + S - 1) when M is a multiple of S."""
    d = ActionDurations(F=fb[0], B=fb[1])
    for S in range(2, 6):
        for v in (2, 3):
            for M in (S, 2 * S, 3 * S):
                result = simulate(add_p2p(interleaved_1f1b(S, M, v)), d)
                assert close(result.bubble, (S - 1) / (v * M + S - 1)), (S, v, M, result.bubble)


@pytest.mark.parametrize("fiw", [(1, 1, 1), (2, 2, 1), (1, 2, 1), (2, 1, 1)])
def test_zb_h1_bubble_is_s_minus_1_times_f_plus_i_minus_w(fiw: tuple[int, int, int]) -> None:
    """ZB paper: ZB-H1's bubble is (S - 1)(F + I - W) per rank (1F1B: (S - 1)(F + I + W)), for
    W no longer than F and I; with W = 2 > F = I = 1 the held-back W's no longer fit."""
    F, I, W = fiw  # noqa: E741 - the ZB paper's names (forward, input grad, weight grad)
    d = ActionDurations(F=F, I=I, W=W)
    for S in range(1, 7):
        for M in range(S, 13):
            bubble = (S - 1) * (F + I - W)
            result = simulate(add_p2p(zb_h1(S, M)), d)
            assert close(result.bubble, bubble / (M * (F + I + W) + bubble)), (S, M, result.bubble)
    assert simulate(zb_h1(4, 8), ActionDurations(F=1, I=1, W=2)).bubble > 0


def test_zbv_bubble_at_equal_f_i_w() -> None:
    """Measured: (R - 1) idle units per rank, whatever M >= 2R - 1 (CP-SAT proves that optimal
    for R = 3, M = 6 in test_pp_exact.py)."""
    d = ActionDurations(F=1, I=1, W=1)
    for R in range(1, 6):
        for M in range(2 * R - 1, 13):
            result = simulate(add_p2p(zbv(R, M)), d)
            assert result.makespan == 6 * M + R - 1, (R, M)


def test_peak_activations() -> None:
    assert simulate(build("1F1B", 4, 8)).peak_activations == (4, 3, 2, 1)
    assert simulate(build("GPipe", 4, 8)).peak_activations == (8, 8, 8, 8)
    assert simulate(build("1F1B", 4, 2)).peak_activations == (2, 2, 2, 1)
    # the example's Megatron chart: 11, 9, 7, 5
    assert simulate(build("Interleaved1F1B", 4, 8), ActionDurations(F=5, B=10)).peak_activations == (11, 9, 7, 5)


def test_compute_only_program_with_latency() -> None:
    """Without P2P actions a cross-rank input arrives ``latency`` after its producer ends."""
    d = ActionDurations(F=1, B=1, latency=1)
    assert simulate(gpipe(2, 1), d).makespan == 6  # 0F0, hop, 1F0, 1B0, hop, 0B0


def test_timeline_is_ordered_per_rank_and_grid_renders() -> None:
    result = simulate(build("ZB-H1", 3, 4))
    for spans in result.timelines:
        for a, b in itertools.pairwise(spans):
            assert a.end <= b.start
    grid = result.grid()
    assert grid.splitlines()[1].startswith("rank 0  0F0")
    with pytest.raises(PPError, match="tick boundary"):
        simulate(build("1F1B", 2, 2), ActionDurations(F=1.5)).grid(tick=1)


# ---------------------------------------------------------------------------- deadlocks
def test_a_send_placed_after_what_the_peer_must_do_first_deadlocks() -> None:
    """Rank 0 waits for 1's gradient before sending the activation rank 1 needs to produce it."""
    broken = Program.from_text(
        "program broken microbatches=1 placement=0,1\n"
        "rank 0: 0F0 0RB0 0B0 0SF0\n"  # 0SF0 belongs right after 0F0
        "rank 1: 1RF0 1F0 1B0 1SB0\n"
    )
    with pytest.raises(PPDeadlock) as e:
        simulate(broken)
    stuck = {s.rank: (s.action, s.waits_for) for s in e.value.stuck}
    assert stuck == {0: ("0B0", "1SB0 on rank 1"), 1: ("1F0", "0SF0 on rank 0")}
    assert "rank 0 step 2 (0B0) waits for 1SB0 on rank 1" in str(e.value)
    assert ">0B0<" in str(e.value)  # the grid, culprit marked


def swapped_receives() -> Program:
    """1F1B, 2 ranks, 2 microbatches, except that rank 1 takes microbatch 1 before 0."""
    return Program.from_text(
        "program swapped microbatches=2 placement=0,1\n"
        "rank 0: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1\n"
        "rank 1: 1RF1 1F1 1B1 1SB1 1RF0 1F0 1B0 1SB0\n"
    )


def test_swapped_receive_order_across_ranks_deadlocks_with_synchronous_p2p() -> None:
    with pytest.raises(PPDeadlock) as e:
        simulate(swapped_receives(), comm="rendezvous")
    assert {(s.rank, s.action) for s in e.value.stuck} == {(0, "0SF0"), (1, "1RF1")}
    assert "rank 0 step 1 (0SF0) waits for 1RF0 on rank 1" in str(e.value)
    # isend/irecv do not block: the replay finishes, and only validate sees that the channel
    # would pair 0SF0's data with 1RF1's buffer (NCCL matches in issue order)
    simulate(swapped_receives())
    with pytest.raises(PPError, match="receive #0 is 1RF1 but send #0 is 0SF0") as v:
        validate(swapped_receives())
    assert (v.value.rank, v.value.step, v.value.action) == (1, 0, "1RF1")


# ---------------------------------------------------------------------- P2P placement
def test_receive_ahead_hides_latency() -> None:
    """Maglev1F1BRecvAhead's point: a receive posted just before its consumer exposes the whole
    transfer; posted one compute ahead it lands while that compute runs."""
    d = ActionDurations(F=1, B=2, latency=0.5)
    just_in_time = simulate(maglev_1f1b(4, 8), d)
    ahead = simulate(maglev_1f1b(4, 8, recv_ahead=True), d)
    ideal = simulate(one_f_one_b(4, 8), d)  # transfers start when the producer ends
    assert (just_in_time.makespan, ahead.makespan, ideal.makespan) == (42.5, 41.0, 41.0)


def test_gradient_receive_posted_during_warmup_deadlocks_with_lazy_channels() -> None:
    """Maglev1F1BRecvAhead's note: the first receive on a pair creates the communicator and
    blocks until the peer's first operation there, so a gradient receive posted during the
    forwards parks the rank. One ahead is safe; two ahead is not."""
    one = recv_ahead(build("1F1B", 4, 8, step=False), 1)
    two = recv_ahead(build("1F1B", 4, 8, step=False), 2)
    validate(two)
    simulate(two)  # fine when channels exist up front
    assert simulate(one, lazy_init=True).makespan == 36  # the first RB still waits for the peer's first SB
    with pytest.raises(PPDeadlock) as e:
        simulate(two, lazy_init=True)
    assert "first use of the channel" in str(e.value)


# Which builders' just-in-time programs survive the stricter P2P models (see comm rule 4).
RENDEZVOUS_OK = {"GPipe", "1F1B", "ZB-H1", "1F1B-split"}
LAZY_INIT_OK = set(SCHEDULES) - {"InterleavedZB"}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_strict_p2p_models(name: str) -> None:
    program = build(name, 4, 8)
    for ok, kwargs in ((RENDEZVOUS_OK, {"comm": "rendezvous"}), (LAZY_INIT_OK, {"lazy_init": True})):
        if name in ok:
            simulate(program, **kwargs)  # type: ignore[arg-type]
        else:
            with pytest.raises(PPDeadlock):
                simulate(program, **kwargs)  # type: ignore[arg-type]


def test_gradient_sync_inside_the_last_backward_delays_the_upstream_stage() -> None:
    """Maglev's DDP reduces during the last backward, before that backward's send: with a
    costly all-reduce each stage's last gradient leaves one sync later, and the delays add up
    down the pipeline: 33 + 4 x 3 against 33 + 3 when each stage syncs after its send."""
    d = ActionDurations(F=1, B=2, G=3)
    maglev = simulate(maglev_1f1b(4, 8), d)
    after_send = simulate(build("1F1B", 4, 8), d)
    assert (maglev.makespan, after_send.makespan) == (45.0, 36.0)


def test_bad_arguments() -> None:
    with pytest.raises(PPError, match="comm must be"):
        simulate(build("1F1B", 2, 2), comm="eager")  # type: ignore[arg-type]
    with pytest.raises(PPError, match="duration F"):
        ActionDurations(F=-1)
    assert ActionDurations.from_text(str(ActionDurations(F=5, B=10, stage_scale=(1, 2)))) == ActionDurations(
        F=5, B=10, stage_scale=(1, 2)
    )
    with pytest.raises(PPError, match="bad duration"):
        ActionDurations.from_text("X=1")
