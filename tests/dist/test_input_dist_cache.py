"""``EvalPipelineSparseDist(input_dist_cache_mb=)``: a held-out set evaluated 4 times, training in
between, distributes its ids once and gives the same outputs as without the cache.

On 1 and 2 gloo ranks with the sharded test model (two sharded EmbeddingBagCollections, tables
table-wise and row-wise): 4 evaluations of the same ``N`` held-out batches, 2 training steps
before each evaluation after the first (so every evaluation sees other weights), as the DLRM
example alternates them (attach, evaluate until StopIteration, detach, reset). Compared with the
same run without the cache, bit for bit: every evaluation's outputs and the final weights. The
sharded modules' ``input_dist`` is counted: ``N`` calls per module with the cache (the first
evaluation), ``4 N`` without. On 2 ranks the ranks agree on each reuse in the agreement the
draws make anyway (``sync_dataloader_exhaustion``), and with that turned off in a collective of
the cache's own. With a cap that keeps nothing on rank 1 only, no batch is reused on any rank
(their agreement), none hangs, and the outputs are the same again.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

from harness.parity import build_model, local_state, make_batches
from harness.ranks import run_on_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.every_release]

N = 5  # held-out batches per rank
EVALS = 4
CPU = torch.device("cpu")


def _run(rank: int, world_size: int, cache_mb: float | None, **options: Any) -> dict[str, Any]:
    from torchrec_swp import EvalPipelineSparseDist

    model, optimizer = build_model(rank, world_size, seed=3)
    held_out = make_batches(rank, world_size, N, seed=11)
    training = make_batches(rank, world_size, 2 * EVALS, seed=12)
    input_dists = 0
    for module in model.modules():
        if isinstance(module, ShardedEmbeddingBagCollection):
            original = module.input_dist

            def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                nonlocal input_dists
                input_dists += 1
                return _original(*args, **kwargs)

            module.input_dist = counted  # type: ignore[method-assign]
    pipeline = EvalPipelineSparseDist(model, optimizer, CPU, input_dist_cache_mb=cache_mb, **options)
    evaluations, dists = [], []
    try:
        for e in range(EVALS):
            if e:
                for batch in training[2 * e : 2 * e + 2]:  # the model's own forward: detached
                    optimizer.zero_grad()
                    loss, _ = model(batch)
                    loss.backward()
                    optimizer.step()
            before = input_dists
            pipeline.attach(model)
            outputs = []
            it = iter(held_out)
            with torch.no_grad():
                for _ in range(N + 2):
                    try:
                        outputs.append(pipeline.progress(it).detach().clone())
                    except StopIteration:
                        break
            pipeline.detach()
            pipeline.reset()
            evaluations.append(outputs)
            dists.append(input_dists - before)
        stats = None if pipeline.input_dist_cache is None else pipeline.input_dist_cache.stats()
    finally:
        pipeline.close()
    return {"evaluations": evaluations, "dists": dists, "weights": local_state(model), "stats": stats}


def _all(rank: int, world_size: int) -> dict[str, Any]:
    runs = {
        "off": _run(rank, world_size, None),
        "on": _run(rank, world_size, 64.0),
        "rank 1 keeps nothing": _run(rank, world_size, 64.0 if rank == 0 else 0.0),
    }
    if world_size > 1:  # without the draws' agreement, the cache's own
        runs["on, own agreement"] = _run(rank, world_size, 64.0, sync_dataloader_exhaustion=False)
    return runs


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def runs(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return run_on_ranks(_all, world_size=request.param, timeout_s=600)


def _equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert len(a["evaluations"]) == len(b["evaluations"]) == EVALS
    for e, (x, y) in enumerate(zip(a["evaluations"], b["evaluations"], strict=True)):
        assert len(x) == len(y) == N, e
        assert all(torch.equal(p, q) for p, q in zip(x, y, strict=True)), f"evaluation {e} differs"
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in b["weights"])


def test_the_held_out_set_is_distributed_once_and_evaluates_the_same(runs: list[dict[str, Any]]) -> None:
    for rank, run in enumerate(runs):
        off, on = run["off"], run["on"]
        _equal(on, off)
        # training between evaluations changed what they compute: the cache reused ids, not outputs
        assert not torch.equal(off["evaluations"][0][0], off["evaluations"][1][0])
        modules = off["dists"][0] // N
        assert modules == 2 and off["dists"] == [N * modules] * EVALS, rank
        assert on["dists"] == [N * modules] + [0] * (EVALS - 1), rank
        stats = on["stats"]
        assert (stats["hits"], stats["misses"], stats["entries"], stats["not_kept"]) == ((EVALS - 1) * N, N, N, 0)
        assert 0 < stats["bytes"] <= stats["max_bytes"] and stats["disabled"] is None
        assert stats["saved_s"] > 0
        # on 2 ranks the reuse is agreed in the draws' agreement (sync_dataloader_exhaustion), else alone
        assert stats["carried"] == (EVALS * N if len(runs) > 1 else 0) and stats["agree_s"] == 0.0
        if len(runs) > 1:
            own = run["on, own agreement"]
            _equal(own, off)
            assert own["dists"] == on["dists"] and own["stats"]["carried"] == 0 and own["stats"]["hits"] == 3 * N


def test_a_rank_that_cannot_keep_a_batch_makes_every_rank_distribute_it(runs: list[dict[str, Any]]) -> None:
    if len(runs) == 1:
        pytest.skip("one rank: nothing to agree on")
    for rank, run in enumerate(runs):
        _equal(run["rank 1 keeps nothing"], run["off"])
        stats = run["rank 1 keeps nothing"]["stats"]
        assert stats["hits"] == 0 and stats["misses"] == EVALS * N
        assert run["rank 1 keeps nothing"]["dists"] == run["off"]["dists"]
        assert (stats["entries"], stats["not_kept"]) == ((N, 0) if rank == 0 else (0, EVALS * N))
