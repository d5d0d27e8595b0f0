"""Nothing lost: every batch drawn is trained exactly once or reported as not trained.

On 2 gloo ranks with the sharded model, against a plain loop over exactly the batches that
should have been trained (bit for bit):
* detach()/attach() in the middle of an epoch;
* execute_all_batches=False, then a new epoch: the two batches left in flight are trained first;
* a DataLoader with persistent workers, whose iterator object is the same every epoch (upstream
  never reads its second epoch: its exhausted flag is keyed on the iterator's identity);
* a failure, reset(), and resuming: the dropped batches are reported.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import torchrec_swp
from harness.parity import RunResult, assert_runs_equal, build_model, make_batches, plain_loop_run, train_pipeline_run
from harness.ranks import run_on_ranks

CPU = torch.device("cpu")


class _Batches(Dataset[Any]):
    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> Any:
        return self.batches[i]


def _identity(batch: Any) -> Any:
    return batch


def _plain(rank: int, world_size: int, batches: list[Any]) -> RunResult:
    model, optimizer = build_model(rank, world_size, 11)
    return plain_loop_run(model, optimizer, batches)


def _scenarios(rank: int, world_size: int) -> dict[str, Any]:
    e1, e2 = make_batches(rank, world_size, 12, 1), make_batches(rank, world_size, 12, 2)
    out: dict[str, Any] = {}

    # detach/attach mid-epoch (H2D on its own thread for good measure)
    model, optimizer = build_model(rank, world_size, 11)
    pipeline = torchrec_swp.TrainPipelineSparseDist(model, optimizer, CPU, thread_map={"H2D": "io"})
    it = iter(e1)
    first = train_pipeline_run(pipeline, e1, 5, iterator=it)
    detached = pipeline.detach()
    assert detached is model
    pipeline.attach(model)
    rest = train_pipeline_run(pipeline, e1, 20, iterator=it)
    out["detach"] = (first, rest, _plain(rank, world_size, e1))
    pipeline.close()

    # execute_all_batches=False: epoch 1 stops with 2 batches in flight; epoch 2 trains them first.
    # by_stream spreads comm group "world" over threads: resuming the stopped iteration must pass
    # on the tickets of collectives that ran before the stop (else the next one waits forever).
    for label, thread_map in (("stop", None), ("stop by_stream", "by_stream")):
        model, optimizer = build_model(rank, world_size, 11)
        pipeline = torchrec_swp.TrainPipelineSparseDist(
            model, optimizer, CPU, execute_all_batches=False, thread_map=thread_map, engine_timeout_s=60
        )
        runs = [train_pipeline_run(pipeline, e, 20) for e in (e1, e2)]
        out[label] = (runs, pipeline.untrained_batches(), _plain(rank, world_size, e1 + e2[:10]))
        pipeline.close()

    # persistent workers: iter(loader) is the same object every epoch
    loader = DataLoader(_Batches(e1), batch_size=None, num_workers=1, persistent_workers=True, collate_fn=_identity)
    model, optimizer = build_model(rank, world_size, 11)
    pipeline = torchrec_swp.TrainPipelineSparseDist(model, optimizer, CPU)
    runs, its = [], []
    for _ in range(2):
        its.append(iter(loader))
        runs.append(train_pipeline_run(pipeline, e1, 20, iterator=its[-1]))
    out["persistent"] = (its[0] is its[1], runs, _plain(rank, world_size, e1 + e1))
    pipeline.close()

    # a failure, reset(), resume: dropped batches are reported, the rest trains
    model, optimizer = build_model(rank, world_size, 11)
    pipeline = torchrec_swp.TrainPipelineSparseDist(model, optimizer, CPU)
    forward = pipeline._model_fwd
    calls = [0]

    def failing_forward(batch: Any) -> Any:
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("injected")
        return forward(batch)

    pipeline._model_fwd = failing_forward
    it = iter(e1)
    trained_before = train_pipeline_run(pipeline, e1, 3, iterator=it)
    try:
        pipeline.progress(it)
    except RuntimeError:
        pass
    pipeline.reset()
    after = train_pipeline_run(pipeline, e1, 20, iterator=it)
    out["reset"] = (trained_before.num_calls, after.num_calls, pipeline.batch_ledger, pipeline.untrained_batches())
    pipeline.close()
    return out


def _concat(a: RunResult, b: RunResult) -> RunResult:
    return RunResult(a.outputs + b.outputs, a.losses + b.losses, a.num_calls + b.num_calls, None, b.weights)


def _expect(reference: RunResult, got: RunResult, what: str) -> None:
    reference = RunResult(reference.outputs, reference.losses, reference.num_calls, None, reference.weights)
    assert_runs_equal(reference, got, what=what)


@pytest.mark.multiprocess
def test_nothing_is_lost() -> None:
    for rank, r in enumerate(run_on_ranks(_scenarios, timeout_s=600)):
        first, rest, plain = r["detach"]
        _expect(plain, _concat(first, rest), f"rank {rank} detach/attach")

        for label in ("stop", "stop by_stream"):
            (e1, e2), untrained, plain = r[label]
            assert (e1.num_calls, e2.num_calls) == (10, 12)  # 2 of e1 wait for e2; 2 of e2 left in flight
            assert [serial for serial, _ in untrained] == [22, 23]
            _expect(plain, _concat(e1, e2), f"rank {rank} {label} then new epoch")

        same_iterator, (p1, p2), plain = r["persistent"]
        assert same_iterator
        _expect(plain, _concat(p1, p2), f"rank {rank} persistent workers")

        before, after, ledger, untrained = r["reset"]
        assert before == 3
        # the failure hit Forward(3), after H2D(5) had fired: batches 3, 4 and 5 were in flight
        # and reset() dropped them; training resumed with batch 6
        assert [serial for serial, _ in untrained] == [3, 4, 5]
        assert ledger.drawn == ledger.trained + len(ledger.dropped) == 12
        assert after == 12 - 6
