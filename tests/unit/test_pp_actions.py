"""The action vocabulary and the program text: exact round trips, typed errors naming the culprit."""

from __future__ import annotations

import pytest

from torchrec_swp.pp import SCHEDULES, Action, Kind, PPError, Program, act, build, loop_placement, v_placement
from torchrec_swp.pp.builders import maglev_1f1b


@pytest.mark.parametrize("text", ["0F1", "12B0", "0I3", "0W2", "3E7", "0SF1", "1RF1", "2SB10", "1RB0", "2G", "0O"])
def test_action_text_round_trips(text: str) -> None:
    a = Action.from_text(text)
    assert str(a) == text and Action.from_text(str(a)) == a


def test_action_fields_and_matching() -> None:
    assert Action.from_text("1RF3") == Action(1, Kind.RECV_F, 3)
    assert Action.from_text("0SF1").matching() == Action.from_text("1RF1")
    assert Action.from_text("2SB4").matching() == Action.from_text("1RB4")
    assert Action.from_text("1RB4").peer_stage == 2 and Action.from_text("1RB4").direction == "B"
    assert act("0F0 0SF0 1G") == (Action(0, Kind.FORWARD, 0), Action(0, Kind.SEND_F, 0), Action(1, Kind.GRAD_SYNC))


@pytest.mark.parametrize("text", ["F1", "0X1", "01F1", "0F01", "0G1", "0F", "0 F1", "-1F0", "0SF"])
def test_bad_action_texts_are_rejected_naming_them(text: str) -> None:
    with pytest.raises(PPError) as e:
        Action.from_text(text)
    assert e.value.action is not None


def test_action_constructor_checks_types() -> None:
    with pytest.raises(PPError, match="microbatch"):
        Action(0, Kind.FORWARD)
    with pytest.raises(PPError, match="no microbatch"):
        Action(0, Kind.STEP, 1)
    with pytest.raises(PPError, match="stage"):
        Action(-1, Kind.FORWARD, 0)
    with pytest.raises(PPError, match="unknown action kind"):
        Action(0, "Q", 0)  # type: ignore[arg-type]


def test_placements() -> None:
    assert loop_placement(4) == (0, 1, 2, 3)
    assert loop_placement(2, 3) == (0, 1, 0, 1, 0, 1)
    assert v_placement(3) == (0, 1, 2, 2, 1, 0)
    with pytest.raises(PPError, match="num_ranks"):
        loop_placement(0)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_program_text_round_trips_for_every_schedule(name: str) -> None:
    program = build(name, 4, 8, recv_ahead=1)
    text = program.to_text()
    assert Program.from_text(text) == program
    assert Program.from_text(text).to_text() == text


def test_program_text_shape_and_errors() -> None:
    text = maglev_1f1b(2, 2).to_text()
    assert text == (
        "program Maglev1F1B microbatches=2 placement=0,1\n"
        "rank 0: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1 0G 0O\n"
        "rank 1: 1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1G 1SB1 1O\n"
    )
    with pytest.raises(PPError, match="line 2: expected 'rank 0:'"):
        Program.from_text("program x microbatches=1 placement=0\nrank 1: 0F0\n")
    with pytest.raises(PPError, match="line 2: bad action '0Q0'") as e:
        Program.from_text("program x microbatches=1 placement=0\nrank 0: 0F0 0Q0\n")
    assert e.value.action == "0Q0"
    with pytest.raises(PPError, match="placed on rank 3"):
        Program("x", 1, (3,), ((),))
    with pytest.raises(PPError, match="no 'program' line"):
        Program.from_text("rank 0: 0F0\n")
