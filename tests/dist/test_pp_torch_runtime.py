"""Our programs on the engine against torch.distributed.pipelining's schedules at run time (2 gloo
ranks): the same model (TorchRec's MaglevTestModel, cut into stages), the same microbatches,
one step; every gradient compared.

torch's ``PipelineStage`` runs a module on tensors, so each torch stage wraps the same layers in
``TorchStage``: the first stage's input is a dummy tensor, later stages get the activation, and
each stage takes its layers' inputs (the ``ModelInput`` s) for the microbatch it is on from a
list (every stage forwards its microbatches in order in every schedule). The last stage returns
the prediction and the loss is the model's own (``mse_loss`` against the label), summed over
microbatches (``scale_grads=False``), as Maglev's. torch infers shapes with one extra forward
per stage in its first step, so the second step is the one compared.

Schedules (ours from ``pp.builders``, theirs from torch): GPipe, 1F1B (2 stages), interleaved
1F1B and interleaved zero bubble (4 stages, 2 per rank, loop), ZBV and DualPipeV (4 stages in a
V). All are bit-identical: same kernels on the same values, gradients summed in microbatch
order on both sides (torch's ZB runs its own input/weight split, ``stage_backward_input`` /
``stage_backward_weight``, ours the backward restricted with ``inputs=``).
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

M = 4
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZB", "ZBV", "DualPipeV"]


class TorchStage(torch.nn.Module):
    """A stage for torch's PipelineStage: tensor in, tensor out; layer inputs from a list."""

    def __init__(self, layers: list[torch.nn.Module], inputs: list[list[Any]], first: bool, last: bool) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.inputs, self.first, self.last = inputs, first, last
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer_inputs = self.inputs[self.calls % len(self.inputs)]
        self.calls += 1
        acts: tuple[torch.Tensor, ...] = () if self.first else (x,)
        for layer, layer_input in zip(self.layers, layer_inputs, strict=True):
            acts = layer(layer_input, acts)
        return acts[0].sum(dim=1) if self.last else acts[0]  # MaglevTestModel.postproc's prediction


def _torch_grads(name: str, program: Any, per_stage: list[int], mbs: list[Any], rank: int) -> dict[str, torch.Tensor]:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as S

    from torchrec_swp.integrations.torchrec.maglev.cpu import ModelConfig, build_model

    cls = {
        "GPipe": S.ScheduleGPipe,
        "1F1B": S.Schedule1F1B,
        "Interleaved1F1B": S.ScheduleInterleaved1F1B,
        "InterleavedZB": S.ScheduleInterleavedZeroBubble,
        "ZBV": S.ScheduleZBVZeroBubble,
        "DualPipeV": S.ScheduleDualPipeV,
    }[name]
    model = build_model(ModelConfig(), seed=0)
    n = program.num_stages
    starts = [sum(per_stage[:s]) for s in range(n)]
    stages = []
    for s in program.stages_of(rank):
        layers = [model[i] for i in range(starts[s], starts[s] + per_stage[s])]
        inputs = [mb[starts[s] : starts[s] + per_stage[s]] for mb in mbs]
        stages.append((s, PipelineStage(TorchStage(layers, inputs, s == 0, s == n - 1), s, n, torch.device("cpu"))))
    loss_fn = lambda out, target: torch.nn.functional.mse_loss(out, target)
    torch_stages = [st for _, st in stages]
    if issubclass(cls, S.PipelineScheduleSingle):
        schedule = cls(torch_stages[0], M, loss_fn=loss_fn, scale_grads=False)
    else:
        schedule = cls(torch_stages, M, loss_fn=loss_fn, scale_grads=False)
    target = torch.cat([mb[-1].label for mb in mbs])
    has_first, has_last = any(s == 0 for s, _ in stages), any(s == n - 1 for s, _ in stages)
    for _ in range(2):  # the first step also infers shapes (one more forward per stage)
        for _, st in stages:
            st.submod.calls = 0
            st.submod.zero_grad()
        kwargs: dict[str, Any] = {"target": target, "losses": []} if has_last else {}
        schedule.step(*((torch.zeros(M, 1),) if has_first else ()), **kwargs)
    return {
        f"L{starts[s] + i}.{pn}": p.grad.clone()
        for s, st in stages
        for i, layer in enumerate(st.submod.layers)
        for pn, p in layer.named_parameters()
    }


def _rank(rank: int, world_size: int) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    from torchrec_swp.integrations.torchrec.maglev import PipelineRank
    from torchrec_swp.integrations.torchrec.maglev.cpu import ModelConfig, build_model, make_batches
    from torchrec_swp.pp import build

    config = ModelConfig()
    mbs = make_batches(config, M, seed=7)
    out = {}
    for name in SCHEDULES:
        program = build(name, 2, M)
        per_stage = [config.num_layers // program.num_stages] * program.num_stages
        ours = PipelineRank(build_model(config, seed=0), per_stage, program, thread_map="comm")
        ours.progress(mbs, step=False)
        starts = [sum(per_stage[:s]) for s in range(program.num_stages)]
        mine = {}
        for key, p in ours.named_parameters().items():
            stage, _, i, rest = key.split(".", 3)
            mine[f"L{starts[int(stage[5:])] + int(i)}.{rest}"] = p.grad.clone()
        ours.close()
        out[name] = (mine, _torch_grads(name, program, per_stage, mbs, rank))
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]]:
    return run_on_ranks(_rank, timeout_s=240)


@pytest.mark.parametrize("name", SCHEDULES)
def test_gradients_equal_torch_pipelining_bit_for_bit(results: list[dict[str, Any]], name: str) -> None:
    compared = 0
    for rank, r in enumerate(results):
        mine, theirs = r[name]
        assert set(mine) == set(theirs), (rank, sorted(set(mine) ^ set(theirs))[:4])
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), f"{name}, rank {rank}, {key}"
            compared += 1
    assert compared == 38  # every parameter of the model, once
