"""The schedules Maglev lacks, on the same model and data, against plain 1F1B (2 gloo ranks).

Reference: our Maglev1F1B drop-in (bit-identical to upstream's, ``test_maglev_parity``), 2
stages of 2 layers, 4 microbatches, 3 SGD steps. Then, on the same weights and microbatches:

* one stage per rank, on the Maglev drop-in (``schedule=``): ZB-H1 (backwards split into
  ``I`` + ``W``), the sparse-hoist split (``E`` lookups ahead of the dense ``F``), GPipe;
* several stages per rank, on ``PipelineRank`` (the model cut into 4 one-layer stages):
  Interleaved1F1B and its zero-bubble twin (stage ``s`` on rank ``s % 2``), ZBV and
  DualPipeV (a V: rank 0 holds stages 0 and 3), and 1F1B itself with 2 stages;
* the CP-SAT optimum (``pp.exact.solve``, 4 stages in a loop, F=1 B=2), whose orders run
  forwards and backwards out of microbatch order.

Every one of them gives the reference's gradients at every step and its final weights bit for
bit: in each, every parameter's gradient sums the microbatches' contributions in microbatch
order (each stage's backwards, or ``W`` s, run in microbatch order), and each contribution is
computed by the same kernels on the same values (a P2P hand-off copies exactly; ``I``/``W``
run the backward restricted with ``inputs=``). A program whose backwards run in another order
(GPipe with each stage's backwards reversed, the CP-SAT optimum) sums in another order: equal
within float tolerance, not bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness.ranks import run_on_ranks
from torchrec_swp.integrations.torchrec.compat import installed

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(not installed().has_maglev, reason="torchrec.distributed.maglev is new in TorchRec 1.9"),
]

STEPS = 3
M = 4
LR = 0.001
ON_STAGE_WRAPPER = [("1F1B", {}), ("ZB-H1", {}), ("ZB-H1", {"thread_map": "comm"}), ("1F1B-split", {}), ("GPipe", {})]
ON_PIPELINE_RANK = ["1F1B", "Interleaved1F1B", "InterleavedZB", "ZBV", "DualPipeV", "GPipe-reversed"]


def microbatches(step: int) -> list[Any]:
    """The microbatches Maglev's cascade all-to-all hands every stage at ``step`` (round ``r``
    brings rank 0's then rank 1's ``r``-th batch; two rounds a step)."""
    from torchrec_swp.integrations.torchrec.maglev.cpu import ModelConfig, make_batches

    per_rank = [make_batches(ModelConfig(), 2 * STEPS, seed=r) for r in range(2)]
    return [per_rank[j][2 * step + k] for k in range(2) for j in range(2)]


def reversed_backwards() -> Any:
    """GPipe whose stages run their backwards last microbatch first."""
    from torchrec_swp.pp.actions import B
    from torchrec_swp.pp.builders import gpipe
    from torchrec_swp.pp.comm import add_p2p, add_step

    program = gpipe(2, M)
    ranks = [[a for a in r if a.kind is not B] + [a for a in reversed(r) if a.kind is B] for r in program.ranks]
    return add_step(add_p2p(program.replace(name="GPipe-reversed", ranks=ranks)))


def on_stage_wrapper(
    schedule: str, options: dict[str, Any]
) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    import torch.distributed as dist
    from torchrec.distributed.maglev.stage import StageWrapper

    from torchrec_swp.integrations.torchrec.maglev import Maglev1F1B
    from torchrec_swp.integrations.torchrec.maglev.cpu import ModelConfig, build_model, make_batches, on_cpu

    config = ModelConfig()
    stage = on_cpu(StageWrapper(build_model(config, seed=0), list(config.layers_per_stage), stage_size=1))
    first = sum(config.layers_per_stage[: stage.stage_index])
    name = lambda n: f"L{first + int(n.split('.')[1])}.{n.split('.', 2)[2]}"
    grads: list[dict[str, torch.Tensor]] = []
    optimizer = torch.optim.SGD(stage.module.parameters(), lr=LR)
    optimizer.register_step_pre_hook(
        lambda o, a, k: grads.append({name(n): p.grad.clone() for n, p in stage.module.named_parameters()})
    )
    pipeline = Maglev1F1B(stage, optimizer, M, schedule=schedule, **options)
    batches = iter(make_batches(config, 2 * STEPS, seed=dist.get_rank()))
    for _ in range(STEPS):
        pipeline.progress(batches)
    pipeline.close()
    return grads, {name(n): p.detach().clone() for n, p in stage.module.named_parameters()}


def on_pipeline_rank(
    schedule: str, text: str | None = None
) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    from torchrec_swp.integrations.torchrec.maglev import PipelineRank
    from torchrec_swp.integrations.torchrec.maglev.cpu import ModelConfig, build_model
    from torchrec_swp.pp import Program, build
    from torchrec_swp.pp.comm import add_step

    config = ModelConfig()
    if text is not None:
        program = add_step(Program.from_text(text))
    elif schedule == "GPipe-reversed":
        program = reversed_backwards()
    else:
        program = build(schedule, 2, M)
    per_stage = [config.num_layers // program.num_stages] * program.num_stages
    rank = PipelineRank(
        build_model(config, seed=0),
        per_stage,
        program,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=LR),
        thread_map="comm",
    )
    name = lambda n: f"L{int(n.split('.')[0][5:]) * per_stage[0] + int(n.split('.')[2])}.{n.split('.', 3)[3]}"
    grads: list[dict[str, torch.Tensor]] = []
    rank.optimizer.register_step_pre_hook(
        lambda o, a, k: grads.append({name(n): p.grad.clone() for n, p in rank.named_parameters().items()})
    )
    for step in range(STEPS):
        rank.progress(microbatches(step))
    rank.close()
    return grads, {name(n): p.detach().clone() for n, p in rank.named_parameters().items()}


def _rank(rank: int, world_size: int, exact: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for schedule, options in ON_STAGE_WRAPPER:
        out[f"maglev:{schedule}{'/comm' if options else ''}"] = on_stage_wrapper(schedule, options)
    for schedule in ON_PIPELINE_RANK:
        out[f"rank:{schedule}"] = on_pipeline_rank(schedule)
    if exact is not None:
        out["rank:CP-SAT"] = on_pipeline_rank("CP-SAT", exact)
    return out


def exact_program() -> str | None:
    """The CP-SAT optimum, solved once here (every rank must run the same program)."""
    try:
        from torchrec_swp.pp import ActionDurations, loop_placement
        from torchrec_swp.pp.exact import solve

        return solve(M, loop_placement(2, 2), ActionDurations(F=1, B=2), time_limit_s=20).program.to_text()
    except ImportError:  # OR-Tools is optional
        return None


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]]:
    """Each run's gradients per step and final weights, both ranks merged, by global layer."""
    merged: dict[str, tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]] = {}
    for result in run_on_ranks(_rank, exact_program(), timeout_s=240):
        for key, (grads, weights) in result.items():
            steps, final = merged.setdefault(key, ([{} for _ in grads], {}))
            for mine, theirs in zip(steps, grads, strict=True):
                mine.update(theirs)
            final.update(weights)
    return merged


BIT_IDENTICAL = [f"maglev:{s}{'/comm' if o else ''}" for s, o in ON_STAGE_WRAPPER[1:]] + [
    f"rank:{s}" for s in ON_PIPELINE_RANK if s != "GPipe-reversed"
]


@pytest.mark.parametrize("key", BIT_IDENTICAL)
def test_gradients_and_weights_equal_plain_1f1b_bit_for_bit(runs: dict[str, Any], key: str) -> None:
    ref_grads, ref_weights = runs["maglev:1F1B"]
    grads, weights = runs[key]
    assert set(weights) == set(ref_weights) and len(ref_weights) == 38
    assert len(grads) == len(ref_grads) == STEPS
    for step, (mine, ref) in enumerate(zip(grads, ref_grads, strict=True)):
        differ = [n for n in ref if not torch.equal(mine[n], ref[n])]
        assert not differ, f"{key}, step {step}: {differ[:5]}"
    assert all(torch.equal(weights[n], ref_weights[n]) for n in ref_weights)


@pytest.mark.parametrize("key", ["rank:GPipe-reversed", "rank:CP-SAT"])
def test_another_backward_order_sums_in_another_order(runs: dict[str, Any], key: str) -> None:
    if key not in runs:
        pytest.skip("OR-Tools is not installed")
    ref_grads, _ = runs["maglev:1F1B"]
    grads, _ = runs[key]
    for mine, ref in zip(grads, ref_grads, strict=True):
        for n in ref:
            torch.testing.assert_close(mine[n], ref[n], rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(mine[n], ref[n]) for mine, ref in zip(grads, ref_grads) for n in ref)
