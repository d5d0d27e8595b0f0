"""A process group of its own for the sparse input dist: a twin of the model's group, same ranks.

How one batch's input dist flows, in TorchRec 1.8 and 1.9 alike: ``start_sparse_data_dist``
calls ``input_dist`` on every pipelined sharded module; each module splits its features by
sharding and hands each part to one of its ``_input_dists`` (``TwSparseFeaturesDist``,
``RwSparseFeaturesDist``, ``TwRwSparseFeaturesDist``, ...). Every one of them that talks to other
ranks does it through its ``_dist``, a ``KJTAllToAll`` whose ``_pg`` is the group of both of the
batch's input-dist collectives: the splits all-to-all (issued at once) and the tensors
all-to-all (issued by ``wait_sparse_data_dist``, from the splits awaitable, which carries the
same group). After the first input dist, upstream's ``_override_input_dist_forwards`` wraps each
``KJTAllToAll`` in a ``KJTAllToAllForward`` built from that same ``_pg``, so that the splits of
all modules go in one fused all-to-all per group (``fused_splits_awaitables``).

So one attribute decides where the input dist talks: ``KJTAllToAll._pg``. ``rebind_input_dists``
sets it to another group over the same ranks (in the same order), and nothing else: the output
dists (their own ``PooledEmbeddingsAllToAll`` / ``ReduceScatter`` objects, built when the module
is sharded), the embedding lookups, DDP and any module that is not pipelined keep the model's
group. TorchRec creates the input dists lazily, inside the first ``input_dist`` call, which also
issues that batch's collectives; rebinding therefore happens right after that first call, and
the first batch's input dist (the model's first collectives of all) runs on the model's group.

TorchRec private names relied on, identical in 1.8.0 and 1.9.2 (the same ones upstream's own
``train_pipeline.utils._override_input_dist_forwards`` walks):

* ``ShardedModule.named_modules()`` children with ``_input_dists`` (sharded EBC / EC, the
  managed-collision collection) and ``_has_uninitialized_input_dist`` (still ``True`` before the
  first ``input_dist``);
* ``input_dist._dist``: a ``torchrec.distributed.dist_data.KJTAllToAll`` where present (data
  parallel input dists have none), and its ``_pg``;
* ``KJTAllToAllForward._pg`` (``train_pipeline.runtime_forwards``), the fused-splits wrapper, set
  as the instance attribute ``forward`` of the ``KJTAllToAll``: rebound too when rebinding after
  upstream installed it.

Cost: one more process group per pipeline built with it (gloo: one more set of TCP pairs and
buffers per rank; NCCL: a second communicator with its own device memory and streams).

Limits:

* the group must span the ranks of the group the input dists use, in the same order: with 2D
  sharding (``ShardingEnv2D``) that is a sharding subgroup, which differs per rank; the default
  twin of the default group is refused there (ValueError naming the input dist) and each rank
  must pass a twin of its own subgroup;
* only ``_input_dists`` move: collectives TorchRec issues elsewhere inside ``input_dist`` stay on
  the model's group (the managed-collision collection's ``_write_input_dists`` for 2D weights,
  created on the first such batch), and their task, in comm group ``input_dist``, would then
  order them against nothing else on that group: do not use the option with such modules;
* the rebinding stays on the model: after ``detach()``, or in another pipeline, its input dists
  keep the group (correct whatever the plan, as long as that plan does not give the input dist
  a comm group of its own without the option);
* with NCCL, the two communicators' kernels are launched from two threads in an order that may
  differ between ranks; NCCL documents that concurrent operations on several communicators of
  one device need care (they can deadlock if a device cannot run them side by side). Only gloo is
  tested here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch.distributed as dist
from torch import nn
from torchrec.distributed.dist_data import KJTAllToAll
from torchrec.distributed.train_pipeline.runtime_forwards import KJTAllToAllForward

__all__ = ["input_dist_all_to_alls", "new_input_dist_group", "rebind_input_dists", "restore_input_dists"]


def _require_world(where: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{where}: the input dist group needs a distributed world; call "
            "torch.distributed.init_process_group() before building the pipeline"
        )


def new_input_dist_group(
    group: dist.ProcessGroup | None = None, *, where: str = "input_dist_group"
) -> dist.ProcessGroup:
    """A new process group over the ranks of ``group`` (default: the default group), in the same
    order and with the same backend: ``torch.distributed.new_group(ranks, backend)``.

    Collective like ``new_group`` itself: every rank of the default group must call it, in the
    same order. Raises RuntimeError (naming ``where``) when no distributed world is initialised.
    """
    _require_world(where)
    base = group if group is not None else dist.group.WORLD
    # (cast: new_group's NON_GROUP_MEMBER is for a rank outside ``ranks``; callers pass a group of this rank's)
    return cast(
        dist.ProcessGroup, dist.new_group(ranks=dist.get_process_group_ranks(base), backend=dist.get_backend(base))
    )


def input_dist_all_to_alls(modules: Iterable[nn.Module]) -> list[tuple[str, KJTAllToAll]]:
    """The ``KJTAllToAll`` of every input dist of ``modules`` (the pipelined sharded modules), as
    ``(where, module)`` with ``where`` = ``"<module index>.<child fqn>._input_dists[<i>]"``.

    Raises RuntimeError when a module has not created its input dists yet (TorchRec creates
    them in the first ``input_dist`` call) and TypeError when an input dist's ``_dist`` is not a
    ``KJTAllToAll`` (a case upstream's fused-splits override rejects too).
    """
    found: list[tuple[str, KJTAllToAll]] = []
    for index, module in enumerate(modules):
        for fqn, child in module.named_modules():
            where = f"{index}.{fqn}" if fqn else str(index)
            if getattr(child, "_has_uninitialized_input_dist", False):
                raise RuntimeError(
                    f"{where} ({type(child).__name__}) has not created its input dists yet: rebind them "
                    "after the first input_dist call"
                )
            for i, input_dist in enumerate(getattr(child, "_input_dists", ())):
                a2a = getattr(input_dist, "_dist", None)
                if a2a is None:
                    continue  # no collective (data parallel)
                if not isinstance(a2a, KJTAllToAll):
                    raise TypeError(
                        f"{where}._input_dists[{i}]._dist is a {type(a2a).__name__}, not a KJTAllToAll: "
                        "its group cannot be rebound"
                    )
                found.append((f"{where}._input_dists[{i}]", a2a))
    return found


def rebind_input_dists(
    modules: Iterable[nn.Module],
    group: dist.ProcessGroup,
    moved: list[tuple[KJTAllToAll, dist.ProcessGroup]] | None = None,
) -> int:
    """Make every input dist of ``modules`` issue its collectives on ``group``; returns how many
    ``KJTAllToAll`` now use it. Idempotent.

    ``group`` must span the same ranks, in the same order, as the group each input dist uses now
    (else ValueError naming the input dist and both rank lists: e.g. 2D sharding, whose input
    dists use a sharding subgroup, needs a twin of that subgroup). Input dists of a module that
    is not in ``modules`` keep their group. Collectives already issued keep theirs. ``moved``
    gets each ``KJTAllToAll`` moved and the group it had (``restore_input_dists`` moves them back).
    """
    group_ranks = dist.get_process_group_ranks(group)
    rebound = 0
    for where, a2a in input_dist_all_to_alls(modules):
        if a2a._pg is not group:
            ranks = dist.get_process_group_ranks(a2a._pg)
            if ranks != group_ranks:
                raise ValueError(
                    f"{where}: its input dist runs on ranks {ranks}, the input dist group spans ranks "
                    f"{group_ranks}; give it a group over the same ranks"
                )
            if moved is not None:
                moved.append((a2a, a2a._pg))
            a2a._pg = group
        fused = vars(a2a).get("forward")  # upstream's fused-splits wrapper, once installed
        if isinstance(fused, KJTAllToAllForward):
            fused._pg = group
        rebound += 1
    return rebound


def restore_input_dists(moved: list[tuple[KJTAllToAll, dist.ProcessGroup]]) -> None:
    """Move every input dist ``rebind_input_dists`` recorded in ``moved`` back to the group it had
    (a pipeline's teardown, before it destroys the group it made); empties ``moved``."""
    while moved:
        a2a, group = moved.pop()
        a2a._pg = group
        fused = vars(a2a).get("forward")
        if isinstance(fused, KJTAllToAllForward):
            fused._pg = group
