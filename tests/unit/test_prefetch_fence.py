"""The prefetch fence of PrefetchTrainPipelineSparseDist (TorchRec's open PR #4191), in the plan.

Upstream's release leaves the data_dist stream unordered with the prefetch stream; the PR makes
``start_sparse_data_dist`` of batch i+2 (and of batch 1 in ``fill_pipeline``) wait for the
prefetch stream. Ours is the plan dependency ``InputDistStart <- EmbPrefetch @1``: these tests
read it in the plan text and golden, in the compiled programs (``stream data_dist <-
EmbPrefetch@1``, and a CPU wait where the two tasks are on different threads), and check with the
CPU stream checker that the engine turns it into a real order, on the real plan with stand-in
tasks. TorchRec's own tasks cannot show the race on the CPU: there the prefetch does no tensor
work (TorchRec prefetches only tables with a UVM-caching or key-value kernel; the CPU test models
use the FUSED kernel, and UVM caching needs CUDA): in a checked run of the DLRM example its 48 ops
on the prefetch stream are profiler labels. So the stand-ins do what the PR says the GPU run
does: the prefetch updates a cache and reads blocks the input dist allocated on data_dist.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from torchrec_swp.catalog import torchrec as plans
from torchrec_swp.compile import compile_iteration, format_program
from torchrec_swp.engine import Engine
from torchrec_swp.plan import Dep, PipelinePlan
from torchrec_swp.streamcheck import CheckedStreamPool, EarlyFree, StreamChecker, UnsyncedAccess

FENCE = Dep("InputDistStart", "EmbPrefetch", 1)
GOLDEN = Path(__file__).parent.parent / "golden" / "plans" / "PrefetchTrainPipelineSparseDist.txt"
N = 6


def fenced() -> PipelinePlan:
    return plans.prefetch_sparse_dist_plan()


def unfenced() -> PipelinePlan:
    """Upstream's schedule as released: the plan without the fence."""
    plan = fenced()
    return plan.replace(inter_iter_deps=[d for d in plan.inter_iter_deps if d != FENCE])


def program(plan: PipelinePlan, thread: str) -> list[str]:
    """The steady-state iteration's instructions of ``thread``, compiled for a device with streams."""
    text = format_program(compile_iteration(plan, (0, 1, 2), device_streams=True))
    lines, inside = [], False
    for line in text.splitlines():
        if line.startswith("thread "):
            inside = line == f"thread {thread}:"
        elif inside:
            lines.append(line.strip())
    return lines


# ------------------------------------------------------------------ the fence is in the plan
def test_the_fence_is_a_dependency_of_the_plan_and_its_golden() -> None:
    assert FENCE in fenced().explicit_deps
    assert "dep InputDistStart <- EmbPrefetch @1" in fenced().to_text().splitlines()
    assert "dep InputDistStart <- EmbPrefetch @1" in GOLDEN.read_text().splitlines()
    assert FENCE not in unfenced().explicit_deps
    # same iteration, prefetch first: the CPU order upstream already has (so its calls are unchanged)
    plan = fenced()
    assert plan.task("EmbPrefetch").stage == plan.task("InputDistStart").stage + FENCE.distance
    assert plan.fire_index("EmbPrefetch") < plan.fire_index("InputDistStart")
    assert unfenced().fire_order == plan.fire_order


@pytest.mark.parametrize("h2d_thread", ["default", "io"])
def test_the_data_dist_stream_waits_for_the_prefetch_before_the_next_input_dist(h2d_thread: str) -> None:
    lines = program(plans.prefetch_sparse_dist_plan(h2d_thread=h2d_thread), "default")
    start = lines.index("run? InputDistStart if not_first")
    assert lines[start - 1] == "stream data_dist <- EmbPrefetch@1"
    assert lines[lines.index("run EmbPrefetch") + 1] == "record EmbPrefetch"
    # batch 0's input dist has no prefetch before it: not fenced, as in the PR
    init = lines.index("run? InitPipelinedModules if first")
    assert "EmbPrefetch" not in lines[init - 1]
    assert "stream data_dist <- EmbPrefetch@1" not in program(unfenced(), "default")


def test_on_threads_of_their_own_the_input_dist_also_waits_on_the_cpu() -> None:
    lines = program(fenced().with_thread_map("by_stream"), "data_dist")
    start = lines.index("run? InputDistStart #4@world if not_first")
    assert lines[start - 2 : start] == ["wait EmbPrefetch", "stream data_dist <- EmbPrefetch@1"]
    assert "signal EmbPrefetch" in program(fenced().with_thread_map("by_stream"), "prefetch")
    assert "wait EmbPrefetch" not in program(unfenced().with_thread_map("by_stream"), "data_dist")


# ------------------------------------------------------------------ the checker sees the order
class StandIns:
    """Stand-in tasks for every task of the plan, touching memory as the PR describes the GPU run:

    * ``cache``: EmbPrefetch writes it on the prefetch stream (the TBE cache the prefetch fills);
      InputDistStart reads it on data_dist (the PR: both streams work on the same cache).
    * ``dist``: InputDistWait allocates and writes batch b's input-dist output on data_dist;
      EmbPrefetch reads it on the prefetch stream, with no ``record_stream`` there, and drops it
      (the last reference); data_dist's next allocation may get the block.
    * ``dist`` with ``record_on`` given: the PR's other half too, ``record_stream`` of ``dist`` on
      the data_dist stream (``record_on``), its own allocation stream.
    """

    def __init__(self, touch: str, record_on: Any = None) -> None:
        self.touch = touch
        self.record_on = record_on
        self.cache = torch.zeros(8)
        self.w = torch.ones(8)

    def bindings(self) -> dict[str, Any]:
        def h2d(b: int, data: Any) -> tuple[torch.Tensor, dict[str, Any]]:
            return next(data), {}  # host memory, made before: read only

        def input_dist_start(b: int, batch: torch.Tensor, context: dict[str, Any]) -> None:
            context["splits"] = batch * 2  # allocated on data_dist
            if self.touch == "cache":
                context["seen"] = self.cache.sum()

        def input_dist_wait(b: int, context: dict[str, Any]) -> None:
            context["dist"] = context.pop("splits") + 1  # allocated on data_dist

        def emb_prefetch(b: int, context: dict[str, Any]) -> None:
            dist = context.pop("dist")
            if self.record_on is not None:
                dist.record_stream(self.record_on)
            if self.touch == "cache":
                self.cache.copy_(dist)
            else:
                context["rows"] = dist.sum()  # the last use of dist: freed here

        def forward(b: int, batch: torch.Tensor, context: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
            out = (batch * self.w).sum() + (self.cache * self.w).sum()
            return out, out

        def optimizer_step(b: int, context: dict[str, Any]) -> None:
            self.w.add_(0.01)

        def nothing(b: int, **values: Any) -> None:
            return None

        return {
            "H2D": h2d,
            "InitPipelinedModules": input_dist_start,
            "InputDistStart": input_dist_start,
            "InputDistWait": input_dist_wait,
            "EmbPrefetch": emb_prefetch,
            "WaitBatch": nothing,
            "ZeroGrad": nothing,
            "Forward": forward,
            "Backward": nothing,
            "OptimizerStep": optimizer_step,
            "Dequeue": nothing,
        }


def run_checked(plan: PipelinePlan, touch: str, record_on_data_dist: bool = False) -> tuple[int, StreamChecker]:
    with StreamChecker() as checker:
        record_on = checker.stream("data_dist") if record_on_data_dist else None
        tasks = StandIns(touch, record_on).bindings()
        engine = Engine(plan, tasks, streams=CheckedStreamPool(checker), timeout_s=20)
        data = iter([torch.full((8,), float(k)) for k in range(N)])
        steps = 0
        try:
            with torch.no_grad():
                while True:
                    try:
                        engine.step(data)
                    except StopIteration:
                        break
                    steps += 1
        finally:
            engine.close()
    return steps, checker


THREAD_MAPS = ["main", "by_stream"]


@pytest.mark.parametrize("thread_map", THREAD_MAPS)
def test_without_the_fence_the_checker_finds_data_dist_racing_the_prefetch_on_the_cache(thread_map: str) -> None:
    steps, checker = run_checked(unfenced().with_thread_map(thread_map), "cache")
    assert steps == N
    races = [str(f) for f in checker.findings if isinstance(f, UnsyncedAccess)]
    assert any(all(w in r for w in ("EmbPrefetch", "InputDistStart", "'prefetch'", "'data_dist'")) for r in races), (
        checker.findings
    )


@pytest.mark.parametrize("thread_map", THREAD_MAPS)
def test_without_the_fence_data_dist_may_reuse_a_block_the_prefetch_still_reads(thread_map: str) -> None:
    steps, checker = run_checked(unfenced().with_thread_map(thread_map), "dist")
    assert steps == N
    frees = [str(f) for f in checker.findings if isinstance(f, EarlyFree)]
    assert any("EmbPrefetch" in f and "data_dist" in f for f in frees), checker.findings


@pytest.mark.parametrize("thread_map", THREAD_MAPS)
def test_record_stream_on_data_dist_alone_does_not_keep_a_data_dist_block_for_the_prefetch(thread_map: str) -> None:
    # a block's own allocation stream: CUDA's caching allocator ignores that record_stream
    steps, checker = run_checked(unfenced().with_thread_map(thread_map), "dist", record_on_data_dist=True)
    assert steps == N
    frees = [str(f) for f in checker.findings if isinstance(f, EarlyFree)]
    assert any("EmbPrefetch" in f and "data_dist" in f for f in frees), checker.findings


@pytest.mark.parametrize("touch", ["cache", "dist"])
@pytest.mark.parametrize("thread_map", THREAD_MAPS)
def test_with_the_fence_the_same_tasks_are_clean(thread_map: str, touch: str) -> None:
    steps, checker = run_checked(fenced().with_thread_map(thread_map), touch)
    assert steps == N
    assert checker.findings == []
