"""Our Maglev drop-ins against TorchRec 1.9.2's, bit for bit, on 2 gloo ranks (2 stages x 1 rank).

Each rank builds TorchRec's own ``MaglevTestModel`` (4 layers, 2 per stage), keeps its stage with
upstream's ``StageWrapper`` and feeds it through the CPU input driver (``maglev.cpu.on_cpu``:
upstream's driver is CUDA-only); upstream and ours then train fresh copies on the same batches
for 4 steps. Compared: the last stage's loss of every microbatch, every gradient the optimizer
sees, the final weights, what ``progress()`` returns and how many batches it drew. Ours runs
with everything on the calling thread (upstream's order), with sends and receives on a
``comm`` thread, and on separate ``send``/``recv`` threads.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from harness.parity import check_streams
from harness.ranks import run_on_ranks
from torchrec_swp.integrations.torchrec.compat import installed

pytestmark = [
    pytest.mark.parity,
    pytest.mark.multiprocess,
    pytest.mark.skipif(not installed().has_maglev, reason="torchrec.distributed.maglev is new in TorchRec 1.9"),
]

STEPS = 4
MICROBATCHES = 4
CASES = [
    ("MaglevPipelineBase", "main"),
    ("MaglevPipelineBase", "comm"),
    ("Maglev1F1B", "main"),
    ("Maglev1F1B", "comm"),
    ("Maglev1F1B", "send_recv"),
    ("Maglev1F1BRecvAhead", "main"),
    ("Maglev1F1BRecvAhead", "comm"),
]


class _Counting:
    def __init__(self, it: Iterator[Any]) -> None:
        self.it, self.drawn = it, 0

    def __iter__(self) -> _Counting:
        return self

    def __next__(self) -> Any:
        value = next(self.it)
        self.drawn += 1
        return value


def make_stage(stage_size: int = 1, ddp: bool = False) -> Any:
    """This rank's stage of the test model, on the CPU (a DDP over the stage's group if asked)."""
    from torch.nn.parallel import DistributedDataParallel
    from torchrec.distributed.maglev.stage import StageWrapper

    from torchrec_swp.integrations.torchrec.maglev.cpu import ModelConfig, build_model, on_cpu

    config = ModelConfig()
    stage = StageWrapper(build_model(config, seed=0), list(config.layers_per_stage), stage_size=stage_size)
    if ddp:
        stage.module = DistributedDataParallel(stage.module, process_group=stage.stage_pg)
    return on_cpu(stage)


def train(impl: str, cls: str, *, stage_size: int = 1, ddp: bool = False, **options: Any) -> dict[str, Any]:
    """Train ``STEPS`` steps with upstream's (``impl="upstream"``) or our ``cls``; what to compare."""
    import torch.distributed as dist
    from torchrec.distributed.maglev import pipeline as upstream

    from torchrec_swp.integrations.torchrec import maglev as ours
    from torchrec_swp.integrations.torchrec.maglev.cpu import ModelConfig, make_batches

    stage = make_stage(stage_size, ddp)
    losses: list[torch.Tensor] = []
    grads: list[list[torch.Tensor]] = []
    if stage.is_last:
        stage.module.register_forward_hook(lambda m, i, out: losses.append(out[0].detach().clone()))
    optimizer = torch.optim.SGD(stage.module.parameters(), lr=0.001)
    optimizer.register_step_pre_hook(lambda o, a, k: grads.append([p.grad.clone() for p in stage.module.parameters()]))
    module = upstream if impl == "upstream" else ours
    pipeline_cls = getattr(module, cls)
    if cls == "MaglevPipelineBase":
        pipeline = pipeline_cls(stage, optimizer, **options)
    else:
        pipeline = pipeline_cls(stage, optimizer, MICROBATCHES, **options)
    batches = _Counting(iter(make_batches(ModelConfig(), 2 * STEPS, seed=dist.get_rank())))
    returned = []
    for _ in range(STEPS):
        out = pipeline.progress(batches)
        returned.append(None if out is None else out.detach().clone())
    if impl != "upstream":
        pipeline.close()
    check_streams()  # with SWP_STREAM_CHECK=1 (make test): no unsynchronised access in the actions
    return {
        "losses": losses,
        "grads": grads,
        "weights": [p.detach().clone() for p in stage.module.parameters()],
        "returned": returned,
        "drawn": batches.drawn,
        "per_pass": pipeline.microbatches_per_pass,
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What differs between two ``train`` results (empty: bit-identical)."""
    problems = []
    for key in ("drawn", "per_pass"):
        if a[key] != b[key]:
            problems.append(f"{key}: {a[key]} != {b[key]}")
    for key in ("losses", "weights", "returned"):
        if len(a[key]) != len(b[key]) or not all(
            (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
            for x, y in zip(a[key], b[key])
        ):
            problems.append(f"{key} differ")
    if len(a["grads"]) != len(b["grads"]) or not all(
        torch.equal(x, y) for g, h in zip(a["grads"], b["grads"]) for x, y in zip(g, h, strict=True)
    ):
        problems.append("gradients differ")
    return problems


def _constructor_checks() -> list[str]:
    """The drop-ins' types and their option checks (on a throwaway stage)."""
    from torchrec.distributed.maglev import pipeline as upstream

    from torchrec_swp.integrations.torchrec import maglev as ours
    from torchrec_swp.pp import build

    stage = make_stage()
    opt = torch.optim.SGD(stage.module.parameters(), lr=0.001)
    checks = []
    p = ours.Maglev1F1BRecvAhead(stage, opt, 4)
    checks.append(f"isinstance {isinstance(p, upstream.Maglev1F1BRecvAhead) and isinstance(p, upstream.Maglev1F1B)}")
    checks.append(f"per_pass {p.microbatches_per_pass}")
    checks.append(f"program {p.program.name}")
    p.close()
    for kwargs, expect in (
        ({"num_microbatches": 1}, "at least one microbatch per stage"),
        ({"num_microbatches": 4, "schedule": "Interleaved1F1B"}, "one stage per rank"),
        ({"num_microbatches": 4, "program": build("1F1B", 2, 2)}, "has 2 microbatches, the pipeline 4"),
        ({"num_microbatches": 4, "schedule": "1F1B", "program": build("1F1B", 2, 4)}, "not both"),
        ({"num_microbatches": 4, "thread_map": "sideways"}, "thread_map 'sideways'"),
        ({"num_microbatches": 4, "grad_sync": "never"}, "grad_sync"),
    ):
        try:
            ours.Maglev1F1B(stage, opt, **kwargs).close()
            checks.append(f"accepted {kwargs}")
        except ValueError as e:
            checks.append("ok" if expect in str(e) else f"{kwargs}: {e}")
    return checks


def _rank(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {"checks": _constructor_checks()}
    for cls, thread_map in CASES:
        reference = train("upstream", cls)
        mine = train("ours", cls, thread_map=thread_map)
        out[f"{cls}/{thread_map}"] = same(reference, mine)
        out[f"{cls}/{thread_map}/losses"] = len(reference["losses"])
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_ranks(_rank, timeout_s=180)


@pytest.mark.parametrize("cls,thread_map", CASES, ids=[f"{c}-{t}" for c, t in CASES])
def test_bit_identical_to_upstream(results: list[dict[str, Any]], cls: str, thread_map: str) -> None:
    for rank, r in enumerate(results):
        assert r[f"{cls}/{thread_map}"] == [], f"rank {rank}: {r[f'{cls}/{thread_map}']}"
    per_pass = 1 if cls == "MaglevPipelineBase" else MICROBATCHES
    assert results[1][f"{cls}/{thread_map}/losses"] == STEPS * per_pass  # the last stage saw every microbatch
    assert results[0][f"{cls}/{thread_map}/losses"] == 0


def test_drop_in_types_and_option_checks(results: list[dict[str, Any]]) -> None:
    checks = results[0]["checks"]
    assert checks[:3] == ["isinstance True", "per_pass 4", "program Maglev1F1BRecvAhead"]
    assert checks[3:] == ["ok"] * 6, checks[3:]
