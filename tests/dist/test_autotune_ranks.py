"""A self-tuning TrainPipelineSparseDist on 2 gloo ranks: both ranks take the same decision at the
same batch (rank 0 searches on both ranks' profiles, and judges the trial's measurements of both),
try the same plans in the same order, switch without losing or repeating a batch, and train bit
for bit as the untuned pipeline - with the input dist's own process group among the choices - and
a resume applies the saved decision on both ranks without tuning again. By default only rank 0
prints its lines (on stdout); ``report=None`` quiets a rank without failing it."""

from __future__ import annotations

import contextlib
import io
import re
import time
from typing import Any

import pytest
import torch

import torchrec_swp
from harness.parity import assert_runs_equal, build_model, make_batches, train_pipeline_run
from harness.ranks import run_on_ranks
from torchrec_swp.data import MapSource

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

STEPS = 260  # warm-up, profile, a trial (at most 220 steps with these options), verification
#: the search in the background: at most this long (it keeps the plan past it), and the steps of a
#: run that takes its result whatever it found (at least 12 ms each: the 5 s fit in 420 of them)
BACKGROUND_SEARCH_S = 5.0
BACKGROUND_STEPS = 700
CPU = torch.device("cpu")


class Waiting:
    """The rank's batches as a map-style dataset whose items wait ``latency_s`` (storage)."""

    def __init__(self, batches: list[Any], latency_s: float) -> None:
        self.batches, self.latency = batches, latency_s

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> Any:
        time.sleep(self.latency)
        return self.batches[i]


def _run(rank: int, world_size: int, tuned: bool, background: bool = False, steps: int = STEPS) -> tuple[Any, Any]:
    model, optimizer = build_model(rank, world_size, seed=3)
    lines: list[str] = []
    # the search on the training thread (``background`` False): the steps above bound the tuning
    tuning = torchrec_swp.Autotune(
        warmup=3, steps=12, verify=6, report=lines.append, background=background, search_s=BACKGROUND_SEARCH_S
    )
    options = {"autotune": tuning} if tuned else {}
    pipeline = torchrec_swp.TrainPipelineSparseDist(model, optimizer, CPU, **options)
    batches = make_batches(rank, world_size, steps, seed=4)
    source = MapSource(Waiting(batches, 0.012))
    result = train_pipeline_run(pipeline, batches, iterator=source)
    d = pipeline.autotune_decision
    decided = None if d is None else (d.plan, d.own_group, d.predicted_s, d.tried, d.visits, d.decided, d.tuning_steps)
    plan = pipeline.plan.to_text()
    pipeline.close()
    return result, (decided, plan, lines)


def _tuned_and_plain(rank: int, world_size: int) -> dict[str, Any]:
    plain, _ = _run(rank, world_size, tuned=False)
    tuned, (decided, plan, lines) = _run(rank, world_size, tuned=True)
    return {"plain": plain, "tuned": tuned, "decided": decided, "plan": plan, "lines": lines}


def test_both_ranks_decide_alike_and_train_bit_for_bit_as_untuned() -> None:
    results = run_on_ranks(_tuned_and_plain, timeout_s=600)
    for r in results:
        assert_runs_equal(r["tuned"], r["plain"])
        assert r["tuned"].num_calls == STEPS
    assert results[0]["decided"] == results[1]["decided"]
    plan, own_group, predicted, tried, visits, decided, _ = results[0]["decided"]
    assert decided and plan is not None, results[0]["lines"]  # a loader of 12 ms binds: some plan wins
    assert len(tried) >= 2 and visits[: len(tried)] == tuple(range(len(tried)))  # tried alike, in turn
    assert results[0]["plan"] == results[1]["plan"]
    assert results[0]["lines"] and not results[1]["lines"]  # rank 0 reports
    assert any("switches to threads" in line for line in results[0]["lines"])
    assert any(
        re.match(r"autotune TrainPipelineSparseDist: tried \d plans over \d+ steps", line)
        for line in results[0]["lines"]
    )


def _in_the_background(rank: int, world_size: int) -> dict[str, Any]:
    tuned, (decided, plan, lines) = _run(rank, world_size, tuned=True, background=True, steps=BACKGROUND_STEPS)
    plain, _ = _run(rank, world_size, tuned=False, steps=BACKGROUND_STEPS)
    return {"plain": plain, "tuned": tuned, "decided": decided, "plan": plan, "lines": lines}


def test_a_background_search_lets_both_ranks_train_on_and_take_its_result_at_the_same_call() -> None:
    """Rank 0 searches in a process of its own while both ranks train on; both take what it
    found at the same call (rank 0's flag on the tuner's own group), decide alike and train bit
    for bit as the untuned pipeline."""
    results = run_on_ranks(_in_the_background, timeout_s=900)
    for r in results:
        assert_runs_equal(r["tuned"], r["plain"])
    assert results[0]["decided"] == results[1]["decided"]  # the call it took the result at included
    *_, decided, tuning_steps = results[0]["decided"]
    assert decided and tuning_steps is not None, results[0]["lines"]
    took = [re.search(r"the search took [\d.]+ s in a process of its own while (\d+) steps trained", line)
            for line in results[0]["lines"]]
    trained = [int(m.group(1)) for m in took if m]
    assert trained and trained[0] >= 1, results[0]["lines"]  # the ranks trained while it searched
    assert results[0]["plan"] == results[1]["plan"]


def _printed(rank: int, world_size: int) -> dict[str, Any]:
    """Rank ``rank``'s stdout lines of the tuner in two short runs: the default report on every rank,
    then ``report=None`` on the ranks other than 0 (the way to quiet them a user reached for)."""
    out: dict[str, Any] = {}
    for case in ("default", "rank 0 only"):
        options: dict[str, Any] = {
            "warmup": 2, "steps": 6, "verify": 2, "rounds": 1, "candidates": 0, "background": False
        }
        if case == "rank 0 only" and rank != 0:
            options["report"] = None
        model, optimizer = build_model(rank, world_size, seed=3)
        tuning = torchrec_swp.Autotune(**options)
        pipeline = torchrec_swp.TrainPipelineSparseDist(model, optimizer, CPU, autotune=tuning)
        batches = make_batches(rank, world_size, 12, seed=4)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            train_pipeline_run(pipeline, batches, iterator=MapSource(Waiting(batches, 0.004)))
        d = pipeline.autotune_decision
        pipeline.close()
        lines = [line for line in printed.getvalue().splitlines() if line.startswith("autotune ")]
        out[case] = (lines, None if d is None else (d.decided, d.plan))
    return out


def test_by_default_only_rank_0_prints_and_report_none_quiets_a_rank() -> None:
    results = run_on_ranks(_printed, timeout_s=300)
    for case in ("default", "rank 0 only"):
        (lines0, decided0), (lines1, decided1) = results[0][case], results[1][case]
        assert decided0 is not None and decided0 == decided1 and decided0[0]  # decided alike (12 batches: after 8)
        assert lines0 and lines0[0].startswith("autotune TrainPipelineSparseDist: profiled 6 steps ("), lines0
        assert lines1 == []
