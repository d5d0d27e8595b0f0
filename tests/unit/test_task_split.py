"""benchmarks/task_split.py: the clock on the task functions times every call and leaves the class
as it found it; the report puts each number in its column."""

from __future__ import annotations

import time

from benchmarks.task_split import TaskClock, _markdown, wrapper_us
from torchrec_swp.integrations.torchrec.pipelines.protocol import task


class Base:
    @task("Forward")
    def _task_forward(self, b: int, batch: int) -> int:
        time.sleep(0.002)
        return batch + b


class Child(Base):
    @task("Backward")
    def _task_backward(self, b: int) -> None:
        return None

    def helper(self) -> int:
        return 1


def test_the_clock_times_each_task_call_and_puts_the_methods_back() -> None:
    own, inherited = Child.__dict__["_task_backward"], Base._task_forward
    clock = TaskClock(Child)
    child = Child()
    clock.start()
    assert child._task_forward(1, batch=2) == 3
    child._task_backward(1)
    child.helper()  # not a task: not timed
    assert clock.calls == 2
    assert 0.002 <= clock.spent < 0.5
    assert Base().__class__._task_forward is inherited  # the base untouched
    clock.start()
    assert (clock.calls, clock.spent) == (0, 0.0)
    clock.remove()
    assert Child.__dict__["_task_backward"] is own
    assert "_task_forward" not in Child.__dict__ and Child._task_forward is inherited


def test_the_timer_cost_is_measured() -> None:
    cost = wrapper_us(calls=20_000)
    assert 0.0 < cost < 20.0


def test_the_report_puts_each_number_in_its_column() -> None:
    meta = {"date": "d", "command": "c", "load_before": "0.1", "load_after": "0.2", "warmup": 2, "steps": 8}
    row = {
        "pipeline": "P",
        "upstream_us": 1000.0,
        "ours_us": 1030.0,
        "inside_us": 995.0,
        "around_us": 35.0,
        "calls": 10,
        "inside_ratio": 0.995,
        "inside_ratio_95": (0.99, 1.001),
        "same_losses": True,
    }
    staged = {**row, "pipeline": "S", "calls": 0, "ours_us": 990.0, "same_losses": False}
    text = _markdown({"wrapper_us": 0.5, "rows": [row, staged]}, meta)
    assert "| P | 1000 | 1030 | +30 | 995 | 35 | 30 | 10 | 0.995 (0.990-1.001) | yes |" in text
    assert "| S | 1000 | 990 | -10 | - | - | - | 0 |" in text and "**no**" in text
