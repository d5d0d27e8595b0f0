"""TrainPipelineSemiSync with ``stash_gradients``: what its state carries over a checkpoint's cut
(the stashed gradients), and a state that does not fit refused in one line, before the first
``progress()``. (Resuming bit for bit: tests/dist/test_checkpoint_resume.py.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torchrec_swp

CPU = torch.device("cpu")


def _pipeline(stash: bool) -> Any:
    model = torch.nn.Linear(2, 3)
    return torchrec_swp.TrainPipelineSemiSync(
        model, torch.optim.SGD(model.parameters(), lr=0.1), CPU, start_batch=2, stash_gradients=stash
    )


def _state(pipeline: Any, **pipeline_state: Any) -> dict[str, Any]:
    """A cut after 3 batches, as ``state_dict()`` writes it."""
    engine = {
        "version": 1,
        "plan": pipeline.plan.name,
        "batch_number": 3,
        "trained_number": 3,
        "ledger": {"drawn": 3, "trained": 3, "dropped": []},
    }
    pipeline_part = {"looked_up": {}, **pipeline_state}
    return {"pipeline_class": "TrainPipelineSemiSync", "loader": None, "engine": engine, "pipeline": pipeline_part}


def test_the_stashed_gradients_come_back_on_the_parameters_device() -> None:
    pipeline = _pipeline(stash=True)
    stashed = {"weight": torch.arange(6.0).reshape(3, 2), "bias": torch.ones(3)}
    pipeline.load_state_dict(_state(pipeline, stashed_gradients=stashed))
    assert pipeline._gradients.keys() == stashed.keys()
    assert all(torch.equal(pipeline._gradients[k], v) for k, v in stashed.items())
    pipeline.close()


@pytest.mark.parametrize(
    "stash, saved, message",
    [
        (True, None, "the state was saved without stash_gradients, this pipeline has stash_gradients=True"),
        (False, {}, "the state was saved with stash_gradients, this pipeline has stash_gradients=False"),
        (True, {"weight": torch.zeros(2, 2)}, "the stashed gradient of 'weight' ((2, 2)) fits no parameter"),
        (True, {"other": torch.zeros(3)}, "the stashed gradient of 'other' ((3,)) fits no parameter"),
    ],
)
def test_a_state_that_does_not_fit_is_refused_in_one_line(stash: bool, saved: Any, message: str) -> None:
    pipeline = _pipeline(stash)
    state = _state(pipeline) if saved is None else _state(pipeline, stashed_gradients=saved)
    with pytest.raises(torchrec_swp.PlanError) as info:
        pipeline.load_state_dict(state)
    assert message in str(info.value) and "\n" not in str(info.value)
    pipeline.close()
