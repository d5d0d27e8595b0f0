"""2 stages x 2 ranks (4 gloo processes): data parallelism inside each stage, against upstream.

Each stage's module is a DDP over the stage's group, as Maglev's benchmark wraps it (DMP's
data-parallel wrapper); each rank reads its own data. Ours with ``grad_sync="wrapper"``
(upstream's ``no_sync`` placement) is bit-identical to upstream on every rank, on one thread
and with sends and receives on a comm thread.

What that placement does: the forward of the pass's last microbatch runs outside ``no_sync``,
so DDP reduces in the *next* backward. On the last stage that is the last backward; on a stage
with warm-up forwards (stage 0 here) it is an earlier one, and the backwards after it stay
local: stage 0's two replicas end the step with different weights. ``grad_sync="explicit"``
(every forward in ``no_sync``, ``G`` averages after the stage's last backward) keeps them equal,
and on the last stage's first step (same inputs) equals DDP's reduction bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness.ranks import run_on_ranks
from tests.dist.test_maglev_parity import same, train
from torchrec_swp.integrations.torchrec.compat import installed

pytestmark = [
    pytest.mark.parity,
    pytest.mark.multiprocess,
    pytest.mark.skipif(not installed().has_maglev, reason="torchrec.distributed.maglev is new in TorchRec 1.9"),
]


def _rank(rank: int, world_size: int) -> dict[str, Any]:
    reference = train("upstream", "Maglev1F1B", stage_size=2, ddp=True)
    main = train("ours", "Maglev1F1B", stage_size=2, ddp=True)
    comm = train("ours", "Maglev1F1BRecvAhead", stage_size=2, ddp=True, thread_map="comm")
    reference_ahead = train("upstream", "Maglev1F1BRecvAhead", stage_size=2, ddp=True)
    explicit = train("ours", "Maglev1F1B", stage_size=2, ddp=True, grad_sync="explicit", thread_map="comm")
    return {
        "main": same(reference, main),
        "comm": same(reference_ahead, comm),
        "upstream_weights": reference["weights"],
        "explicit_weights": explicit["weights"],
        "upstream_first_grads": reference["grads"][0],
        "explicit_first_grads": explicit["grads"][0],
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_ranks(_rank, world_size=4, timeout_s=240)


def test_bit_identical_to_upstream_with_data_parallel_stages(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        assert r["main"] == [], f"rank {rank}: {r['main']}"
        assert r["comm"] == [], f"rank {rank}: {r['comm']}"


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_explicit_grad_sync_keeps_replicas_equal_where_upstreams_placement_does_not(
    results: list[dict[str, Any]],
) -> None:
    stage0, stage1 = results[0:2], results[2:4]  # ranks 0, 1: stage 0; ranks 2, 3: stage 1
    # upstream: the last stage's replicas agree, the warm-up stage's do not (different data per lane)
    assert _equal(stage1[0]["upstream_weights"], stage1[1]["upstream_weights"])
    assert not _equal(stage0[0]["upstream_weights"], stage0[1]["upstream_weights"])
    # explicit: every stage's replicas agree, and the last stage's first step (same inputs as
    # upstream's: stage 0 started from the same weights) equals DDP's own reduction
    assert _equal(stage0[0]["explicit_weights"], stage0[1]["explicit_weights"])
    assert _equal(stage1[0]["explicit_weights"], stage1[1]["explicit_weights"])
    for r in stage1:
        assert _equal(r["explicit_first_grads"], r["upstream_first_grads"])
    assert not _equal(stage0[0]["explicit_first_grads"], stage0[0]["upstream_first_grads"])
