"""The overlap benchmark's peers and helpers, without ranks: the prefetch thread, the DataLoader
over the latency dataset (the very batches of the plain loader), the ``+io+dist`` thread map,
block interleaving and the ahead / equal / behind verdicts."""

from __future__ import annotations

import itertools
import math
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from benchmarks.common import Contender
from benchmarks.overlap import _stats, comparisons, halves_noise, held_out, interleave_blocks, io_dist_map, io_map
from benchmarks.peers import ThreadPrefetcher, dataloader
from harness.dlrm_data import SIZES, batches
from torchrec_swp.catalog.torchrec import sparse_dist_plan, train_pipeline_base_plan


def test_the_prefetch_thread_yields_everything_in_order_and_ends() -> None:
    p = ThreadPrefetcher(iter(range(10)), depth=2)
    assert list(p) == list(range(10))
    with pytest.raises(StopIteration):
        next(p)
    p.close()


def test_the_prefetch_thread_loads_ahead_while_the_consumer_works() -> None:
    three_queued, taken = threading.Event(), threading.Event()

    def loader() -> object:
        for k in range(6):
            if k == 3:  # the thread asks for a 4th item: items 0, 1 and 2 are in its queue
                three_queued.set()
                assert taken.wait(5)  # the loader holds here until the consumer took them
            yield k

    p = ThreadPrefetcher(loader(), depth=3)
    assert three_queued.wait(5)  # the thread filled its queue before the consumer asked for anything
    assert [next(p), next(p), next(p)] == [0, 1, 2]  # all from the queue: the loader is held
    taken.set()
    assert list(p) == [3, 4, 5]
    p.close()


def test_the_prefetch_thread_hands_on_the_loaders_error_and_closes() -> None:
    def failing() -> object:
        yield 1
        raise ValueError("disk on fire")

    p = ThreadPrefetcher(failing())
    assert next(p) == 1
    with pytest.raises(ValueError, match="disk on fire"):
        next(p)
    endless = ThreadPrefetcher(itertools.count(), depth=1)
    next(endless)
    endless.close()
    assert not endless._thread.is_alive()
    with pytest.raises(ValueError, match="depth"):
        ThreadPrefetcher(iter(()), depth=0)


def test_the_dataloader_yields_the_plain_loaders_batches() -> None:
    size = SIZES["small"]
    plain = list(itertools.islice(batches(size, 1, 20), 20))
    loaded = list(dataloader(size, 1, 20, 0.001, num_workers=2, prefetch_factor=2))
    assert len(loaded) == 20
    for a, b in zip(plain, loaded, strict=True):
        assert torch.equal(a.dense_features, b.dense_features)
        assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
        assert torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())
        assert torch.equal(a.labels, b.labels)


def on(plan: object, thread: str) -> set[str]:
    return {t for t in plan.fire_order if plan.task(t).thread_group == thread}  # type: ignore[attr-defined]


def test_io_dist_puts_every_task_ahead_of_training_off_the_training_thread() -> None:
    plan = sparse_dist_plan()
    io_dist = plan.with_thread_map(io_dist_map("TrainPipelineSparseDist"))
    assert on(io_dist, "io") == {"H2D"}
    assert on(io_dist, "dist") == {"InitPipelinedModules", "InputDistStart", "InputDistWait"}
    assert on(plan.with_thread_map(io_map), "io") == {"H2D"}
    base = train_pipeline_base_plan().with_thread_map(io_dist_map("TrainPipelineBase"))
    assert on(base, "io") == {"LoadBatch", "H2D"} and not on(base, "dist")


@dataclass
class _Runner:
    """Takes ``cost`` seconds per step and returns the step's number as its loss."""

    cost: float
    calls: list[int] = field(default_factory=list)

    def step(self, it: object) -> tuple[float]:
        self.calls.append(1)
        time.sleep(self.cost)
        return (float(len(self.calls)),)


def test_blocks_time_only_the_second_part_of_each_block() -> None:
    a, b = _Runner(0.002), _Runner(0.002)
    cs = [Contender("a", a, iter(())), Contender("b", b, iter(()))]
    ticks: list[int] = []
    interleave_blocks(cs, 3, 10, 4, {}, lambda: ticks.append(1))
    assert len(a.calls) == len(b.calls) == 30 and len(ticks) == 60
    assert len(cs[0].times) == len(cs[1].times) == 18  # 3 blocks x (10 - 4)
    assert cs[0].losses == [float(k) for k in range(1, 31)]


def test_verdicts_compare_like_loaders_and_the_best_of_each_side() -> None:
    row = {
        label: {"mean_ms": ms}
        for label, ms in {
            "upstream": 20.0,
            "upstream+thread": 10.0,
            "upstream+dataloader": 6.0,
            "ours": 20.2,
            "ours+io": 10.1,
            "ours+io+thread": 9.0,
            "ours+dataloader": 6.5,
        }.items()
    }
    got = comparisons(row, list(row), 0.03)
    assert got == [
        ("ours+io", "upstream", pytest.approx(20 / 10.1), "ahead"),
        ("ours+io+thread", "upstream+thread", pytest.approx(10 / 9), "ahead"),
        ("ours+dataloader", "upstream+dataloader", pytest.approx(6 / 6.5), "behind"),  # also the best of each
    ]


def test_each_rounds_mean_step_is_kept() -> None:
    got = _stats([0.010, 0.012, 0.020, 0.022, 0.030, 0.032], 100, per_round=2)
    assert got["rounds_ms"] == pytest.approx([11.0, 21.0, 31.0])
    assert got["mean_ms"] == pytest.approx(21.0)


def test_the_held_out_best_is_chosen_on_one_half_and_judged_on_the_other() -> None:
    # three plans as fast as one another (10 ms), two of them lucky in turns
    row = {
        "ours+a": {"rounds_ms": [9.0, 10.5, 9.0, 10.5]},
        "ours+b": {"rounds_ms": [10.5, 9.5, 10.5, 9.5]},
        "ours+autotune": {"rounds_ms": [10.0, 10.0, 10.0, 10.0]},
    }
    # by the same rounds' means "a" looks best (9.75 ms) and the tuner 0.975x of it
    assert min(("ours+a", "ours+b"), key=lambda k: sum(row[k]["rounds_ms"])) == "ours+a"
    got = held_out(row, ["ours+a", "ours+b"], "ours+autotune")
    assert got is not None
    # chosen on the even rounds: a (9 < 10.5), judged on the odd ones: 10.5 / 10
    # chosen on the odd rounds: b (9.5 < 10.5), judged on the even ones: 10.5 / 10
    assert got["picks"] == ["ours+a", "ours+b"]
    assert got["ratios"] == pytest.approx([1.05, 1.05])
    assert got["ratio"] == pytest.approx(1.05)
    one_round = {k: {"rounds_ms": v["rounds_ms"][:1]} for k, v in row.items()}
    assert held_out(one_round, ["ours+a"], "ours+autotune") is None


def test_the_held_out_ratio_has_an_interval_from_the_judged_rounds_paired() -> None:
    row = {
        # chosen on the even rounds (9 ms), judged on the odd ones: 1.0, 1.1, 1.05, 1.05 of the tuner's
        "ours+a": {"rounds_ms": [9.0, 10.0, 9.0, 11.0, 9.0, 10.5, 9.0, 10.5]},
        # chosen on the odd rounds (9.5 ms), judged on the even ones: 1.05 of the tuner's each time
        "ours+b": {"rounds_ms": [10.5, 9.5, 10.5, 9.5, 10.5, 9.5, 10.5, 9.5]},
        "ours+autotune": {"rounds_ms": [10.0] * 8},
    }
    got = held_out(row, ["ours+a", "ours+b"], "ours+autotune")
    assert got is not None
    assert got["picks"] == ["ours+a", "ours+b"]
    assert got["ratio"] == pytest.approx(1.05)
    # by hand: the odd rounds' logs 0, .09531, .04879, .04879 vary (variance .0015144, of their mean
    # .0003786), the even rounds' not; se = sqrt(.0003786) / 2 = .009729; t(90%, 3 + 3 df) = 1.9432
    assert got["low"] == pytest.approx(1.05 * math.exp(-1.9432 * 0.009729), abs=2e-4)
    assert got["high"] == pytest.approx(1.05 * math.exp(1.9432 * 0.009729), abs=2e-4)
    assert got["low"] < got["ratio"] < got["high"]
    # the tuner as noisy as the others in step with them (the same slow rounds): a narrower interval
    # than the same rounds shuffled against its own
    base = [10.0, 10.0, 12.0, 12.0, 10.0, 10.0, 12.0, 12.0]
    together = {
        "ours+a": {"rounds_ms": [0.98 * x for x in base]},
        "ours+autotune": {"rounds_ms": base},
    }
    apart = {"ours+a": together["ours+a"], "ours+autotune": {"rounds_ms": base[2:] + base[:2]}}
    narrow, wide = held_out(together, ["ours+a"], "ours+autotune"), held_out(apart, ["ours+a"], "ours+autotune")
    assert narrow is not None and wide is not None
    assert narrow["low"] == pytest.approx(0.98) and narrow["high"] == pytest.approx(0.98)
    assert wide["high"] - wide["low"] > 0.1
    # one judged round a half: no interval
    two_rounds = {k: {"rounds_ms": v["rounds_ms"][:2]} for k, v in row.items()}
    short = held_out(two_rounds, ["ours+a", "ours+b"], "ours+autotune")
    assert short is not None and short["low"] is None and short["high"] is None


def test_the_halves_noise_is_how_far_one_contenders_even_and_odd_rounds_lie_apart() -> None:
    row = {
        "a": {"rounds_ms": [10.0, 11.0, 10.0, 11.0]},
        "b": {"rounds_ms": [10.0, 10.0, 10.0, 10.0]},
        "c": {"rounds_ms": [12.0, 10.0]},
        "d": {"rounds_ms": [10.0]},  # one round: no halves
    }
    got = halves_noise(row, list(row))
    assert got is not None
    assert got["largest"] == "c"
    assert got["largest_pct"] == pytest.approx(100 * math.log(1.2))
    assert got["median_pct"] == pytest.approx(100 * math.log(1.1))
    assert halves_noise(row, ["d"]) is None


def test_the_report_of_a_tuning_that_went_back_to_its_starting_plan_has_no_prediction_to_print() -> None:
    """A later round may choose the plan the tuning started from, which has no prediction of its
    own (its decision's and its trial row's ``predicted_ms`` are None): the report says so
    instead of failing to format None (it did, after a 2-rank tail cell's tuning went back)."""
    from benchmarks.overlap import _autotune_lines

    tried = [
        {"plan": "the running plan", "predicted_ms": 30.0, "measured_ms": 31.0, "steps": 24, "verdict": "slower"},
        {"plan": "the starting plan", "predicted_ms": None, "measured_ms": 27.0, "steps": 24, "verdict": "best"},
    ]
    t = {
        "switched": True, "threads": "default", "lookahead": 0, "loads": 1, "input_dist_group": False,
        "change": ["the change: back to the starting plan"], "predicted_ms": None, "why": ["kept"], "tried": tried,
    }  # fmt: skip
    lines = _autotune_lines({"autotune": t, "ours+autotune": {"mean_ms": 27.5}}, ["ours+autotune"])
    assert "no prediction of its own (the trial measured it best), measured 27.50 ms" in lines[0], lines
    assert lines[2] == "  - tried the starting plan: predicted -, measured 27.00 ms over 24 steps (best)", lines
