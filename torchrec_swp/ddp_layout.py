"""DistributedDataParallel's bucket layout, kept over a checkpoint so a resumed run reduces alike.

DDP all-reduces gradients bucket by bucket: a bucket is one flat tensor of several parameters'
gradients, and gloo's ring all-reduce cuts it into chunks, each summed around the ring starting
at another rank. Which rank's value an element's sum starts from therefore depends on the
element's offset in its bucket and on the bucket's size. A sum of 2 values does not depend on
its order; a sum of 3 or more does, in the last bits.

A DDP with ``static_graph=True`` (TorchRec's DMP default) starts with every parameter in one
bucket, in registration order (whatever ``bucket_cap_mb`` says), records the order in which the
gradients become ready in its second backward and rebuilds its buckets in that order at its third
forward (``Reducer::rebuild_buckets``: a first bucket of up to 1 MiB, then 25 MiB ones). A run
resumed in new processes wraps the model in a new DDP, whose first two steps reduce with the
initial layout where the uninterrupted run used the rebuilt one: on 3 or more ranks their
gradients differ in the last bits (``tools/ddp_rewrap_repro.py`` shows it).

``layout_state(model)`` records the layout of every DDP in ``model`` that has rebuilt (parameter
indices per bucket, as the reducer numbers them); ``restore_layout_state(model, state)``, on the
resumed model before its first forward, gives each DDP a reducer built with that layout. The new
reducer still rebuilds once from the ready order, which a static graph repeats, so the layout
stays the saved one. Saving reads the layout only; a run that loads no state is untouched
(upstream parity).

What this relies on from torch (private, checked by ``tests/unit/test_ddp_layout.py`` and the
multi-process resume tests): ``Reducer(params, bucket_indices, per_bucket_size_limits, ...)``,
``Reducer._get_zeros_like_grad_buckets()`` (to read the layout),
``DistributedDataParallel._build_params_for_reducer()``, ``_build_debug_param_to_name_mapping()``,
``_bucket_config``, ``_comm_hooks``, ``_has_rebuilt_buckets``, ``_static_graph_delay_allreduce_enqueued``
and ``_use_python_reducer``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


class LayoutError(ValueError):
    """A saved layout does not fit the model it is restored on."""


def _ddps(model: torch.nn.Module) -> list[tuple[str, DistributedDataParallel]]:
    """Every DDP in ``model`` that reduces with the C++ reducer, with its module path."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, DistributedDataParallel) and not module._use_python_reducer
    ]


def bucket_layout(ddp: DistributedDataParallel) -> list[list[int]]:
    """The reducer's buckets in reduction order, each as the indices (into the reducer's parameter
    list) of the parameters it holds, in their order in the flat bucket."""
    params, _ = ddp._build_params_for_reducer()
    index = {id(p): i for i, p in enumerate(params)}
    return [[index[id(p)] for p in bucket.parameters()] for bucket in ddp.reducer._get_zeros_like_grad_buckets()]


def restore_bucket_layout(ddp: DistributedDataParallel, layout: list[list[int]]) -> None:
    """Replace ``ddp``'s reducer, between steps, by one whose buckets are ``layout``.

    Everything else is as DDP's constructor builds it (``_ddp_init_helper``): the same parameters,
    caps, flags and static graph; comm hooks registered with ``register_comm_hook`` are registered
    again. LayoutError if ``layout`` is not a partition of the reducer's parameters."""
    params, expect_sparse = ddp._build_params_for_reducer()
    flat = sorted(i for bucket in layout for i in bucket)
    if flat != list(range(len(params))) or not all(layout):
        raise LayoutError(
            f"a DDP bucket layout over {len(flat)} parameter indices does not fit a DDP of {len(params)} parameters"
        )
    config = ddp._bucket_config
    _, limits_for_rebuilding = config.compute_bucket_size_limits(
        static_graph=ddp.static_graph, find_unused_parameters=ddp.find_unused_parameters
    )
    sizes = [sum(params[i].numel() * params[i].element_size() for i in bucket) for bucket in layout]
    ddp.reducer._remove_autograd_hooks()
    ddp.reducer = dist.Reducer(
        params,
        [list(bucket) for bucket in layout],
        sizes,
        ddp.process_group,
        expect_sparse,
        ddp.bucket_bytes_cap,
        ddp.find_unused_parameters,
        ddp.gradient_as_bucket_view,
        ddp._build_debug_param_to_name_mapping(params),
        config.first_bucket_bytes_cap,
        ddp.skip_all_reduce_unused_params,
        ddp._use_python_reducer,
        limits_for_rebuilding,
        ddp.batched_grad_copy,
    )
    ddp.logger = dist.Logger(ddp.reducer)
    ddp.reducer.set_logger(ddp.logger)
    if ddp.static_graph:
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
        # the new reducer's first iteration reduces only through the all-reduce DDP's backward
        # enqueues once (``_DDPSink``); a DDP that has trained enqueued it for its old reducer
        ddp._static_graph_delay_allreduce_enqueued = False
    for hook, state in ddp._comm_hooks:
        dist._register_comm_hook(ddp.reducer, state, hook)


def layout_state(model: torch.nn.Module) -> dict[str, Any]:
    """Every C++-reduced DDP's bucket layout in ``model``, by module path (``""``: the model
    itself), once its reducer has rebuilt its buckets; between steps. No collective: a rank may
    call it alone.

    A DDP that has not rebuilt yet (a cut after its first or second step) is left out: it still
    uses the layout a new one starts with, but the new one rebuilds 2 steps after the resume,
    where it would have rebuilt at the next step or the one after (on 3 or more ranks the sums of
    the steps between may then differ in the last bits). Rebuilding here after the second step
    would fix that but is a collective (the reducer broadcasts rank 0's layout), which a cut
    must not start on its own while other threads may run the pipeline's collectives."""
    return {name: bucket_layout(ddp) for name, ddp in _ddps(model) if ddp._has_rebuilt_buckets}


def restore_layout_state(model: torch.nn.Module, state: Mapping[str, Any]) -> None:
    """Give each DDP of ``model`` named in ``state`` (``layout_state()``) its saved layout; between
    steps (a resumed model: before its first forward). LayoutError naming the module if a name is
    not a DDP of ``model``."""
    ddps = dict(_ddps(model))
    for name, layout in state.items():
        if name not in ddps:
            raise LayoutError(
                f"the checkpoint has a DDP bucket layout for {name or 'the model'!r}, which is not a DDP here"
            )
        restore_bucket_layout(ddps[name], layout)
