"""benchmarks/task_split.py on a real gloo rank, a few steps: ours trains like upstream with the
clock on its task functions, every task call is timed, and the split adds up to the step."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.task_split import _split
from harness.ranks import run_on_ranks

pytestmark = pytest.mark.multiprocess


def _rank(rank: int, world_size: int) -> dict:
    from benchmarks.common import rank_setup

    rank_setup()
    return _split("TrainPipelineSparseDist", rank, world_size, argparse.Namespace(warmup=3, steps=12))


def test_the_split_of_a_real_pipeline_adds_up() -> None:
    (row,) = run_on_ranks(_rank, world_size=1)
    assert row["same_losses"]
    assert row["calls"] == 9  # TrainPipelineSparseDist's nine tasks, one call each per step
    assert 0 < row["inside_us"] < row["ours_us"]
    assert row["around_us"] > 0
    lo, hi = row["inside_ratio_95"]
    assert 0 < lo <= hi
