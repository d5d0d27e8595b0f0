"""One rank fails mid-training: the other ends with a clear error within the timeout, never a hang.

Rank 1's Forward raises on batch 3. Rank 1 aborts: progress() raises the task's own error,
named, and its later collectives are not issued. Rank 0 goes on into Forward(3), whose
all-to-all has no partner: if rank 1 exits, gloo reports the closed connection at once; if
rank 1 lingers, gloo's timeout (set short here) ends the wait. Either way the error surfaces
from rank 0's progress() naming the task, batch and thread, well within the test's deadline.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

import torchrec_swp
from harness.parity import build_model, make_batches
from harness.ranks import run_on_ranks
from tests.dist.linger import linger_until_peer_ended, peer_ended

PG_TIMEOUT_S = 5


def _rank(rank: int, world_size: int, thread_map: Any, linger: bool, marker: str) -> dict[str, Any]:
    distributed_c10d._set_pg_timeout(timedelta(seconds=PG_TIMEOUT_S), dist.group.WORLD)
    model, optimizer = build_model(rank, world_size, 3)
    pipeline = torchrec_swp.TrainPipelineSparseDist(model, optimizer, torch.device("cpu"), thread_map=thread_map)
    if rank == 1:
        forward = pipeline._model_fwd

        def failing_forward(batch: Any) -> Any:
            if pipeline.contexts[0].index == 3:
                raise ValueError("injected failure in forward on rank 1")
            return forward(batch)

        pipeline._model_fwd = failing_forward
    it = iter(make_batches(rank, world_size, 10, 3))
    trained = 0
    start = time.monotonic()
    try:
        while True:
            pipeline.progress(it)
            trained += 1
    except BaseException as e:  # noqa: BLE001 - the test reports whatever ended the run
        error = e
    elapsed = time.monotonic() - start
    if rank == 0:
        peer_ended(marker)
    elif linger:
        linger_until_peer_ended(marker)  # stay connected: rank 0 must be ended by the timeout
    pipeline.close()
    return {
        "trained": trained,
        "type": type(error).__name__,
        "message": str(error),
        "notes": list(getattr(error, "__notes__", [])),
        "task": getattr(error, "swp_task", None),
        "batch": getattr(error, "swp_batch", None),
        "elapsed": elapsed,
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "thread_map,linger",
    [("main", False), ({"H2D": "io"}, False), ({"H2D": "io"}, True)],
    ids=["one thread, failed rank exits", "H2D on io, failed rank exits", "H2D on io, failed rank lingers"],
)
def test_one_rank_failing_ends_the_other_with_a_clear_error_not_a_hang(
    thread_map: Any, linger: bool, tmp_path: Path
) -> None:
    marker = str(tmp_path / "healthy-rank-ended")
    healthy, failed = run_on_ranks(_rank, thread_map, linger, marker, timeout_s=PG_TIMEOUT_S * 8, group_may_break=True)
    assert failed["type"] == "ValueError" and "injected failure" in failed["message"]
    assert (failed["task"], failed["batch"]) == ("Forward", 3)
    assert failed["trained"] == 3
    # the healthy rank was stuck in a collective with no partner: gloo's timeout ends it
    assert healthy["trained"] == 3
    assert healthy["type"] != "StopIteration"
    assert healthy["task"] is not None, f"the error does not name the task: {healthy}"
    assert any("torchrec_swp: task" in note for note in healthy["notes"])
    assert healthy["elapsed"] < PG_TIMEOUT_S * 2
    if linger:
        assert healthy["elapsed"] >= PG_TIMEOUT_S * 0.9, "ended before the timeout: by what?"
        assert "timed out" in healthy["message"].lower() or "timeout" in healthy["message"].lower()
