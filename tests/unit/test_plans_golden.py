"""The 11 upstream pipelines as plans: golden schedule tables and text forms, and how they
differ from seed 001's tables (only where upstream 1.8.0's progress() does).

Regenerate the goldens after an intended change with ``SWP_UPDATE_GOLDEN=1 pytest tests/unit``
and read the diff.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torchrec_swp.integrations.torchrec import plans
from torchrec_swp.plan import PipelinePlan

GOLDEN = Path(__file__).parent.parent / "golden"
ALL = plans.default_plans()

# Extra plans for the options that change a schedule.
VARIANTS = {
    "TrainPipelineSparseDist.enqueue_batch_after_forward": plans.sparse_dist_plan(enqueue_batch_after_forward=True),
    "TrainPipelineSparseDist.clear_data_dist_inputs": plans.sparse_dist_plan(clear_data_dist_inputs=True),
    "TrainPipelineFusedSparseDist.emb_lookup_stream_new.after_data_dist": plans.fused_sparse_dist_plan(
        emb_lookup_stream="new", embedding_lookup_after_data_dist=True
    ),
    "TrainPipelineSemiSync.sync_phase": plans.semi_sync_plan(phase="sync"),
    "EvalPipelineFusedSparseDist.enable_embedding_lookup_prefetch": plans.eval_fused_sparse_dist_plan(
        enable_embedding_lookup_prefetch=True
    ),
}


def render(plan: PipelinePlan) -> str:
    columns = plan.pipeline_depth + 2
    return plan.format_schedule(columns) + "\n\n" + plan.to_text()


@pytest.mark.parametrize("name", [*ALL, *VARIANTS])
def test_golden_schedule_and_text(name: str) -> None:
    plan = ALL.get(name) or VARIANTS[name]
    path = GOLDEN / "plans" / f"{name}.txt"
    text = render(plan)
    if os.environ.get("SWP_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"no golden file {path}; run with SWP_UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text()
    assert PipelinePlan.from_text(plan.to_text()) == plan


def test_all_eleven_pipelines_have_a_plan() -> None:
    assert len(ALL) == 11


# --------------------------------------------------------- against seed 001
# Where our plan's table departs from seed 001's, and why (each documented in plans.py).
EXTRA_TASKS = {
    "TrainPipelineBase": {"LoadBatch": "upstream pulls batch i+1 before zero_grad, copies it after backward"},
    "TrainPipelineSparseDist": {"Dequeue": "upstream pops the trained batch with dequeue_batch()"},
    "TrainPipelineSparseDistLite": {"Dequeue": "as SparseDist"},
    "TrainPipelineFusedSparseDist": {"Dequeue": "as SparseDist"},
    "TrainPipelineSemiSync": {"Dequeue": "upstream pops batch i right after Forward(i)"},
    "PrefetchTrainPipelineSparseDist": {"Dequeue": "as SparseDist"},
    "TrainPipelineSparseDistCompAutograd": {"Dequeue": "as SparseDist"},
}
CHANGED_STREAM = {("TrainPipelineFusedSparseDist", "EmbLookup"): "data_dist"}  # upstream default option
REORDERED = {"TrainPipelineSemiSync"}  # upstream's fire order, not seed 001's stage-by-stage list


def parse_table(text: str) -> list[tuple[str, str, str, str]]:
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) > 4 and parts[0].isdigit():
            _, task, thread, stream, *rest = parts
            rows.append((task, thread, stream, " ".join(rest)))
    return rows


@pytest.mark.parametrize("name", sorted(EXTRA_TASKS))
def test_tables_match_seed_001_except_documented_differences(name: str) -> None:
    seed = parse_table((GOLDEN / "seed001" / f"{name}.txt").read_text())
    ours = parse_table(ALL[name].format_schedule(len(seed[0][3].split("|")[1].split())))
    seed_tasks = [r[0] for r in seed]
    our_tasks = [r[0] for r in ours]
    assert not set(seed_tasks) - set(our_tasks), "a task of seed 001 is missing"
    assert set(our_tasks) - set(seed_tasks) == set(EXTRA_TASKS[name])
    common = [t for t in our_tasks if t in seed_tasks]
    if name not in REORDERED:
        assert common == seed_tasks
    for task, thread, stream, cells in ours:
        if task in EXTRA_TASKS[name]:
            continue
        (seed_row,) = [r for r in seed if r[0] == task]
        expected_stream = CHANGED_STREAM.get((name, task), seed_row[2])
        assert (thread, stream, cells) == (seed_row[1], expected_stream, seed_row[3]), task
