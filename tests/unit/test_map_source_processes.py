"""``MapSource(dataset, processes=N)``: each item fetched in one of N worker processes, the same
items in the same order as without them, through a pipeline with parallel loads bit for bit; an
error there raised here with its type and message; ``close()`` ends the workers; bad arguments
and a dataset a start method cannot send are refused in one line."""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Any

import pytest
import torch

import torchrec_swp
from tests.unit.test_autotune import Slow, Summing
from torchrec_swp.data import GlobalMapSource, MapSource
from torchrec_swp.plans import default_plans, with_parallel_loads


class Items:
    """Item ``i``: the process that made it, and a tensor of ``i``."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        if i == 7 and getattr(self, "fail_at_7", False):
            raise KeyError(f"item {i} is missing")
        return os.getpid(), torch.full((4,), float(i))


def _fetch_all(source: MapSource, loads: int = 2) -> list[Any]:
    with concurrent.futures.ThreadPoolExecutor(loads) as pool:
        claimed = [source.claim() for _ in range(len(source))]
        return list(pool.map(source.fetch, claimed))


def test_items_come_from_the_worker_processes_in_order() -> None:
    source = MapSource(Items(), processes=2)
    try:
        got = _fetch_all(source)
    finally:
        source.close()
    assert [int(t[0]) for _, t in got] == list(range(12))
    pids = {pid for pid, _ in got}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2


def test_a_pipeline_with_parallel_loads_over_processes_trains_as_over_threads() -> None:
    def run(processes: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        model = Summing()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        plan = with_parallel_loads(default_plans()["TrainPipelineBase"], 2)
        pipeline = torchrec_swp.TrainPipelineBase(model, optimizer, torch.device("cpu"), plan=plan)
        source = MapSource(Slow(24, 0.001), processes=processes)
        outputs = []
        try:
            while True:
                try:
                    outputs.append(pipeline.progress(source))
                except StopIteration:
                    break
        finally:
            pipeline.close()
            source.close()
        return [o.detach().clone() if isinstance(o, torch.Tensor) else o[0].detach().clone() for o in outputs], {
            k: v.clone() for k, v in model.state_dict().items()
        }

    (threads, weights), (procs, proc_weights) = run(0), run(2)
    assert len(threads) == len(procs) == 24
    assert all(torch.equal(a, b) for a, b in zip(threads, procs))
    assert all(torch.equal(weights[k], proc_weights[k]) for k in weights)


def test_an_error_in_a_worker_is_raised_in_the_fetching_thread() -> None:
    items = Items()
    items.fail_at_7 = True  # type: ignore[attr-defined]
    source = MapSource(items, processes=2)
    try:
        for i in range(7):
            assert int(source.fetch(source.claim())[1][0]) == i
        with pytest.raises(KeyError, match="item 7 is missing"):
            source.fetch(source.claim())
        assert int(source.fetch(source.claim())[1][0]) == 8  # the workers go on
    finally:
        source.close()


def test_iterating_starts_the_workers_before_the_first_fetch() -> None:
    """As a DataLoader does at ``iter()``: the workers' start-up (seconds where they import torch)
    falls before the first step, not inside it."""
    source = MapSource(Items(), processes=2)
    try:
        assert source._pool is None  # nothing started by the constructor
        it = iter(source)
        pool = source._pool
        assert it is source and pool is not None
        started = list(pool._processes.values())
        assert len(started) == 2 and all(p.is_alive() for p in started)
        assert iter(source) is source and source._pool is pool  # again: the same workers
        got = list(source)
        assert [int(t[0]) for _, t in got] == list(range(12)) and {pid for pid, _ in got} <= set(pool._processes)
    finally:
        source.close()
    assert iter(MapSource(Items())) is not None  # without processes: nothing to start


def test_close_ends_the_workers_and_a_later_fetch_is_refused() -> None:
    source = MapSource(Items(), processes=2)
    pids = {source.fetch(source.claim())[0] for _ in range(4)}
    pool = source._pool
    assert pool is not None
    processes = list(pool._processes.values())
    source.close()
    assert all(not p.is_alive() for p in processes), pids
    with pytest.raises(RuntimeError, match=r"MapSource: closed \(close\(\)\)"):
        source.fetch(source.claim())
    source.close()  # again: nothing more


def test_a_dead_worker_is_said_in_one_line() -> None:
    source = MapSource(Items(), processes=1)
    try:
        pid, _ = source.fetch(source.claim())
        os.kill(pid, 9)
        with pytest.raises(RuntimeError, match="MapSource: a worker process ended while fetching item"):
            for _ in range(3):  # the pool learns of the death at its next fetch at the latest
                source.fetch(source.claim())
    finally:
        source.close()


def test_a_dataset_spawn_cannot_send_is_refused_at_the_first_fetch() -> None:
    class Local(Items):  # a class inside a function: pickle cannot name it
        lock = threading.Lock()

    source = MapSource(Local(), processes=1, context="spawn")
    with pytest.raises(TypeError, match="with the 'spawn' start method the dataset goes to each worker"):
        source.fetch(source.claim())
    source.close()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"processes": -1}, "processes must be an int >= 0"),
        ({"processes": True}, "processes must be an int >= 0"),
        ({"processes": 2, "context": "threads"}, "context must be a start method of this platform"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MapSource(Items(), **kwargs)


def test_a_global_source_fetches_in_processes_too() -> None:
    source = GlobalMapSource(Items(), rank=1, world_size=2, processes=2)
    try:
        got = _fetch_all(source)
    finally:
        source.close()
    assert [int(t[0]) for _, t in got] == [1, 3, 5, 7, 9, 11]
    assert source.state_dict()["consumed"] == 12


class Sorting:
    """Items made by ops on torch's intra-op thread pool (a loader's transforms: sort 200k ids)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        ids = torch.randint(0, 2**31 - 1, (200_000,), generator=torch.Generator().manual_seed(i))
        return int(torch.sort(ids.remainder(1_000_003))[0][-1])


def test_a_worker_forked_after_torch_used_its_thread_pool_still_computes() -> None:
    # the parent's training thread runs ops on torch's thread pool while the worker is forked: the
    # worker must not wait forever in its first parallel op (it runs torch on one thread, as
    # DataLoader's workers do)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    stop = threading.Event()

    def train() -> None:  # the training thread, in torch ops while the worker is forked
        while not stop.is_set():
            Sorting()[0]

    training = threading.Thread(target=train)
    training.start()
    try:
        source = MapSource(Sorting(), processes=1)
        got: list[int] = []
        fetching = threading.Thread(target=lambda: got.extend(source.fetch(source.claim()) for _ in range(4)))
        fetching.start()
        fetching.join(timeout=60)
        alive = fetching.is_alive()
        if alive:  # a hung worker: killed, so that the pool's exit does not wait for it too
            pool = source._pool
            for process in list(pool._processes.values()) if pool is not None else []:
                process.kill()
            fetching.join(timeout=60)
        source.close()
    finally:
        stop.set()
        training.join()
        torch.set_num_threads(threads)
    assert not alive, "the worker process hung in its first torch op"
    assert got == [Sorting()[i] for i in range(4)]
