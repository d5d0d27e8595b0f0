"""Effects in plans: the ``effects`` column of the text form and of the schedule table, the edits
that keep a task's effects, and what the catalog declares for every drop-in
(``torchrec_swp.plan.effects``, ``PipelineTask.effects``)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from torchrec_swp import drop_ins
from torchrec_swp.catalog import torchrec as catalog
from torchrec_swp.catalog.accumulation import accumulation_phases
from torchrec_swp.catalog.transforms import with_input_dist_group
from torchrec_swp.plan import PhasedPlan, PipelinePlan, PipelineTask, PlanError
from torchrec_swp.plan import TaskSchedule as S
from torchrec_swp.plan.effects import KNOWN_EFFECTS
from torchrec_swp.plan.text_words import COLUMNS


def toy(**effects: tuple[str, ...]) -> PipelinePlan:
    """Load -> Fwd -> Bwd -> Step, each task declaring ``effects[name]``."""
    io = {
        "Load": PipelineTask("Load", writes=("batch",)),
        "Fwd": PipelineTask("Fwd", reads=("batch",), writes=("loss", "out"), anchor=True),
        "Bwd": PipelineTask("Bwd", reads=("loss",), anchor=True),
        "Step": PipelineTask("Step", anchor=True),
    }
    tasks = [dataclasses.replace(t, effects=effects.get(n, ())) for n, t in io.items()]
    return PipelinePlan(
        schedule={"Load": S(0, "memcpy"), "Fwd": S(1), "Bwd": S(1), "Step": S(1)},
        intra_iter_deps=[("Step", "Bwd")],
        tasks=tasks,
        source="Load",
        output="out",
        name="toy",
    )


TOY = toy(Bwd=("fused_rows", "dense_grads"), Step=("dense_params", "dense_optim"))


def row(text: str, task: str) -> str:
    (line,) = [ln for ln in text.splitlines() if ln.split()[:2] == ["task", task]]
    return line


# ------------------------------------------------------------------------------ the text form
def test_effects_are_a_column_between_writes_and_flags_with_an_exact_round_trip() -> None:
    assert COLUMNS.index("effects") == COLUMNS.index("writes") + 1 == COLUMNS.index("flags") - 1
    text = TOY.to_text()
    header = next(ln for ln in text.splitlines() if ln.startswith("#    task"))
    assert header.split()[1:] == list(COLUMNS)
    assert row(text, "Bwd").split()[9:] == ["fused_rows,dense_grads", "anchor"]
    assert row(text, "Load").split()[9:] == ["-", "-"]  # none: '-'
    again = PipelinePlan.from_text(text)
    assert again == TOY and again.to_text() == text
    assert again.tasks["Step"].effects == ("dense_params", "dense_optim")
    assert again != toy(Bwd=("dense_grads", "fused_rows"), Step=("dense_params", "dense_optim"))  # as written


def test_phased_plan_text_carries_effects() -> None:
    phased = PhasedPlan([(0, TOY), (5, TOY.replace(name="toy_later"))], name="two")
    text = phased.to_text()
    assert text.count("fused_rows,dense_grads") == 2
    again = PhasedPlan.from_text(text)
    assert again == phased and again.to_text() == text


def _slip(old: str, new: str) -> tuple[str, int, int]:
    """TOY's text with ``old`` replaced on Bwd's row, the row's line and the column of ``new``."""
    lines = TOY.to_text().split("\n")
    (i,) = [k for k, ln in enumerate(lines) if ln.startswith("task Bwd ")]
    lines[i] = lines[i].replace(old, new, 1)
    return "\n".join(lines), i + 1, lines[i].index(new.split(",")[-1]) + 1


def test_an_unknown_effect_is_refused_at_its_line_and_column_with_the_nearest_name() -> None:
    text, line, column = _slip("fused_rows,dense_grads", "fused_rows,dense_param")
    with pytest.raises(PlanError) as info:
        PipelinePlan.from_text(text)
    assert (info.value.line, info.value.column) == (line, column), str(info.value)
    assert "task Bwd declares unknown effect 'dense_param'" in str(info.value)
    assert "did you mean 'dense_params'?" in str(info.value)


def test_an_effect_given_twice_is_refused_at_its_cell() -> None:
    text, line, column = _slip("fused_rows,dense_grads", "dense_grads,dense_grads")
    column = text.split("\n")[line - 1].index("dense_grads,dense_grads") + len("dense_grads,") + 1
    with pytest.raises(PlanError, match="task Bwd declares effect 'dense_grads' twice") as info:
        PipelinePlan.from_text(text)
    assert (info.value.line, info.value.column) == (line, column)
    with pytest.raises(PlanError, match="declares an effect twice"):
        PipelineTask("Bwd", effects=("dense_grads", "dense_grads"))
    with pytest.raises(PlanError, match="unknown effect 'dense_param'"):
        PipelineTask("Bwd", effects=("dense_param",))


def test_an_effect_in_the_flags_cell_says_where_effects_go() -> None:
    text = "plan p\ndepth 1\ntask A 0 default default - - - - - counters\n"
    with pytest.raises(PlanError, match="unknown flag 'counters'.*effects go in the effects column"):
        PipelinePlan.from_text(text)


def test_rows_of_nine_cells_written_before_effects_are_read_as_declaring_none() -> None:
    old = (
        "plan toy\ndepth 2\nsource Load\noutput out\nexhausted drain\n"
        "#    task  stage  stream   thread   comm  when  reads  writes    flags\n"
        "task Load  0      memcpy   default  -     -     -      batch     -\n"
        "task Fwd   1      default  default  -     -     batch  loss,out  anchor\n"
        "task Bwd   1      default  default  -     -     loss   -         anchor\n"
        "task Step  1      default  default  -     -     -      -         anchor\n"
        "dep Step <- Bwd\n"
    )
    plan = PipelinePlan.from_text(old)
    assert plan == toy()
    assert all(io.effects == () for io in plan.tasks.values())
    assert PipelinePlan.from_text(plan.to_text()) == plan  # written back with the effects column


def test_a_row_of_nine_cells_among_rows_of_ten_is_a_missing_cell() -> None:
    lines = TOY.to_text().split("\n")
    (i,) = [k for k, ln in enumerate(lines) if ln.startswith("task Fwd ")]
    lines[i] = lines[i].replace("loss,out  -", "loss,out ", 1)  # its effects cell left out
    with pytest.raises(PlanError, match="a task row has 10 columns .* got 9: .*is a cell missing") as info:
        PipelinePlan.from_text("\n".join(lines))
    assert info.value.line == i + 1


def test_an_old_key_value_row_with_an_effects_key_is_refused_naming_the_effects_column() -> None:
    text = "plan p\ndepth 1\ntask A stage=0 writes=x effects=dense_grads,counters\n"
    with pytest.raises(PlanError, match="old 'key=value' form are no longer read: .* effects flags;") as info:
        PipelinePlan.from_text(text)
    assert (info.value.line, info.value.column) == (3, text.splitlines()[2].index("stage=0") + 1)


# ------------------------------------------------------------------------------ the table
def test_the_schedule_table_shows_an_effects_column_after_when() -> None:
    guarded = TOY.with_schedule("Step", when="not_first")
    lines = guarded.format_schedule(3).splitlines()
    header = lines[1].split()
    assert header[header.index("When") + 1] == "Effects" and header[header.index("Effects") + 1] == "|"
    by_task = {ln.split()[1]: ln.split() for ln in lines[3:]}
    assert by_task["Bwd"][6] == "fused_rows,dense_grads" and by_task["Load"][6] == "-"
    assert by_task["Step"][5:7] == ["not_first", "dense_params,dense_optim"]
    # a plan whose tasks declare none has no such column, as one without guards has no When column
    assert "Effects" not in toy().format_schedule(3) and "Effects" in TOY.format_schedule(3)


# ------------------------------------------------------------------------------ the edits keep them
def test_plan_edits_keep_effects() -> None:
    edited = (
        TOY.with_thread_map("per_task")
        .with_schedule("Fwd", stream="memcpy")
        .moved("Load", after="Step")
        .with_loads(2, thread="load")
        .replace(name="edited")
    )
    assert {t: io.effects for t, io in edited.tasks.items()} == {t: io.effects for t, io in TOY.tasks.items()}
    for thread_map in ("by_stream", "per_task", "main", "io"):
        assert TOY.with_thread_map(thread_map).tasks == TOY.tasks


@pytest.mark.parametrize("name", ["TrainPipelineSparseDist", "TrainPipelineBase", "TrainPipelineSemiSync"])
def test_parallel_loads_and_lookahead_keep_effects(name: str) -> None:
    from torchrec_swp import plans

    plan = catalog.default_plans()[name]
    loaded = plans.with_lookahead(plans.with_parallel_loads(plan, 2), 3)
    for before, after in zip(getattr(plan, "plans", (plan,)), getattr(loaded, "plans", (loaded,))):
        for task, io in before.tasks.items():
            assert after.tasks[task].effects == io.effects, task
        if "Fetch" in after.tasks:  # H2D split: the draw changes nothing, H2D keeps what it had
            assert after.tasks["Fetch"].effects == () and after.tasks["H2D"].effects == before.tasks["H2D"].effects


def test_gradient_accumulation_and_the_input_dist_group_keep_effects() -> None:
    plan = catalog.sparse_dist_plan()
    for phased in (accumulation_phases(plan, 3), with_input_dist_group(plan)):
        for p in getattr(phased, "plans", (phased,)):
            assert p.tasks == plan.tasks


# ------------------------------------------------------------------------------ the catalog
def _plans(entry: PipelinePlan | PhasedPlan) -> tuple[PipelinePlan, ...]:
    return tuple(getattr(entry, "plans", (entry,)))


TRAINING = {
    "ZeroGrad": (),  # it clears what the previous step consumed: nothing to undo (the catalog's EFFECTS)
    "Backward": ("fused_rows", "dense_grads"),
    "OptimizerStep": ("dense_params", "dense_optim"),
}
EVAL = tuple(d.name for d in drop_ins.drop_ins() if d.kind == "eval")


@pytest.mark.parametrize("name", [r.name for r in drop_ins.drop_ins()])
def test_every_drop_in_declares_its_training_step(name: str) -> None:
    entry = catalog.default_plans()[name]
    for plan in _plans(entry):
        for task, effects in TRAINING.items():
            if task in plan.tasks:
                assert set(effects) <= set(plan.tasks[task].effects), (plan.name, task)
                if not effects:
                    assert plan.tasks[task].effects == (), (plan.name, task)
        if name in EVAL or name == "StagedTrainPipeline":  # forward only; Staged's step is the caller's
            continue
        # the training step changes the weights: somewhere its plan says so, in every phase
        declared = {e for io in plan.tasks.values() for e in io.effects}
        assert {"dense_grads", "fused_rows", "dense_params", "dense_optim"} <= declared, plan.name
        step = "BackwardOptimizerStep" if "BackwardOptimizerStep" in plan.tasks else "OptimizerStep"
        if plan.name != "TrainPipelineSemiSync_semi_sync_start":  # upstream skips that step
            assert {"dense_params", "dense_optim"} <= set(plan.tasks[step].effects), plan.name


@pytest.mark.parametrize("name", EVAL)
def test_eval_pipelines_declare_nothing(name: str) -> None:
    for plan in _plans(catalog.default_plans()[name]):
        declared = {t: io.effects for t, io in plan.tasks.items() if io.effects}
        assert declared == {}, plan.name


def test_data_movement_declares_nothing() -> None:
    moving = {"H2D", "Fetch", "LoadBatch", "Enqueue", "InputDistStart", "InputDistWait", "InitPipelinedModules",
              "Dequeue", "CopyToDevice", "ClearDataDistInputs"}
    for name, entry in catalog.default_plans().items():
        for plan in _plans(entry):
            for task in moving & set(plan.tasks):
                assert plan.tasks[task].effects == (), (name, task)


def test_a_task_declares_the_same_effects_in_every_pipeline_unless_its_function_differs() -> None:
    # where a pipeline's function for a task does more than the others', its plan function says so
    differs = {
        ("TrainPipelineBase", "WaitBatch"),  # counts the progress() calls
        ("TrainPipelinePT2", "Forward"),  # counts the forwards
        ("TrainPipelineSparseDistOptStash", "Backward"),  # the restore starts in its hook
        ("TrainPipelineSparseDistEmbStash", "Forward"),  # the weights are stashed after the lookup
        ("TrainPipelineSparseDistEmbStash", "Backward"),
        ("TrainPipelinePrefetchEMS", "Forward"),
        ("TrainPipelinePrefetchEMS", "Backward"),
    }
    seen: dict[str, set[tuple[str, ...]]] = {}
    for name, entry in catalog.default_plans().items():
        for plan in _plans(entry):
            for task, io in plan.tasks.items():
                if (name, task) in differs:
                    assert io.effects != catalog.EFFECTS.get(task, ()), (name, task)
                else:
                    seen.setdefault(task, set()).add(io.effects)
                    assert io.effects == catalog.EFFECTS.get(task, ()), (name, task)
    assert all(len(effects) == 1 for effects in seen.values())


def test_the_catalog_declares_only_known_effects_and_every_one_somewhere() -> None:
    declared = {e for effects in catalog.EFFECTS.values() for e in effects}
    for entry in catalog.default_plans().values():
        for plan in _plans(entry):
            declared |= {e for io in plan.tasks.values() for e in io.effects}
    assert declared == set(KNOWN_EFFECTS)


def test_semi_sync_declares_its_embedding_backward_and_gradient_swap() -> None:
    phased = catalog.semi_sync_phases(start_batch=10, stash_gradients=True)
    for plan in phased.plans:
        assert plan.tasks["EmbBackward"].effects == ("fused_rows",)
        if "GradSwap" in plan.tasks:
            assert set(plan.tasks["GradSwap"].effects) == {"stashed_grads", "dense_grads"}
    assert "GradSwap" in phased.plan_for(10).tasks and "OptimizerStep" not in phased.plan_for(10).tasks


def test_prefetch_and_stashing_pipelines_declare_their_caches_and_stashes() -> None:
    plans = catalog.default_plans()
    assert plans["PrefetchTrainPipelineSparseDist"].tasks["EmbPrefetch"].effects == ("emb_cache",)
    ems = plans["TrainPipelinePrefetchEMS"].tasks
    assert ems["PrefetchNext"].effects == ("emb_cache",)
    assert set(ems["RestoreEmbeddings"].effects) == {"stashed_state", "emb_cache"}
    opt = plans["TrainPipelineSparseDistOptStash"].tasks
    for task in ("RestoreWait", "StashOptimizerState", "Backward"):
        assert "stashed_state" in opt[task].effects, task
    pec = plans["TrainPipelinePEC"].tasks
    for task in ("OlGradApply", "NolGradApply", "DeferNolGradLast"):
        assert pec[task].effects == ("fused_rows",), task
    assert pec["OlGradStart"].effects == ("stashed_grads",)  # the batch's NOL gradient, for the next step
    for task in ("NolGradStart", "DeferNolGrad", "OlCompute", "NolCompute", "OverlapDist"):
        assert pec[task].effects == (), task


def test_pecs_undoable_plan_applies_the_last_nol_gradient_first_and_leaves_the_previous_batchs_alone() -> None:
    from torchrec_swp.integrations.torchrec.compat import installed

    if not installed().has_pec:
        pytest.skip("TrainPipelinePEC is new in TorchRec 1.9")
    from torchrec_swp.integrations.torchrec.pipelines.pec import last_nol_before_ol

    plan = last_nol_before_ol(catalog.pec_plan())
    assert plan.fire_index("OptimizerStep") < plan.fire_index("DeferNolGradLast") < plan.fire_index("OlGradApply")
    assert "OlGradApply <- DeferNolGradLast" in {str(d) for d in plan.deps}
    assert plan.tasks["NolGradApply"].effects == ()  # (the batch before's gradient: decided already)
    assert last_nol_before_ol(plan) == plan


# ------------------------------------------------------------------------------ the docs
def test_docs_plans_md_lists_exactly_the_known_effects_with_their_descriptions() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "plans.md").read_text()
    rows = re.findall(r"^\s*\| `(\w+)` \| (.+?) \|$", doc, re.M)
    assert rows == list(KNOWN_EFFECTS.items())
