"""A loader that fails on one item on one rank of 2, caught and retried by the user's loop.

Rank 1's loader raises once while reading item 7; the user's loop catches the error and calls
``progress()`` again, as a loop that retries transient read errors does; rank 0 meanwhile waits in
its next collective. Where the item can be drawn again (a map-style dataset read through
``torchrec_swp.data.MapSource``: the retry fetches the same index), every item is trained once
and the weights equal those of the run without the failure, on the default plan and with a load
thread and 2 parallel loads. Where it cannot (a plain iterator whose failed ``next()`` took the
item), rank 1 has one batch fewer: with ``sync_dataloader_exhaustion=True`` both ranks stop after
the same batch, without an abort, and rank 1's ledger names the failed draw.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import torchrec_swp
from harness.parity import RunResult, assert_runs_equal, build_model, local_state, make_batches, record_losses
from harness.ranks import run_on_ranks
from torchrec_swp.data import MapSource
from torchrec_swp.engine.errors import FailedDrawWarning

CPU = torch.device("cpu")
N = 16
BAD = 7
OPTIONS: dict[str, dict[str, Any]] = {"default": {}, "io loads=2": {"thread_map": "io", "loads": 2, "lookahead": 2}}


class Transient(OSError):
    """A read error that goes away when read again."""


class FlakyDataset:
    """``batches`` as a map-style dataset whose read of ``bad`` fails once (None: never)."""

    def __init__(self, batches: list[Any], bad: int | None) -> None:
        self.batches, self.bad = batches, bad

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> Any:
        if i == self.bad:
            self.bad = None
            raise Transient(f"read error at item {i}")
        return self.batches[i]


class LosingIterator:
    """A plain iterator over ``batches`` whose ``next()`` raises once at ``bad`` after taking it."""

    def __init__(self, batches: list[Any], bad: int | None) -> None:
        self.batches, self.bad, self.i = batches, bad, 0

    def __iter__(self) -> LosingIterator:
        return self

    def __next__(self) -> Any:
        if self.i >= len(self.batches):
            raise StopIteration
        i = self.i
        self.i += 1
        if i == self.bad:
            self.bad = None
            raise Transient(f"read error at item {i}")
        return self.batches[i]


def _retrying_run(pipeline: Any, data: Any) -> tuple[RunResult, int]:
    """The user's loop: ``progress()`` until StopIteration, a Transient caught and retried."""
    outputs: list[Any] = []
    retries = 0
    with record_losses(pipeline._model) as losses:
        while True:
            try:
                outputs.append(pipeline.progress(data))
            except StopIteration:
                break
            except Transient:
                retries += 1
                assert retries <= 3, "the retry failed again"
    return RunResult(outputs, losses, len(outputs), None, local_state(pipeline._model)), retries


def _rank(rank: int, world_size: int) -> dict[str, Any]:
    batches = make_batches(rank, world_size, N, 5)
    out: dict[str, Any] = {}
    for label, options in OPTIONS.items():
        for bad in (None, BAD if rank == 1 else None):
            model, optimizer = build_model(rank, world_size, 5)
            pipeline = torchrec_swp.TrainPipelineSparseDist(model, optimizer, CPU, engine_timeout_s=120, **options)
            run, retries = _retrying_run(pipeline, MapSource(FlakyDataset(batches, bad)))
            out[(label, bad)] = (run, retries, pipeline.batch_ledger)
            pipeline.close()
    # a plain iterator that took the item: one batch fewer on rank 1, a common end with the sync
    model, optimizer = build_model(rank, world_size, 5)
    pipeline = torchrec_swp.TrainPipelineSparseDist(
        model, optimizer, CPU, engine_timeout_s=120, sync_dataloader_exhaustion=True
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run, retries = _retrying_run(pipeline, LosingIterator(batches, BAD if rank == 1 else None))
    lines = [str(w.message) for w in seen if issubclass(w.category, FailedDrawWarning)]
    out["lost"] = (run.num_calls, retries, pipeline.batch_ledger, lines)
    pipeline.close()
    return out


@pytest.mark.multiprocess
def test_a_failed_draw_on_one_rank_is_retried_or_named_and_no_rank_aborts() -> None:
    for rank, out in enumerate(run_on_ranks(_rank, timeout_s=600)):
        for label in OPTIONS:
            clean, _, _ = out[(label, None)]
            bad = BAD if rank == 1 else None
            retried, retries, ledger = out[(label, bad)]
            assert retries == (1 if rank == 1 else 0)
            assert retried.num_calls == N and ledger.drawn == ledger.trained == N and ledger.failed_draws == []
            assert_runs_equal(clean, retried, what=f"rank {rank} {label}: the retried item against no failure")
        calls, retries, ledger, lines = out["lost"]
        assert calls == N - 1  # rank 1 lost one item; rank 0 stops with it at the common end
        if rank == 1:
            assert retries == 1 and [serial for serial, _ in ledger.failed_draws] == [BAD]
            assert len(lines) == 1 and f"drawing batch {BAD} of the epoch" in lines[0]
        else:
            assert ledger.failed_draws == [] and ledger.dropped_past_end == 1 and lines == []
