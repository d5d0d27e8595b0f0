"""The README's "Overlap options in your own loop" and docs/overlap.md run as written, on 2 gloo ranks.

Every ```python block of that README section, then of docs/overlap.md (which goes on from it),
runs, in order, in one namespace that holds what the README says is the user's: ``model`` (a new
sharded model for each block: harness.parity's, the same seed), its ``optimizer``, ``device`` and
``dataset`` (a list of the rank's batches: map-style). Each block trains; its losses (every
forward of the model) and final weights must equal, bit for bit, those of
TrainPipelineSparseDist with its default plan over the same batches, and what it prints on rank 0
must be the ```text block that follows it (none: nothing printed; the self-tuning block prints the
tuner's report, which holds what it measured: it must say it profiled).
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import torchrec_swp
from harness.parity import build_model, local_state, make_batches, record_losses, train_pipeline_run
from harness.ranks import run_on_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
#: Where the blocks are, in the order they run: (page, the section holding them, or None: all of it).
SOURCES = (("README.md", "## Overlap options in your own loop"), ("docs/overlap.md", None))
STEPS = 12
SEED = 2024
CPU = torch.device("cpu")


def blocks() -> list[tuple[str, str, str | None]]:
    """``(page, python code, the text block right after it or None)`` for every ```python block of
    SOURCES, in order."""
    found = []
    for page, section in SOURCES:
        text = (ROOT / page).read_text()
        if section is not None:
            text = text.split(section, 1)[1].split("\n## ", 1)[0]
        for match in re.finditer(r"```python\n(.*?)```\n(?:\s*```text\n(.*?)```)?", text, re.S):
            found.append((page, match[1], match[2]))
    return found


def _run(rank: int, world_size: int, code: list[tuple[str, str]]) -> dict[str, Any]:
    model, optimizer = build_model(rank, world_size, SEED)
    pipeline = torchrec_swp.TrainPipelineSparseDist(model, optimizer, CPU)
    reference = train_pipeline_run(pipeline, make_batches(rank, world_size, STEPS, SEED))
    pipeline.close()
    namespace: dict[str, Any] = {"device": CPU}
    runs = []
    for page, block in code:
        model, optimizer = build_model(rank, world_size, SEED)
        namespace.update(model=model, optimizer=optimizer, dataset=make_batches(rank, world_size, STEPS, SEED))
        printed = io.StringIO()
        with record_losses(model) as losses, contextlib.redirect_stdout(printed):
            exec(compile(block, page, "exec"), namespace)  # noqa: S102 - the docs' own code
        namespace["pipeline"].close()
        runs.append({"losses": losses, "weights": local_state(model), "printed": printed.getvalue()})
    return {"reference": {"losses": reference.losses, "weights": reference.weights}, "runs": runs}


def test_the_section_has_the_blocks_the_test_runs() -> None:
    found = blocks()
    assert len(found) == 3
    assert found[0][0] == "README.md"  # the README's block defines train(), which the others call
    code = "".join(c for _, c, _ in found)
    for option in ('thread_map="io"', "lookahead=", "loads=", "MapSource", "input_dist_group=True",
                   "from torchrec_swp import", "plans.with_parallel_loads", "plans.with_lookahead", "print_schedule(",
                   "autotune=", "autotune_decision"):
        assert option in code, option
    assert found[0][2] is not None


def test_the_overlap_code_of_the_docs_trains_as_the_default_plan() -> None:
    found = blocks()
    per_rank = run_on_ranks(_run, [(page, code) for page, code, _ in found], timeout_s=400)
    for rank, result in enumerate(per_rank):
        reference = result["reference"]
        assert len(reference["losses"]) == STEPS
        for k, run in enumerate(result["runs"]):
            what = f"rank {rank}, {found[k][0]} block {k}"
            assert len(run["losses"]) == STEPS, what
            assert all(torch.equal(a, b) for a, b in zip(run["losses"], reference["losses"])), what
            assert run["weights"].keys() == reference["weights"].keys(), what
            assert all(torch.equal(run["weights"][n], w) for n, w in reference["weights"].items()), what
    for (_, code, shown), run in zip(found, per_rank[0]["runs"]):
        if "autotune=" in code:  # the tuner's report: what it measured, so no fixed text
            assert "autotune TrainPipelineSparseDist: profiled 6 steps" in run["printed"], run["printed"]
        else:
            assert run["printed"] == (shown or ""), f"printed:\n{run['printed']}"
