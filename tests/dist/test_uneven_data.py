"""Ranks whose data runs out unevenly (10 batches against 13), on 2 gloo ranks.

* With ``sync_dataloader_exhaustion=False`` ours fails as upstream does (the reproduction): while
  one rank drains its last batches, the other issues the input dist of its batch 10, the
  collectives pair up wrongly and a rank dies or raises - never a silent pass. Each runs in
  ranks of its own (``run_on_ranks``), so the suite survives the abort.
* With default options (``sync_dataloader_exhaustion`` is on by default), for every pipeline
  family, with the default plan, an io thread, 2 parallel loads and lookahead: two epochs on one
  pipeline, rank 0 short in the first (10 against 13), rank 1 in the second. Every rank stops after batch 10 with
  StopIteration (the staged pipeline: returns None) in both epochs, and outputs, losses and final
  weights equal bit for bit those of the run in which every rank had 10 batches (sync off); the
  longer rank's draw for batch 10 is counted in ``batch_ledger.dropped_past_end``. One rank process runs
  every family and case (``_all_cases``), each test checks one family. The eval pipeline gets
  ``reset()`` between epochs, as upstream's needs; StagedTrainPipeline takes no ``loads`` (its
  source runs the user's first stage) and, given a new iterator after returning None, returns
  None again, as upstream's does (with the option and without: its second epoch is empty).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from functools import cache
from typing import Any

import pytest
import torch

from harness.parity import (
    assert_runs_equal,
    build_model,
    make_batches,
    sparse_data_dist_stages,
    staged_pipeline_run,
    train_pipeline_run,
)
from harness.ranks import RankError, run_on_ranks
from torchrec_swp.integrations.torchrec.compat import installed

pytestmark = pytest.mark.multiprocess

SHORT, LONG = 10, 13
CPU = torch.device("cpu")

#: The engine options each family runs with (besides the sync), by label.
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "io thread": {"thread_map": "io"},
    "2 loads": {"loads": 2},
    "lookahead": {"thread_map": "io", "lookahead": 2},
}

Factory = Callable[[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]], Any]


def _factories() -> dict[str, Factory]:
    from torchrec_swp import (
        EvalPipelineSparseDist,
        PrefetchTrainPipelineSparseDist,
        TrainPipelineBase,
        TrainPipelineFusedSparseDist,
        TrainPipelineSemiSync,
        TrainPipelineSparseDist,
        TrainPipelineSparseDistLite,
    )

    return {
        "Base": lambda m, o, kw: TrainPipelineBase(m, o, CPU, **kw),
        "SparseDist": lambda m, o, kw: TrainPipelineSparseDist(m, o, CPU, **kw),
        "Fused": lambda m, o, kw: TrainPipelineFusedSparseDist(m, o, CPU, **kw),
        "SemiSync": lambda m, o, kw: TrainPipelineSemiSync(m, o, CPU, start_batch=4, **kw),
        "Prefetch": lambda m, o, kw: PrefetchTrainPipelineSparseDist(m, o, CPU, **kw),
        "Eval": lambda m, o, kw: EvalPipelineSparseDist(m, o, CPU, **kw),
        "Lite": lambda m, o, kw: TrainPipelineSparseDistLite(m, o, device=CPU, **kw),
    }


#: the families one rank process runs (PEC and Maglev are new in TorchRec 1.9)
FAMILIES = ["Base", "SparseDist", "Fused", "SemiSync", "Prefetch", "Eval", "Lite", "Staged"] + (
    ["PEC"] if installed().has_pec else []
)


def _lengths(rank: int, sync: bool) -> tuple[int, int]:
    """This rank's batches in epochs 1 and 2: rank 0 short first, rank 1 short second (without
    the sync: both short, the reference)."""
    if not sync:
        return SHORT, SHORT
    return (SHORT, LONG) if rank == 0 else (LONG, SHORT)


def _sync(sync: bool) -> dict[str, Any]:
    """The options of a run with the sync (none: it is the default with a process group of
    several ranks) or without it (the reference: off)."""
    return {} if sync else {"sync_dataloader_exhaustion": False}


def _epoch_data(rank: int, world_size: int, seed: int, epoch: int, n: int) -> list[Any]:
    return make_batches(rank, world_size, LONG, seed + 100 * epoch)[:n]


def _train_run(family: str, rank: int, world_size: int, seed: int, options: dict[str, Any], sync: bool) -> list[Any]:
    model, optimizer = build_model(rank, world_size, seed)
    pipeline = _factories()[family](model, optimizer, {**options, **_sync(sync)})
    try:
        runs: list[Any] = []
        for e, n in enumerate(_lengths(rank, sync)):
            if e and family == "Eval":
                pipeline.reset()  # upstream's eval pipeline binds its first iterator until reset()
            runs.append(train_pipeline_run(pipeline, _epoch_data(rank, world_size, seed, e, n), LONG + 3))
        return [*runs, pipeline.batch_ledger.dropped_past_end]
    finally:
        pipeline.close()


def _staged_run(rank: int, world_size: int, seed: int, options: dict[str, Any], sync: bool) -> list[Any]:
    from torchrec_swp import StagedTrainPipeline

    model, optimizer = build_model(rank, world_size, seed)
    stages = sparse_data_dist_stages(model, torch.Stream(device="cpu"))
    thread_map = options.get("thread_map")
    staged = {**options, "thread_map": {"data_copy": "io"} if thread_map == "io" else thread_map}
    pipeline = StagedTrainPipeline(stages, **staged, **_sync(sync))
    try:
        runs: list[Any] = [
            staged_pipeline_run(pipeline, model, optimizer, _epoch_data(rank, world_size, seed, e, n), LONG + 5)
            for e, n in enumerate(_lengths(rank, sync))
        ]
        return [*runs, pipeline.batch_ledger.dropped_past_end]
    finally:
        pipeline.close()


def _pec_run(rank: int, world_size: int, seed: int, options: dict[str, Any], sync: bool) -> list[Any]:
    from harness.pec_model import build_pec_model
    from torchrec_swp import TrainPipelinePEC

    model, optimizer, batches = build_pec_model(seed, 2 * LONG)
    thread_map = options.get("thread_map")
    pec = {**options, "thread_map": {"H2D": "io"} if thread_map == "io" else thread_map}
    pipeline = TrainPipelinePEC(model, optimizer, CPU, **pec, **_sync(sync))
    try:
        runs: list[Any] = [
            train_pipeline_run(pipeline, batches[e * LONG : e * LONG + n], LONG + 3)
            for e, n in enumerate(_lengths(rank, sync))
        ]
        return [*runs, pipeline.batch_ledger.dropped_past_end]
    finally:
        pipeline.close()


def _case(family: str, rank: int, world_size: int, seed: int, options: dict[str, Any], sync: bool) -> list[Any]:
    if family == "Staged":
        return _staged_run(rank, world_size, seed, options, sync)
    if family == "PEC":
        return _pec_run(rank, world_size, seed, options, sync)
    return _train_run(family, rank, world_size, seed, options, sync)


def _all_cases(rank: int, world_size: int, seed: int, families: list[str]) -> dict[str, Any]:
    """Per family: the reference (both ranks short, no sync, default plan) and each config with
    the sync; a case that raises reports its traceback (the ranks go on with the next family)."""
    out: dict[str, Any] = {}
    for family in families:
        cases: dict[str, Any] = {}
        for label, options in {"reference": {}, **CONFIGS}.items():
            if family == "Staged" and "loads" in options:
                continue
            try:
                cases[label] = _case(family, rank, world_size, seed, options, label != "reference")
            except Exception:  # noqa: BLE001 - reported to the test, which fails naming the case
                cases[label] = traceback.format_exc()
        out[family] = cases
    return out


@cache
def _results() -> list[dict[str, Any]]:
    return run_on_ranks(_all_cases, 7, FAMILIES, timeout_s=1500)


@pytest.mark.parametrize("family", FAMILIES)
def test_uneven_data_stops_every_rank_after_the_same_batch(family: str) -> None:
    for rank, out in enumerate(_results()):
        cases = out[family]
        failed = {label: r for label, r in cases.items() if isinstance(r, str)}
        assert not failed, f"rank {rank} {family}: " + "\n".join(f"[{k}] {v}" for k, v in failed.items())
        *reference, no_drops = cases["reference"]
        assert no_drops == 0
        expected = [SHORT, 0] if family == "Staged" else [SHORT, SHORT]
        assert [(r.num_calls, r.stop_iteration_call) for r in reference] == [(n, n) for n in expected], family
        for label in CONFIGS:
            if label not in cases:
                assert family == "Staged" and label == "2 loads"
                continue
            *epochs, dropped_past_end = cases[label]
            for e, (ref, got) in enumerate(zip(reference, epochs, strict=True)):
                # outputs, losses, calls, the StopIteration call and the weights after the epoch
                assert_runs_equal(ref, got, what=f"rank {rank} {family} [{label}] epoch {e + 1}")
            # each rank was the longer one once and drew an item for batch 10 then (not trained)
            drawn_past = 1 if family != "Staged" else int(rank == 1)
            said = f"rank {rank} {family} [{label}]: {dropped_past_end} items drawn past the end"
            assert dropped_past_end == drawn_past, said


def _close_while_run_ahead_draws(rank: int, world_size: int, seed: int) -> list[Any]:
    """A staged pipeline, its io thread running 2 batches ahead: after an epoch, a second one's
    first progress() returns None on both ranks (as upstream's) and gives the io threads credit to
    draw ahead, every draw an agreement of every rank. Rank 1 closes at once, its thread woken but
    not yet drawing; rank 0 closes a second later, its thread waiting in its draw's agreement."""
    from torchrec_swp import StagedTrainPipeline

    model, optimizer = build_model(rank, world_size, seed)
    stages = sparse_data_dist_stages(model, torch.Stream(device="cpu"))
    pipeline = StagedTrainPipeline(stages, thread_map={"data_copy": "io"}, lookahead=2, engine_timeout_s=30)
    sync = pipeline._swp_engine.exhaustion
    try:
        first = staged_pipeline_run(pipeline, model, optimizer, _epoch_data(rank, world_size, seed, 0, SHORT))
        drawn = sync.calls
        second = pipeline.progress(iter(_epoch_data(rank, world_size, seed, 1, LONG)))
        if rank == 0:
            time.sleep(1.0)
    finally:
        start = time.monotonic()
        pipeline.close()
    return [first.num_calls, second, sync.calls - drawn, time.monotonic() - start]


def test_a_rank_that_closes_while_its_thread_is_behind_the_peers_draws_first() -> None:
    """close() lets every thread do what the calls so far entitle it to before it stops them (a
    thread just woken counts as going on, not as waiting for a call). Without either, the peer's
    draw waits for an agreement this rank never joins (1 in 12 runs of the family test's staged
    lookahead case, then once in CI): here it waits the sync's 30 s and fails."""
    results = run_on_ranks(_close_while_run_ahead_draws, 7, timeout_s=120)
    (calls_0, second_0, drawn_0, close_0), (calls_1, second_1, drawn_1, close_1) = results
    assert calls_0 == calls_1 == SHORT and second_0 is second_1 is None
    assert drawn_0 == drawn_1 > 0, (drawn_0, drawn_1)  # the second epoch's draws, alike on both ranks
    assert close_0 < 10 and close_1 < 10, (close_0, close_1)


# --------------------------------------------------------------------------------------------
# The reproduction: without the option, ours fails as upstream does
# --------------------------------------------------------------------------------------------


def _unsynced(rank: int, world_size: int, seed: int, ours: bool) -> list[int]:
    import torchrec.distributed.train_pipeline.train_pipelines as upstream

    from torchrec_swp import TrainPipelineSparseDist

    model, optimizer = build_model(rank, world_size, seed)
    cls = TrainPipelineSparseDist if ours else upstream.TrainPipelineSparseDist
    pipeline = cls(model, optimizer, CPU, **({"sync_dataloader_exhaustion": False} if ours else {}))
    run = train_pipeline_run(pipeline, make_batches(rank, world_size, SHORT if rank == 0 else LONG, seed), LONG + 3)
    return [run.num_calls, run.stop_iteration_call or -1]


@pytest.mark.parametrize("ours", [False, True], ids=["upstream", "ours"])
def test_with_the_sync_off_uneven_data_fails_like_upstream(ours: bool) -> None:
    with pytest.raises(RankError) as failure:
        run_on_ranks(_unsynced, 7, ours, timeout_s=240, group_may_break=True)
    # the rank that issues its batch 10's input dist while the other drains is aborted by gloo
    # (SIGABRT: "Received data size doesn't match expected size", on its stderr); its peer then
    # raises "Connection reset by peer"
    message = str(failure.value)
    assert "exited with code -6 without reporting a result" in message, message


# --------------------------------------------------------------------------------------------
# The Maglev drop-ins (2 stages x 1 rank): the draw is in take_inputs, one raw batch per round
# --------------------------------------------------------------------------------------------

MAGLEV_CASES = [
    ("MaglevPipelineBase", "main"),
    ("Maglev1F1B", "main"),
    ("Maglev1F1B", "comm"),
    ("Maglev1F1BRecvAhead", "comm"),
]
MICROBATCHES = 4


def _maglev_run(cls: str, thread_map: str, sync: bool) -> dict[str, Any]:
    """Two epochs of one of our Maglev pipelines (rank 0 short first, rank 1 second; without the
    sync both short): per epoch the progress() calls that returned, the call that raised
    StopIteration and the items drawn past the common end; the last stage's losses and the weights."""
    import torch.distributed as dist
    from torchrec.distributed.maglev.stage import StageWrapper

    from torchrec_swp.integrations.torchrec import maglev
    from torchrec_swp.integrations.torchrec.maglev.cpu import ModelConfig, on_cpu
    from torchrec_swp.integrations.torchrec.maglev.cpu import build_model as build_maglev
    from torchrec_swp.integrations.torchrec.maglev.cpu import make_batches as maglev_batches

    rank = dist.get_rank()
    config = ModelConfig()
    stage = on_cpu(StageWrapper(build_maglev(config, seed=0), list(config.layers_per_stage), stage_size=1))
    losses: list[torch.Tensor] = []
    if stage.is_last:
        stage.module.register_forward_hook(lambda m, i, out: losses.append(out[0].detach().clone()))
    optimizer = torch.optim.SGD(stage.module.parameters(), lr=0.001)
    options: dict[str, Any] = {"thread_map": thread_map, **_sync(sync)}
    pipeline_cls = getattr(maglev, cls)
    if cls == "MaglevPipelineBase":
        pipeline = pipeline_cls(stage, optimizer, **options)
    else:
        pipeline = pipeline_cls(stage, optimizer, MICROBATCHES, **options)
    epochs = []
    for e, n in enumerate(_lengths(rank, sync)):
        it = iter(maglev_batches(config, LONG, seed=10 * rank + e)[:n])
        calls, stop = 0, None
        for call in range(4 * LONG):
            try:
                pipeline.progress(it)
            except StopIteration:
                stop = call
                break
            calls += 1
        epochs.append((calls, stop, pipeline.dropped_past_end))
    pipeline.close()
    return {"epochs": epochs, "losses": losses, "weights": [p.detach().clone() for p in stage.module.parameters()]}


def _maglev_all(rank: int, world_size: int) -> dict[str, Any]:
    return {
        f"{cls} [{tm}]": {sync: _maglev_run(cls, tm, sync) for sync in (False, True)} for cls, tm in MAGLEV_CASES
    }


@pytest.mark.skipif(not installed().has_maglev, reason="torchrec.distributed.maglev is new in TorchRec 1.9")
def test_maglev_uneven_data_stops_every_rank_in_the_same_round() -> None:
    for rank, out in enumerate(run_on_ranks(_maglev_all, timeout_s=600)):
        for case, runs in out.items():
            reference, synced = runs[False], runs[True]
            what = f"rank {rank} {case}"
            calls = SHORT * 2 if case.startswith("MaglevPipelineBase") else SHORT * 2 // MICROBATCHES
            assert [e[:2] for e in reference["epochs"]] == [(calls, calls)] * 2, (what, reference["epochs"])
            # every rank stops in the same call; the longer rank's draw for round 10 is not trained
            long_epoch = 1 if rank == 0 else 0
            assert [e[:2] for e in synced["epochs"]] == [(calls, calls)] * 2, (what, synced["epochs"])
            assert [e[2] for e in synced["epochs"]] == [int(e == long_epoch) for e in range(2)], what
            assert len(synced["losses"]) == len(reference["losses"]), what
            assert all(torch.equal(a, b) for a, b in zip(synced["losses"], reference["losses"])), f"{what}: losses"
            assert all(torch.equal(a, b) for a, b in zip(synced["weights"], reference["weights"])), f"{what}: weights"


# --------------------------------------------------------------------------------------------
# A world of one: the option is a no-op
# --------------------------------------------------------------------------------------------


def _alone(rank: int, world_size: int) -> list[Any]:
    from torchrec_swp import TrainPipelineBase

    results = []
    for sync in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3))
        summing = _Summing(model)
        pipeline = TrainPipelineBase(summing, torch.optim.SGD(model.parameters(), lr=0.1), CPU,
                                     sync_dataloader_exhaustion=sync, thread_map="io")
        torch.manual_seed(1)
        run = train_pipeline_run(pipeline, [torch.randn(5, 4) for _ in range(SHORT)], model=summing)
        results.append((run, pipeline.engine.exhaustion))
        pipeline.close()
    return results


class _Summing(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.inner(x)
        return (out**2).sum(), out


def test_a_world_of_one_needs_no_sync() -> None:
    (plain, no_sync), (synced, sync) = run_on_ranks(_alone, world_size=1, timeout_s=120)[0]
    assert no_sync is None and sync is None  # nothing to agree on: no group, no collective
    assert synced.num_calls == synced.stop_iteration_call == SHORT
    assert_runs_equal(plain, synced, what="world of one")
