"""The plan language: construction, inferred deps, validation, text form, thread maps, table."""

from __future__ import annotations

import re

import pytest

from torchrec_swp.plan import Dep, PhasedPlan, PipelinePlan, PipelineTask, PlanError, TaskSchedule, When

S = TaskSchedule


def three_stage(**changes: object) -> PipelinePlan:
    args: dict[str, object] = dict(
        schedule={"Fwd": S(2), "Dist": S(1, "data_dist", comm_group="world"), "H2D": S(0, "memcpy")},
        tasks=[
            PipelineTask("H2D", writes=("batch_gpu",)),
            PipelineTask("Dist", reads=("batch_gpu",), writes=("dist",)),
            PipelineTask("Fwd", reads=("batch_gpu", "dist"), writes=("out",)),
        ],
        inter_iter_deps=[("Fwd", "Fwd")],
        source="H2D",
        output="out",
        name="toy",
    )
    args.update(changes)
    return PipelinePlan(**args)  # type: ignore[arg-type]


def test_reads_and_writes_become_deps_merged_with_explicit_ones() -> None:
    plan = three_stage()
    assert set(plan.deps) == {
        Dep("Fwd", "Fwd", 1),  # explicit
        Dep("Dist", "H2D"),  # Dist reads batch_gpu, which H2D writes
        Dep("Fwd", "H2D"),
        Dep("Fwd", "Dist"),
    }
    assert plan.deps[0] == Dep("Fwd", "Fwd", 1)  # explicit first
    assert plan.intra_iter_deps == tuple(d for d in plan.deps if d.distance == 0)


def test_explicit_dep_equal_to_an_inferred_one_is_kept_once() -> None:
    plan = three_stage(intra_iter_deps=[("Dist", "H2D")])
    assert plan.deps.count(Dep("Dist", "H2D")) == 1


def test_defaults_depth_and_fire_order() -> None:
    plan = three_stage()
    assert plan.pipeline_depth == 3
    assert plan.fire_order == ("Fwd", "Dist", "H2D")
    assert plan.max_stage == 2
    assert plan.task("Dist").comm_group == "world"
    assert plan.streams == ("default", "data_dist", "memcpy")


def test_globally_ordered_without_group_joins_world() -> None:
    assert S(1, globally_ordered=True).comm_group == "world"
    assert S(1, comm_group="pg2").globally_ordered
    assert not S(1, comm_group="pg2").replace(globally_ordered=False).globally_ordered


# ------------------------------------------------------------------ validation
BAD_PLANS: list[tuple[str, dict[str, object], str]] = [
    ("empty plan", {"schedule": {}, "tasks": [], "source": None, "output": None, "inter_iter_deps": []}, "no tasks"),
    ("unknown producer", {"intra_iter_deps": [("Fwd", "Nope")]}, "unknown producer task 'Nope'"),
    ("unknown consumer", {"inter_iter_deps": [("Nope", "Fwd")]}, "unknown consumer task 'Nope'"),
    (
        "cycle",
        {"intra_iter_deps": [("H2D", "Fwd")], "schedule": {"Fwd": S(0), "Dist": S(0), "H2D": S(0)}},
        "dependency cycle in one batch",
    ),
    (
        "consumer at a lower stage than its producer",
        {
            "schedule": {"Fwd": S(2), "Log": S(2), "Dist": S(1, "data_dist"), "H2D": S(0, "memcpy")},
            "intra_iter_deps": [("Dist", "Log")],
        },
        "cannot be satisfied: Log (stage 2) works on batch b at iteration b+2, after Dist (stage 1)",
    ),
    (
        "same stage, wrong fire order",
        {"schedule": {"Fwd": S(2), "Dist": S(0), "H2D": S(0, "memcpy")}},
        "must come before Dist in the fire order",
    ),
    ("depth below stage span", {"pipeline_depth": 2}, "smaller than the stage span 3"),
    ("duplicate in fire order", {"fire_order": ["Fwd", "Dist", "H2D", "Fwd"]}, "appears twice"),
    ("task missing from fire order", {"fire_order": ["Fwd", "Dist"]}, "missing from the fire order"),
    ("unknown task in fire order", {"fire_order": ["Fwd", "Dist", "H2D", "X"]}, "unknown task 'X'"),
    ("self dep in one batch", {"intra_iter_deps": [("Fwd", "Fwd")]}, "cannot depend on itself"),
    # a dep on a later batch (Dist(b+1) runs one stage lower in the same iteration) must follow fire order
    (
        "later batch fired after",
        {"inter_iter_deps": [("Fwd", "Dist", -1)]},
        "both run in the same iteration, so Dist must come before Fwd",
    ),
    (
        "later batch too far",
        {"inter_iter_deps": [("Fwd", "Dist", -2)]},
        "Dist (stage 1) works on batch b+2 at iteration b+3",
    ),
    ("distance not an int", {"inter_iter_deps": [("Fwd", "Dist", 1.5)]}, "dependency must be"),
    (
        "read that nobody writes",
        {"tasks": [PipelineTask("Fwd", reads=("ghost",))]},
        "reads 'ghost', which no task writes",
    ),
    (
        "two writers",
        {"tasks": [PipelineTask("H2D", writes=("x",)), PipelineTask("Dist", writes=("x",))], "output": None},
        "written by both Dist and H2D",
    ),
    ("source not at stage 0", {"source": "Dist"}, "must be at stage 0"),
    ("unknown source", {"source": "Loader"}, "source 'Loader' is not a task"),
    ("output nobody writes", {"output": "loss"}, "output 'loss' is not written"),
    (
        "stage-0 task not fed by the source",
        {"schedule": {"Fwd": S(2), "Dist": S(1, "data_dist"), "H2D": S(0, "memcpy"), "Side": S(0)}},
        "does not depend on the source H2D",
    ),
    ("bad exhausted policy", {"on_exhausted": "retry"}, "on_exhausted must be"),
    ("schedule of wrong type", {"schedule": {"Fwd": 2, "Dist": S(1), "H2D": S(0)}}, "must be a TaskSchedule"),
]


@pytest.mark.parametrize("what,changes,message", BAD_PLANS, ids=[b[0] for b in BAD_PLANS])
def test_plans_that_cannot_run_are_rejected_with_a_named_culprit(
    what: str, changes: dict[str, object], message: str
) -> None:
    with pytest.raises(PlanError, match=re.escape(message)) as info:
        three_stage(**changes)
    assert info.value.culprit, f"{what}: the error names no culprit"


def test_cycle_message_shows_the_path() -> None:
    with pytest.raises(PlanError) as info:
        PipelinePlan(
            schedule={"A": S(0), "B": S(0), "C": S(0)},
            intra_iter_deps=[("B", "A"), ("C", "B"), ("A", "C")],
        )
    assert (
        "A -> C -> B -> A" in str(info.value)
        or "B -> A -> C -> B" in str(info.value)
        or "C -> B -> A -> C" in str(info.value)
    )


def test_bad_schedule_fields_and_names() -> None:
    with pytest.raises(PlanError, match="stage must be >= 0"):
        S(-1)
    with pytest.raises(PlanError, match="stage must be an int"):
        S("1")  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="not an identifier"):
        S(0, stream="mem cpy")
    with pytest.raises(PlanError, match="not an identifier"):
        PipelineTask("for ward")
    with pytest.raises(PlanError, match="reads a name twice"):
        PipelineTask("F", reads=("x", "x"))


def test_inter_dep_across_stages_is_satisfiable_by_earlier_iteration() -> None:
    # Dist(b) (stage 1) after Fwd(b-1) (stage 2): Fwd(b-1) runs at iteration b+1, Dist(b) at b+1:
    # same iteration, so Fwd must fire first -- it does (fire order Fwd, Dist, H2D).
    plan = three_stage(inter_iter_deps=[("Dist", "Fwd")])
    assert Dep("Dist", "Fwd", 1) in plan.deps
    with pytest.raises(PlanError, match="must come before"):
        three_stage(inter_iter_deps=[("Dist", "Fwd")], fire_order=["Dist", "Fwd", "H2D"])
    # distance 2 reaches an instance two iterations back: always satisfied
    assert Dep("H2D", "Fwd", 2) in three_stage(inter_iter_deps=[("H2D", "Fwd", 2)]).deps


# ------------------------------------------------------------------ text form
def test_text_round_trip_is_exact() -> None:
    plan = three_stage(inter_iter_deps=[("Fwd", "Fwd"), ("H2D", "Fwd", 2)], on_exhausted="stop").with_thread_map(
        {"H2D": "io"}
    )
    text = plan.to_text()
    again = PipelinePlan.from_text(text)
    assert again == plan
    assert hash(again) == hash(plan)
    assert again.to_text() == text
    # one row per task, in fire order, columns aligned under the header
    rows = [line for line in text.splitlines() if line.startswith(("task ", "#"))]
    assert rows[0].split() == [
        "#", "task", "stage", "stream", "thread", "comm", "when", "reads", "writes", "effects", "flags"
    ]  # fmt: skip
    assert rows[3].split() == ["task", "H2D", "0", "memcpy", "io", "-", "-", "-", "batch_gpu", "-", "-"]
    assert len({row.index(row.split()[2]) for row in rows[1:]}) == 1  # the stage column is aligned
    assert [r.split()[1] for r in rows[1:]] == list(plan.fire_order)
    assert "dep H2D <- Fwd @2" in text
    guarded = PipelinePlan(
        schedule={"A": S(0), "B": S(1, when="first"), "C": S(2, when="last")},
        tasks=[PipelineTask("A", writes=("x",)), PipelineTask("B", reads=("x", "x@1"), anchor=True),
               PipelineTask("C", writes=("y",), noop_on=("cpu", "mtia"), reads=("x",))],
        source="A",
    )
    text = guarded.to_text()
    assert "task B     1      default  default  -     first  x,x@1  -       -        anchor" in text
    assert "noop_on=cpu+mtia" in text
    assert PipelinePlan.from_text(text) == guarded


def test_text_form_refuses_the_old_key_value_rows() -> None:
    # the first text form's rows, 'task NAME stage=2 stream=... reads=a,b', are no longer read: the
    # error is at the row's first key=value cell and names the columns to write instead
    old = (
        "plan toy\ndepth 3\nsource H2D\noutput out\nexhausted drain\n"
        "task Fwd stage=2 stream=default thread=default comm=world reads=y writes=out\n"
        "task H2D stage=0 stream=memcpy thread=default writes=y\n"
    )
    with pytest.raises(PlanError) as info:
        PipelinePlan.from_text(old)
    assert str(info.value) == (
        "line 6, column 10: task rows of the old 'key=value' form are no longer read: a task row has 10 columns "
        "(task stage stream thread comm when reads writes effects flags; '-' for none) "
        "(in 'task Fwd stage=2 stream=default thread=default comm=world reads=y writes=out')"
    )
    assert (info.value.line, info.value.column, info.value.culprit) == (6, 10, "Fwd")


def test_text_form_ignores_comments_and_reports_bad_lines() -> None:
    text = three_stage().to_text().replace("depth 3", "depth 3   # three batches in flight") + "\n# the end\n"
    assert PipelinePlan.from_text(text) == three_stage()
    with pytest.raises(PlanError, match="line 6, column 10: task rows of the old 'key=value' form"):
        PipelinePlan.from_text(
            "plan p\ndepth 3\nsource H2D\noutput out\nexhausted drain\ntask Fwd stage=2 colour=red\n"
        )
    with pytest.raises(PlanError, match="a task row has 10 columns"):
        PipelinePlan.from_text("plan p\ndepth 1\ntask A 0 default default - -\n")
    with pytest.raises(PlanError, match="unknown flag 'fast' of task A"):
        PipelinePlan.from_text("plan p\ndepth 1\ntask A 0 default default - - - - fast\n")
    with pytest.raises(PlanError, match="when must be one of"):
        PipelinePlan.from_text("plan p\ndepth 1\ntask A 0 default default - sometimes - - -\n")
    with pytest.raises(PlanError, match="unknown keyword 'tsak'"):
        PipelinePlan.from_text("plan p\ndepth 1\ntsak A\n")
    with pytest.raises(PlanError, match="no 'depth' line"):
        PipelinePlan.from_text("plan p\ntask A 0 default default - - - - - -\n")
    with pytest.raises(PlanError, match="dep line reads"):
        PipelinePlan.from_text("plan p\ndepth 1\n" + "".join(f"task {t} 0 default default - - - - - -\n" for t in "AB")
                               + "dep A B\n")
    with pytest.raises(PlanError, match="phased plan"):
        PipelinePlan.from_text("phases p\nphase 0\nplan p\ndepth 1\n")


# Every error about a plan's text names its line the same way, ``line N: ... (in 'the line')``, and
# holds N in PlanError.line: the header, task rows, deps, the checks run once the plan is built (on the
# line that gave the culprit) and phased plans (line numbers of the whole text, not of one phase).
_ROW = "task A 0 default default - - - x -\n"
_PLAN = "plan p\ndepth 1\n" + _ROW
_LINE_ERRORS = [
    # (kind, text, line, words of the message)
    ("header value not an int", "plan p\ndepth three\n" + _ROW, 2, "depth must be an int, got 'three'"),
    ("lookahead not an int", "plan p\ndepth 1\nlookahead soon\n" + _ROW, 3, "lookahead must be an int"),
    ("header key twice", "plan p\ndepth 1\ndepth 2\n" + _ROW, 3, "'depth' given twice"),
    ("header line missing", "# a comment\nplan p\n" + _ROW, 2, "no 'depth' line"),
    ("plan line missing", "\ndepth 1\n" + _ROW, 2, "no 'plan' line"),
    ("empty text", "", 1, "no 'plan' line"),
    ("plan name not an identifier", "plan p!\ndepth 1\n" + _ROW, 1, "plan name 'p!' is not an identifier"),
    ("plan without tasks", "plan p\ndepth 1\n", 1, "plan p has no tasks"),
    ("bad exhausted", "plan p\ndepth 1\nexhausted never\n" + _ROW, 3, "on_exhausted must be 'drain' or 'stop'"),
    ("lookahead below 0", "plan p\ndepth 1\nlookahead -1\n" + _ROW, 3, "lookahead must be an int >= 0"),
    ("loads without a source", "plan p\ndepth 1\nloads 2\n" + _ROW, 3, "loads 2 needs a source task"),
    ("source not a task", "plan p\ndepth 1\nsource Q\n" + _ROW, 3, "source 'Q' is not a task"),
    ("output never written", "plan p\ndepth 1\noutput q\n" + _ROW, 3, "output 'q' is not written"),
    ("unknown keyword", _PLAN + "tsak B\n", 4, "unknown keyword 'tsak'"),
    ("task row short", _PLAN + "task B 0 default\n", 4, "a task row has 10 columns"),
    ("stage not an int", _PLAN + "task B one default default - - - - -\n", 4, "stage must be an int"),
    ("unknown flag", _PLAN + "task B 0 default default - - - - fast\n", 4, "unknown flag 'fast'"),
    ("unknown guard", _PLAN + "task B 0 default default - sometimes - - -\n", 4, "when must be one of"),
    ("bad stream name", _PLAN + "task B 0 st-ream default - - - - -\n", 4, "stream name 'st-ream'"),
    ("two comm groups", _PLAN + "task B 0 default default w,v - - - -\n", 4, "several comm groups"),
    ("duplicate task", _PLAN + _ROW, 4, "duplicate task name A"),
    ("old key=value row", _PLAN + "task B stage=0 colour=red\n", 4, "old 'key=value' form are no longer read"),
    ("reads what nobody writes", _PLAN + "task B 0 default default - - y - -\n", 4, "reads 'y', which no task writes"),
    ("stage past the depth", _PLAN + "task B 1 default default - - x - -\n", 4, "smaller than the stage span"),
    ("guard needs a source", _PLAN + "task B 0 default default - has_next x - -\n", 4, "needs a source task"),
    ("guard below the source", "plan p\ndepth 1\nsource A\n" + _ROW + "task B 0 default default - has_next x - -\n",
     5, "has not looked for batch"),
    ("dep syntax", _PLAN + "task B 0 default default - - - - -\ndep A B\n", 5, "a dep line reads"),
    ("dep distance", _PLAN + "task B 0 default default - - - - -\ndep A <- B @x\n", 5, "bad distance '@x'"),
    ("dep on an unknown task", _PLAN + "dep A <- Z\n", 4, "unknown producer task 'Z'"),
    ("dep on itself", _PLAN + "\ndep A <- A\n", 5, "cannot depend on itself"),
    ("dep never satisfied", _PLAN.replace("depth 1", "depth 2") + "task B 1 default default - - - - -\ndep A <- B\n",
     5, "cannot be satisfied"),
    ("phased text read as a plan", "phases x\nphase 0\n" + _PLAN, 1, "this is a phased plan"),
]
_PHASED_LINE_ERRORS = [
    ("phases line missing", "\n\nphase 0\n" + _PLAN, 3, "no 'phases' line"),
    ("phases line twice", "phases x\nphases y\nphase 0\n" + _PLAN, 2, "'phases' must come first"),
    ("line before the phases line", "plan p\nphases x\n", 1, "expected 'phases NAME'"),
    ("bad clock", "phases x\nclock wrong\nphase 0\n" + _PLAN, 2, "clock must be one of"),
    ("cycle syntax", "phases x\ncycle 1\nphase 0\n" + _PLAN, 2, "a cycle line reads 'cycle FIRST PERIOD'"),
    ("cycle not fitting the phases", "phases x\ncycle 3 1\nphase 0\n" + _PLAN, 2, "period must be >= 1"),
    ("phase start syntax", "phases x\nphase zero\n" + _PLAN, 2, "a phase line reads 'phase START'"),
    ("no phase", "phases x\n", 1, "needs at least one phase"),
    ("phase without a plan", "phases x\nphase 0\nphase 4\n" + _PLAN, 2, "no 'plan' line"),
    ("phase start twice", "phases x\nphase 0\n" + _PLAN + "phase 0\n" + _PLAN, 6, "must begin at 0 and increase"),
    ("phase starts out of order", "phases x\nphase 0\n" + _PLAN + "phase 5\n" + _PLAN + "phase 3\n" + _PLAN, 10,
     "must begin at 0 and increase"),
    ("phases that cannot take turns",
     "phases x\nphase 0\n" + _PLAN + "phase 4\n" + _PLAN.replace("task A", "task B"), 5, "cannot take turns"),
    ("error in a later phase's header",
     "phases x\nphase 0\n" + _PLAN + "phase 5\n" + _PLAN.replace("depth 1", "depth one"), 8, "depth must be an int"),
    ("error in a later phase's plan", "phases x\nphase 0\n" + _PLAN + "phase 5\n" + _PLAN + "dep A <- Q\n", 10,
     "unknown producer task 'Q'"),
]


@pytest.mark.parametrize(
    ("read", "text", "line", "words"),
    [(PipelinePlan.from_text, *case[1:]) for case in _LINE_ERRORS]
    + [(PhasedPlan.from_text, *case[1:]) for case in _PHASED_LINE_ERRORS],
    ids=[case[0] for case in _LINE_ERRORS + _PHASED_LINE_ERRORS],
)
def test_every_plan_text_error_names_its_line(read: object, text: str, line: int, words: str) -> None:
    with pytest.raises(PlanError) as info:
        read(text)  # type: ignore[operator]
    message = str(info.value)
    quoted = (text.splitlines()[line - 1] if text else "").strip()
    column = info.value.column
    assert message.startswith(f"line {line}, column {column}: " if column else f"line {line}: "), message
    assert message.endswith(f"(in {quoted!r})"), message
    assert words in message and info.value.line == line and info.value.culprit, message
    assert info.value.lines[0] == line, info.value.lines


def test_save_and_load(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "p.plan"
    three_stage().save(str(path))
    assert PipelinePlan.load(str(path)) == three_stage()


# ------------------------------------------------------------------ thread maps
def test_thread_map_strategies() -> None:
    plan = three_stage()
    by_stream = plan.with_thread_map("by_stream")
    assert [by_stream.task(t).thread_group for t in plan.fire_order] == ["default", "data_dist", "memcpy"]
    per_task = plan.with_thread_map("per_task")
    assert [per_task.task(t).thread_group for t in plan.fire_order] == ["Fwd", "Dist", "H2D"]
    moved = plan.with_thread_map({"H2D": "io"})
    assert moved.task("H2D").thread_group == "io" and moved.task("Fwd").thread_group == "default"
    assert moved.with_thread_map("main") == plan
    by_fn = plan.with_thread_map(lambda t: "io" if t.stream == "memcpy" else "compute")
    assert by_fn.thread_groups == ("compute", "io")
    # the thread map changes threads only
    assert [s.stream for s in by_fn.schedule.values()] == [s.stream for s in plan.schedule.values()]


def test_thread_map_errors() -> None:
    plan = three_stage()
    with pytest.raises(PlanError, match="unknown task 'h2d'"):
        plan.with_thread_map({"h2d": "io"})
    with pytest.raises(PlanError, match="unknown thread_map strategy 'by_thread'"):
        plan.with_thread_map("by_thread")
    with pytest.raises(PlanError, match="not an identifier"):
        plan.with_thread_map(lambda t: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(PlanError, match="must be a strategy name"):
        plan.with_thread_map(3)  # type: ignore[arg-type]


def test_io_strategy_puts_the_stage_0_tasks_on_thread_io() -> None:
    plan = three_stage(
        schedule={"Fwd": S(2), "Dist": S(1, "data_dist", comm_group="world"), "H2D": S(0, "memcpy"), "Log": S(0)},
        intra_iter_deps=[("Log", "H2D")],
    ).with_thread_map({"Dist": "dist"})
    io = plan.with_thread_map("io")
    assert {t: io.task(t).thread_group for t in io.fire_order} == {
        "Fwd": "default",
        "Dist": "dist",
        "H2D": "io",
        "Log": "io",
    }
    assert [s.stream for s in io.schedule.values()] == [s.stream for s in plan.schedule.values()]
    # a source with loads keeps its own lanes; the other stage-0 tasks still move
    loaded = plan.with_loads(2).with_thread_map("io")
    assert loaded.source_lanes() == ("load", "load.1") and loaded.task("Log").thread_group == "io"
    with pytest.raises(PlanError, match="unknown thread_map strategy 'IO'; use one of by_stream, per_task, main, io"):
        plan.with_thread_map("IO")


# ------------------------------------------------------------------ loads
def test_with_loads_moves_a_source_that_is_not_alone_on_a_worker_thread() -> None:
    plan = three_stage()
    on_caller = plan.with_loads(2)
    assert (on_caller.loads, on_caller.lookahead, on_caller.source_lanes()) == (2, 0, ("load", "load.1"))
    assert on_caller.task("H2D").schedule == plan.task("H2D").schedule.replace(thread_group="load")
    shared = plan.with_thread_map({"H2D": "io", "Dist": "io"}).with_loads(3, lookahead=1, thread="src")
    expected = (("src", "src.1", "src.2"), 1, "io")
    assert (shared.source_lanes(), shared.lookahead, shared.task("Dist").thread_group) == expected
    alone = plan.with_thread_map({"H2D": "io"}).with_loads(2)
    assert alone.source_lanes() == ("io", "io.1")
    assert on_caller.with_loads(1).loads == 1 and on_caller.with_loads(1).task("H2D").thread_group == "load"
    with pytest.raises(PlanError, match=r"with_loads\(2, thread='dist'\): .* 'dist' runs Dist; pass another thread="):
        plan.with_thread_map({"Dist": "dist"}).with_loads(2, thread="dist")
    with pytest.raises(PlanError, match="with_loads.*'default' is the calling thread"):
        plan.with_loads(2, thread="default")
    for bad in (0, True, 1.5):
        with pytest.raises(PlanError, match=f"loads must be an int >= 1, got {bad!r}"):
            plan.with_loads(bad)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="lookahead must be an int >= 0, got -1"):
        plan.with_loads(2, lookahead=-1)


HINT = re.compile(r"`(plan\.with_loads\([^`]*\))`")


def loads_hint(plan: PipelinePlan, **changes: object) -> str:
    """The code the error for ``plan.replace(**changes)`` says to run instead."""
    with pytest.raises(PlanError) as info:
        plan.replace(**changes)
    (code,) = HINT.findall(str(info.value))
    assert "\n" not in str(info.value)
    return code


@pytest.mark.parametrize(
    "thread_map, changes",
    [
        ("main", {"loads": 2}),
        ({"H2D": "io", "Dist": "io"}, {"loads": 2}),
        ({"H2D": "io", "Fwd": "io"}, {"loads": 3, "lookahead": 2}),
        ({"Dist": "load", "Fwd": "load_1"}, {"loads": 2}),  # "load" is taken: the hint names a free thread
    ],
)
def test_every_loads_error_shows_code_that_builds_a_valid_plan(thread_map: object, changes: dict[str, int]) -> None:
    plan = three_stage().with_thread_map(thread_map)  # type: ignore[arg-type]
    code = loads_hint(plan, **changes)
    fixed = eval(code, {"plan": plan})
    assert isinstance(fixed, PipelinePlan)
    assert (fixed.loads, fixed.lookahead) == (changes["loads"], changes.get("lookahead", 0))
    others = {t: fixed.task(t).thread_group for t in fixed.fire_order if t != "H2D"}
    assert others == {t: plan.task(t).thread_group for t in others}  # only the source moved
    assert fixed.task("H2D").thread_group not in {*others.values(), "default"}


# ------------------------------------------------------------------ table
def test_the_table_header_shows_batches_in_flight_and_the_source_loads() -> None:
    plan = three_stage()
    assert (
        plan.format_schedule(2).splitlines()[0]
        == "depth 3 + lookahead 0 = 3 batches in flight; loads 1: H2D on thread default"
    )
    ahead = plan.with_loads(2, lookahead=2)
    assert ahead.format_schedule(2).splitlines()[0] == (
        "depth 3 + lookahead 2 = 5 batches in flight; loads 2: H2D on threads load, load.1"
    )
    one = PipelinePlan(schedule={"A": S(0)}, name="one")
    assert one.format_schedule(1).splitlines()[0] == "depth 1 + lookahead 0 = 1 batch in flight; no source task"
    phased = PhasedPlan([(0, plan), (4, plan.replace(lookahead=1, name="later"))])
    first, second = phased.format_schedule(2).split("\n\n")
    assert first.splitlines()[1].startswith("depth 3 + lookahead 0 = 3 batches")
    assert second.splitlines()[:2] == [
        "phase 1 (batches 4 and on): later",
        "depth 3 + lookahead 1 = 4 batches in flight; loads 1: H2D on thread default",
    ]


# ------------------------------------------------------------------ table
def test_print_schedule_shows_fill_steady_and_drain_in_fire_order(capsys) -> None:  # type: ignore[no-untyped-def]
    plan = three_stage().with_thread_map({"H2D": "io"})
    plan.print_schedule(6, num_batches=3)
    assert capsys.readouterr().out == (
        "depth 3 + lookahead 0 = 3 batches in flight; loads 1: H2D on thread io\n"
        "   #  Task               Stage  Thread   Stream        | P0    P1    P2    P3    P4    P5\n"
        "  --  -----------------  -----  -------  ------------  + ----- ----- ----- ----- ----- -----\n"
        "   0  Fwd                    2  default  default       |  --    --   i0    i1    i2     --\n"
        "   1  Dist                   1  default  data_dist     |  --   i0    i1    i2     --    --\n"
        "   2  H2D                    0  io       memcpy        | i0    i1    i2     --    --    --\n"
    )
    # the fire order is the table's row order: moving a task moves its row
    assert three_stage().moved("H2D", before="Fwd").format_schedule(3).splitlines()[3].split()[1] == "H2D"


# ------------------------------------------------------------------ guards, previous batches, phases
def test_guards_and_previous_batch_reads_are_validated() -> None:
    base = {"A": S(0), "B": S(1), "C": S(2)}
    tasks = [PipelineTask("A", writes=("x",)), PipelineTask("B", reads=("x",)), PipelineTask("C", reads=("x",))]
    # b+1 is known only above the source's stage, and one stage above only after the source fires
    with pytest.raises(PlanError, match="task B runs when=last but the source A has not looked for batch b\\+1"):
        PipelinePlan(schedule={**base, "B": S(1, when="last")}, tasks=tasks, source="A", fire_order=["B", "A", "C"])
    ok = PipelinePlan(schedule={**base, "B": S(1, when="has_next")}, tasks=tasks, source="A")
    assert ok.task("B").when is When.HAS_NEXT
    with pytest.raises(PlanError, match="needs a source task"):
        PipelinePlan(schedule={**base, "C": S(2, when="has_next")}, tasks=tasks)
    # x@1 of batch b-1: inferred dep at distance 1; the batch must still be in flight
    prev = [tasks[0], PipelineTask("B", reads=("x@1",)), tasks[2]]
    plan = PipelinePlan(schedule=base, tasks=prev, source="A")
    assert Dep("B", "A", 1) in plan.deps and plan.tasks["B"].arguments == ("prev_x",)
    with pytest.raises(PlanError, match="reads 'x@2' from batch b-2, which left the pipeline"):
        PipelinePlan(schedule=base, tasks=[tasks[0], PipelineTask("B", reads=("x@2",)), tasks[2]], source="A")
    assert PipelineTask("T", reads=("x@3",)).arguments == ("prev3_x",)


def test_phased_plans_take_turns_and_must_agree_on_what_is_in_flight() -> None:
    a = three_stage()
    b = three_stage().moved("H2D", before="Fwd").replace(name="other")
    phased = PhasedPlan([(0, a), (5, b)], name="two")
    assert [phased.plan_for(n) is p for n, p in ((0, a), (4, a), (5, b), (99, b))] == [True] * 4
    assert PhasedPlan.from_text(phased.to_text()) == phased
    assert (phased.max_stage, phased.pipeline_depth) == (a.max_stage, a.pipeline_depth)
    assert "phase 1 (batches 5 and on): other" in phased.format_schedule(3)
    with pytest.raises(PlanError, match="must begin at 0 and increase"):
        PhasedPlan([(1, a)])
    with pytest.raises(PlanError, match="task Extra, in only one plan, writes data"):
        PhasedPlan(
            [(0, a), (3, a.with_task(PipelineTask("Extra", writes=("z",)), S(2), after="Fwd").replace(name="x"))]
        )
    with pytest.raises(PlanError, match="source, output and highest stage must stay the same"):
        PhasedPlan([(0, a), (3, a.replace(output=None, name="y"))])


def test_insert_and_move_tasks() -> None:
    plan = three_stage()
    plus = plan.with_task(PipelineTask("Log", reads=("dist",)), S(2), after="Fwd", deps=[("Log", "Fwd")])
    assert plus.fire_order == ("Fwd", "Log", "Dist", "H2D") and Dep("Log", "Fwd") in plus.deps
    assert plan.moved("Fwd", after="H2D").fire_order == ("Dist", "H2D", "Fwd")
    with pytest.raises(PlanError, match="exactly one of after= and before="):
        plan.moved("Fwd")
