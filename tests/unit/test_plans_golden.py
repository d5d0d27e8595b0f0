"""The upstream pipelines as plans: golden schedule tables and text forms, and how they differ
from the design tables in tests/golden/design_tables/ (only where upstream's progress() does).

Regenerate the goldens after an intended change with ``SWP_UPDATE_GOLDEN=1 pytest tests/unit``
and read the diff.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from torchrec_swp.catalog import torchrec as plans
from torchrec_swp.catalog.accumulation import accumulation_phases
from torchrec_swp.catalog.transforms import with_parallel_loads
from torchrec_swp.plan import PhasedPlan, PipelinePlan, When

GOLDEN = Path(__file__).parent.parent / "golden"
ALL = plans.default_plans()

# Extra plans for the options that change a schedule.
VARIANTS = {
    "TrainPipelineSparseDist.enqueue_batch_after_forward": plans.sparse_dist_plan(enqueue_batch_after_forward=True),
    "TrainPipelineSparseDist.clear_data_dist_inputs": plans.sparse_dist_plan(clear_data_dist_inputs=True),
    "TrainPipelineSparseDist.async_inplace_copy": plans.sparse_dist_plan(h2d_thread="io"),
    "TrainPipelineFusedSparseDist.emb_lookup_stream_new.after_data_dist": plans.fused_sparse_dist_plan(
        emb_lookup_stream="new", embedding_lookup_after_data_dist=True
    ),
    "TrainPipelineSemiSync.sync_phase": plans.semi_sync_plan(phase="sync"),
    "TrainPipelineSemiSync.stash_gradients": plans.semi_sync_phases(start_batch=900, stash_gradients=True),
    "EvalPipelineFusedSparseDist.enable_embedding_lookup_prefetch": plans.eval_fused_sparse_dist_plan(
        enable_embedding_lookup_prefetch=True
    ),
    # the overlap options: H2D's draw split off onto 2 load lanes; Base's LoadBatch moved as it is
    "TrainPipelineSparseDist.io.parallel_loads": with_parallel_loads(
        plans.sparse_dist_plan().with_thread_map("io"), 2
    ),
    "TrainPipelineBase.parallel_loads.lookahead_3": with_parallel_loads(
        plans.train_pipeline_base_plan(), 2, lookahead=3
    ),
    "EvalPipelineCPUSparse.pipeline_depth_1.multi_thread": plans.eval_cpu_sparse_plan(
        pipeline_depth=1, multi_thread=True
    ),
    # GradientAccumulationWrapper's window of 3: ZeroGrad/OptimizerStep guarded never in between
    "TrainPipelineSparseDist.gradient_accumulation_3": accumulation_phases(plans.sparse_dist_plan(), 3),
}


def render(plan: PipelinePlan | PhasedPlan) -> str:
    depth = max(p.pipeline_depth for p in getattr(plan, "plans", (plan,)))
    return plan.format_schedule(depth + 2) + "\n\n" + plan.to_text()


@pytest.mark.parametrize("name", [*ALL, *VARIANTS])
def test_golden_schedule_and_text(name: str) -> None:
    plan = ALL.get(name) or VARIANTS[name]
    path = GOLDEN / "plans" / f"{name}.txt"
    text = render(plan)
    if os.environ.get("SWP_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"no golden file {path}; run with SWP_UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text()
    assert type(plan).from_text(plan.to_text()) == plan


def test_all_twelve_pipelines_have_a_plan() -> None:
    import torchrec_swp

    assert sorted(ALL) == sorted(torchrec_swp._PIPELINES)


def test_tables_show_fire_order_so_options_that_reorder_differ() -> None:
    default = (GOLDEN / "plans" / "TrainPipelineSparseDist.txt").read_text()
    after_forward = (GOLDEN / "plans" / "TrainPipelineSparseDist.enqueue_batch_after_forward.txt").read_text()
    table = lambda text: [ln.split()[1] for ln in text.split("\n\n")[0].splitlines()[3:]]  # noqa: E731
    assert table(default).index("H2D") < table(default).index("Forward")
    assert table(after_forward).index("H2D") == table(after_forward).index("Forward") + 1


def test_semi_sync_table_shows_both_phases() -> None:
    text = plans.semi_sync_phases(start_batch=10).format_schedule(5)
    assert "phase 0 (batches 0 to 9): TrainPipelineSemiSync_sync" in text
    assert "phase 1 (batches 10 and on): TrainPipelineSemiSync_semi_sync" in text
    sync, semi = text.split("phase 1")
    assert "Synchronize" in sync and "Synchronize" not in semi


def test_semi_sync_table_shows_the_optimizer_skip_at_start_batch() -> None:
    # upstream's _mlp_optimizer_step skips the step of batch start_batch with stash_gradients
    text = plans.semi_sync_phases(start_batch=10, stash_gradients=True).format_schedule(5)
    assert "phase 1 (batches 10 to 10): TrainPipelineSemiSync_semi_sync_start" in text
    assert "phase 2 (batches 11 and on): TrainPipelineSemiSync_semi_sync" in text
    sync, start, semi = text.split("\n\nphase ")
    rows = lambda block: [ln.split()[1] for ln in block.splitlines()[4:]]  # noqa: E731
    assert "OptimizerStep" in rows(sync) and "OptimizerStep" in rows(semi)
    assert "OptimizerStep" not in rows(start) and "GradSwap" in rows(start)
    assert rows(start).index("GradSwap") < rows(start).index("ZeroGrad")


@pytest.mark.parametrize(
    ("start_batch", "stash", "starts"),
    [(10, False, [0, 10]), (0, True, [0, 1]), (-1, True, [0]), (0, False, [0]), (-3, False, [0])],
)
def test_semi_sync_phases_skip_the_step_only_where_upstream_does(
    start_batch: int, stash: bool, starts: list[int]
) -> None:
    # upstream: skip iff context.index == start_batch and stash_gradients (indices are >= 0)
    phased = plans.semi_sync_phases(start_batch=start_batch, stash_gradients=stash)
    assert [s for s, _ in phased.phases] == starts
    skipped = [b for b in range(max(start_batch, 0) + 3) if "OptimizerStep" not in phased.plan_for(b).schedule]
    assert skipped == ([start_batch] if stash and start_batch >= 0 else [])


# ------------------------------------------- against the design tables (tests/golden/design_tables)
# Where our plan's table departs from the design table's, and why (each documented in catalog/torchrec.py).
FIRST_INPUT_DIST = "upstream's first input dist of an epoch is _init_pipelined_modules (when=first)"
EXTRA_TASKS = {
    "TrainPipelineBase": {"LoadBatch": "upstream pulls batch i+1 before zero_grad, copies it after backward"},
    "TrainPipelineSparseDist": {"Dequeue": "upstream pops the trained batch with dequeue_batch()",
                                "InitPipelinedModules": FIRST_INPUT_DIST},
    "TrainPipelineSparseDistLite": {"Dequeue": "as SparseDist"},
    "TrainPipelineFusedSparseDist": {"Dequeue": "as SparseDist", "InitPipelinedModules": FIRST_INPUT_DIST},
    "TrainPipelineSemiSync": {"Dequeue": "upstream pops batch i right after Forward(i)",
                              "InitPipelinedModules": FIRST_INPUT_DIST},
    "PrefetchTrainPipelineSparseDist": {"Dequeue": "as SparseDist", "InitPipelinedModules": FIRST_INPUT_DIST},
    "TrainPipelineSparseDistCompAutograd": {"Dequeue": "as SparseDist", "InitPipelinedModules": FIRST_INPUT_DIST},
}
# Lite's input dist is upstream's _init_pipelined_modules on every batch
RENAMED = {("TrainPipelineSparseDistLite", "InputDistStart"): "InitPipelinedModules"}
CHANGED_STREAM = {("TrainPipelineFusedSparseDist", "EmbLookup"): "data_dist"}  # upstream default option
REORDERED = {"TrainPipelineSemiSync"}  # upstream's fire order, not the design table's stage-by-stage list


def parse_seed(text: str) -> list[tuple[str, str, str, str]]:
    """(task, thread, stream, cells) rows of a design table."""
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) > 4 and parts[0].isdigit():
            _, task, thread, stream, *rest = parts
            rows.append((task, thread, stream, " ".join(rest)))
    return rows


def ours(plan: PipelinePlan, columns: int) -> list[tuple[str, str, str, str]]:
    """Our table's rows in the design tables' row order (stage descending, then fire order), guards
    and effects ignored (the design tables have neither), as (task, thread, stream, cells)."""
    unguarded = plan.replace(
        schedule={t: s.replace(when=When.ALWAYS) for t, s in plan.schedule.items()},
        tasks=[dataclasses.replace(io, effects=()) for io in plan.tasks.values()],
    )
    rows = []
    for line in unguarded.format_schedule(columns).splitlines()[3:]:
        _, task, _stage, thread, stream, *rest = line.split()
        rows.append((task, thread, stream, " ".join(rest)))
    return sorted(rows, key=lambda r: (-plan.task(r[0]).stage, plan.fire_index(r[0])))


@pytest.mark.parametrize("name", sorted(EXTRA_TASKS))
def test_tables_match_seed_001_except_documented_differences(name: str) -> None:
    seed = parse_seed((GOLDEN / "design_tables" / f"{name}.txt").read_text())
    entry = ALL[name]
    plan = entry.plan_for(10**6) if isinstance(entry, PhasedPlan) else entry  # SemiSync: its semi-sync phase
    rows = ours(plan, len(seed[0][3].split("|")[1].split()))
    seed_tasks = [RENAMED.get((name, r[0]), r[0]) for r in seed]
    our_tasks = [r[0] for r in rows]
    assert not set(seed_tasks) - set(our_tasks), "a task of the design table is missing"
    assert set(our_tasks) - set(seed_tasks) == set(EXTRA_TASKS[name])
    common = [t for t in our_tasks if t in seed_tasks]
    if name not in REORDERED:
        assert common == seed_tasks
    for task, thread, stream, cells in rows:
        if task in EXTRA_TASKS[name]:
            continue
        (seed_row,) = [r for r in seed if RENAMED.get((name, r[0]), r[0]) == task]
        expected_stream = CHANGED_STREAM.get((name, task), seed_row[2])
        assert (thread, stream, cells) == (seed_row[1], expected_stream, seed_row[3]), task
