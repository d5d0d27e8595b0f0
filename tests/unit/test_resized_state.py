"""``load_state_dict(state, resized=True)``: a cut taken on another number of ranks.

What each class keeps of its own batches in flight was made on an old rank: SemiSync drops its
looked-up embeddings (the batch goes back to the data and is looked up again) and keeps its
stashed gradients (all-reduced: every old rank's are the same); a class that keeps something it
cannot move refuses in one line; the accumulation wrapper refuses a cut inside a window (each old
rank's gradients, not all-reduced) and carries a complete one over. ``resized`` must agree
with the world size the state records, both ways, in one line.
(Resuming across world sizes end to end: tests/dist/test_checkpoint_resize.py.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torchrec_swp
from tests.unit.test_engine_options import Summing  # model(x) -> (per-row losses, output)
from torchrec_swp import GradientAccumulationConfig, GradientAccumulationWrapper
from torchrec_swp.data import MapSource

CPU = torch.device("cpu")


def _engine_state(pipeline: Any, n: int) -> dict[str, Any]:
    return {
        "version": 1,
        "plan": pipeline.plan.name,
        "batch_number": n,
        "trained_number": n,
        "ledger": {"drawn": n, "trained": n, "dropped": []},
    }


def test_semisync_drops_its_lookups_and_keeps_its_stashed_gradients() -> None:
    stashed = {"weight": torch.arange(6.0).reshape(3, 2), "bias": torch.ones(3)}
    looked = {(3, "sparse"): torch.ones(2, 4)}
    for resized in (False, True):
        model = torch.nn.Linear(2, 3)
        pipeline = torchrec_swp.TrainPipelineSemiSync(
            model, torch.optim.SGD(model.parameters(), lr=0.1), CPU, start_batch=2, stash_gradients=True
        )
        state = {
            "pipeline_class": "TrainPipelineSemiSync",
            "loader": None,
            "engine": _engine_state(pipeline, 3),
            "pipeline": {"looked_up": dict(looked), "stashed_gradients": stashed},
        }
        pipeline.load_state_dict(state, resized=resized)
        assert pipeline._swp_replays == ({} if resized else looked)
        assert all(torch.equal(pipeline._gradients[k], v) for k, v in stashed.items())
        pipeline.close()


def test_state_a_class_cannot_move_is_refused_in_one_line() -> None:
    model = torch.nn.Linear(2, 3)
    pipeline = torchrec_swp.TrainPipelineBase(model, torch.optim.SGD(model.parameters(), lr=0.1), CPU)
    state = {
        "pipeline_class": "TrainPipelineBase",
        "loader": None,
        "engine": _engine_state(pipeline, 3),
        "pipeline": {"per_rank_thing": 1},
    }
    with pytest.raises(torchrec_swp.PlanError) as info:
        pipeline.load_state_dict(state, resized=True)
    assert str(info.value) == (
        "TrainPipelineBase.load_state_dict(resized=True): its state keeps per_rank_thing, which it cannot carry "
        "to another world size"
    )
    pipeline.close()


ITEMS = [torch.randn(5, 4, generator=torch.Generator().manual_seed(k)) for k in range(10)]


def _accumulating(cut: tuple[Any, Any] | None = None, *, resized: bool = False, steps: int) -> tuple[Any, Any]:
    """A wrapper (windows of 4) over TrainPipelineBase, from ``cut`` (a state and the model's
    weights of the same step) if given, trained ``steps`` more batches; returns its state and the
    model's weights then (SGD without momentum: no optimizer state to carry). ``resized``: the
    state is loaded as if cut on 2 ranks (this process is a world of 1)."""
    model = Summing()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pipeline = torchrec_swp.TrainPipelineBase(model, optimizer, CPU)
    config = GradientAccumulationConfig(is_enabled=True, num_steps=4, num_warmup_steps=1)
    source = MapSource(ITEMS)
    with GradientAccumulationWrapper(pipeline, optimizer, model, config) as wrapper:
        if cut is not None:
            state, weights = cut
            model.load_state_dict(weights)
            source.load_state_dict(state["loader"])
            wrapper.load_state_dict({**state, "world_size": 2} if resized else state, resized=resized)
        for _ in range(steps):
            wrapper.progress(source)
        return wrapper.state_dict(), {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_accumulation_refuses_a_cut_inside_a_window_on_another_world_size() -> None:
    inside = _accumulating(steps=2)  # calls 1 and 2 of the window 1..3 accumulated alone
    with pytest.raises(torchrec_swp.PlanError) as info:
        _accumulating(inside, resized=True, steps=1)
    assert str(info.value) == (
        "GradientAccumulationWrapper.load_state_dict(resized=True): the cut at step 2 is inside an accumulation "
        "window, whose gradients each old rank accumulated alone: they cannot move to another world size; resize "
        "from a checkpoint where step % 4 == 0"
    )
    _accumulating(inside, steps=1)  # on the same world size it goes on


def test_accumulation_carries_a_complete_window_to_another_world_size() -> None:
    boundary = _accumulating(steps=4)  # call 3 closed the window 1..3: all-reduced, stepped
    _, same = _accumulating(boundary, steps=4)
    _, resized = _accumulating(boundary, resized=True, steps=4)
    _, whole = _accumulating(steps=8)
    assert boundary[1]["layer.weight"].ne(whole["layer.weight"]).any()  # the 4 steps after the cut changed it
    for name in whole:
        assert torch.equal(resized[name], same[name]) and torch.equal(same[name], whole[name]), name


def _base() -> Any:
    model = Summing()
    return torchrec_swp.TrainPipelineBase(model, torch.optim.SGD(model.parameters(), lr=0.1), CPU)


def _base_state(steps: int) -> dict[str, Any]:
    """TrainPipelineBase's state after ``steps`` batches in this process (a world of 1)."""
    with _base() as pipeline:
        source = MapSource(ITEMS)
        for _ in range(steps):
            pipeline.progress(source)
        return pipeline.state_dict()


def test_a_state_records_the_world_size_it_was_cut_on_and_the_flag_must_agree() -> None:
    state, pipeline = _base_state(2), _base()
    assert state["world_size"] == 1
    with pipeline, pytest.raises(torchrec_swp.PlanError) as info:
        pipeline.load_state_dict({**state, "world_size": 2})
    assert str(info.value) == (
        "TrainPipelineBase.load_state_dict(): the state was cut on 2 ranks, this process runs on 1 rank: pass "
        "resized=True, with the data position global (torchrec_swp.data.GlobalMapSource) and the model and "
        "optimizer resharded through torch.distributed.checkpoint (docs/long_jobs.md, Resume on another world size)"
    )
    with pipeline, pytest.raises(torchrec_swp.PlanError) as info:
        pipeline.load_state_dict(state, resized=True)
    assert str(info.value) == (
        "TrainPipelineBase.load_state_dict(resized=True): the state was cut on 1 rank, as many as this process runs "
        "on: load it without resized=True, which is for another world size (it drops what the pipeline kept of its "
        "batches in flight and its tuned plan, with which a same-size resume goes on bit for bit)"
    )
    with pipeline:  # refused before anything was loaded: the pipeline still takes the state
        pipeline.load_state_dict({**state, "world_size": 2}, resized=True)
        assert pipeline.engine.trained_since_reset == 2


def test_a_state_without_a_world_size_is_taken_at_the_callers_word() -> None:
    old = {k: v for k, v in _base_state(2).items() if k != "world_size"}  # saved before the field existed
    for resized in (False, True):
        with _base() as pipeline:
            pipeline.load_state_dict(old, resized=resized)
            assert pipeline.engine.trained_since_reset == 2


def test_the_accumulation_wrapper_refuses_a_resize_it_was_not_told_of_before_its_window_check() -> None:
    inside = _accumulating(steps=2)  # a cut inside a window: with resized=True, refused for the window
    with pytest.raises(torchrec_swp.PlanError) as info:
        _accumulating(({**inside[0], "world_size": 2}, inside[1]), steps=1)
    assert str(info.value).startswith(
        "GradientAccumulationWrapper.load_state_dict(): the state was cut on 2 ranks, this process runs on 1 rank: "
        "pass resized=True"
    )
