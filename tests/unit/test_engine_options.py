"""The engine's keyword options, defined once (``EngineOptions``) and taken by every plan-driven
drop-in: checked before anything is built, applied in the documented order (plan, thread_map,
loads, lookahead), and, with loads and lookahead, TrainPipelineBase and TrainPipelinePT2 train
bit for bit as with their default plan, over a plain iterator and over a MapSource."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import pytest
import torch
import torch._dynamo.config
import torch._functorch.config
import torch._inductor.config
from torchrec.distributed.train_pipeline import train_pipelines as upstream
from torchrec.distributed.train_pipeline.pipeline_stage import PipelineStage

import torchrec_swp
from torchrec_swp import plans
from torchrec_swp.catalog import torchrec as catalog
from torchrec_swp.data import MapSource
from torchrec_swp.engine import DEFAULT_TIMEOUT_S
from torchrec_swp.integrations.torchrec import pipelines
from torchrec_swp.integrations.torchrec.pipelines.engine_options import EngineOptions
from torchrec_swp.plan import PipelinePlan, PlanError

CPU = torch.device("cpu")


# ------------------------------------------------------------------ the options themselves
def test_take_pops_the_engine_keywords_and_leaves_the_rest() -> None:
    kwargs: dict[str, Any] = {"loads": 2, "execute_all_batches": False, "thread_map": "io", "lookahead": 3}
    options = EngineOptions.take(kwargs, "X")
    assert kwargs == {"execute_all_batches": False}
    assert options == EngineOptions(thread_map="io", loads=2, lookahead=3)
    assert EngineOptions.take({}, "X") == EngineOptions(None, None, 1, None, DEFAULT_TIMEOUT_S)
    assert EngineOptions.names() == (
        "plan", "thread_map", "loads", "lookahead", "engine_timeout_s", "autotune", "sync_dataloader_exhaustion",
        "on_nonfinite",
    )


def test_the_options_apply_in_order_plan_thread_map_loads_lookahead(tmp_path: Path) -> None:
    default = catalog.sparse_dist_plan()
    chosen = EngineOptions(thread_map="io", loads=2, lookahead=3).plan_for(default, "X")
    assert chosen == plans.with_lookahead(plans.with_parallel_loads(default.with_thread_map("io"), 2), 3)
    assert chosen.task("H2D").thread_group == "io" and chosen.source_lanes() == ("load", "load.1")
    # defaults change nothing, and a plan= keeps its own lookahead and loads unless told otherwise
    assert EngineOptions().plan_for(default, "X") is default
    mine = plans.with_parallel_loads(default, 3, lookahead=1)
    assert EngineOptions(plan=mine).plan_for(default, "X") == mine
    assert EngineOptions(plan=mine, lookahead=0).plan_for(default, "X") == plans.with_lookahead(mine, 0)
    # a plan file, then a thread map over it ("io" keeps the lanes of a source with loads)
    path = tmp_path / "mine.plan"
    mine.save(str(path))
    from_file = EngineOptions(plan=path, thread_map="io").plan_for(default, "X")
    assert from_file == mine.with_thread_map("io") and from_file.source_lanes() == ("load", "load.1", "load.2")
    # a thread map that puts the loads' source back on the calling thread is refused, naming the option
    with pytest.raises(
        PlanError, match=r"^X\(thread_map='main'\): loads 3: the source Fetch runs on the calling thread"
    ):
        EngineOptions(plan=mine, thread_map="main").plan_for(default, "X")


def base(**kwargs: Any) -> Any:
    model = torch.nn.Linear(2, 2)
    return torchrec_swp.TrainPipelineBase(model, torch.optim.SGD(model.parameters(), lr=0.1), CPU, **kwargs)


def staged(**kwargs: Any) -> Any:
    stage = PipelineStage(name="data_copy", runnable=lambda b: b, stream=None)
    return torchrec_swp.StagedTrainPipeline([stage], **kwargs)


# (what, how, error type, the whole message)
BAD: list[tuple[str, Callable[[], Any], type[BaseException], str]] = [
    ("loads 0", lambda: base(loads=0), ValueError, "TrainPipelineBase: loads must be an int >= 1, got 0"),
    ("loads a bool", lambda: base(loads=True), TypeError, "TrainPipelineBase: loads must be an int >= 1, got True"),
    ("loads a float", lambda: base(loads=2.0), TypeError, "TrainPipelineBase: loads must be an int >= 1, got 2.0"),
    ("lookahead < 0", lambda: base(lookahead=-1), ValueError,
     "TrainPipelineBase: lookahead must be an int >= 0, got -1"),
    ("lookahead a bool", lambda: base(lookahead=False), TypeError,
     "TrainPipelineBase: lookahead must be an int >= 0, got False"),
    ("timeout 0", lambda: base(engine_timeout_s=0), ValueError,
     "TrainPipelineBase: engine_timeout_s must be a number > 0, got 0"),
    ("timeout a bool", lambda: base(engine_timeout_s=True), TypeError,
     "TrainPipelineBase: engine_timeout_s must be a number > 0, got True"),
    ("plan of the wrong type", lambda: base(plan=3), TypeError,
     "TrainPipelineBase: plan must be a PipelinePlan, a PhasedPlan or a path to a plan file, got int"),
    ("thread_map of the wrong type", lambda: base(thread_map=["io"]), TypeError,
     "TrainPipelineBase: thread_map must be a strategy name, a dict {task: thread} or a callable, got list"),
    ("unknown strategy", lambda: base(thread_map="IO"), PlanError,
     "TrainPipelineBase(thread_map='IO'): unknown thread_map strategy 'IO'; use one of by_stream, per_task, main, io, "
     "a dict {task: thread} or a callable"),
    ("loads on a source that cannot be split", lambda: staged(loads=2), ValueError,
     "StagedTrainPipeline(loads=2): plan StagedTrainPipeline: with_parallel_loads needs a source that only draws "
     "(Fetch, LoadBatch) or H2D, to split the draw off; this plan's source is data_copy"),
    ("a plan whose source does more than draw, with loads",
     lambda: staged(plan=catalog.staged_plan(["data_copy"]).with_loads(2)), PlanError,
     "StagedTrainPipeline: plan StagedTrainPipeline has 2 loads of its source data_copy, whose function does more than "
     "draw from the data (its calls would overlap); only a source that only draws (Fetch, LoadBatch) may have loads"),
    ("an unknown keyword", lambda: staged(thread_mapp="io"), TypeError,
     "StagedTrainPipeline() got an unexpected keyword argument 'thread_mapp'"),
]


@pytest.mark.parametrize("what, provoke, error, message", BAD, ids=[b[0] for b in BAD])
def test_bad_options_fail_in_one_line_naming_the_class_and_the_value(
    what: str, provoke: Callable[[], Any], error: type[BaseException], message: str
) -> None:
    with pytest.raises(error) as info:
        provoke()
    assert str(info.value) == message


def test_a_plan_with_loads_on_h2d_says_to_give_loads_instead() -> None:
    model = MagicMock(spec=torch.nn.Module)
    plan = catalog.sparse_dist_plan().with_loads(2)  # validates, but H2D's calls would overlap
    with pytest.raises(PlanError, match="only a source that only draws .* may have loads: pass the plan with one "
                                        "load and loads=2, which splits the draw off"):
        torchrec_swp.TrainPipelineSparseDist(model, MagicMock(spec=torch.optim.Optimizer), CPU, plan=plan)
    # following it works
    pipeline = torchrec_swp.TrainPipelineSparseDist(model, MagicMock(), CPU, plan=catalog.sparse_dist_plan(), loads=2)
    assert pipeline.plan.source == plans.FETCH
    pipeline.close()


# ------------------------------------------------------------------ every drop-in takes them
#: constructor arguments a pipeline requires besides model, optimizer and device
REQUIRED: dict[str, dict[str, Any]] = {
    "TrainPipelineSparseDistOptStash": {"site_fqn": "sparse.ebc"},
    "TrainPipelineSparseDistEmbStash": {"site_fqn": "over"},
    "TrainPipelinePrefetchEMS": {"site_fqn": "over"},
    "TrainPipelineSparseDistBwdOpt": {"site_fqn": "sparse.ebc"},
}


def build(name: str, **options: Any) -> Any:
    cls = getattr(pipelines, name)
    if name == "StagedTrainPipeline":
        return staged(**options)
    model: Any = torch.nn.Linear(2, 2) if name == "TrainPipelinePT2" else MagicMock(spec=torch.nn.Module)
    return cls(model, MagicMock(spec=torch.optim.Optimizer), CPU, **REQUIRED.get(name, {}), **options)


@pytest.fixture
def global_configs_restored() -> Iterator[None]:
    """TrainPipelineSparseDistCompAutograd's constructor sets dynamo, functorch and inductor
    settings and compiled autograd's logging for the whole process, as upstream's: undone here."""
    modules = (torch._dynamo.config, torch._functorch.config, torch._inductor.config)
    saved = [m.get_config_copy() for m in modules]
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # setting a deprecated option warns
        for module, before in zip(modules, saved):
            now = module.get_config_copy()
            module.load_config({k: v for k, v in before.items() if now.get(k) != v})
    torch._logging.set_logs()


@pytest.mark.usefixtures("global_configs_restored")
@pytest.mark.parametrize("name", pipelines.__all__)
def test_every_plan_driven_pipeline_takes_loads_lookahead_and_the_io_thread_map(name: str) -> None:
    pipeline = build(name, thread_map="io", lookahead=2, engine_timeout_s=30)
    default = build(name)
    try:
        for mine, theirs in zip(_plans(pipeline.plan), _plans(default.plan)):
            assert mine.lookahead == 2
            stage_0 = [t for t in theirs.fire_order if theirs.task(t).stage == 0]
            assert {mine.task(t).thread_group for t in stage_0} == {"io"}
        assert pipeline.engine.timeout_s == 30
        if name == "StagedTrainPipeline":
            return  # its source runs the user's stage after the draw: no loads (tested above)
        loaded = build(name, loads=2)
        for p in _plans(loaded.plan):
            expected = (True, 2, 2, ("load", "load.1"))
            assert (p.source in plans.DRAW_TASKS, p.loads, p.lookahead, p.source_lanes()) == expected
        loaded.close()
    finally:
        pipeline.close()
        default.close()


def _plans(plan: Any) -> tuple[PipelinePlan, ...]:
    return getattr(plan, "plans", (plan,))


# ------------------------------------------------------------------ bit for bit with loads
class Summing(torch.nn.Module):
    """``model(x)`` -> (per-row losses, output), as TrainPipelineBase and PT2 expect."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.tanh(self.layer(x))
        return (out**2).sum(dim=-1), out


def batches(n: int) -> list[torch.Tensor]:
    with torch.random.fork_rng():
        torch.manual_seed(1)
        return [torch.randn(5, 4) for _ in range(n)]


def train(
    make: Callable[..., Any], data: Callable[[list[torch.Tensor]], Iterator[torch.Tensor]], **options: Any
) -> Any:
    model = Summing()
    pipeline = make(model, torch.optim.SGD(model.parameters(), lr=0.05), CPU, **options)
    outputs = []
    it = data(batches(13))
    with pytest.raises(StopIteration):
        while True:
            outputs.append(pipeline.progress(it)[1].detach().clone())
    pipeline.close()
    return outputs, {k: v.clone() for k, v in model.state_dict().items()}


PT2 = {"compile_configs": upstream.TorchCompileConfig(compile_on_iter=-1)}  # no compiling: a unit test


@pytest.mark.parametrize(
    "make, extra",
    [(torchrec_swp.TrainPipelineBase, {}), (torchrec_swp.TrainPipelinePT2, PT2)],
    ids=["TrainPipelineBase", "TrainPipelinePT2"],
)
@pytest.mark.parametrize("data", [iter, MapSource], ids=["iterator", "MapSource"])
@pytest.mark.parametrize(
    "options",
    [{"loads": 2}, {"loads": 3, "lookahead": 1, "thread_map": "io"}, {"lookahead": 2, "thread_map": "io"}],
    ids=str,
)
def test_loads_and_lookahead_train_bit_for_bit_as_the_default_plan(
    make: Any, extra: dict[str, Any], data: Any, options: dict[str, Any]
) -> None:
    reference = train(make, iter, **extra)
    mine = train(make, data, **extra, **options)
    assert len(mine[0]) == len(reference[0]) == 13
    assert all(torch.equal(a, b) for a, b in zip(mine[0], reference[0]))
    assert mine[1].keys() == reference[1].keys()
    assert all(torch.equal(mine[1][k], reference[1][k]) for k in reference[1])


def test_a_plan_from_plans_with_parallel_loads_trains_the_same() -> None:
    plan = plans.with_parallel_loads(plans.default_plans()["TrainPipelineBase"], 2)
    (outputs, weights), (ref_outputs, ref_weights) = (
        train(torchrec_swp.TrainPipelineBase, MapSource, plan=plan),
        train(torchrec_swp.TrainPipelineBase, iter),
    )
    assert len(outputs) == len(ref_outputs) and all(torch.equal(x, y) for x, y in zip(outputs, ref_outputs))
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


@pytest.mark.parametrize("options", [{}, {"thread_map": "io"}, {"loads": 2}], ids=str)
def test_a_slow_batch_is_no_timeout_whatever_the_thread_map(options: dict[str, Any]) -> None:
    """One batch the loader takes three engine_timeout_s to give: a slow loader, not a timeout,
    on the calling thread (it never was) and with the draw on threads of its own (it was)."""
    timeout = 0.3
    blocked: list[float] = []

    def slow_fourth(items: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        for k, x in enumerate(items):
            if k == 4:
                release = threading.Event()
                threading.Timer(3 * timeout, release.set).start()
                start = time.monotonic()
                assert release.wait(60)
                blocked.append(time.monotonic() - start)
            yield x

    mine = train(torchrec_swp.TrainPipelineBase, slow_fourth, engine_timeout_s=timeout, **options)
    reference = train(torchrec_swp.TrainPipelineBase, iter)
    assert len(blocked) == 1 and blocked[0] > timeout
    assert len(mine[0]) == 13 and all(torch.equal(a, b) for a, b in zip(mine[0], reference[0]))
    assert all(torch.equal(mine[1][k], reference[1][k]) for k in reference[1])
