"""The loaders' per-batch work (``examples/dlrm/loader_work.py``): what each kind does, that item
``k`` waits or works the same whoever loads it when (a plain iterator, a map-style dataset read
out of order, a DataLoader's worker), and that bad input is refused in one line."""

from __future__ import annotations

import math
import pickle
import statistics

import pytest

from benchmarks.common import percentile
from benchmarks.peers import LatencyDataset
from examples.dlrm import loader_work
from examples.dlrm.data import with_latency
from examples.dlrm.loader_work import KINDS, TAIL_SIGMA, LoaderWork, as_work, calibrate, parse_rows


@pytest.fixture
def slept(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    waits: list[float] = []
    monkeypatch.setattr(loader_work.time, "sleep", waits.append)
    return waits


def test_a_number_is_a_sleep_as_latency_always_was(slept: list[float]) -> None:
    work = as_work(0.005)
    assert work == LoaderWork("sleep", 5.0) and work.describe() == "sleep 5 ms"
    assert list(with_latency(["a", "b"], 0.005)) == ["a", "b"] and slept == [0.005, 0.005]
    assert not as_work(0.0) and as_work(work) is work


def test_the_tails_waits_are_the_items_own_and_heavy(slept: list[float]) -> None:
    work = LoaderWork("tail", 10.0, seed=3, rank=1)
    assert list(with_latency(range(6), work)) == list(range(6))
    assert slept == [work.tail_s(k) for k in range(6)]
    # read out of order (parallel loads, a DataLoader's workers): item k still waits tail_s(k)
    data = LatencyDataset(list(range(6)), 6, work)
    slept.clear()
    assert [data[k] for k in (4, 1, 5)] == [4, 1, 5] and slept == [work.tail_s(k) for k in (4, 1, 5)]
    assert pickle.loads(pickle.dumps(work)).tail_s(4) == work.tail_s(4)  # a worker process draws the same
    assert LoaderWork("tail", 10.0, seed=3, rank=0).tail_s(4) != work.tail_s(4)  # each rank its own draws
    waits = [work.tail_s(k) for k in range(20_000)]
    median = statistics.median(waits)
    assert median == pytest.approx(0.010, rel=0.03)
    assert percentile(waits, 0.99) / median == pytest.approx(math.exp(2.326 * TAIL_SIGMA), rel=0.1)
    assert percentile(waits, 0.99) / median >= 5


def test_the_gil_kind_parses_criteo_rows_in_python() -> None:
    # 26 categorical fields a row, about 5% of them empty: ids parsed, the same for the same item
    ids = parse_rows(200, 7)
    assert 0.9 * 200 * 26 < ids <= 200 * 26
    assert parse_rows(200, 7) == ids
    work = LoaderWork("gil", 1.0, units=50)
    assert work.describe() == "gil 1 ms (50 rows parsed)"
    work(3)  # runs


def test_calibration_sizes_the_cpu_kinds_and_leaves_the_waits_alone() -> None:
    for kind in ("gil", "torch"):
        work = calibrate(kind, 2.0, trials=2)
        assert work.kind == kind and work.ms == 2.0 and work.units >= 1
        work(0)
    assert calibrate("tail", 5.0, seed=9, rank=1) == LoaderWork("tail", 5.0, 0, 9, 1)
    assert calibrate("gil", 0.0).units == 0  # no work: nothing to calibrate


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"kind": "disk"}, "not one of sleep, gil, torch, tail"),
        ({"kind": "sleep", "ms": -1.0}, ">= 0 ms"),
        ({"kind": "tail", "ms": math.nan}, ">= 0 ms"),
        ({"kind": "gil", "ms": 5.0}, "make it with calibrate"),
    ],
)
def test_bad_work_is_refused_in_one_line(kwargs: dict, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        LoaderWork(**kwargs)
    assert KINDS == ("sleep", "gil", "torch", "tail")


def test_a_negative_latency_is_refused() -> None:
    with pytest.raises(ValueError, match="latency must be >= 0"):
        list(with_latency([1], -0.001))


def test_the_examples_loader_kind_reaches_every_loader_of_the_run() -> None:
    import torch

    from examples.dlrm.train import data_source_for, dataset_for, parse_args

    args = parse_args(["--loader-kind", "tail", "--loader-latency-ms", "3", "--data-source", "map", "--steps", "4"])
    work = LoaderWork("tail", 3.0, seed=args.seed, rank=1)
    assert data_source_for(args, 1, 2, torch.device("cpu")).dataset.work == work  # the map source's loads
    assert dataset_for(args, 1, 2).work == work  # the StatefulDataLoader's dataset (workers get it pickled)
    gil = parse_args(["--loader-kind", "gil", "--loader-latency-ms", "1", "--steps", "4"])
    assert dataset_for(gil, 0, 1).work is dataset_for(gil, 0, 1).work  # calibrated once per process
    assert dataset_for(gil, 0, 1).work.units >= 1
    with pytest.raises(SystemExit):
        parse_args(["--loader-kind", "disk"])
