"""Why a DDP wrapped anew mid-run reduces other bits than the one it replaces (issue 46 item 4).

Plain DDP (``static_graph=True``, Adagrad) on W gloo ranks over loopback, a 3-layer MLP, 8 steps:

* ``straight``: one DDP for all 8 steps;
* ``rewrapped``: the module is wrapped in a new DDP after 4 steps (same weights, same optimizer),
  as a resumed run does;
* ``rewrapped+layout``: the same, with the new DDP's buckets set to the old one's layout
  (``torchrec_swp.ddp_layout``) before its first backward.

Prints rank 0's view of each run: per step (from 1) the loss, a digest of the all-reduced
gradients and the bucket layout that step's backward reduced with (parameter indices per bucket,
in their order in the flat bucket), marking the steps whose gradients differ from ``straight``'s;
the final weights; and how many of step 5's gradient elements differ from ``straight``'s.

    .venv/bin/python tools/ddp_rewrap_repro.py --world-size 4

On 4 ranks (torch 2.14.1, 2026-12-02) ``rewrapped`` reduces steps 5 and 6 with ``[[0, 1, 2, 3, 4,
5]]`` where ``straight`` has ``[[5, 4, 3, 2, 1, 0]]``; 807 of step 5's 3009 gradient elements
differ (by at most 1.9e-9), and so do every later step's gradients and the final weights. On 3
ranks 470 elements differ; on 2 ranks none. ``rewrapped+layout`` equals ``straight`` throughout.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from torchrec_swp.ddp_layout import bucket_layout, restore_bucket_layout

STEPS, CUT = 8, 4


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def _run(rank: int, world_size: int, mode: str) -> tuple[list[tuple[str, str, str]], torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(13, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
    )
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    ddp = DDP(model, static_graph=True)
    gen = torch.Generator().manual_seed(100 + rank)
    rows, at_cut = [], torch.empty(0)
    for step in range(STEPS):
        if step == CUT and mode != "straight":
            layout = bucket_layout(ddp)
            del ddp
            ddp = DDP(model, static_graph=True)
            if mode == "rewrapped+layout":
                restore_bucket_layout(ddp, layout)
        x, y = torch.randn(32, 13, generator=gen), torch.rand(32, 1, generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(ddp(x), y)
        layout_now = bucket_layout(ddp)  # the layout this step's backward reduces with
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        rows.append((str(layout_now), _digest(grads), f"{loss.item():.9g}"))
        if step == CUT:
            at_cut = torch.cat([g.flatten() for g in grads])
        opt.step()
    rows.append(("final", _digest(list(model.parameters())), ""))
    return rows, at_cut


def _worker(rank: int, world_size: int, init: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    try:
        out[rank] = {mode: _run(rank, world_size, mode) for mode in ("straight", "rewrapped", "rewrapped+layout")}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        init = f"file://{os.path.join(tmp, 'store')}"
        mp.spawn(_worker, args=(args.world_size, init, out), nprocs=args.world_size)
        results = dict(out[0])
    straight, straight_at_cut = results["straight"]
    for mode, (rows, at_cut) in results.items():
        print(f"== {mode} (rank 0)")
        for step, (layout, grads, loss) in enumerate(rows[:-1], 1):  # steps counted from 1
            mark = "" if grads == straight[step - 1][1] else "   <- differs from straight"
            print(f"  step {step}: loss {loss:>12} grads {grads} buckets {layout}{mark}")
        mark = "" if rows[-1][1] == straight[-1][1] else "   <- differ from straight's"
        print(f"  final weights {rows[-1][1]}{mark}")
        differ = (at_cut != straight_at_cut).nonzero().flatten()
        print(f"  step {CUT + 1}'s gradients: {len(differ)} of {len(at_cut)} elements differ from straight's", end="")
        print(f", the largest by {(at_cut - straight_at_cut).abs().max().item():.3g}" if len(differ) else "")


if __name__ == "__main__":
    main()
