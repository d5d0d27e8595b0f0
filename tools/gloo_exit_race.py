"""Reproduce torch's gloo exit race (docs/clean_exit.md, "What aborts: captured").

Run on 2 ranks, many times, and count the runs whose output has "terminate called"::

    for i in $(seq 12); do
      python -m torch.distributed.run --standalone --nproc_per_node 2 tools/gloo_exit_race.py --keep --destroy \\
        2>&1 | grep -c "terminate called"
    done

Each rank does one all-reduce on a tensor made in Python (rank 1 ``--late-s`` later), deletes
the tensor and ends. With
``--keep`` the script holds the default group (as a model does: DDP and TorchRec's sharded
modules hold theirs), so ``--destroy`` (``dist.destroy_process_group()``) does not destroy it: a
gloo worker thread that drops the finished all-reduce after the interpreter's finalization began
needs the GIL for the tensor's Python object, and the process aborts with "terminate called
without an active exception". Measured with this script here: ``--keep --destroy`` 4 runs of 12 aborted,
``--destroy`` alone 0 of 8. ``ulimit -c unlimited`` in the launch folder leaves a core (the
kernel's ``core_pattern`` permitting): ``gdb -batch -ex "thread apply all bt" python core``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

KEPT: object = None  # what holds the group to the interpreter's exit with --keep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="hold the default group to the exit, as a model does")
    parser.add_argument("--destroy", action="store_true", help="call dist.destroy_process_group() before the end")
    parser.add_argument("--late-s", type=float, default=0.3, help="rank 1 comes to the all-reduce this much later")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        time.sleep(args.late_s)
    tensor = torch.ones(1 << 16)
    dist.all_reduce(tensor)
    del tensor
    global KEPT
    if args.keep:
        KEPT = dist.group.WORLD
    if args.destroy:
        dist.destroy_process_group()
    print("leaving", flush=True)


if __name__ == "__main__":
    main()
