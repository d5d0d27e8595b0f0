"""The lowered program text round-trips: ``parse_program(format_program(p), plan) == p`` and the
text formats back unchanged, for every program of every golden plan (each set of active stages,
each thread map the goldens use and ``by_stream``, with and without device streams and the CPU's
no-ops dropped) and for every pipeline-parallel rank program; bad text is refused at its line."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchrec_swp.compile import CompiledPlan, format_program, parse_program
from torchrec_swp.plan import PhasedPlan, PipelinePlan, PlanError
from torchrec_swp.plan.text_read import is_phased_text
from torchrec_swp.pp.builders import build
from torchrec_swp.pp.lower_rank import lower_rank

GOLDEN = Path(__file__).parent.parent / "golden" / "plans"


def golden_plans() -> list[tuple[str, PipelinePlan]]:
    out = []
    for path in sorted(GOLDEN.glob("*.txt")):
        text = path.read_text().split("\n\n")[-1]  # the plan text, after the schedule table
        read = (PhasedPlan if is_phased_text(text) else PipelinePlan).from_text(text)
        for i, plan in enumerate(getattr(read, "plans", (read,))):
            out.append((f"{path.stem}[{i}]", plan))
    return out


def variants(plan: PipelinePlan) -> list[PipelinePlan]:
    """The plan, and its ``by_stream`` thread map where the plan admits one (a plan with parallel
    loads keeps its source's thread)."""
    try:
        return [plan, plan.with_thread_map("by_stream")]
    except PlanError:
        return [plan]


def round_trip(program, plan):  # type: ignore[no-untyped-def]
    text = format_program(program)
    parsed = parse_program(text, plan)
    assert parsed == program, f"parsed differs from the program:\n{text}"
    assert format_program(parsed) == text


@pytest.mark.parametrize(("name", "plan"), golden_plans(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_program_of_every_golden_plan_round_trips(name: str, plan: PipelinePlan) -> None:
    seen = 0
    for variant in variants(plan):
        for kwargs in ({}, {"device_streams": True}, {"device_streams": True, "device_type": "cpu"}):
            compiled = CompiledPlan(variant, **kwargs)  # type: ignore[arg-type]
            for n in (1, 2, 5):
                for _, program in compiled.iterations(n):
                    round_trip(program, variant)
                    seen += 1
    assert seen > 0


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZB", "DualPipeV"])
def test_pipeline_parallel_rank_programs_round_trip(schedule: str) -> None:
    program = build(schedule, 4, 8)
    for rank in range(4):
        lowered = lower_rank(program, rank, {"SF": "send", "SB": "send", "RF": "recv", "RB": "recv"})
        round_trip(lowered, None)


def test_the_text_holds_every_kind_of_instruction() -> None:
    """The goldens reach each instruction kind, so the round trip above covers them all."""
    kinds: set[str] = set()
    for _, plan in golden_plans():
        for variant in variants(plan):
            for device_type in (None, "cpu"):
                for _, program in CompiledPlan(variant, device_streams=True, device_type=device_type).iterations(3):
                    kinds |= {type(i).__name__ for _, instrs in program.threads for i in instrs}
    assert kinds == {"Run", "WaitTask", "Signal", "WaitStream", "RecordEvent", "Alias"}


SPARSE = next(p for n, p in golden_plans() if n == "TrainPipelineSparseDist[0]")


@pytest.mark.parametrize(
    ("text", "line", "says"),
    [
        ("stages 0,1\nthread default:\n  run Forwrd", 3, "unknown task 'Forwrd'"),
        ("stages 0,1\nthread default:\n  run Forward if sometimes", 3, "unknown guard 'sometimes'"),
        ("stages 0,1\nthread default:\n  run Forward if always", 3, "unknown guard 'always'"),
        ("stages 0,1\nthread default:\n  jump Forward", 3, "unknown instruction 'jump'"),
        ("stages 0,x\nthread default:\n  run Forward", 1, "bad number"),
        ("thread default:\n  run Forward", 1, "starts with 'stages"),
        ("stages 0\n  run Forward", 2, "before the first 'thread NAME:'"),
        ("stages 0\nthread default:\n  stream default <- Forward@1", 3, "followed by the run"),
        ("stages 0\nthread default:\n  wait Forward@P-x", 3, "bad number"),
        ("stages 0\nthread default:\n  run H2D x1", 3, "xN"),
    ],
)
def test_bad_program_text_is_refused_at_its_line(text: str, line: int, says: str) -> None:
    with pytest.raises(PlanError) as e:
        parse_program(text, SPARSE)
    assert f"line {line}:" in str(e.value) and says in str(e.value), str(e.value)


def test_a_program_of_a_plan_needs_its_plan() -> None:
    with pytest.raises(PlanError, match="parsed with its plan"):
        parse_program("stages 0\nthread default:\n  run Forward", None)
