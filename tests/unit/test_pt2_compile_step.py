"""TrainPipelinePT2's compile step is a phase of its plan (a Compile task) and fires on the
forward upstream compiles on, also across short epochs and reset(); a plan of the user's without
the Compile task still compiles, inside Forward, where upstream does."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo.config
from torchrec.distributed.train_pipeline import train_pipelines as upstream

import torchrec_swp
from torchrec_swp.catalog import torchrec as plans

pytestmark = pytest.mark.parity

CPU = torch.device("cpu")
DYNAMO_SETTINGS = (
    "capture_scalar_outputs",
    "capture_dynamic_output_shape_ops",
    "force_unspec_int_unbacked_size_like_on_torchrec_kjt",
    "skip_torchrec",
)


class Counting(torch.nn.Module):
    """Returns (losses, output) and counts its forwards; ``compile`` only records when it is asked."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2))
        self.forwards = 0
        self.compiled_at: list[int] = []

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.forwards += 1
        out = x * self.weight
        return out.sum(dim=-1), out

    def compile(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.compiled_at.append(self.forwards)


def compiled_at(cls: type, epochs: list[int], reset_after: int | None = None, **kwargs: Any) -> list[int]:
    """The number of forwards before each compile, over ``epochs`` (batches per epoch), with a
    reset() after epoch ``reset_after``."""
    model = Counting()
    pipeline = cls(model, torch.optim.SGD(model.parameters(), lr=0.1), CPU, **kwargs)
    for k, n in enumerate(epochs):
        data: Iterator[torch.Tensor] = iter([torch.ones(3, 2)] * n)
        with pytest.raises(StopIteration):
            while True:
                pipeline.progress(data)
        if k == reset_after:
            pipeline.reset()
    if hasattr(pipeline, "close"):
        pipeline.close()
    return model.compiled_at


@pytest.fixture(autouse=True)
def _dynamo_settings_restored() -> Iterator[None]:
    saved = {name: getattr(torch._dynamo.config, name) for name in DYNAMO_SETTINGS}
    yield
    for name, value in saved.items():
        setattr(torch._dynamo.config, name, value)


@pytest.mark.parametrize(("epochs", "reset_after"), [([6], None), ([2, 1, 4], None), ([2, 5], 0), ([3, 3], 0)])
@pytest.mark.parametrize("compile_on_iter", [0, 3])
def test_compile_fires_on_upstreams_forward(epochs: list[int], reset_after: int | None, compile_on_iter: int) -> None:
    configs = {"compile_configs": upstream.TorchCompileConfig(compile_on_iter=compile_on_iter)}
    theirs = compiled_at(upstream.TrainPipelinePT2, epochs, reset_after, **configs)
    assert theirs == [compile_on_iter]
    assert compiled_at(torchrec_swp.TrainPipelinePT2, epochs, reset_after, **configs) == theirs
    # a plan without the Compile step compiles inside Forward, as upstream
    assert compiled_at(torchrec_swp.TrainPipelinePT2, epochs, reset_after, plan=plans.pt2_plan(), **configs) == theirs


def test_the_printed_schedule_shows_the_compile_step() -> None:
    model = Counting()
    pipeline = torchrec_swp.TrainPipelinePT2(model, torch.optim.SGD(model.parameters(), lr=0.1), CPU)
    text = pipeline.plan.format_schedule(2)
    pipeline.close()
    assert "phase 1 (batches 3 to 3 drawn since the pipeline was built): TrainPipelinePT2_compile" in text
    plain, compiling, after = text.split("\n\nphase ")
    assert "Compile" not in plain and "Compile" not in after
    rows = [line.split()[1] for line in compiling.splitlines()[4:]]
    assert rows.index("Compile") + 1 == rows.index("Forward")


@pytest.mark.parametrize(("compile_on_iter", "starts"), [(3, [0, 3, 4]), (0, [0, 1]), (-1, [0])])
def test_pt2_phases(compile_on_iter: int, starts: list[int]) -> None:
    phased = plans.pt2_phases(compile_on_iter=compile_on_iter)
    assert [s for s, _ in phased.phases] == starts and phased.clock == "drawn"
    compiling = [b for b in range(6) if "Compile" in phased.plan_for(b).schedule]
    assert compiling == ([compile_on_iter] if compile_on_iter >= 0 else [])


def _skip_run(k: int, *, poison: bool, compile_on_iter: int = 3, reset_first: bool = False, **kwargs: Any) -> dict:
    """8 batches, batch ``k`` poisoned (a NaN loss) under ``on_nonfinite="skip"``, or left out of
    the data under "off"; what the model saw before each compile, the weights and ``_iter`` after.
    ``reset_first``: an epoch of 2 batches and a reset() before (upstream's ``_iter`` counts on)."""
    model = Counting()
    seen: list[float] = []  # the second feature of each batch the model ran
    compiled_after: list[list[float]] = []  # what the model had run at each compile
    forward = model.forward
    model.forward = lambda x: (seen.append(float(x[0, 1])), forward(x))[1]  # type: ignore[method-assign]
    model.compile = lambda *a, **kw: compiled_after.append(list(seen))  # type: ignore[method-assign]
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    configs = upstream.TorchCompileConfig(compile_on_iter=compile_on_iter)
    pipeline = torchrec_swp.TrainPipelinePT2(model, optimizer, CPU, compile_configs=configs, **kwargs)
    if reset_first:
        first = iter([-torch.ones(3, 2)] * 2)
        with pytest.raises(StopIteration):
            for _ in range(3):
                pipeline.progress(first)
        pipeline.reset()
    data = [torch.tensor([[1.0, float(i)]] * 3) for i in range(8)]
    if poison:
        data[k][0, 0] = math.nan
    else:
        del data[k]
    losses, it = [], iter(data)
    with pytest.raises(StopIteration):
        for _ in range(10):
            losses.append(pipeline.progress(it).detach().sum().item())
    result = {
        # the batches it had trained on (the rolled-back one left out) when it compiled
        "trained before compiling": [[x for x in before if not (poison and x == k)] for before in compiled_after],
        "iter": pipeline._iter,
        "weight": model.weight.detach().clone(),
        "losses": [x for x in losses if not math.isnan(x)],
        "skipped": [v.batch for v in pipeline.skipped_steps],
    }
    pipeline.close()
    return result


@pytest.mark.parametrize("plan", ["default", "without Compile"])
@pytest.mark.parametrize(("k", "where"), [(1, "before"), (3, "the compile step"), (5, "after")])
def test_a_rolled_back_step_leaves_the_compile_where_the_data_without_it_puts_it(k: int, where: str, plan: str) -> None:
    """Under ``on_nonfinite="skip"`` the model compiles once, right before the same batch as in the
    run whose data lacks the rolled-back one (a rolled-back compile step leaves the model compiled:
    the next batch, the compile step now, does not compile again); ``_iter``, the weights and every
    other loss as that run's."""
    options = {} if plan == "default" else {"plan": plans.pt2_plan()}
    run = _skip_run(k, poison=True, on_nonfinite="skip", **options)
    reference = _skip_run(k, poison=False, **options)
    assert run["skipped"] == [k]
    assert reference["trained before compiling"] == [[x for x in (0.0, 1.0, 2.0, 3.0) if x != k][:3]]
    assert run["trained before compiling"] == reference["trained before compiling"]
    assert run["iter"] == reference["iter"] == 7
    assert torch.equal(run["weight"], reference["weight"])
    assert run["losses"] == reference["losses"]


def test_across_a_reset_the_compile_counts_upstreams_forwards() -> None:
    run = _skip_run(0, poison=True, reset_first=True, on_nonfinite="skip")
    reference = _skip_run(0, poison=False, reset_first=True)
    # the 2 forwards before the reset count: the compile comes after 1 batch of the second epoch
    assert run["trained before compiling"] == reference["trained before compiling"] == [[-1.0, -1.0, 1.0]]
    assert torch.equal(run["weight"], reference["weight"])


def test_without_putting_iter_back_the_compile_comes_a_batch_early() -> None:
    from torchrec_swp.integrations.torchrec import nonfinite

    original = nonfinite.Counters.restore
    nonfinite.Counters.restore = lambda self, saved, keep: None  # type: ignore[method-assign]
    try:
        run = _skip_run(1, poison=True, on_nonfinite="skip", plan=plans.pt2_plan())
    finally:
        nonfinite.Counters.restore = original  # type: ignore[method-assign]
    reference = _skip_run(1, poison=False, plan=plans.pt2_plan())
    assert run["trained before compiling"] == [[0.0, 2.0]] != reference["trained before compiling"]
