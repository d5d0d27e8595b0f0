"""Two threads per rank issuing gloo collectives: the turnstile keeps ranks paired correctly.

gloo (like NCCL) pairs collectives across ranks by the order each rank issues them. Here each
rank all-reduces two tensors, ``a`` and ``b``, from two threads, with delays chosen so that,
left to themselves, rank 0 issues ``a`` first and rank 1 issues ``b`` first. Without ordering,
rank 0's ``a`` is summed with rank 1's ``b``: wrong numbers on both ranks. Through the engine,
both tasks are globally ordered in one comm group, take tickets in fire order, and every sum is
right, whatever the delays.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness.ranks import run_on_ranks
from torchrec_swp.engine import Engine
from torchrec_swp.plan import PipelinePlan, PipelineTask, TaskSchedule

STEPS = 6


def _delay(rank: int, tensor: str) -> float:
    # rank 0 is slow to issue b, rank 1 is slow to issue a
    slow = (rank == 0 and tensor == "b") or (rank == 1 and tensor == "a")
    return 0.15 if slow else 0.0


def _values(rank: int, step: int) -> dict[str, torch.Tensor]:
    return {"a": torch.full((4,), float(rank + 1 + 10 * step)), "b": torch.full((4,), 1000.0 * (rank + 1) + step)}


def _expected(world_size: int, step: int) -> dict[str, list[float]]:
    return {
        name: torch.stack([_values(r, step)[name] for r in range(world_size)]).sum(0).tolist() for name in ("a", "b")
    }


def _unordered(rank: int, world_size: int) -> list[dict[str, list[float]]]:
    """Plain threads, no ordering."""
    results = []
    for step in range(2):
        values = _values(rank, step)

        def reduce(name: str, values: dict[str, torch.Tensor] = values) -> None:
            time.sleep(_delay(rank, name))
            dist.all_reduce(values[name])

        threads = [threading.Thread(target=reduce, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results.append({n: values[n].tolist() for n in ("a", "b")})
    return results


def _ordered(rank: int, world_size: int) -> list[dict[str, list[float]]]:
    """The same two all-reduces as tasks of a plan, on two threads, in one comm group."""
    plan = PipelinePlan(
        schedule={
            "Load": TaskSchedule(0),
            "ReduceA": TaskSchedule(0, thread_group="thread_a", comm_group="world"),
            "ReduceB": TaskSchedule(0, thread_group="thread_b", comm_group="world"),
        },
        tasks=[
            PipelineTask("Load", writes=("values",)),
            PipelineTask("ReduceA", reads=("values",), writes=("a",)),
            PipelineTask("ReduceB", reads=("values",), writes=("b",)),
        ],
        source="Load",
        output="values",
        name="two_threads",
    )
    steps = iter(range(STEPS))

    def load(b: int) -> dict[str, torch.Tensor]:
        return _values(rank, next(steps))

    def reducer(name: str) -> Any:
        def reduce(b: int, values: dict[str, torch.Tensor]) -> torch.Tensor:
            time.sleep(_delay(rank, name))
            dist.all_reduce(values[name])
            return values[name]

        return reduce

    engine = Engine(plan, {"Load": load, "ReduceA": reducer("a"), "ReduceB": reducer("b")}, timeout_s=60)
    assert engine.compiled.program(0, None).tickets == (("world", 2),)
    results = []
    while True:
        try:
            values = engine.step()
        except StopIteration:
            break
        results.append({n: values[n].tolist() for n in ("a", "b")})
    engine.close()
    return results


@pytest.mark.multiprocess
def test_collectives_from_two_threads_pair_correctly_with_tickets_and_not_without() -> None:
    ordered = run_on_ranks(_ordered, timeout_s=120)
    for rank_results in ordered:
        assert rank_results == [_expected(2, step) for step in range(STEPS)]

    unordered = run_on_ranks(_unordered, timeout_s=120)
    # without ordering rank 0's `a` met rank 1's `b`: a = 1 + 2000, not 1 + 2
    for rank_results in unordered:
        assert rank_results[0] != _expected(2, 0)
    assert unordered[0][0]["a"] == [1.0 + 2000.0] * 4
