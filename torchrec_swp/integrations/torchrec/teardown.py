"""What a pipeline shuts down before the interpreter's teardown: ``Teardown``.

A pipeline runs on its engine's worker threads and may make process groups of its own
(``new_group``: the input dist's with ``input_dist_group=True`` or when ``autotune`` gives it one;
the exhaustion sync's with ``sync_dataloader_exhaustion=True``). Both must end while the
interpreter is whole: once its finalization has begun, a daemon thread that comes back from
native code to take the GIL is ended by ``pthread_exit``, and a C++ frame on its way out
(a noexcept destructor) turns that unwind into ``std::terminate`` ("terminate called without an
active exception", SIGABRT); and a process group destroyed by the interpreter's last garbage
collection tears its native threads down in whatever order its Python references happen to go.

The order (what gloo and NCCL need):

1. the engines' threads: interrupted where they wait and joined, one inside a task (a draw)
   once the task returned (``walkers.stop_workers``; a thread may be inside a collective on one
   of the groups below: the group must outlive it);
2. the input dists moved back to the group they had (the model outlives its pipeline: a later
   pipeline or an evaluation on it must not find its input dists on a destroyed group);
3. the groups the pipeline made, newest first, with ``destroy_process_group(group)``; a group
   torch.distributed no longer knows (``destroy_process_group()`` already shut every group down)
   is left alone. The default group is the user's: never touched.

When, whichever comes first, once: ``close()``; the pipeline's collection by the garbage
collector; and, for a pipeline never closed, at exit: a ``weakref.finalize`` runs from ``atexit``,
before the interpreter's finalization begins (every thread can still take the GIL there).

Only in the process that made the groups. A forked child (a DataLoader's worker) inherits the
parent's objects but none of its threads: a gloo group whose destructor runs there waits for the
worker threads of the parent's copy, which the child does not have, and the child hangs before it
serves a single batch (``ProcessGroupGloo::~ProcessGroupGloo`` in ``pthread_cond_broadcast``, the
child's garbage collector having freed a dropped pipeline's cycle; found with py-spy and gdb on
``tests/dist/test_checkpoint_resume.py``, issue 46). So every group a pipeline makes stays held
here (``_HELD``) until the teardown destroys it in the process that made it: a child's garbage
collector can drop the pipeline's own references, never the last one, and a child never tears
down (its ``weakref.finalize`` does nothing there).

TorchRec/torch private name relied on: ``torch.distributed.distributed_c10d._world.pg_map``
(the groups torch.distributed knows), to tell a group already destroyed.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

Stop = Callable[[], Any]

#: id -> every process group a pipeline made and has not destroyed yet (module docstring: the last
#: reference, so that no forked child's garbage collector destroys one). The finalizer's own list
#: is not enough: a finalizer that ran (in a child too, where it returns at once) drops its arguments.
_HELD: dict[int, dist.ProcessGroup] = {}


class Teardown:
    """What ``owner`` (a pipeline) shuts down, in the module docstring's order, once: on ``()``,
    when ``owner`` is collected, or at exit. Holds nothing that holds ``owner``."""

    def __init__(self, owner: object) -> None:
        self._stops: list[Stop] = []
        self._groups: list[tuple[dist.ProcessGroup, Stop | None]] = []
        self._finalizer = weakref.finalize(owner, _tear_down, self._stops, self._groups, os.getpid())

    def threads(self, stop: Stop) -> None:
        """Stop threads with ``stop()`` (an engine's ``stop_threads``: idempotent, not holding the engine)."""
        self._stops.append(stop)

    def group(self, group: dist.ProcessGroup, undo: Stop | None = None) -> None:
        """Destroy ``group`` (made by the owner), after ``undo()`` moved whatever uses it back;
        held until then (``_HELD``)."""
        _HELD[id(group)] = group
        self._groups.append((group, undo))

    def __call__(self) -> None:
        self._finalizer()

    @property
    def done(self) -> bool:
        """Whether it ran (by a call, the owner's collection or at exit)."""
        return not self._finalizer.alive


def known(group: dist.ProcessGroup) -> bool:
    """Whether torch.distributed still knows ``group`` (not destroyed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return group in dist.distributed_c10d._world.pg_map


def _tear_down(stops: list[Stop], groups: list[tuple[dist.ProcessGroup, Stop | None]], pid: int) -> None:
    if os.getpid() != pid:  # a forked child: the threads and groups are the parent's
        return
    for stop in reversed(stops):
        stop()
    stops.clear()
    while groups:
        group, undo = groups.pop()
        if undo is not None:
            undo()
        if known(group):
            dist.destroy_process_group(group)
        _HELD.pop(id(group), None)
