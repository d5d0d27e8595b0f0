"""TrainPipelinePT2's compile step is a phase of its plan (a Compile task) and fires on the
forward upstream compiles on, also across short epochs and reset(); a plan of the user's without
the Compile task still compiles, inside Forward, where upstream does."""

from __future__ import annotations

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
