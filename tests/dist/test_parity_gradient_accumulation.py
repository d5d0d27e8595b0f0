"""Our GradientAccumulationWrapper over our pipelines against upstream's over upstream's, 2 gloo ranks.

Same sharded model (DMP: fused tables, the dense part in DDP with TorchRec's default
``static_graph=True``) and data for every run; two epochs (10 batches, then 8 from a new
iterator), so that the first ends inside a window (upstream flushes it at StopIteration) and
the counter goes on across the epochs. Outputs, losses, final weights and the StopIteration
calls must be equal bit for bit, with the default plan and with thread maps, loads and
lookahead; upstream's Fused and SemiSync run under the test-only CPU patch, as in their own
parity tests, and so does TrainPipelinePEC (1.9), one epoch on its own model. On our side the
window is in the plan (``plans.accumulation_phases``); a pipeline
whose plan has phases of its own (SemiSync) keeps upstream's optimizer interception.

Checkpoints: a run cut in the middle of a window (after 5 batches of windows of 3: batches 3 and
4 accumulated, not all-reduced) and resumed on a new model, pipeline and wrapper equals the
uncut run bit for bit, over SparseDist (the window in the plan) and SemiSync (upstream's
interception); a cut whose next batch would skip the all-reduce is refused (DDP's static graph
must all-reduce its first backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torchrec.distributed.train_pipeline.train_pipelines as upstream
from torchrec.distributed.train_pipeline.gradient_accumulation import (
    GradientAccumulationConfig,
)
from torchrec.distributed.train_pipeline.gradient_accumulation import (
    GradientAccumulationWrapper as UpstreamWrapper,
)

import torchrec_swp
from examples.dlrm.upstream_cpu_patch import upstream_cpu_patch
from harness.parity import RunResult, assert_runs_equal, build_model, local_state, make_batches, train_pipeline_run
from harness.ranks import run_on_ranks
from torchrec_swp.data import MapSource
from torchrec_swp.integrations.torchrec.compat import installed

OursWrapper = torchrec_swp.GradientAccumulationWrapper

pytestmark = [pytest.mark.parity, pytest.mark.multiprocess]

EPOCHS = (10, 8)
CPU = torch.device("cpu")
CONFIGS = {
    "k3": GradientAccumulationConfig(num_steps=3),
    "k2w3": GradientAccumulationConfig(num_steps=2, num_warmup_steps=3),
}

Factory = Callable[[torch.nn.Module, torch.optim.Optimizer], Any]

# (name, configs, upstream factory, whether upstream needs the CPU patch, our factories by label)
CASES: list[tuple[str, tuple[str, ...], Factory, bool, dict[str, Factory]]] = [
    (
        "Base",
        ("k3",),
        lambda m, o: upstream.TrainPipelineBase(m, o, CPU),
        False,
        {
            "default": lambda m, o: torchrec_swp.TrainPipelineBase(m, o, CPU),
            "io_loads_lookahead": lambda m, o: torchrec_swp.TrainPipelineBase(
                m, o, CPU, thread_map="io", loads=2, lookahead=2
            ),
        },
    ),
    (
        "SparseDist",
        ("k3", "k2w3"),
        lambda m, o: upstream.TrainPipelineSparseDist(m, o, CPU),
        False,
        {
            "default": lambda m, o: torchrec_swp.TrainPipelineSparseDist(m, o, CPU),
            "per_task": lambda m, o: torchrec_swp.TrainPipelineSparseDist(m, o, CPU, thread_map="per_task"),
            "io_loads_lookahead": lambda m, o: torchrec_swp.TrainPipelineSparseDist(
                m, o, CPU, thread_map="io", loads=2, lookahead=2
            ),
        },
    ),
    (
        "SparseDistLite",
        ("k3",),
        lambda m, o: upstream.TrainPipelineSparseDistLite(m, o, CPU),
        False,
        {"default": lambda m, o: torchrec_swp.TrainPipelineSparseDistLite(m, o, CPU)},
    ),
    (
        "Fused",
        ("k3",),
        lambda m, o: upstream.TrainPipelineFusedSparseDist(m, o, CPU),
        True,
        {
            "default": lambda m, o: torchrec_swp.TrainPipelineFusedSparseDist(m, o, CPU),
            "io_thread": lambda m, o: torchrec_swp.TrainPipelineFusedSparseDist(m, o, CPU, thread_map={"H2D": "io"}),
        },
    ),
    (
        "SemiSync",
        ("k3",),
        lambda m, o: upstream.TrainPipelineSemiSync(m, o, CPU, start_batch=4),
        True,
        {"default": lambda m, o: torchrec_swp.TrainPipelineSemiSync(m, o, CPU, start_batch=4)},
    ),
]


def _train(
    factory: Factory,
    wrapper: type,
    config: str,
    patched: bool,
    epochs: tuple[int, ...],
    rank: int,
    world_size: int,
    seed: int,
) -> tuple[list[RunResult], str | None]:
    model, optimizer = build_model(rank, world_size, seed)
    with upstream_cpu_patch() if patched else contextlib.nullcontext():
        pipeline = factory(model, optimizer)
        wrapped = wrapper(pipeline, optimizer, model, CONFIGS[config])
        try:
            runs = [
                train_pipeline_run(wrapped, make_batches(rank, world_size, n, seed + e), n + 3, model=model)
                for e, n in enumerate(epochs)
            ]
            # which plan ran: the window's phases (ours), or the pipeline's own plan
            return runs, getattr(getattr(pipeline, "plan", None), "name", None)
        finally:
            if hasattr(pipeline, "close"):
                pipeline.close()


def _schedule(factory: Factory, rank: int, world_size: int, seed: int) -> str:
    model, optimizer = build_model(rank, world_size, seed)
    pipeline = factory(model, optimizer)
    torchrec_swp.GradientAccumulationWrapper(pipeline, optimizer, model, CONFIGS["k3"])
    text = pipeline.plan.format_schedule(3)
    pipeline.close()
    return text


def _all_cases(rank: int, world_size: int, seed: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, configs, up, patched, ours in CASES:
        # upstream's TrainPipelineBase trains no second epoch (its data stays stopped), ours does
        epochs = EPOCHS[:1] if name == "Base" else EPOCHS
        for config in configs:
            out[f"{name} {config}"] = (
                _train(up, UpstreamWrapper, config, patched, epochs, rank, world_size, seed),
                {
                    label: _train(f, OursWrapper, config, False, epochs, rank, world_size, seed)
                    for label, f in ours.items()
                },
            )
    out["schedule"] = _schedule(CASES[1][4]["default"], rank, world_size, seed)
    return out


@pytest.fixture(scope="module")
def cases() -> list[dict[str, Any]]:
    return run_on_ranks(_all_cases, 4242, timeout_s=600)


def test_every_pipeline_accumulates_as_upstream_bit_for_bit(cases: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(cases):
        for name, runs in results.items():
            if name == "schedule":
                continue
            (reference, _), ours = runs
            trained = [r.num_calls for r in reference]
            assert trained == list(EPOCHS[: len(reference)]), f"{name}: upstream trained {trained}"
            for label, (ran, plan) in ours.items():
                if not name.startswith("SemiSync"):  # SemiSync's own phases keep upstream's interception
                    assert plan is not None and plan.endswith(("_accumulate3", "_accumulate2_warmup3")), (name, plan)
                for epoch, (a, b) in enumerate(zip(reference, ran, strict=True)):
                    assert_runs_equal(a, b, what=f"rank {rank} {name} [{label}] epoch {epoch}")


def test_the_window_is_in_the_schedule(cases: list[dict[str, Any]]) -> None:
    text = cases[0]["schedule"]
    headers = [line for line in text.splitlines() if line.startswith("phase ")]
    assert headers == [
        "phase 0 (batches 0 to 0 trained since the pipeline was built or reset): TrainPipelineSparseDist_zero",
        "phase 1 (batches 1 to 1 trained since the pipeline was built or reset): "
        "TrainPipelineSparseDist_accumulate_nosync",
        "phase 2 (batches 2 to 2 trained since the pipeline was built or reset): TrainPipelineSparseDist_step",
        "phase 3 (batches 3 to 3, then every 3 batches trained since the pipeline was built or reset): "
        "TrainPipelineSparseDist_zero_nosync",
        "phase 4 (batches 4 to 4, then every 3 batches trained since the pipeline was built or reset): "
        "TrainPipelineSparseDist_accumulate_nosync",
        "phase 5 (batches 5 to 5, then every 3 batches trained since the pipeline was built or reset): "
        "TrainPipelineSparseDist_step",
    ], text


def _pec(rank: int, world_size: int, seed: int) -> dict[str, Any]:
    """TrainPipelinePEC (1.9) on its own model (``harness.pec_model``), upstream's under the patch."""
    from torchrec.distributed.train_pipeline.pec_train_pipeline import TrainPipelinePEC as Upstream

    from harness.pec_model import PEC_THREAD_MAPS, build_pec_model

    def run(factory: Factory, wrapper: type, patched: bool) -> tuple[RunResult, str | None]:
        model, optimizer, batches = build_pec_model(seed, EPOCHS[0])
        with upstream_cpu_patch() if patched else contextlib.nullcontext():
            pipeline = factory(model, optimizer)
            wrapped = wrapper(pipeline, optimizer, model, CONFIGS["k3"])
            try:
                result = train_pipeline_run(wrapped, batches, EPOCHS[0] + 3, model=model)
                return result, getattr(getattr(pipeline, "plan", None), "name", None)
            finally:
                if hasattr(pipeline, "close"):
                    pipeline.close()

    return {
        "upstream": run(lambda m, o: Upstream(m, o, CPU), UpstreamWrapper, True)[0],
        "ours": {
            label: run(lambda m, o, tm=PEC_THREAD_MAPS[label]: torchrec_swp.TrainPipelinePEC(m, o, CPU, thread_map=tm),
                       OursWrapper, False)
            for label in ("default", "spread")
        },
    }


@pytest.mark.skipif(not installed().has_pec, reason="TrainPipelinePEC is new in TorchRec 1.9")
def test_pec_accumulates_as_upstream_bit_for_bit() -> None:
    for rank, out in enumerate(run_on_ranks(_pec, 31, timeout_s=600)):
        reference = out["upstream"]
        assert reference.num_calls == EPOCHS[0]
        for label, (result, plan) in out["ours"].items():
            assert plan is not None and plan.endswith("_accumulate3"), plan
            assert_runs_equal(reference, result, what=f"rank {rank} PEC [{label}]")


# ---------------------------------------------------------------------------------- checkpoints
STEPS, CUT = 11, 5


#: The window in the plan (SparseDist), and upstream's optimizer interception (SemiSync's phases).
RESUMED: dict[str, Factory] = {
    "SparseDist": lambda m, o: torchrec_swp.TrainPipelineSparseDist(m, o, CPU, thread_map={"H2D": "io"}),
    "SemiSync": lambda m, o: torchrec_swp.TrainPipelineSemiSync(m, o, CPU, start_batch=2),
}


def _resume(rank: int, world_size: int, seed: int, name: str) -> dict[str, Any]:
    batches = make_batches(rank, world_size, STEPS, seed)
    config = GradientAccumulationConfig(num_steps=3)

    def wrapped(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        return OursWrapper(RESUMED[name](model, optimizer), optimizer, model, config)

    model, optimizer = build_model(rank, world_size, seed)
    uncut = train_pipeline_run(wrapped(model, optimizer), batches, STEPS + 3, model=model)

    model, optimizer = build_model(rank, world_size, seed)
    first = wrapped(model, optimizer)
    source = MapSource(batches)
    head = [train_pipeline_run(first, batches, 1, model=model, iterator=source) for _ in range(CUT)]
    refused = None
    state = first.state_dict()
    saved_model = model.state_dict()  # live tensors: loaded into model2 before `first` trains on
    accumulated = sorted(state["gradient_accumulation"]["gradients"])
    # batches 3 and 4 are in the window: the state carries their gradients; a cut two batches
    # later (the next batch the second of a window, not all-reduced) is refused with the
    # static-graph DDP
    model2, optimizer2 = build_model(rank, world_size, seed)
    resumed = wrapped(model2, optimizer2)
    model2.load_state_dict(saved_model)
    resumed.load_state_dict(state)
    source2 = MapSource(batches)
    source2.load_state_dict(state["loader"])
    tail = train_pipeline_run(resumed, batches, STEPS + 3, model=model2, iterator=source2)
    train_pipeline_run(first, batches, 1, model=model, iterator=source)  # batch 5: the window's last
    train_pipeline_run(first, batches, 1, model=model, iterator=source)  # batch 6: the next window's first
    try:
        first.state_dict()
    except torchrec_swp.PlanError as e:
        refused = str(e)
    # a state loaded where it does not fit is refused before anything changes
    bad = []
    for config_, state_ in (
        (GradientAccumulationConfig(num_steps=2), state),
        (config, {k: v for k, v in state.items() if k != "gradient_accumulation"}),
    ):
        other = OursWrapper(RESUMED[name](model2, optimizer2), optimizer2, model2, config_)
        try:
            other.load_state_dict(state_)
        except torchrec_swp.PlanError as e:
            bad.append(str(e))
        other.close()
    for p in (first, resumed):
        p.close()
    return {
        "uncut": uncut,
        "losses": [loss for run in head for loss in run.losses] + tail.losses,
        "outputs": [o for run in head for o in run.outputs] + tail.outputs,
        "weights": local_state(model2),
        "tail_calls": (tail.num_calls, tail.stop_iteration_call),
        "accumulated": accumulated,
        "refused": refused,
        "bad": bad,
    }


@pytest.mark.parametrize("name", list(RESUMED))
def test_a_run_cut_in_the_middle_of_a_window_resumes_bit_for_bit(name: str) -> None:
    for rank, out in enumerate(run_on_ranks(_resume, 99, name, timeout_s=300)):
        uncut: RunResult = out["uncut"]
        assert uncut.num_calls == STEPS and out["tail_calls"] == (STEPS - CUT, STEPS - CUT)
        resumed = RunResult(out["outputs"], out["losses"], STEPS, uncut.stop_iteration_call, out["weights"])
        assert_runs_equal(uncut, resumed, what=f"rank {rank} {name} resumed at {CUT}")
        assert out["accumulated"], "the cut carried no gradient"
        assert out["refused"] is not None and "static_graph=True" in out["refused"], out["refused"]
        assert out["bad"] == [
            "GradientAccumulationWrapper.load_state_dict(): the state was saved with num_steps=3, "
            "num_warmup_steps=1; this wrapper has 2, 1",
            "GradientAccumulationWrapper.load_state_dict(): the state holds no accumulated gradients "
            "(saved by the pipeline, not by a GradientAccumulationWrapper)",
        ]
