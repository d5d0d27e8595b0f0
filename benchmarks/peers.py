"""The ways a user of upstream TorchRec hides loader latency: the peers of ``overlap.py``.

* ``async_copy_runner``: TorchRec 1.9's ``async_inplace_copy=True`` (with
  ``enable_inplace_copy_batch=True``, which it needs). As shipped it turns itself off on a CPU
  device (``AsyncInplaceCopyMixin._setup_async_inplace_copy`` keeps it for ``cuda``/``mtia``
  only, and logs so); ``forced=True`` lifts that check, to show what it does where it is on: it
  moves the *copy* to a worker thread, while ``_next_batch`` - the loader's ``next()``, where the
  latency is - still runs on the training thread.
* ``ThreadPrefetcher``: a background thread that pulls batches from the loader into a queue of
  ``depth`` batches; upstream's pipeline reads the queue.
* ``dataloader``: a ``torch.utils.data.DataLoader`` with ``num_workers`` worker processes and
  ``prefetch_factor`` over a map-style dataset whose ``__getitem__`` waits the same latency and
  returns the same batch; workers load batches in parallel, in order.

Every one yields the very same batches in the same order as the plain loader (``harness.dlrm_data.batches``).
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from examples.dlrm.loader_work import LoaderWork, as_work
from examples.dlrm.model import DlrmSize

_END = object()


class ThreadPrefetcher:
    """Iterate ``source`` on a daemon thread, ``depth`` batches ahead; ``close()`` stops it."""

    def __init__(self, source: Iterator[Any], depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(source,), name="prefetch", daemon=True)
        self._thread.start()

    def _fill(self, source: Iterator[Any]) -> None:
        try:
            for item in source:
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as e:  # surfaces in the consumer
            self._queue.put(e)
            return
        self._queue.put(_END)

    def __iter__(self) -> ThreadPrefetcher:
        return self

    def __next__(self) -> Any:
        item = self._queue.get()
        if item is _END:
            self._queue.put(_END)
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        self._thread.join(timeout=5)


class LatencyDataset(torch.utils.data.Dataset):
    """Map-style: item ``k`` is ``cycle[k % len(cycle)]``, returned ``latency_s`` late (or after the
    loader's work ``latency_s`` is: ``examples.dlrm.loader_work.LoaderWork``, for item ``k``)."""

    def __init__(self, cycle: list[Any], num_batches: int, latency_s: float | LoaderWork) -> None:
        self.cycle = cycle
        self.num_batches = num_batches
        self.work = as_work(latency_s)

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, k: int) -> Any:
        if self.work:
            self.work(k)
        return self.cycle[k % len(self.cycle)]


def latency_dataset(size: DlrmSize, rank: int, num_batches: int, latency_s: float | LoaderWork) -> LatencyDataset:
    """The map-style dataset behind ``dataloader``: the batches of ``harness.dlrm_data.batches`` (the same
    ``DISTINCT_BATCHES``, repeated), each ``latency_s`` late (or after that work)."""
    from harness.dlrm_data import DISTINCT_BATCHES, batches

    cycle = list(itertools.islice(batches(size, rank, DISTINCT_BATCHES), DISTINCT_BATCHES))
    return LatencyDataset(cycle, num_batches, latency_s)


def dataloader(
    size: DlrmSize,
    rank: int,
    num_batches: int,
    latency_s: float | LoaderWork,
    *,
    num_workers: int,
    prefetch_factor: int,
) -> Iterator[Any]:
    """An iterator over a DataLoader yielding the batches of ``harness.dlrm_data.batches``: the same
    ``DISTINCT_BATCHES`` batches, repeated, each ``latency_s`` late."""
    loader = torch.utils.data.DataLoader(
        latency_dataset(size, rank, num_batches, latency_s),
        batch_size=None,
        shuffle=False,
        num_workers=num_workers,
        prefetch_factor=prefetch_factor,
    )
    return iter(loader)


def async_copy_runner(build: Callable[[], Any], *, forced: bool) -> Any:
    """Upstream TrainPipelineSparseDist with ``async_inplace_copy=True`` as a Runner; ``forced``
    keeps it on on the CPU (module docstring)."""
    from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDist
    from torchrec.distributed.train_pipeline.utils import FutureDeque

    from harness.dlrm import CPU, INFO, Runner

    class ForcedAsyncCopy(TrainPipelineSparseDist):
        """Upstream's pipeline with the background copy thread on the CPU too: what
        ``_setup_async_inplace_copy`` sets up on an accelerator (a one-worker executor and a
        Future-resolving batch deque), minus the device binding a CPU does not need."""

        def _setup_async_inplace_copy(self, enabled: bool, device: torch.device) -> None:
            super()._setup_async_inplace_copy(False, device)
            if enabled:
                from concurrent.futures import ThreadPoolExecutor

                self._async_inplace_copy = True
                self._inplace_copy_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inplace_copy")
                self.batches = FutureDeque()

    model, optimizer = build()
    cls = ForcedAsyncCopy if forced else TrainPipelineSparseDist
    pipeline = cls(model, optimizer, CPU, async_inplace_copy=True, enable_inplace_copy_batch=True)
    return Runner(INFO["TrainPipelineSparseDist"], "upstream", pipeline, model, optimizer, contextlib.ExitStack())
