"""A user's short 2-rank training script, as users write it: the body that ``exit_counts.py`` counts
the exits of.

    torchrun --standalone --nproc_per_node 2 benchmarks/exit_user.py --pattern ours-default

A tiny sharded model (``harness.parity.build_model``: TorchRec's TestSparseNN in a DMP on the
default gloo group), ``STEPS`` batches through ``progress()`` until StopIteration, a line with the
last loss, ``destroy_process_group()`` (not with ``--no-destroy``) and a normal return: no
``close()``, no ``gc.collect()``, no ``os._exit``. The pipeline, its model and whatever they hold
live on until the interpreter's own finalization, as in a user's script whose pipeline is a
module global or sits in a cycle.

Patterns (``PATTERNS``): ``ours-*`` build torchrec_swp's TrainPipelineSparseDist (the default
plan; ``loads=2``; ``io`` thread and lookahead 2; GradientAccumulationWrapper; ``autotune``),
``up-*`` upstream's (plain; upstream's GradientAccumulationWrapper).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torchrec.distributed.train_pipeline.train_pipelines as upstream
from torchrec.distributed.train_pipeline.gradient_accumulation import (
    GradientAccumulationConfig,
)
from torchrec.distributed.train_pipeline.gradient_accumulation import (
    GradientAccumulationWrapper as UpstreamWrapper,
)

import torchrec_swp
from harness.parity import build_model, make_batches

STEPS = 20
CPU = torch.device("cpu")
TUNE = torchrec_swp.Autotune(warmup=2, steps=4, verify=2, rounds=1, report=None)


def _ours(**options: Any) -> Callable[[torch.nn.Module, torch.optim.Optimizer], Any]:
    return lambda m, o: torchrec_swp.TrainPipelineSparseDist(m, o, CPU, **options)


def _wrapped(inner: Callable[..., Any], wrapper: type) -> Callable[[torch.nn.Module, torch.optim.Optimizer], Any]:
    return lambda m, o: wrapper(inner(m, o), o, m, GradientAccumulationConfig(num_steps=3))


def _upstream(m: torch.nn.Module, o: torch.optim.Optimizer) -> Any:
    return upstream.TrainPipelineSparseDist(m, o, CPU)


#: pattern -> how the script builds its pipeline from the model and its optimizer
PATTERNS: dict[str, Callable[[torch.nn.Module, torch.optim.Optimizer], Any]] = {
    "ours-default": _ours(),
    "ours-loads2": _ours(loads=2),
    "ours-io-lookahead": _ours(thread_map="io", lookahead=2),
    "ours-wrapper": _wrapped(_ours(), torchrec_swp.GradientAccumulationWrapper),
    "ours-autotune": _ours(autotune=TUNE),
    "up-default": _upstream,
    "up-wrapper": _wrapped(_upstream, UpstreamWrapper),
}


def train(pattern: str, steps: int = STEPS) -> Any:
    """The script's body on this rank (the default process group initialized): train ``steps``
    batches with ``pattern``'s pipeline, print the last loss; returns the pipeline (the caller keeps
    it, as a script's global would be kept)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build_model(rank, world, seed=0)
    pipeline = PATTERNS[pattern](model, optimizer)
    batches = iter(make_batches(rank, world, steps, seed=1))
    loss, trained = None, 0
    while True:
        try:
            loss = pipeline.progress(batches)[0]
        except StopIteration:
            break
        trained += 1
    print(f"rank {rank}: {pattern} trained {trained} batches, last loss {float(loss):.6f}", flush=True)
    return pipeline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pattern", choices=sorted(PATTERNS), default="ours-default")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument(
        "--no-destroy", action="store_true", help="leave without destroy_process_group(), as many scripts do"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo")
    global _PIPELINE  # a script's pipeline lives to the interpreter's exit, never closed
    _PIPELINE = train(args.pattern, args.steps)
    if not args.no_destroy:
        dist.destroy_process_group()
    return 0


_PIPELINE: Any = None

if __name__ == "__main__":
    sys.exit(main())
