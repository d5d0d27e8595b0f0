"""What recording data positions costs per step (checkpoints that lose no batch).

With an iterator that has ``state_dict()`` the source records the iterator's state before every
draw (``torchrec_swp.engine.source.Draws``), so that a checkpoint can cut at the first batch not
yet trained. This times that call - ``state_dict()`` of a torchdata StatefulDataLoader iterator
over the DLRM example's batches, with 0 and 2 worker processes - against drawing the batch itself
(``next()``), interleaved, and prints the cost per step in microseconds. An iterator without
``state_dict()`` (``benchmarks/compare.py``'s, plain DataLoaders, lists) records nothing.

    .venv/bin/python benchmarks/positions.py [--steps 400]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.dlrm.data import SyntheticCriteo  # noqa: E402
from examples.dlrm.loader import SyntheticBatches, make_loader, shutdown_workers  # noqa: E402


def measure(workers: int, steps: int) -> tuple[float, float]:
    """Median microseconds of ``state_dict()`` and of ``next()`` over ``steps`` batches."""
    synthetic = SyntheticCriteo(batch_size=512, num_batches=steps + 10, num_embeddings=100_000, distinct=8)
    it = iter(make_loader(SyntheticBatches(synthetic), num_workers=workers))
    for _ in range(5):  # workers started, caches warm
        next(it)
    record, draw = [], []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            it.state_dict()
            t1 = time.perf_counter()
            next(it)
            t2 = time.perf_counter()
            record.append(t1 - t0)
            draw.append(t2 - t1)
    finally:
        shutdown_workers(it)
    return 1e6 * statistics.median(record), 1e6 * statistics.median(draw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    print(f"{'loader':<32} {'state_dict() us':>16} {'next() us':>10}")
    for workers in (0, 2):
        rec, draw = measure(workers, args.steps)
        print(f"{f'StatefulDataLoader, {workers} workers':<32} {rec:>16.1f} {draw:>10.1f}")


if __name__ == "__main__":
    main()
