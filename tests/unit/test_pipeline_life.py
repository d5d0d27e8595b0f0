"""What a user touches of every drop-in, plan-driven and Maglev alike (``EngineDriven``):
``progress(None)`` or another non-iterator is a TypeError naming the class and the argument (not a
StopIteration that an ``except StopIteration: break`` loop would take for the end of the data); an
unknown constructor keyword is a TypeError naming the class, before upstream's constructor logs
anything; ``close()`` ends the pipeline (a later ``progress()`` raises, naming the class; closing
again does nothing) and ``with pipeline:`` closes it without swallowing exceptions."""

from __future__ import annotations

import gc
import logging
import weakref
from typing import Any

import pytest
import torch

from harness.ranks import run_on_ranks
from tests.unit.test_engine_options import build, global_configs_restored  # noqa: F401  (the fixture)
from torchrec_swp.integrations.torchrec import pipelines
from torchrec_swp.integrations.torchrec.compat import installed
from torchrec_swp.integrations.torchrec.engine_driven import PipelineClosed

pytestmark = pytest.mark.usefixtures("global_configs_restored")

NOT_ITERATORS = [(None, "None"), (3, "int"), ([torch.zeros(2)], "list")]


@pytest.mark.parametrize("name", pipelines.__all__)
def test_progress_of_a_non_iterator_is_a_type_error_naming_the_class(name: str) -> None:
    pipeline = build(name)
    try:
        for given, shown in NOT_ITERATORS:
            with pytest.raises(TypeError) as info:
                pipeline.progress(given)
            assert str(info.value) == (
                f"{name}.progress(dataloader_iter): dataloader_iter must be an iterator (e.g. iter(dataloader)), "
                f"got {shown}"
            )
        # a user's loop that stops at StopIteration does not take it for the end of the data
        with pytest.raises(TypeError):
            while True:
                try:
                    pipeline.progress(None)
                except StopIteration:
                    break
    finally:
        pipeline.close()


@pytest.mark.parametrize("name", pipelines.__all__)
def test_an_unknown_keyword_names_the_class_before_upstream_logs(name: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    with pytest.raises(TypeError) as info:
        build(name, thread_mapp="io")
    assert str(info.value) == f"{name}() got an unexpected keyword argument 'thread_mapp'"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("name", pipelines.__all__)
def test_close_ends_the_pipeline_and_with_closes_it(name: str) -> None:
    pipeline = build(name)
    assert not pipeline.closed
    pipeline.close()
    pipeline.close()  # harmless
    with pytest.raises(PipelineClosed, match=rf"^{name}\.progress\(\): the pipeline was closed"):
        pipeline.progress(iter([]))
    with build(name) as entered:
        assert isinstance(entered, getattr(pipelines, name)) and not entered.closed
    assert entered.closed
    with pytest.raises(ZeroDivisionError):  # the block's exception passes through
        with build(name) as failing:
            raise ZeroDivisionError
    assert failing.closed


@pytest.mark.parametrize("name", pipelines.__all__)
def test_a_pipeline_dropped_unclosed_is_collected_and_torn_down(name: str) -> None:
    """Nothing global holds a pipeline: dropped without close(), the garbage collector takes it and
    its teardown runs (its engine's threads, the groups it made), not left to the exit hook."""
    pipeline = build(name, thread_map="io", lookahead=2)
    ref, teardown = weakref.ref(pipeline), pipeline._swp_teardown()
    assert not teardown.done
    del pipeline
    gc.collect()
    assert ref() is None and teardown.done


def test_the_upstream_argument_check_leaves_known_arguments_alone() -> None:
    # upstream's keywords, and a subclass's required one (site_fqn), still bind
    pipeline = build("TrainPipelineSparseDistOptStash", execute_all_batches=False)
    assert pipeline._execute_all_batches is False
    pipeline.close()


# ------------------------------------------------------------------ the Maglev drop-ins
def _maglev_surface(rank: int, world_size: int) -> list[str]:
    from torchrec.distributed.maglev.stage import StageWrapper

    from torchrec_swp.integrations.torchrec import maglev
    from torchrec_swp.integrations.torchrec.maglev.cpu import ModelConfig, build_model, on_cpu

    config = ModelConfig(layers_per_stage=(2,))
    stage = on_cpu(StageWrapper(build_model(config, seed=0), list(config.layers_per_stage), stage_size=1))
    optimizer = torch.optim.SGD(stage.module.parameters(), lr=0.001)
    seen: list[str] = []

    def attempt(call: Any) -> None:
        try:
            call()
            seen.append("accepted")
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            seen.append(f"{type(e).__name__}: {e}")

    attempt(lambda: maglev.MaglevPipelineBase(stage, optimizer, bogus=1))
    attempt(lambda: maglev.MaglevPipelineBase(stage, optimizer, schedule="1F1B"))  # Maglev1F1B's option only
    attempt(lambda: maglev.Maglev1F1B(stage, optimizer, 1, engine_timeout_s=0))
    for cls, args in ((maglev.MaglevPipelineBase, ()), (maglev.Maglev1F1BRecvAhead, (1,))):
        pipeline = cls(stage, optimizer, *args)
        # attempt() calls each lambda at once, within this iteration: no late binding (B023)
        attempt(lambda: pipeline.progress(None))  # noqa: B023
        with pipeline as entered:
            seen.append(f"entered itself {entered is pipeline}")
        seen.append(f"closed {pipeline.closed}")
        pipeline.close()
        attempt(lambda: pipeline.progress(iter([])))  # noqa: B023
    return seen


@pytest.mark.multiprocess
@pytest.mark.skipif(not installed().has_maglev, reason="torchrec.distributed.maglev is new in TorchRec 1.9")
def test_the_maglev_drop_ins_share_the_surface() -> None:
    (seen,) = run_on_ranks(_maglev_surface, world_size=1, timeout_s=120)
    iterator = "dataloader_iter must be an iterator (e.g. iter(dataloader)), got None"
    assert seen == [
        "TypeError: MaglevPipelineBase() got an unexpected keyword argument 'bogus'",
        "TypeError: MaglevPipelineBase() got an unexpected keyword argument 'schedule'",
        "ValueError: Maglev1F1B: engine_timeout_s must be a number > 0, got 0",
        f"TypeError: MaglevPipelineBase.progress(dataloader_iter): {iterator}",
        "entered itself True",
        "closed True",
        "PipelineClosed: MaglevPipelineBase.progress(): the pipeline was closed (close() or its with block ended)",
        f"TypeError: Maglev1F1BRecvAhead.progress(dataloader_iter): {iterator}",
        "entered itself True",
        "closed True",
        "PipelineClosed: Maglev1F1BRecvAhead.progress(): the pipeline was closed (close() or its with block ended)",
    ]


def test_the_accumulation_wrapper_closes_the_pipeline_it_wraps() -> None:
    from torchrec_swp import GradientAccumulationConfig, GradientAccumulationWrapper

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = GradientAccumulationConfig(is_enabled=True, num_steps=2, num_warmup_steps=1)
    with GradientAccumulationWrapper(build("TrainPipelineBase"), optimizer, model, config) as wrapper:
        assert not wrapper.closed
    assert wrapper.closed and wrapper._pipeline.closed
    wrapper.close()  # harmless
    with pytest.raises(PipelineClosed, match=r"^GradientAccumulationWrapper\.progress\(\): the pipeline was closed"):
        wrapper.progress(iter([]))
