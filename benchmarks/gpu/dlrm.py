"""The DLRM example on a CUDA device, for parts (c) and (d): model, pinned batches, runners.

``examples/dlrm`` runs on the CPU (``make_runner`` passes the CPU to the pipelines); this module
builds the same model on a given device (``build_dlrm(..., device=)``) and runs it there.
Upstream's pipelines run as shipped here (no CPU patch), ours with an optional thread map.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from examples.dlrm.model import DlrmSize, build_dlrm
from harness.dlrm_data import DISTINCT_BATCHES, batches

GPU_SIZE = DlrmSize(
    batch_size=8192, num_embeddings=100_000, embedding_dim=64, dense_arch=(512, 256), over_arch=(512, 256)
)
"""A DLRM that gives an H100 milliseconds of work per step (the CPU sizes give it microseconds)."""

LOOKAHEAD = 3
"""Batches loaded beyond the last step taken, so that no measured step drains the pipeline."""

TIMED_PIPELINES = (
    "TrainPipelineSparseDist",
    "TrainPipelineFusedSparseDist",
    "TrainPipelineSemiSync",
    "PrefetchTrainPipelineSparseDist",
)


def build_dlrm_on(
    device: torch.device, rank: int, world_size: int, size: DlrmSize, *, seed: int = 0
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``examples.dlrm.model.build_dlrm`` sharded onto ``device``."""
    return build_dlrm(rank, world_size, size, seed=seed, device=device)


def pinned_batches(size: DlrmSize, rank: int, num_batches: int, *, seed: int = 1000, pin: bool = True) -> Iterator[Any]:
    """``num_batches`` synthetic batches in pinned host memory (``DISTINCT_BATCHES`` distinct ones,
    repeated), so that the pipelines' non-blocking copies are asynchronous, as with a DataLoader
    that pins memory (``pin=False``: plain memory, for a CPU run)."""
    data = batches(size, rank, DISTINCT_BATCHES, seed=seed)
    distinct = [batch.pin_memory() if pin else batch for batch in data]
    return (distinct[k % len(distinct)] for k in range(num_batches))


def make_gpu_runner(
    name: str, impl: str, device: torch.device, rank: int, world_size: int, size: DlrmSize, *, thread_map: Any = None
) -> Any:
    """A ``harness.dlrm.Runner`` of pipeline ``name`` (a train pipeline) on ``device``."""
    import torchrec.distributed.train_pipeline.train_pipelines as upstream

    import torchrec_swp
    from harness.dlrm import INFO, Runner

    info = INFO[name]
    if info.kind != "train" or info.compiles:
        raise ValueError(f"{name}: only the eager train pipelines are timed on the GPU")
    model, optimizer = build_dlrm_on(device, rank, world_size, size)
    engine = {"thread_map": thread_map} if thread_map is not None else {}
    if impl == "upstream":
        if engine:
            raise ValueError("a thread_map applies to our pipelines only")
        pipeline = getattr(upstream, name)(model, optimizer, device, **info.options)
    else:
        pipeline = getattr(torchrec_swp, name)(model, optimizer, device, **info.options, **engine)
    return Runner(info, impl, pipeline, model, optimizer, contextlib.ExitStack())  # type: ignore[arg-type]
