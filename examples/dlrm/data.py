"""Criteo-like batches for the DLRM example: synthetic ones made on the fly, or real Criteo TSV files.

Both yield ``torchrec.datasets.utils.Batch`` (dense features, sparse features as a KJT, labels):
what TorchRec's DLRM and every train pipeline take. The feature counts and names are those of
``torchrec.datasets.criteo`` (13 integer features, 26 categorical ones named ``cat_0`` ...).

* ``SyntheticCriteo``: 13 dense and (by default) 26 sparse features, generated batch by batch
  from a seed, so the example runs with no download. Each batch's ids, id counts and dense
  features are drawn by TorchRec's ``RandomRecDataset`` (``torchrec.datasets.random``, what
  upstream's DLRM example uses for random data), seeded by the batch's rank and index. What is
  ours makes them Criteo-like: the ids heavy-tailed (a few ids are frequent, as in Criteo;
  RandomRecDataset's are uniform), the dense values log-transformed counts (RandomRecDataset's
  are standard normal), and labels with a learnable signal so the loss goes down
  (RandomRecDataset's are coin flips). ``split="val"`` gives held-out batches: the same hidden
  model behind the labels, never one of the training batches.
* ``CriteoTsv``: the raw Criteo format (Kaggle ``train.txt``, Terabyte ``day_N``), the format
  ``torchrec.datasets.criteo``'s ``criteo_kaggle`` / ``criteo_terabyte`` read: one example per
  line, tab-separated: label, 13 integer features, 26 categorical features in hex; any field may
  be empty. Dense values become ``log(1 + max(x, 0))``, hex ids ``int(x, 16) % num_embeddings``,
  an empty categorical field no id. Read in order (iterating), or batch by batch in any order
  (``batch(k)``, after one pass over the files that notes where each of this rank's batches
  starts), with the same batches either way. The reader is ours: see ``CriteoTsv`` for why
  TorchRec's ``CriteoIterDataPipe`` does not do this job.
* ``write_sample_tsv``: a small file in Criteo's format with random values, to try
  ``--criteo-tsv`` without the download (the tests write theirs with it).
* ``with_latency``: wraps an iterable so that each batch arrives ``latency_s`` late, like a
  loader waiting on storage (the wait sleeps, releasing the GIL), or after a loader's work of
  another kind (``loader_work``: Python parsing that holds the GIL, torch ops, a heavy tail).
* ``EditedBatches``: one rank's batches as it draws them with ``--drop-batch K`` (without its
  ``K``-th batch) or ``--poison-batch K`` (its ``K``-th batch with NaN dense features), edited by
  index, so that a batch is the same whoever draws it when (a loader's workers, the map source's
  loads, a pipeline's lookahead, a resume).

Every rank reads its own share: synthetic data is seeded per rank; a TSV file is cut into rounds
of ``world_size`` batches, rank r takes the r-th batch of each round, and an incomplete last
round is dropped on every rank, so all ranks train the same number of batches (a rank with one
batch more would wait forever in a collective).
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import NamedTuple, TypeVar

import torch
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, DEFAULT_CAT_NAMES, INT_FEATURE_COUNT
from torchrec.datasets.random import RandomRecDataset
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from examples.dlrm.loader_work import LoaderWork, as_work

NUM_DENSE = INT_FEATURE_COUNT  # 13
NUM_SPARSE = CAT_FEATURE_COUNT  # 26
SPLITS = ("train", "val")
#: Where the held-out split's batches start among the generator's keys: batch ``k`` of ``"val"`` is
#: made from key ``VAL_KEYS + k``. torch's CPU generator keeps only the low 32 bits of a seed, so
#: the offset is half of that space: no rank's held-out batch is a training batch of a run of
#: fewer than 2**31 - world_size * 1,000,003 steps (for 1,000 ranks, about a billion).
VAL_KEYS = 1 << 31
#: XORed into a batch's seed for its labels' draws: a generator apart from the one its features come from
#: (a 32-bit constant, since torch keeps only the low 32 bits of a seed).
LABEL_SALT = 0x9E3779B9

T = TypeVar("T")


def sparse_names(num_sparse: int = NUM_SPARSE) -> list[str]:
    """Names of the sparse features: TorchRec's Criteo names (``cat_0`` ... ``cat_25``), numbered on
    past 26 for synthetic data with more features."""
    return [*DEFAULT_CAT_NAMES[:num_sparse], *(f"cat_{i}" for i in range(CAT_FEATURE_COUNT, num_sparse))]


class SyntheticCriteo:
    """``num_batches`` Criteo-like batches of ``batch_size`` examples, made on the fly.

    Batch ``k`` of rank ``rank`` depends only on ``(seed, rank, k % distinct)``: iterating again
    gives the same batches. ``distinct`` (default: all of them) bounds how many different
    batches are generated; later ones repeat them from a cache, which keeps data generation out
    of step-time measurements. ``ids_per_feature`` > 1 makes multi-hot features (1 to that many
    ids per example). ``split`` (``"train"`` or ``"val"``): the held-out split ``"val"`` draws
    its batches from keys no training batch uses, its labels from the same hidden model.
    """

    def __init__(
        self,
        *,
        batch_size: int,
        num_batches: int,
        num_embeddings: int,
        num_sparse: int = NUM_SPARSE,
        ids_per_feature: int = 1,
        rank: int = 0,
        seed: int = 1000,
        distinct: int | None = None,
        split: str = "train",
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        for name, value, low in (
            ("batch_size", batch_size, 1),
            ("num_batches", num_batches, 0),
            ("num_embeddings", num_embeddings, 1),
            ("num_sparse", num_sparse, 1),
            ("ids_per_feature", ids_per_feature, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if distinct is not None and distinct < 1:
            raise ValueError(f"distinct must be >= 1 or None, got {distinct!r}")
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.num_embeddings = num_embeddings
        self.keys = sparse_names(num_sparse)
        self.ids_per_feature = ids_per_feature
        self.rank = rank
        self.seed = seed
        self.distinct = distinct
        self.split = split
        self._cache: dict[int, Batch] = {}
        # The hidden model behind the labels: the same on every rank.
        g = torch.Generator().manual_seed(seed)
        self._dense_weight = torch.randn(NUM_DENSE, generator=g) / math.sqrt(NUM_DENSE)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        for k in range(self.num_batches):
            yield self.batch(k)

    def batch(self, k: int) -> Batch:
        """Batch ``k`` of this rank."""
        key = k if self.distinct is None else k % self.distinct
        if self.split == "val":
            key += VAL_KEYS
        # RandomRecDataset caches too (num_generated_batches), but fills its cache up front from its one
        # generator and hands it out in order; this one is filled by index, as batches are asked for.
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        batch = self._generate(key)
        if self.distinct is not None:
            self._cache[key] = batch
        return batch

    def _generate(self, key: int) -> Batch:
        n = self.batch_size
        # The ids, their counts and the dense features: TorchRec's RandomRecDataset (what upstream's DLRM
        # example trains on without Criteo), one per batch, seeded by the batch's key. One per batch because
        # its iterator draws every batch from a single generator in order: batch k could only be had by
        # drawing the k before it, while the map-style dataset (a StatefulDataLoader's workers, the map
        # source's parallel fetches, the held-out split) reads any batch by index, and a resume starts at one.
        (drawn,) = RandomRecDataset(
            keys=self.keys,
            batch_size=n,
            hash_size=self.num_embeddings,
            ids_per_feature=self.ids_per_feature,
            min_ids_per_feature=1,  # every example has 1 to ids_per_feature ids of each feature
            num_dense=NUM_DENSE,
            manual_seed=self._seed(key),
            num_batches=1,
            num_generated_batches=-1,  # draw on demand: no cache of its own (``distinct`` is ours)
        )
        lengths = drawn.sparse_features.lengths()
        # RandomRecDataset's ids are uniform over the table; Criteo's are heavy-tailed (a few ids are very
        # frequent, most are rare), which is what the embedding lookups meet: u**4 piles them up near 0.
        u = (drawn.sparse_features.values().double() + 0.5) / self.num_embeddings
        values = (u.pow(4) * self.num_embeddings).long().clamp_(max=self.num_embeddings - 1)
        sparse = KeyedJaggedTensor.from_lengths_sync(keys=self.keys, values=values, lengths=lengths)
        # RandomRecDataset's dense features are standard normal; Criteo's are counts, which models see as
        # log(1 + count). The normal's CDF turns each into an exponential draw (-log(1 - Phi(z))), 20 times
        # it a count: the shape Criteo's have, and one the example's DLRM learns from in a few hundred steps.
        dense = torch.log1p((-20 * torch.special.log_ndtr(-drawn.dense_features)).floor())
        # RandomRecDataset's labels are fair coins, independent of the features: nothing to learn, a
        # validation AUC of 0.5. Ours come from a hidden model of the dense features and the parity of each
        # example's first id, drawn from a generator of their own (seeded apart from RandomRecDataset's).
        first_ids = values[torch.cumsum(lengths[:n], 0) - lengths[:n]]
        logit = (dense - dense.mean(0)) @ self._dense_weight + (first_ids % 2).float() - 0.5
        g = torch.Generator().manual_seed(self._seed(key) ^ LABEL_SALT)
        labels = torch.bernoulli(torch.sigmoid(2 * logit), generator=g).long()
        return Batch(dense_features=dense, sparse_features=sparse, labels=labels)

    def _seed(self, key: int) -> int:
        """The seed of the batch with key ``key`` of this rank (torch keeps its low 32 bits)."""
        return ((self.seed * 1_000_003 + self.rank) * 1_000_003 + key) % 2**63


class LinePosition(NamedTuple):
    """Where reading resumes in a list of files: file ``file`` at ``offset`` (its ``tell()``),
    ``line`` lines of that file before it (for ``path:line`` in error messages)."""

    file: int
    offset: int
    line: int


#: The start of the first file.
_FIRST_LINE = LinePosition(0, 0, 0)


class CriteoTsv:
    """Batches read from Criteo TSV files (see the module docstring), this rank's share.

    ``max_batches`` stops after that many batches of this rank (None: the whole files).

    Iterating reads the files once, in order. ``batch(k)`` reads batch ``k`` alone (any thread,
    any order): the first ``batch()`` or ``len()`` reads the files once to note where each of this
    rank's batches starts (one position per batch, kept in memory), up to the last complete round
    or ``max_batches``; ``batch(k)`` then reads from there. Both give the same batches, and the
    same error for a bad line.

    Why not TorchRec's reader of this format (``torchrec.datasets.criteo.CriteoIterDataPipe``, behind
    ``criteo_kaggle`` and ``criteo_terabyte``; the tests check that both read the same values from a
    well-formed file): it is a stream from the first line of the first file, with no position to
    start at batch ``k``, which ``batch(k)`` (the map-style dataset: loader workers, the map source's
    parallel fetches) and a resume need, and with two readers the two ways of reading could differ.
    And it takes bad input silently: its row mapper reads a line's fields from the end, so a short
    line becomes an example with its last fields as ``cat_25``, ``cat_24``... and no label, an
    unreadable number becomes 0 (``safe_cast``), a blank line an empty row, and its ``csv`` reader
    lets a ``"`` swallow the tabs and lines that follow. Here a blank line is skipped and each of the
    others is an error naming the file and line.
    """

    def __init__(
        self,
        paths: Sequence[str | Path],
        *,
        batch_size: int,
        num_embeddings: int,
        num_sparse: int = NUM_SPARSE,
        rank: int = 0,
        world_size: int = 1,
        max_batches: int | None = None,
    ) -> None:
        if not paths:
            raise ValueError("CriteoTsv needs at least one file")
        missing = [str(p) for p in paths if not Path(p).is_file()]
        if missing:
            raise FileNotFoundError(f"Criteo TSV file not found: {missing[0]}")
        if not 1 <= num_sparse <= NUM_SPARSE:
            raise ValueError(
                f"Criteo has {NUM_SPARSE} sparse features; num_sparse must be 1..{NUM_SPARSE}, got {num_sparse}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.paths = [Path(p) for p in paths]
        self.batch_size = batch_size
        self.num_embeddings = num_embeddings
        self.keys = sparse_names(num_sparse)
        self.rank = rank
        self.world_size = world_size
        self.max_batches = max_batches
        self._starts: list[LinePosition] | None = None
        self._starts_lock = threading.Lock()

    def __len__(self) -> int:
        """This rank's batches: one per complete round, at most ``max_batches``."""
        return len(self._batch_starts())

    def __getstate__(self) -> dict[str, object]:
        """For a worker process (a loader's, a ``MapSource``'s): where the batches start goes with
        it (noted before it was sent: no worker reads the files to find them again), the lock does not."""
        self._batch_starts()
        return {k: v for k, v in self.__dict__.items() if k != "_starts_lock"}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._starts_lock = threading.Lock()

    def batch(self, k: int) -> Batch:
        """Batch ``k`` of this rank: the ``k``-th item of iterating (IndexError past the last)."""
        starts = self._batch_starts()
        if not 0 <= k < len(starts):
            raise IndexError(f"batch {k} of {len(starts)} in {', '.join(map(str, self.paths))} (rank {self.rank})")
        lines = self._lines(starts[k])
        try:
            return self._parse(list(islice(lines, self.batch_size)))
        finally:
            lines.close()

    def _batch_starts(self) -> list[LinePosition]:
        """Where each of this rank's batches starts (read once, on first use)."""
        with self._starts_lock:
            if self._starts is None:
                self._starts = self._scan()
            return self._starts

    def _scan(self) -> list[LinePosition]:
        """One pass over the files, as ``__iter__`` reads them: the position before the first line of
        this rank's share of each round (empty lines before it are skipped when reading), for the
        complete rounds only, at most ``max_batches``."""
        round_lines = self.batch_size * self.world_size
        first = self.rank * self.batch_size  # this rank's first line in a round
        wanted = self.max_batches
        starts: list[LinePosition] = []
        seen = 0  # non-empty lines read so far
        for index, path in enumerate(self.paths):
            with path.open(encoding="utf-8") as f:
                number = 0
                while True:
                    if seen == len(starts) * round_lines + first and (wanted is None or len(starts) < wanted):
                        starts.append(LinePosition(index, f.tell(), number))
                    line = f.readline()  # not `for line in f`: that disables tell()
                    if not line:
                        break
                    number += 1
                    if line.strip():
                        seen += 1
                        if wanted is not None and seen == wanted * round_lines:
                            return starts
        return starts[: seen // round_lines]

    def __iter__(self) -> Iterator[Batch]:
        round_lines = self.batch_size * self.world_size
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        produced = 0
        chunk: list[tuple[str, str]] = []
        for row in self._lines():
            chunk.append(row)
            if len(chunk) < round_lines:
                continue
            if self.max_batches is not None and produced >= self.max_batches:
                return
            yield self._parse(chunk[mine])
            produced += 1
            chunk = []

    def _lines(self, start: LinePosition = _FIRST_LINE) -> Iterator[tuple[str, str]]:
        """Every non-empty line from ``start`` on, with where it is (``path:line``) for error messages."""
        for index in range(start.file, len(self.paths)):
            path = self.paths[index]
            with path.open(encoding="utf-8") as f:
                first = 1
                if index == start.file:
                    f.seek(start.offset)
                    first = start.line + 1
                for number, line in enumerate(f, first):
                    if line.strip():
                        yield line, f"{path}:{number}"

    def _parse(self, rows: list[tuple[str, str]]) -> Batch:
        num_sparse = len(self.keys)
        labels = []
        dense = []
        ids: list[list[int]] = [[] for _ in range(num_sparse)]
        lengths: list[list[int]] = [[] for _ in range(num_sparse)]
        for line, where in rows:
            fields = line.rstrip("\n").split("\t")
            if len(fields) != 1 + NUM_DENSE + NUM_SPARSE:
                raise ValueError(
                    f"{where}: {len(fields)} tab-separated fields; a Criteo TSV line has "
                    f"{1 + NUM_DENSE + NUM_SPARSE} (label, {NUM_DENSE} integers, {NUM_SPARSE} hex ids)"
                )
            try:
                labels.append(int(fields[0] or 0))
                dense.append([math.log1p(max(int(x), 0)) if x else 0.0 for x in fields[1 : 1 + NUM_DENSE]])
                for j, x in enumerate(fields[1 + NUM_DENSE : 1 + NUM_DENSE + num_sparse]):
                    if x:
                        ids[j].append(int(x, 16) % self.num_embeddings)
                    lengths[j].append(1 if x else 0)
            except ValueError as e:
                raise ValueError(f"{where}: not a Criteo TSV line: {e}") from None
        return Batch(
            dense_features=torch.tensor(dense, dtype=torch.float32),
            sparse_features=KeyedJaggedTensor.from_lengths_sync(
                keys=self.keys,
                values=torch.tensor([i for per in ids for i in per], dtype=torch.long),
                lengths=torch.tensor([n for per in lengths for n in per], dtype=torch.int32),
            ),
            labels=torch.tensor(labels, dtype=torch.long),
        )


def write_sample_tsv(path: str | Path, lines: int, seed: int = 0) -> None:
    """Write ``lines`` random examples in Criteo's TSV format to ``path``: labels 0/1, counts from -2
    to 500, 8-digit hex ids, about one field in ten empty."""
    rng = random.Random(seed)
    rows = []
    for _ in range(lines):
        dense = [str(rng.randint(-2, 500)) if rng.random() > 0.1 else "" for _ in range(NUM_DENSE)]
        sparse = [f"{rng.getrandbits(32):08x}" if rng.random() > 0.1 else "" for _ in range(NUM_SPARSE)]
        rows.append("\t".join([str(rng.randint(0, 1)), *dense, *sparse]))
    Path(path).write_text("\n".join(rows) + "\n")


def with_latency(batches: Iterable[T], latency_s: float | LoaderWork) -> Iterator[T]:
    """Yield ``batches``, each ``latency_s`` seconds late (storage latency; sleeping frees the GIL),
    or after the per-batch work ``latency_s`` is (``loader_work.LoaderWork``: the k-th batch after
    ``work(k)``)."""
    work = as_work(latency_s)
    for k, batch in enumerate(batches):
        if work:
            work(k)
        yield batch


def poisoned(batch: Batch) -> Batch:
    """``batch`` with every dense feature NaN (its ids and labels as they were): a step that trains on
    it has a NaN loss and NaN gradients (``--poison-batch``)."""
    return Batch(
        dense_features=torch.full_like(batch.dense_features, math.nan),
        sparse_features=batch.sparse_features,
        labels=batch.labels,
    )


class EditedBatches:
    """``source``'s batches (``SyntheticCriteo`` or ``CriteoTsv``: ``len()``, ``batch(k)``, iterating)
    as one rank draws them: without batch ``drop`` of ``source`` (``--drop-batch``; the later ones
    move up by one), and with draw ``poison`` (0-based, counted after the drop) ``poisoned``
    (``--poison-batch``). Item ``k`` is decided by ``k`` alone, the same read by index or in order:
    the draws of a StatefulDataLoader (its workers), of the map source's parallel loads or of a
    pipeline running ahead get the same batches as the plain loop, and a resume the same ones again.
    """

    def __init__(
        self, source: SyntheticCriteo | CriteoTsv, *, drop: int | None = None, poison: int | None = None
    ) -> None:
        for name, value in (("drop", drop), ("poison", poison)):
            if value is not None and value < 0:
                raise ValueError(f"{name} must be a batch index >= 0, got {value}")
        self.source, self.drop, self.poison = source, drop, poison

    def __len__(self) -> int:
        n = len(self.source)
        return n - 1 if self.drop is not None and self.drop < n else n

    def batch(self, k: int) -> Batch:
        """The ``k``-th batch this rank draws."""
        if not 0 <= k < len(self):
            raise IndexError(f"batch {k} of {len(self)}")
        batch = self.source.batch(k + 1 if self.drop is not None and k >= self.drop else k)
        return poisoned(batch) if k == self.poison else batch

    def __iter__(self) -> Iterator[Batch]:
        k = 0
        for j, batch in enumerate(self.source):
            if j == self.drop:
                continue
            yield poisoned(batch) if k == self.poison else batch
            k += 1
