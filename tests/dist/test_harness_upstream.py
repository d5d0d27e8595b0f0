"""The harness against upstream TorchRec: its pipelines must match the plain loop bit for bit.

Also checks the harness itself: reproducible models and batches, failure reports that carry
a rank's traceback, and a timeout that kills hanging ranks.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchrec.distributed.test_utils.test_model import ModelInput
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from harness.parity import (
    RunResult,
    assert_runs_equal,
    build_model,
    local_state,
    make_batches,
    plain_loop_run,
    train_pipeline_run,
)
from harness.ranks import RankError, run_on_ranks

SEED = 1234
NUM_BATCHES = 20
CPU = torch.device("cpu")


# --------------------------------------------------------------------------------------------
# Upstream TrainPipelineSparseDist vs. the plain loop (one set of ranks for all these tests)
# --------------------------------------------------------------------------------------------


def _upstream_runs(rank: int, world_size: int, seed: int) -> dict[str, Any]:
    """Every run compared below, each on a freshly built model and fresh batches."""

    def batches(n: int = NUM_BATCHES) -> list[ModelInput]:
        return make_batches(rank, world_size, n, seed)

    model, optimizer = build_model(rank, world_size, seed)
    initial = local_state(model)
    initial_again = local_state(build_model(rank, world_size, seed)[0])
    plain = plain_loop_run(model, optimizer, batches())

    model, optimizer = build_model(rank, world_size, seed)
    sparse_dist = train_pipeline_run(TrainPipelineSparseDist(model, optimizer, CPU), batches())

    model, optimizer = build_model(rank, world_size, seed)
    pipeline = TrainPipelineSparseDist(model, optimizer, CPU, execute_all_batches=False)
    sparse_dist_not_all = train_pipeline_run(pipeline, batches())

    model, optimizer = build_model(rank, world_size, seed)
    plain_18 = plain_loop_run(model, optimizer, batches(NUM_BATCHES - 2))
    return {
        "initial": initial,
        "initial_again": initial_again,
        "plain": plain,
        "sparse_dist": sparse_dist,
        "sparse_dist_not_all": sparse_dist_not_all,
        "plain_18": plain_18,
    }


@pytest.fixture(scope="module")
def upstream_runs() -> list[dict[str, Any]]:
    return run_on_ranks(_upstream_runs, SEED)


@pytest.mark.multiprocess
def test_build_model_is_reproducible(upstream_runs: list[dict[str, Any]]) -> None:
    for rank, runs in enumerate(upstream_runs):
        initial, again = runs["initial"], runs["initial_again"]
        assert initial.keys() == again.keys()
        for name in initial:
            assert torch.equal(initial[name], again[name]), f"rank {rank}: {name} differs between builds"
        # Table 0 lives on rank 0 only and table 1 on rank 1 only; the row-wise ones on both.
        assert ("sparse.ebc.embedding_bags.table_0.weight" in initial) == (rank == 0)
        assert ("sparse.ebc.embedding_bags.table_1.weight" in initial) == (rank == 1)
        assert "sparse.ebc.embedding_bags.table_2.weight" in initial


@pytest.mark.multiprocess
def test_sparse_dist_matches_plain_loop(upstream_runs: list[dict[str, Any]]) -> None:
    assert len(upstream_runs) == 2
    for rank, runs in enumerate(upstream_runs):
        plain: RunResult = runs["plain"]
        pipelined: RunResult = runs["sparse_dist"]
        assert_runs_equal(plain, pipelined, what=f"rank {rank}, TrainPipelineSparseDist vs plain loop")
        assert pipelined.num_calls == NUM_BATCHES
        assert pipelined.stop_iteration_call == NUM_BATCHES
        assert len(pipelined.losses) == NUM_BATCHES
        # Training really happened: the dense part and the fused tables both moved.
        for name in ("over.dhn_arch.linear1.weight", "sparse.ebc.embedding_bags.table_2.weight"):
            assert not torch.equal(runs["initial"][name], pipelined.weights[name]), name
    assert not torch.equal(upstream_runs[0]["plain"].losses[0], upstream_runs[1]["plain"].losses[0])


@pytest.mark.multiprocess
def test_sparse_dist_without_execute_all_batches_trains_18(upstream_runs: list[dict[str, Any]]) -> None:
    for rank, runs in enumerate(upstream_runs):
        pipelined: RunResult = runs["sparse_dist_not_all"]
        assert pipelined.num_calls == NUM_BATCHES - 2
        assert pipelined.stop_iteration_call == NUM_BATCHES - 2
        assert_runs_equal(runs["plain_18"], pipelined, what=f"rank {rank}, execute_all_batches=False")


# --------------------------------------------------------------------------------------------
# The harness on its own
# --------------------------------------------------------------------------------------------


def _batch_tensors(batch: ModelInput) -> list[torch.Tensor]:
    idscore = batch.idscore_features
    assert idscore is not None
    return [
        batch.float_features,
        batch.label,
        batch.idlist_features.values(),
        batch.idlist_features.lengths(),
        idscore.values(),
        idscore.lengths(),
        idscore.weights(),
    ]


def test_make_batches_is_deterministic_and_rank_specific() -> None:
    first = make_batches(0, 2, 3, SEED)
    again = make_batches(0, 2, 3, SEED)
    other_rank = make_batches(1, 2, 3, SEED)
    assert len(first) == 3
    for a, b in zip(first, again):
        assert all(torch.equal(x, y) for x, y in zip(_batch_tensors(a), _batch_tensors(b)))
    assert not torch.equal(first[0].float_features, other_rank[0].float_features)
    assert not torch.equal(first[0].float_features, first[1].float_features)


def test_assert_runs_equal_names_first_difference() -> None:
    def run(loss_1: float) -> RunResult:
        losses = [torch.tensor(0.5), torch.tensor(loss_1)]
        return RunResult([torch.zeros(2), torch.ones(2)], losses, 2, 2, {"w": torch.zeros(3)})

    assert_runs_equal(run(0.25), run(0.25))
    with pytest.raises(AssertionError, match=r"^sdd: loss of step 1: max abs diff 0\.125$"):
        assert_runs_equal(run(0.25), run(0.375), what="sdd")
    eval_mode = run(0.25)
    eval_mode.losses = []
    assert_runs_equal(eval_mode, eval_mode)
    with pytest.raises(AssertionError, match="^2 vs 0 recorded values of loss$"):
        assert_runs_equal(run(0.25), eval_mode)
    stopped_early = run(0.25)
    stopped_early.stop_iteration_call = 1
    with pytest.raises(AssertionError, match="StopIteration on call 2 vs 1"):
        assert_runs_equal(run(0.25), stopped_early)


def _assert_all_gone(pid_dir: Path) -> None:
    """No child is left: neither in multiprocessing's books nor in the OS (by the pids ranks wrote)."""
    assert multiprocessing.active_children() == []
    pids = [int(path.read_text()) for path in pid_dir.iterdir()]
    assert pids, "no rank recorded its pid"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _raise_on_rank_1(rank: int, world_size: int, pid_dir: str) -> None:
    (Path(pid_dir) / str(rank)).write_text(str(os.getpid()))
    if rank == 1:
        _deep_failure()
    dist.barrier()  # rank 0 waits here for a peer that never comes


def _deep_failure() -> None:
    raise ValueError("boom on rank 1")


@pytest.mark.multiprocess
def test_run_on_ranks_surfaces_rank_exception_with_traceback(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_on_ranks(_raise_on_rank_1, str(tmp_path), timeout_s=120.0)
    assert time.monotonic() - start < 60, "the parent waited for the blocked rank instead of killing it"
    assert info.value.rank == 1
    message = str(info.value)
    assert message.startswith("rank 1 of 2 raised:\nTraceback (most recent call last)")
    assert "in _deep_failure" in message
    assert "ValueError: boom on rank 1" in message
    _assert_all_gone(tmp_path)


def _die_on_rank_1(rank: int, world_size: int, pid_dir: str) -> None:
    (Path(pid_dir) / str(rank)).write_text(str(os.getpid()))
    if rank == 1:
        os._exit(3)
    dist.barrier()  # fails with "Connection reset by peer" once rank 1 is gone


def _start_a_worker_then_crash(rank: int, world_size: int, pid_dir: str) -> None:
    """Like a rank whose DataLoader workers are running when it aborts."""
    (Path(pid_dir) / str(rank)).write_text(str(os.getpid()))
    if rank == 1:
        worker = subprocess.Popen(["sleep", "600"])
        (Path(pid_dir) / "worker").write_text(str(worker.pid))
        os.abort()
    dist.barrier()


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (dead, waiting for init to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"


@pytest.mark.multiprocess
def test_nothing_a_crashed_rank_started_outlives_the_call(tmp_path: Path) -> None:
    with pytest.raises(RankError):
        run_on_ranks(_start_a_worker_then_crash, str(tmp_path), timeout_s=120.0)
    worker = int((tmp_path / "worker").read_text())
    deadline = time.monotonic() + 10
    while not _gone(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(worker), f"the worker {worker} the crashed rank started is still running"


@pytest.mark.multiprocess
def test_run_on_ranks_blames_rank_that_died_silently(tmp_path: Path) -> None:
    with pytest.raises(RankError) as info:
        run_on_ranks(_die_on_rank_1, str(tmp_path), timeout_s=120.0)
    assert info.value.rank == 1
    assert str(info.value).startswith("rank 1 of 2 exited with code 3 without reporting a result")
    _assert_all_gone(tmp_path)


def _hang_on_rank_1(rank: int, world_size: int, pid_dir: str) -> int:
    (Path(pid_dir) / str(rank)).write_text(str(os.getpid()))
    if rank == 1:
        time.sleep(3600)
    return rank


@pytest.mark.multiprocess
def test_run_on_ranks_timeout_kills_hanging_rank(tmp_path: Path) -> None:
    start = time.monotonic()
    # 30 s: enough for rank 0 to start, import torchrec and report even on a loaded machine
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 had not finished after 30\.0 s"):
        run_on_ranks(_hang_on_rank_1, str(tmp_path), timeout_s=30.0)
    assert time.monotonic() - start < 60
    _assert_all_gone(tmp_path)


def _rank_environment(rank: int, world_size: int, name: str) -> str | None:
    return os.environ.get(name)


@pytest.mark.multiprocess
def test_a_rank_runs_with_the_callers_environment_of_the_moment(monkeypatch: pytest.MonkeyPatch) -> None:
    # ranks are forked from a fork server started by an earlier call: its environment is that of its
    # start, and each rank takes the caller's of the call instead
    run_on_ranks(_rank_environment, "SWP_TEST_CALLER_ENV", timeout_s=120.0)  # the server is up
    monkeypatch.setenv("SWP_TEST_CALLER_ENV", "set after the server started")
    assert run_on_ranks(_rank_environment, "SWP_TEST_CALLER_ENV", timeout_s=120.0) == [
        "set after the server started"
    ] * 2
    monkeypatch.delenv("SWP_TEST_CALLER_ENV")
    assert run_on_ranks(_rank_environment, "SWP_TEST_CALLER_ENV", timeout_s=120.0) == [None, None]


_CALLER = """
import sys
from tests.dist.test_harness_upstream import _hang_on_rank_1
from harness.ranks import run_on_ranks
run_on_ranks(_hang_on_rank_1, sys.argv[1], timeout_s=600.0)
"""


@pytest.mark.multiprocess
def test_ranks_exit_when_their_caller_is_killed(tmp_path: Path) -> None:
    """A test run killed (SIGKILL: no finally runs) leaves no rank behind: a rank watches its caller
    and the fork server it was forked from."""
    caller = subprocess.Popen([sys.executable, "-c", _CALLER, str(tmp_path)], cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "1").exists() and time.monotonic() < deadline:  # rank 1 is up (and hangs)
            assert caller.poll() is None, "the caller ended before its ranks started"
            time.sleep(0.1)
        pids = [int((tmp_path / str(rank)).read_text()) for rank in range(2)]
    finally:
        caller.kill()
        caller.wait()
    deadline = time.monotonic() + 15
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in pids), f"ranks {pids} outlived their killed caller"
