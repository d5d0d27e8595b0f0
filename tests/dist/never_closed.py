"""A rank of a 2-rank script that never closes its pipeline nor destroys a process group, and
reports, from its last exit hook, what the pipeline's own exit hook left (``test_clean_exit``).

Its check is registered with ``atexit`` before anything is imported, so it runs after every
hook registered later (``atexit`` runs the newest first), the pipeline's among them
(``weakref.finalize``'s), and before the interpreter's finalization: it prints one line,
``exit check: {...}``, with whether the interpreter is finalizing, whether the pipeline's teardown
ran, the engine's threads still alive, and whether torch.distributed still knows the groups the
pipeline made and the default group.
"""

from __future__ import annotations

import atexit
import sys
from typing import Any

_SEEN: dict[str, Any] = {}


def _exit_check() -> None:
    import torch.distributed as dist

    from torchrec_swp.integrations.torchrec.teardown import known

    pipeline = _SEEN["pipeline"]
    report = {
        "finalizing": sys.is_finalizing(),
        "teardown_done": pipeline._swp_teardown().done,
        "threads_alive": sorted(t.name for t in _SEEN["threads"] if t.is_alive()),
        "made_groups_known": [known(g) for g in _SEEN["groups"]],
        "default_group_known": dist.is_initialized() and known(dist.group.WORLD),
    }
    print(f"exit check: {report}", flush=True)


atexit.register(_exit_check)  # first registered: runs last among the exit hooks

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torchrec_swp  # noqa: E402
from harness.parity import build_model, make_batches  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optimizer = build_model(rank, 2, seed=0)
    pipeline = torchrec_swp.TrainPipelineSparseDist(
        model, optimizer, torch.device("cpu"), loads=2, input_dist_group=True, sync_dataloader_exhaustion=True
    )
    batches = iter(make_batches(rank, 2, 8, seed=1))
    trained = 0
    while True:
        try:
            pipeline.progress(batches)
        except StopIteration:
            break
        trained += 1
    engine = pipeline.engine
    _SEEN.update(
        pipeline=pipeline,
        threads=list(engine.worker_threads),
        groups=[pipeline._swp_input_dist_group, engine.exhaustion.group],
    )
    print(f"rank {rank}: trained {trained}, threads {sorted(t.name for t in engine.worker_threads)}", flush=True)


if __name__ == "__main__":
    main()
