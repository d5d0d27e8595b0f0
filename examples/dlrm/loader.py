"""The example's data loaders: torchdata's StatefulDataLoader over this rank's batches
(``--data-source dataloader``, the default), or torchrec_swp's ``MapSource`` over them
(``--data-source map``).

A StatefulDataLoader's iterator has ``state_dict()``: where the data is, which a checkpoint records
(through the pipeline's ``state_dict()``, at the first batch not yet trained) and a resume gives back
with ``loader.load_state_dict(...)``. Each item of the datasets below is a whole batch (a
``torchrec.datasets.utils.Batch``), so the loader runs with ``batch_size=None`` and does no
batching of its own; with ``num_workers`` > 0, worker processes make the batches ahead of the
training, and the loader's state still counts only the batches it handed out.

* ``MapBatches``: map-style, item ``k`` is batch ``k`` of ``SyntheticCriteo`` or ``CriteoTsv``
  (``batch(k)``). ``SyntheticBatches``, its synthetic case, is what the DataLoader reads: the
  batches the example trained on before it had a loader, in the same order. Any number of workers.
* ``TsvBatches``: iterable over Criteo TSV files (``CriteoTsv``); a resume re-reads the files and
  drops the batches already handed out (StatefulDataLoader's fast-forward). No workers: each would
  read every file.

Both wait ``latency_s`` before each batch, like a loader waiting on storage (in a worker when
there are workers, so the wait overlaps the training).

With ``--data-source map`` the pipeline gets a ``torchrec_swp.data.MapSource`` over a
``MapBatches`` instead of a loader's iterator. Its draws split into ``claim()`` (the next index,
in batch order) and ``fetch(k)`` (``MapBatches[k]``: the wait and the reading), so that a plan
with ``loads`` > 1 runs several fetches at once on the engine's threads, their waits overlapping,
while the batches keep their order: the DataLoader's batches, in the same order. Its
``state_dict()`` is the next index, which the pipeline's cut records as it records the
DataLoader's position.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from multiprocessing.context import BaseContext

import torch
from torch.utils.data import Dataset, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchrec.datasets.utils import Batch

from examples.dlrm.data import CriteoTsv, EditedBatches, SyntheticCriteo
from examples.dlrm.loader_work import LoaderWork, as_work


class MapBatches(Dataset[Batch]):
    """Map-style: item ``k`` is ``batches.batch(k)``, ``latency_s`` late (the wait sleeps, releasing
    the GIL, so that loads on several threads wait at once), or after a loader's work of another
    kind (``latency_s`` a ``LoaderWork``: ``--loader-kind``); pinned when ``pin_memory`` (for a
    CUDA device: the pipelines copy batches there)."""

    def __init__(
        self,
        batches: SyntheticCriteo | CriteoTsv | EditedBatches,
        latency_s: float | LoaderWork = 0.0,
        *,
        pin_memory: bool = False,
    ) -> None:
        self.batches = batches
        self.work = as_work(latency_s)
        self.pin_memory = pin_memory

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, k: int) -> Batch:
        if not 0 <= k < len(self.batches):
            raise IndexError(f"batch {k} of {len(self.batches)}")
        if self.work:
            self.work(k)
        batch = self.batches.batch(k)
        return batch.pin_memory() if self.pin_memory else batch


class SyntheticBatches(MapBatches):
    """``MapBatches`` over synthetic data: what the StatefulDataLoader reads (the DataLoader pins
    the batches itself).

    Upstream's DLRM example hands TorchRec's ``RandomRecDataset`` to the DataLoader itself; here its
    batches (``SyntheticCriteo`` draws each with one) go through this map-style dataset instead,
    because ``RandomRecDataset`` is an IterableDataset that ignores the loader's workers (with
    ``--num-workers 2`` each worker would hand out the whole stream: every batch twice), has no
    item ``k`` for ``--data-source map``'s parallel fetches, and has no state of its own, so the
    loader's state after ``k`` batches could only be given back by drawing the ``k`` again. Over
    this dataset the loader's state is its sampler's position: the same batches at any resume,
    with or without workers."""

    def __init__(self, synthetic: SyntheticCriteo | EditedBatches, latency_s: float | LoaderWork = 0.0) -> None:
        super().__init__(synthetic, latency_s)


class TsvBatches(IterableDataset[Batch]):
    """Iterable: the batches of ``tsv`` (or of an ``EditedBatches`` over one), each ``latency_s`` late
    (or after that work: a ``LoaderWork``)."""

    def __init__(self, tsv: CriteoTsv | EditedBatches, latency_s: float | LoaderWork = 0.0) -> None:
        self.tsv = tsv
        self.work = as_work(latency_s)

    def __iter__(self) -> Iterator[Batch]:
        for k, batch in enumerate(self.tsv):
            if self.work:
                self.work(k)
            yield batch


def _whole_batch(item: Batch) -> Batch:
    """The loader's collate function: an item is already a batch (module level: workers pickle it)."""
    return item


def workers_start_method() -> str:
    """The start method of worker processes (``_workers_context``), for ``MapSource(context=)``."""
    return _workers_context().get_start_method()


def _workers_context() -> BaseContext:
    """Where worker processes come from: a fork server (one clean process per rank, the loader's
    modules imported once, workers forked from it), not a fork of the rank itself. A rank runs
    threads (gloo's, the engine's, a previous loader's queue feeders); a worker forked while one
    of them held a lock inherits it held: torch's shared-tensor cache lock, taken by the feeder
    thread that sends a worker its start state while the next worker is forked, left a worker hung
    at its exit and its rank waiting for a batch (tests/dist/test_checkpoint_resume.py, SemiSync
    with 2 workers after six runs in one process)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


def make_loader(
    dataset: MapBatches | TsvBatches, *, num_workers: int = 0, device: torch.device | None = None
) -> StatefulDataLoader:
    """A StatefulDataLoader handing out the items of ``dataset`` in order, made by ``num_workers``
    worker processes (0: in the calling thread). Batches go to pinned memory when ``device`` is a
    CUDA device (the pipelines copy them to the device)."""
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if num_workers and isinstance(dataset, TsvBatches):
        raise ValueError(
            "Criteo TSV files in order are read without workers (each worker would read every file): use 0 workers, "
            "or MapBatches (each worker reads its batches by index)"
        )
    return StatefulDataLoader(
        dataset,
        batch_size=None,
        shuffle=False,
        num_workers=num_workers,
        collate_fn=_whole_batch,
        pin_memory=device is not None and device.type == "cuda",
        multiprocessing_context=_workers_context() if num_workers else None,
    )


def shutdown_workers(iterator: object) -> None:
    """Stop the worker processes of a StatefulDataLoader iterator now.

    The iterator does this itself when it is garbage-collected; a pipeline may still hold it, so
    the example stops them explicitly at the end of a run (a private method of torch's
    DataLoader iterators, which StatefulDataLoader's inherit)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()
