"""What a loader does before each batch, as the loaders users have do it: the per-batch work of the
DLRM example (``--loader-kind``) and of the benchmarks (``benchmarks/overlap.py --loader``).

* ``sleep``: waits ``ms`` (a read from storage; sleeping releases the GIL, so threads overlap it
  perfectly: the kind most favourable to a thread-based engine).
* ``gil``: parses Criteo TSV rows in Python (split on tabs, dense counts log-transformed, hex ids
  hashed into the tables, the lists a KJT is built from): work that holds the GIL, so two
  threads doing it do not run in parallel and each takes the GIL from the training thread.
  Worker processes do run it in parallel.
* ``torch``: torch ops on the batch's ids (hash, sort, bucketize: the feature transforms a loader
  runs), which release the GIL inside each op and take it back between ops.
* ``tail``: waits a heavy-tailed time: lognormal with median ``ms`` and sigma ``TAIL_SIGMA``
  (p99 = 5.7x the median), drawn from ``(seed, rank, item)`` alone, so that every contender,
  thread or worker process that loads item ``k`` waits the same.

``gil`` and ``torch`` are calibrated once per process (``calibrate``): the number of rows parsed
(or op rounds) per batch that takes ``ms`` on this machine when nothing else runs. The count, not
the time, is then fixed for every contender: on a busy machine the same work takes longer, as
it would for a user. The work's result is thrown away: every contender trains on the same
batches, so the losses stay comparable.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

#: the kinds of per-batch work, in the order the docs list them
KINDS = ("sleep", "gil", "torch", "tail")
#: the tail's lognormal sigma: p99 / median = exp(2.326 * sigma) = 5.7
TAIL_SIGMA = 0.75
#: rows of the TSV text the ``gil`` kind parses (cycled), and ids per ``torch`` round
_ROWS, _IDS = 512, 4096


@dataclass(frozen=True)
class LoaderWork:
    """Per-batch work of kind ``kind`` (``KINDS``) sized ``ms``: ``work(k)`` does it for item
    ``k``. ``units``: rows parsed (``gil``) or op rounds (``torch``) per batch, from ``calibrate``;
    ``seed``, ``rank``: the tail's draws. Picklable: a DataLoader's workers get it as it is."""

    kind: str = "sleep"
    ms: float = 0.0
    units: int = 0
    seed: int = 0
    rank: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"loader kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if not (self.ms >= 0 and math.isfinite(self.ms)):
            raise ValueError(f"loader work must be >= 0 ms, got {self.ms}")
        if self.kind in ("gil", "torch") and self.ms > 0 and self.units < 1:
            raise ValueError(f"loader kind {self.kind!r} needs its units per batch: make it with calibrate()")

    def __bool__(self) -> bool:
        return self.ms > 0

    def tail_s(self, k: int) -> float:
        """Item ``k``'s wait under ``tail`` (seconds): the same for every draw of ``k``."""
        z = random.Random(f"{self.seed}:{self.rank}:{k}").gauss(0.0, 1.0)
        return self.ms / 1e3 * math.exp(TAIL_SIGMA * z)

    def __call__(self, k: int) -> None:
        if not self.ms:
            return
        if self.kind == "sleep":
            time.sleep(self.ms / 1e3)
        elif self.kind == "tail":
            time.sleep(self.tail_s(k))
        elif self.kind == "gil":
            parse_rows(self.units, k)
        else:
            torch_rounds(self.units, k)

    def describe(self) -> str:
        """One phrase for reports, e.g. ``"gil 10 ms (1,840 rows parsed)"``."""
        extra = {"gil": f" ({self.units:,} rows parsed)", "torch": f" ({self.units:,} op rounds)"}
        tail = f" (lognormal, median; p99 {math.exp(2.326 * TAIL_SIGMA):.1f}x)" if self.kind == "tail" else ""
        return f"{self.kind} {self.ms:g} ms" + extra.get(self.kind, "") + tail


def as_work(latency: float | LoaderWork) -> LoaderWork:
    """``latency`` as work: seconds of sleep for a number (what ``--loader-latency-ms`` always
    meant), the work itself otherwise."""
    if isinstance(latency, LoaderWork):
        return latency
    if latency < 0:
        raise ValueError(f"latency must be >= 0, got {latency}")
    return LoaderWork("sleep", 1e3 * latency)


def _tsv_rows() -> list[str]:
    """``_ROWS`` lines in Criteo's format (label, 13 counts, 26 hex ids; some fields empty)."""
    rng = random.Random(7)
    rows = []
    for _ in range(_ROWS):
        dense = ["" if rng.random() < 0.1 else str(rng.randrange(1000)) for _ in range(13)]
        sparse = ["" if rng.random() < 0.05 else f"{rng.getrandbits(32):08x}" for _ in range(26)]
        rows.append("\t".join([str(rng.randrange(2)), *dense, *sparse]))
    return rows


_TEXT = _tsv_rows()


def parse_rows(n: int, k: int, num_embeddings: int = 100_000) -> int:
    """Parse ``n`` rows of Criteo TSV (starting at row ``k * n`` of the cycled text) into the lists
    a batch is built from: dense values, ids, lengths, labels. Pure Python, holding the GIL; the
    number of ids parsed."""
    labels: list[int] = []
    dense: list[list[float]] = []
    values: list[int] = []
    lengths: list[int] = []
    start = k * n
    for i in range(start, start + n):
        fields = _TEXT[i % _ROWS].split("\t")
        labels.append(int(fields[0]))
        dense.append([math.log1p(max(int(x), 0)) if x else 0.0 for x in fields[1:14]])
        for x in fields[14:]:
            if x:
                values.append(int(x, 16) % num_embeddings)
                lengths.append(1)
            else:
                lengths.append(0)
    return len(values)


def torch_rounds(n: int, k: int) -> int:
    """``n`` rounds of the torch ops a loader's feature transforms run on ``_IDS`` ids (hash,
    sort, bucketize against fixed boundaries); each op releases the GIL while it runs. A checksum."""
    import torch

    g = torch.Generator().manual_seed(k)
    ids = torch.randint(0, 2**31 - 1, (_IDS,), generator=g)
    boundaries = torch.arange(0, 1_000_003, 1_000_003 // 64)
    total = 0
    for _ in range(n):
        hashed = ids.mul(2654435761).remainder(1_000_003)
        ordered, _order = torch.sort(hashed)
        total += int(torch.bucketize(ordered, boundaries).sum())
    return total


def calibrate(kind: str, ms: float, *, seed: int = 0, rank: int = 0, trials: int = 5) -> LoaderWork:
    """``kind`` work of ``ms`` per batch on this machine: for ``gil`` and ``torch`` the units whose
    fastest of ``trials`` timings (nothing else running) takes ``ms``; the others need none."""
    if kind not in ("gil", "torch") or not ms:
        return LoaderWork(kind, ms, 0, seed, rank)
    unit = parse_rows if kind == "gil" else torch_rounds
    probe = 64 if kind == "gil" else 4
    unit(probe, 0)  # first-call costs (imports, allocations) out of the timing
    best = math.inf
    for t in range(trials):
        start = time.perf_counter()
        unit(probe, t)
        best = min(best, time.perf_counter() - start)
    units = max(1, round(ms / 1e3 / (best / probe)))
    return LoaderWork(kind, ms, units, seed, rank)
