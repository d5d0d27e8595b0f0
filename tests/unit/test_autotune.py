"""A pipeline that tunes itself (``autotune=``): it profiles, decides, switches at a batch boundary
and trains bit for bit as without tuning; it keeps its plan when nothing wins by more than the
noise; the decision survives a checkpoint; bad options and impossible limits say so in one line."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import torchrec_swp
from torchrec_swp import Autotune
from torchrec_swp.data import MapSource

CPU = torch.device("cpu")


class Summing(torch.nn.Module):
    """``model(x)`` -> (per-row losses, output), as TrainPipelineBase expects."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(width, 3 if width == 4 else width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.tanh(self.layer(x))
        return (out**2).sum(dim=-1), out


class Slow:
    """A map-style dataset whose items wait ``latency_s`` (storage), the GIL released."""

    def __init__(self, n: int, latency_s: float, width: int = 4) -> None:
        with torch.random.fork_rng():
            torch.manual_seed(1)
            self.items = [torch.randn(5 if width == 4 else 256, width) for _ in range(n)]
        self.latency = latency_s

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.latency)
        return self.items[i]


def train(
    n: int, latency_s: float, *, state: dict[str, Any] | None = None, width: int = 4, **options: Any
) -> tuple[list[torch.Tensor], Any, Any]:
    """``n`` steps of TrainPipelineBase over ``Slow``; the outputs, the pipeline (closed), the weights."""
    model = Summing(width)
    pipeline = torchrec_swp.TrainPipelineBase(model, torch.optim.SGD(model.parameters(), lr=0.05), CPU, **options)
    source = MapSource(Slow(n, latency_s, width))
    if state is not None:
        source.load_state_dict(state["loader"])
        pipeline.load_state_dict(state)
    it: Iterator[torch.Tensor] = source
    outputs = []
    try:
        while True:
            try:
                outputs.append(pipeline.progress(it)[1].detach().clone())
            except StopIteration:
                break
    finally:
        pipeline.close()
    return outputs, pipeline, {k: v.clone() for k, v in model.state_dict().items()}


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


FAST = {"warmup": 3, "steps": 12, "verify": 6}


def test_where_the_loader_binds_it_switches_and_trains_bit_for_bit() -> None:
    lines: list[str] = []
    tuned, pipeline, weights = train(64, 0.006, autotune=Autotune(**FAST, report=lines.append))
    plain, _, plain_weights = train(64, 0.006)
    assert same(tuned, plain) and all(torch.equal(weights[k], plain_weights[k]) for k in weights)
    d = pipeline.autotune_decision
    assert d is not None and d.switched, lines
    plan = pipeline.plan
    assert plan.loads > 1 or plan.task("LoadBatch").thread_group != "default"
    assert plan.lookahead >= 1
    assert d.predicted_s is not None and d.baseline_s is not None and d.predicted_s < d.baseline_s / 1.05
    assert d.measured_s is not None and d.measured_start_s is not None
    text = "\n".join(lines)
    assert "autotune TrainPipelineBase: profiled 12 steps" in text and "switches to threads" in text
    assert "the starting plan is bound by" in text and "measured" in text and "predicted" in text
    assert "second round" in text and d.first_predicted_s is not None
    assert pipeline.batch_ledger.trained == 64 and not pipeline.untrained_batches()


def test_where_compute_binds_it_keeps_its_plan_and_says_why() -> None:
    # a step of milliseconds of matrix products, a loader of a tenth of one: moving the loader
    # off the training thread gains about 5%, under a noise of 15%
    lines: list[str] = []
    _, pipeline, _ = train(24, 0.0, width=512, autotune=Autotune(**FAST, noise=0.15, report=lines.append))
    d = pipeline.autotune_decision
    assert d is not None and not d.switched
    assert any("keeps the plan" in line and "within the noise (15%)" in line for line in lines), lines


def test_the_decision_is_in_the_checkpoint_and_a_resume_applies_it() -> None:
    lines: list[str] = []
    model = Summing()
    pipeline = torchrec_swp.TrainPipelineBase(
        model, torch.optim.SGD(model.parameters(), lr=0.05), CPU, autotune=Autotune(**FAST, report=lines.append)
    )
    source = MapSource(Slow(40, 0.006))
    for _ in range(FAST["warmup"] + FAST["steps"] + 2):
        pipeline.progress(source)
    state = pipeline.state_dict()
    decided, switched_to = pipeline.autotune_decision, pipeline.plan
    pipeline.close()
    assert decided is not None and decided.switched and state["autotune"]["decision"]["plan"]
    resumed_lines: list[str] = []
    _, again, _ = train(40, 0.006, state=state, autotune=Autotune(**FAST, report=resumed_lines.append))
    assert again.autotune_decision == decided
    assert not any("profiled" in line for line in resumed_lines)  # applied, not tuned again
    assert again.plan == switched_to


def test_a_memory_cap_no_plan_meets_keeps_the_plan_in_one_line() -> None:
    lines: list[str] = []
    tiny = Autotune(**FAST, memory_cap_bytes=1, report=lines.append)
    outputs, pipeline, _ = train(30, 0.004, autotune=tiny)
    assert len(outputs) == 30
    d = pipeline.autotune_decision
    assert d is not None and not d.switched
    assert any("keeps the plan" in line and "memory cap" in line for line in lines), lines


@pytest.mark.parametrize(
    "options, message",
    [
        ({"steps": 1}, "Autotune: steps must be an int >= 2 (too few steps to profile), got 1"),
        ({"noise": 1.5}, "Autotune: noise must be a share in [0, 1), got 1.5"),
        ({"memory_cap_bytes": -3}, "Autotune: memory_cap_bytes must be a number > 0 or None, got -3"),
    ],
)
def test_bad_options_fail_in_one_line(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Autotune(**options)


def test_autotune_of_the_wrong_type_names_the_class() -> None:
    model = Summing()
    with pytest.raises(TypeError, match="TrainPipelineBase: autotune must be a bool or torchrec_swp.Autotune"):
        torchrec_swp.TrainPipelineBase(model, torch.optim.SGD(model.parameters(), lr=0.1), CPU, autotune="yes")


def test_data_that_ends_while_profiling_ends_the_run_as_usual() -> None:
    outputs, pipeline, _ = train(8, 0.0, autotune=Autotune(**FAST))
    assert len(outputs) == 8 and pipeline.autotune_decision is None


def test_a_second_switch_from_a_plan_that_runs_ahead_waits_for_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    # The search is replaced by a script: the first round chooses LoadBatch on a thread with
    # lookahead 2, the second round something else; the second switch must wait until the
    # calling thread caught up with the loader, and the run must train bit for bit as untuned.
    import torchrec_swp.autotune.tuner as tuner
    from torchrec_swp import plans

    start = plans.default_plans()["TrainPipelineBase"]
    first = start.with_thread_map({"LoadBatch": "io"}).replace(lookahead=2)
    second = start.with_thread_map({"LoadBatch": "io", "H2D": "io"}).replace(lookahead=1)
    chosen = iter([first, second])

    class Found:
        def __init__(self, plan: Any) -> None:
            self.plan, self.predicted, self.baseline, self.speedup = plan, 1e-3, 2e-3, 2.0
            self.best = type("Best", (), {"candidate": type("C", (), {"own_group": False})()})()

        def why(self) -> list[str]:
            return [f"the change: scripted to {self.plan.thread_groups}"]

    monkeypatch.setattr(tuner, "search_overlap", lambda *a, **k: Found(next(chosen)))
    lines: list[str] = []
    tuned, pipeline, weights = train(70, 0.002, autotune=Autotune(**FAST, report=lines.append))
    plain, _, plain_weights = train(70, 0.002)
    assert same(tuned, plain) and all(torch.equal(weights[k], plain_weights[k]) for k in weights)
    assert pipeline.plan.lookahead == 1 and pipeline.plan.task("H2D").thread_group == "io", lines
    assert pipeline.autotune_decision is not None and pipeline.autotune_decision.measured_s is not None
