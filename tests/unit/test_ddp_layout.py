"""``torchrec_swp.ddp_layout`` on a real DDP in a gloo world of one: what the layout is, when a
cut records it, and that a new DDP given it reduces with it.

A world of one cannot show the bits a layout changes (``tests/dist/test_checkpoint_resume_ranks.py``
does, on 3 and 4 ranks); it shows the torch internals the module relies on behave as it says.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from torchrec_swp.ddp_layout import LayoutError, bucket_layout, layout_state, restore_layout_state

REGISTERED = [[0, 1, 2, 3]]  # a static graph's first bucket: every parameter, in registration order
READY = [[3, 2, 1, 0]]  # after its rebuild: in the order backward makes the gradients


@pytest.fixture
def world(tmp_path: Path) -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("needs a process without a default process group")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/store")
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _step(model: torch.nn.Module) -> None:
    model(torch.randn(4, 5)).sum().backward()


def _wrapped(ddp: DDP) -> torch.nn.Module:
    """``ddp`` inside a model, as DMP holds it (``_dmp_wrapped_module``)."""
    outer = torch.nn.Module()
    outer.inner = ddp
    return outer


def test_a_cut_records_the_rebuilt_layout_and_a_new_ddp_reduces_with_it(world: None) -> None:
    model = _model()
    ddp = DDP(model, static_graph=True)
    assert bucket_layout(ddp) == REGISTERED
    for _ in range(3):
        _step(ddp)
    state = layout_state(_wrapped(ddp))
    assert state == {"inner": READY}

    fresh = DDP(model, static_graph=True)
    assert bucket_layout(fresh) == REGISTERED
    restore_layout_state(_wrapped(fresh), state)
    assert bucket_layout(fresh) == READY
    for _ in range(3):  # the new reducer trains (static graph's first iteration included) and keeps it
        _step(fresh)
        assert bucket_layout(fresh) == READY
    assert all(p.grad is not None for p in model.parameters())


def test_a_cut_before_the_rebuild_records_nothing_and_starts_no_collective(world: None) -> None:
    ddp = DDP(_model(), static_graph=True)
    for _ in range(2):
        _step(ddp)
        assert layout_state(ddp) == {}
    assert not ddp._has_rebuilt_buckets  # the next forward rebuilds (a broadcast), not the cut
    _step(ddp)
    assert layout_state(ddp) == {"": READY}


def test_a_layout_that_does_not_fit_is_refused(world: None) -> None:
    ddp = DDP(_model(), static_graph=True)
    with pytest.raises(LayoutError, match="over 3 parameter indices does not fit a DDP of 4 parameters"):
        restore_layout_state(ddp, {"": [[2, 1, 0]]})
    with pytest.raises(LayoutError, match="'inner', which is not a DDP here"):
        restore_layout_state(ddp, {"inner": READY})


def test_a_ddp_that_has_trained_takes_a_layout_and_trains_on(world: None) -> None:
    """Between steps of a DDP that has trained (not only before the first forward): its new reducer
    starts a static graph's first iteration, whose all-reduce DDP must enqueue again."""
    ddp = DDP(_model(), static_graph=True)
    for _ in range(3):
        _step(ddp)
    restore_layout_state(ddp, {"": REGISTERED})
    assert bucket_layout(ddp) == REGISTERED
    for _ in range(3):
        _step(ddp)
    assert bucket_layout(ddp) == READY  # rebuilt from the ready order, as a new DDP does
