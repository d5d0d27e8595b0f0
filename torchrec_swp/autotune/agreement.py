"""The ranks agree: every rank's profile to rank 0, rank 0's decision to every rank.

Both are collectives of ``torch.distributed`` on the default process group (object collectives:
pickled dicts), issued by the calling thread inside a ``progress()`` call, at the same call on
every rank, while no thread of the engine issues a collective (the tuner switches plans only
where every thread stands at the same batch boundary, with no lookahead). Without an initialised
world, or in a world of one, they return the rank's own values. While the search runs in the
background, rank 0 says every few calls whether it has ended (``code_from_rank0``) on a gloo group of
the tuner's own: the engine's threads never issue a collective there, so the running plan need
not stand still for it.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    """``(rank, world size)``: ``(0, 1)`` without an initialised world."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def machine() -> tuple[str, int]:
    """This process's host name and the cores it may run on."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return socket.gethostname(), cores


def gather_to_all(value: Any) -> list[Any]:
    """Every rank's ``value``, by rank (on every rank)."""
    rank, size = world()
    if size == 1:
        return [value]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, value)
    return out


def from_rank0(value: Any, group: Any = None) -> Any:
    """Rank 0's ``value``, on every rank (over ``group``: the default one where None)."""
    rank, size = world()
    if size == 1:
        return value
    box = [value if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def code_from_rank0(code: int, group: Any) -> int:
    """Rank 0's ``code`` (0-255), on every rank, over ``group`` (a gloo group: one byte on the CPU)."""
    if not 0 <= code <= 255:
        raise ValueError(f"code_from_rank0: a code is one byte (0-255), got {code!r}")
    if world()[1] == 1:
        return code
    box = torch.tensor([code], dtype=torch.uint8)
    dist.broadcast(box, src=0, group=group)
    return int(box.item())
