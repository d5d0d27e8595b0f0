"""The DLRM sizes the benchmarks, tools and harness train (``SIZES``) and each rank's synthetic
batches for them (``batches``): here, below the benchmarks, so that the harness needs nothing
from ``benchmarks/``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from examples.dlrm.data import SyntheticCriteo, with_latency
from examples.dlrm.loader_work import LoaderWork
from examples.dlrm.model import DlrmSize

SIZES: dict[str, DlrmSize] = {
    "small": DlrmSize(batch_size=128, num_embeddings=2_000, embedding_dim=16, dense_arch=(32,), over_arch=(32,)),
    "medium": DlrmSize(
        batch_size=512, num_embeddings=20_000, embedding_dim=32, dense_arch=(128, 64), over_arch=(128, 64)
    ),
    "large": DlrmSize(
        batch_size=1024, num_embeddings=50_000, embedding_dim=64, dense_arch=(256, 128), over_arch=(256, 128)
    ),
}

DISTINCT_BATCHES = 16
"""Synthetic batches generated per rank; later steps repeat them, so data generation stays out of the timings."""


def batches(
    size: DlrmSize, rank: int, num_batches: int, latency_s: float | LoaderWork = 0.0, seed: int = 1000
) -> Iterator[Any]:
    """This rank's synthetic batches for a benchmark (``DISTINCT_BATCHES`` distinct ones, repeated)."""
    data = SyntheticCriteo(
        batch_size=size.batch_size,
        num_batches=num_batches,
        num_embeddings=size.num_embeddings,
        num_sparse=size.num_sparse,
        rank=rank,
        seed=seed,
        distinct=DISTINCT_BATCHES,
    )
    return with_latency(data, latency_s)
