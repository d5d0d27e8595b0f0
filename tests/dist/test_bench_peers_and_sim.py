"""Smoke tests of the overlap and simulator benchmarks on real gloo ranks, with few steps: the
overlap peers train exactly like upstream over a loader with a heavy-tailed wait (TorchRec 1.9's
async_inplace_copy is off on a CPU device as shipped, on when forced), and the multi-rank
simulator, calibrated from both ranks' profiles, replays a real 2-rank run to within a loose
tolerance (the tight numbers come from the full benchmark on a quiet machine)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.overlap import _case
from benchmarks.sim_vs_real import _rank as sim_rank
from benchmarks.sim_vs_real import analyse
from examples.dlrm.loader_work import LoaderWork
from harness.ranks import run_on_ranks

pytestmark = pytest.mark.multiprocess


def _overlap_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    from benchmarks.common import rank_setup

    rank_setup()
    # a heavy-tailed wait (2 ms median): item k waits the same for every contender and loader
    return _case(rank, world_size, "small", LoaderWork("tail", 2.0, seed=49, rank=rank), args, lambda: None)


def _async_copy_state(rank: int, world_size: int) -> tuple[bool, bool]:
    from benchmarks.common import rank_setup
    from benchmarks.peers import async_copy_runner
    from examples.dlrm.model import build_dlrm
    from harness.dlrm_data import SIZES

    rank_setup()
    build = lambda: build_dlrm(rank, world_size, SIZES["small"])
    shipped = async_copy_runner(build, forced=False)
    forced = async_copy_runner(build, forced=True)
    return shipped.pipeline._async_inplace_copy, forced.pipeline._async_inplace_copy


def test_async_inplace_copy_is_off_on_cpu_as_shipped_and_on_when_forced() -> None:
    assert run_on_ranks(_async_copy_state, world_size=1) == [(False, True)]


def test_every_overlap_contender_trains_like_upstream_on_one_rank() -> None:
    args = argparse.Namespace(
        pipeline="TrainPipelineSparseDist",
        contenders=[
            "upstream",
            "upstream+async_copy(forced)",
            "upstream+thread",
            "upstream+dataloader",
            "ours+io+dist",
            "ours+io+dataloader",
            "ours+io+ahead",
            "ours+1load",
            "ours+2loads+dist",
            "ours+2procs",
        ],
        warmup=2,
        steps=6,
        block=5,
        skip=2,
        loader_workers=1,
        prefetch_factor=2,
        thread_depth=2,
    )
    (row,) = run_on_ranks(_overlap_rank, args, world_size=1, timeout_s=120)
    assert row["same_losses"], row["losses_differ"]
    ours = {"ours+io+dist", "ours+io+dataloader", "ours+io+ahead", "ours+1load", "ours+2loads+dist", "ours+2procs"}
    assert set(row["bounds"]) == ours
    assert all(0 < e < 1.5 for e in row["efficiency"].values())


def test_the_engine_model_replays_real_runs_of_every_configuration() -> None:
    args = argparse.Namespace(
        pipelines=["TrainPipelineSparseDist"], size=["small"], warmup=4, rounds=1, block=30, skip=6, latency_ms=4.0
    )
    per_rank = run_on_ranks(sim_rank, args, world_size=2, timeout_s=240)
    rows = analyse(per_rank, 2)
    assert [(r["pipeline"], r["config"]) for r in rows] == [
        ("TrainPipelineSparseDist", c) for c in ("default", "io", "io+ahead", "2loads")
    ]
    for r in rows:
        assert r["same_losses_as_default"]
        assert r["iterations_calibrated"] >= 20
        # the replay is the model of the measured run itself: loose here (a loaded CI machine,
        # 24 timed steps), within 10% in notebook/2026-11-sim-vs-real.md on a quiet one
        assert abs(r["replay_error"]) < 0.35, r
    assert all("from_default_ms" in r for r in rows[1:])
