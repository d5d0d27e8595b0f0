"""validate: each rule rejects its broken program with a PPError naming rank, step and action,
and the program grid with that cell marked."""

from __future__ import annotations

import pytest

from torchrec_swp.pp import PPError, Program, build, validate

GOOD = "rank 0: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1 0G 0O\nrank 1: 1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1 1G 1O\n"


def program(rank0: str, rank1: str) -> Program:
    return Program.from_text(f"program p microbatches=2 placement=0,1\nrank 0: {rank0}\nrank 1: {rank1}\n")


def test_good_program_passes() -> None:
    validate(Program.from_text("program p microbatches=2 placement=0,1\n" + GOOD))


R1 = "1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1"
CASES = [
    # (rank 0, rank 1, message, rank, step, action)
    ("0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1 1F5", R1, "lives on rank 1", 0, 8, "1F5"),
    ("0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1 0F2", R1, "microbatch 2 does not exist", 0, 8, "0F2"),
    ("0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1 0B1", R1, "0B1 runs twice", 0, 8, "0B1"),
    ("0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1", R1, "0B1 is missing", 0, 7, None),
    ("0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0I1 0B1", R1, "a backward is either full or split", 0, 7, "0I1"),
    ("0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0I1", R1, "0W1 is missing", 0, 8, None),
    ("0F0 0SF0 0RB1 0W1 0F1 0SF1 0RB0 0B0 0I1", R1, "0W1 runs before 0I1", 0, 3, "0W1"),
    ("0F0 0SF0 0RB0 0B0 0F1 0SF1 0RB1 0B1", "1RF0 1F0 1B0 1SB0 1RF1 1B1 1F1 1SB1", "1B1 runs before 1F1", 1, 5, "1B1"),
    ("0SF0 0F0 0F1 0SF1 0RB0 0B0 0RB1 0B1", R1, "0SF0 must come after 0F0", 0, 0, "0SF0"),
    ("0F0 0SF0 0F1 0SF1 0B0 0RB0 0RB1 0B1", R1, "0RB0 must come before 0B0", 0, 5, "0RB0"),
    ("0F0 0SF0 0F1 0SF1 0B0 0RB1 0B1", R1, "0B0 needs 0RB0 before it", 0, 4, "0B0"),
    (
        "0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1",
        "1RF0 1F0 1B0 1SB0 1F1 1B1 1SB1",
        "0SF1 has no matching 1RF1",
        0,
        3,
        "0SF1",
    ),
    ("0F0 0RF0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1", R1, "0RF0 has no peer stage on another rank", 0, 1, "0RF0"),
    ("0F0 0SF0 0F1 0SF1 0RB1 0RB0 0B0 0B1", R1, "receive #0 is 0RB1 but send #0 is 1SB0", 0, 4, "0RB1"),
    ("0F0 0SF0 0F1 0SF1 0RB0 0B0 0G 0RB1 0B1", R1, "0G runs before stage 0's last weight gradient", 0, 6, "0G"),
    ("0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1 0O 0G", R1, "0O runs before stage 0's gradients are final", 0, 8, "0O"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[2] for c in CASES])
def test_each_rule_names_its_culprit(case: tuple) -> None:
    rank0, rank1, message, rank, step, action = case
    with pytest.raises(PPError) as e:
        validate(program(rank0, rank1))
    text = str(e.value)
    assert message in text
    assert (e.value.rank, e.value.step, e.value.action) == (rank, step, action)
    marked = [line for line in text.splitlines() if ">" in line and "<" in line and line.startswith("rank")]
    assert len(marked) == 1 and marked[0].startswith(f"rank {rank}")


def test_compute_only_programs_need_no_p2p_and_sparse_is_all_or_nothing() -> None:
    validate(build("1F1B", 3, 4).only({a.kind for r in build("1F1B", 3, 4).ranks for a in r if a.is_compute}))
    with pytest.raises(PPError, match="has sparse forwards"):
        validate(program("0E0 0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"))
    with pytest.raises(PPError, match="0F1 runs before 0E1"):
        validate(program("0E0 0F0 0F1 0E1 0B0 0B1", "1F0 1B0 1F1 1B1"))
