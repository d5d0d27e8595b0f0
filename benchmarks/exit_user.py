"""A user's short 2-rank training script, as users write it: the body that ``exit_counts.py`` counts
the exits of.

    torchrun --standalone --nproc_per_node 2 benchmarks/exit_user.py --pattern ours-default

A tiny sharded model (``harness.parity.build_model``: TorchRec's TestSparseNN in a DMP on the
default gloo group), batches through ``progress()``, a line with the last loss, then what the
pattern says: ``close()`` or not, ``destroy_process_group()`` (not with ``--no-destroy``), and a
normal return: no ``gc.collect()``, no ``os._exit``. The pipeline, its model and whatever they
hold live on until the interpreter's own finalization, as in a user's script whose pipeline is a
module global or sits in a cycle.

Patterns (``PATTERNS``, one ``Pattern`` row each):

* ``ours-*`` / ``up-*`` over ``STEPS`` in-memory batches until StopIteration, never closed: the
  pipeline is torchrec_swp's TrainPipelineSparseDist (the default plan; ``loads=2``; ``io``
  thread and lookahead 2; GradientAccumulationWrapper; ``autotune``) or upstream's (plain;
  upstream's GradientAccumulationWrapper).
* the loader grid (issue 46): ``ours-{io,main}-loads{1,2}-lookahead{0,2}`` with ``-close`` or
  without, and ``up-sleep`` / ``up-sleep-close``: a loader that sleeps ``LOADER_SLEEP_S`` before
  each batch, ``STOP_AT`` steps out of ``DATA`` batches (the pipeline is stopped while the data
  has more, its threads may be inside a draw), then ``close()`` (``-close``; upstream's pipeline
  has none: nothing) and ``destroy_process_group()``. ``ours-io-loads2-lookahead2-close`` is
  the user's configuration of issue 46; ``ours-io-loads2-lookahead2-close-stall`` the same with one
  draw of the lookahead's stalling ``STALL_S`` (a thread of ours inside a draw when ``close()``
  is called).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
#: the loader grid's: each batch's draw sleeps this long, and the script stops after STOP_AT steps of DATA
LOADER_SLEEP_S = 0.008
STOP_AT = 40
DATA = 60
#: ``-stall`` patterns: the draw of item STALL_AT (0-based; one the lookahead draws while the last
#: steps run) works this long, in torch ops (a loader opening its next shard): past the 5 s that
#: close() used to wait for a thread inside a draw
STALL_AT = STOP_AT + 2
STALL_S = 6.0
CPU = torch.device("cpu")
TUNE = torchrec_swp.Autotune(warmup=2, steps=4, verify=2, rounds=1, report=None)


#: how a script builds its pipeline from the model and its optimizer
Build = Callable[[torch.nn.Module, torch.optim.Optimizer], Any]


def _ours(**options: Any) -> Build:
    return lambda m, o: torchrec_swp.TrainPipelineSparseDist(m, o, CPU, **options)


def _wrapped(inner: Callable[..., Any], wrapper: type) -> Build:
    return lambda m, o: wrapper(inner(m, o), o, m, GradientAccumulationConfig(num_steps=3))


def _upstream(m: torch.nn.Module, o: torch.optim.Optimizer) -> Any:
    return upstream.TrainPipelineSparseDist(m, o, CPU)


@dataclass(frozen=True)
class Pattern:
    """How one pattern's script runs: ``build`` makes the pipeline from the model and its optimizer;
    ``stop_at`` steps at most (None: until StopIteration) out of ``data`` batches, each drawn after
    ``sleep_s``, item ``STALL_AT``'s after ``stall_s`` more; ``close``: the script calls the
    pipeline's ``close()`` (where it has one) after training."""

    build: Build
    data: int = STEPS
    stop_at: int | None = None
    sleep_s: float = 0.0
    close: bool = False
    stall_s: float = 0.0


def _grid() -> dict[str, Pattern]:
    """The loader grid (module docstring): every combination of the overlap options, with and
    without ``close()``, and upstream's pipeline over the same loader."""
    rows = {}
    for close in (False, True):
        tail = "-close" if close else ""
        for io in (True, False):
            for loads in (1, 2):
                for lookahead in (0, 2):
                    options: dict[str, Any] = {"loads": loads, "lookahead": lookahead}
                    if io:
                        options["thread_map"] = "io"
                    name = f"ours-{'io' if io else 'main'}-loads{loads}-lookahead{lookahead}{tail}"
                    rows[name] = Pattern(_ours(**options), DATA, STOP_AT, LOADER_SLEEP_S, close)
        rows[f"up-sleep{tail}"] = Pattern(_upstream, DATA, STOP_AT, LOADER_SLEEP_S, close)
    user = rows["ours-io-loads2-lookahead2-close"]
    rows["ours-io-loads2-lookahead2-close-stall"] = Pattern(user.build, DATA, STOP_AT, LOADER_SLEEP_S, True, STALL_S)
    return rows


#: pattern -> how its script runs
PATTERNS: dict[str, Pattern] = {
    "ours-default": Pattern(_ours()),
    "ours-loads2": Pattern(_ours(loads=2)),
    "ours-io-lookahead": Pattern(_ours(thread_map="io", lookahead=2)),
    "ours-wrapper": Pattern(_wrapped(_ours(), torchrec_swp.GradientAccumulationWrapper)),
    "ours-autotune": Pattern(_ours(autotune=TUNE)),
    "up-default": Pattern(_upstream),
    "up-wrapper": Pattern(_wrapped(_upstream, UpstreamWrapper)),
    **_grid(),
}


class SleepyLoader:
    """A user's loader: each batch comes after ``sleep_s`` (reading, decoding: the GIL released);
    item ``STALL_AT`` after ``stall_s`` more of torch ops (each leaves and re-takes the GIL)."""

    def __init__(self, batches: list[Any], sleep_s: float, stall_s: float = 0.0) -> None:
        self._batches: Iterator[Any] = iter(batches)
        self._sleep_s, self._stall_s, self._drawn = sleep_s, stall_s, 0

    def __iter__(self) -> SleepyLoader:
        return self

    def __next__(self) -> Any:
        if self._sleep_s:
            time.sleep(self._sleep_s)
        if self._stall_s and self._drawn == STALL_AT:
            a, end = torch.ones(64, 64), time.monotonic() + self._stall_s
            while time.monotonic() < end:
                a = (a @ a).clamp_(max=1.0)
        self._drawn += 1
        return next(self._batches)


def train(name: str, steps: int | None = None) -> Any:
    """The script's body on this rank (the default process group initialized): train with pattern
    ``name``'s pipeline (``steps`` batches of data instead of the pattern's, if given), print the
    last loss, close the pipeline where the pattern says so; returns the pipeline (the caller keeps
    it, as a script's global would be kept)."""
    pattern = PATTERNS[name]
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build_model(rank, world, seed=0)
    pipeline = pattern.build(model, optimizer)
    data = pattern.data if steps is None else steps
    batches = SleepyLoader(make_batches(rank, world, data, seed=1), pattern.sleep_s, pattern.stall_s)
    loss, trained = None, 0
    while pattern.stop_at is None or trained < pattern.stop_at:
        try:
            loss = pipeline.progress(batches)[0]
        except StopIteration:
            break
        trained += 1
    print(f"rank {rank}: {name} trained {trained} batches, last loss {float(loss):.6f}", flush=True)
    close = getattr(pipeline, "close", None)
    if pattern.close and close is not None:
        close()
    return pipeline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pattern", choices=sorted(PATTERNS), default="ours-default")
    parser.add_argument("--steps", type=int, default=None, help="batches of data (default: the pattern's)")
    parser.add_argument(
        "--no-destroy", action="store_true", help="leave without destroy_process_group(), as many scripts do"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo")
    global _PIPELINE  # a script's pipeline lives to the interpreter's exit (closed only where the pattern says)
    _PIPELINE = train(args.pattern, args.steps)
    if not args.no_destroy:
        dist.destroy_process_group()
    return 0


_PIPELINE: Any = None

if __name__ == "__main__":
    sys.exit(main())
