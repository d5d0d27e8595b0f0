"""A rank of a pipeline-parallel run that may hold several stages: interleaved and V schedules.

Maglev's ``StageWrapper`` owns one stage per rank, so schedules with virtual stages
(``Interleaved1F1B``: stage ``s`` on rank ``s % R``; ``ZBV``/``DualPipeV``: a V) run here:
``PipelineRank`` cuts the same authored model (a ``MaglevModuleList``) into
``len(layers_per_stage)`` stages, keeps those ``program.placement`` puts on this rank (the
model's own layer modules, as StageWrapper keeps them, the model's ``postproc`` on the last
stage), and runs each step as ``ProgramEngine.run_program`` of this rank's lowered program with
``RankRuntime`` bindings over a ``P2PWire`` (two direction-split groups over the ranks, built
collectively in the constructor like Maglev's hand-off groups).

One pipeline rank per process (no data parallelism here); every rank is given every
microbatch (a list of raw batches: one input per layer of the whole model) and takes its
stages' layer inputs from them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchrec_swp.compile import IterationProgram
from torchrec_swp.engine import DEFAULT_TIMEOUT_S, ProgramEngine, stream_pool_for
from torchrec_swp.integrations.torchrec.maglev.runtime import Chunk, P2PWire, RankRuntime
from torchrec_swp.integrations.torchrec.teardown import Teardown
from torchrec_swp.plan import MAIN_THREAD
from torchrec_swp.pp import Program, validate
from torchrec_swp.pp.actions import P2P, Action, Kind
from torchrec_swp.pp.lower_rank import lower_rank


class StageChain(nn.Module):
    """A stage's layers run back to back (Maglev's ``_LayerChain`` contract): the activation
    threads through; the model's ``postproc`` closes the last stage."""

    def __init__(self, layers: Sequence[nn.Module], postproc: Callable[..., Any] | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self._postproc = postproc

    def forward(self, layer_inputs: Sequence[Any], in_activations: tuple[torch.Tensor, ...] = ()) -> Any:
        if len(layer_inputs) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} layer inputs, got {len(layer_inputs)}")
        activations = in_activations
        for layer, layer_input in zip(self.layers, layer_inputs, strict=True):
            activations = layer(layer_input, activations)
        if self._postproc is not None:
            return self._postproc(activations, layer_inputs[-1])
        return activations


class PipelineRank:
    """This process's stages of ``model`` under ``program`` (module docstring).

    ``optimizer``: builds the optimizer of the rank's parameters (default SGD, lr 0.01).
    ``thread_map``: as the drop-ins' (``"main"``, ``"comm"``, a mapping or a callable).
    """

    def __init__(
        self,
        model: Sequence[nn.Module],
        layers_per_stage: Sequence[int],
        program: Program,
        *,
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
        thread_map: str | Callable[[Action], str] | dict[str, str] = "main",
        engine_timeout_s: float = DEFAULT_TIMEOUT_S,
        device: torch.device | None = None,
    ) -> None:
        if len(layers_per_stage) != program.num_stages:
            raise ValueError(
                f"layers_per_stage has {len(layers_per_stage)} stages, program {program.name} {program.num_stages}"
            )
        if sum(layers_per_stage) != len(model):
            raise ValueError(f"layers_per_stage sums to {sum(layers_per_stage)}, the model has {len(model)} layers")
        if dist.get_world_size() != program.num_ranks:
            raise ValueError(f"program {program.name} has {program.num_ranks} ranks, the job {dist.get_world_size()}")
        validate(program)
        device = device or torch.device("cpu")
        self.rank = dist.get_rank()
        self.program = program
        self.layers_per_stage = list(layers_per_stage)
        starts = [sum(layers_per_stage[:s]) for s in range(program.num_stages)]
        postproc = getattr(model, "postproc", None)
        self.chunks: list[Chunk] = []
        self.modules: dict[int, StageChain] = {}
        for s in program.stages_of(self.rank):
            layers: list[Any] = [model[i] for i in range(starts[s], starts[s] + layers_per_stage[s])]  # Maglev's layers
            chain = StageChain(layers, postproc if s == program.num_stages - 1 else None)
            self.modules[s] = chain
            self.chunks.append(
                Chunk(
                    s,
                    chain,
                    tuple(layers[0].in_activation_specs()),
                    tuple(layers[-1].out_activation_specs()),
                    [p for p in chain.parameters() if p.requires_grad],
                    split_module=chain,
                )
            )
        everyone = list(range(program.num_ranks))
        act_pg, grad_pg = dist.new_group(everyone), dist.new_group(everyone)  # collective: every rank, this order
        # the engine's threads, then these groups, at close(), collection or exit (teardown.Teardown)
        self._teardown = Teardown(self)
        self._teardown.group(act_pg)  # type: ignore[arg-type]
        self._teardown.group(grad_pg)  # type: ignore[arg-type]
        params = [p for c in self.chunks for p in c.parameters]
        self.optimizer = (optimizer or (lambda ps: torch.optim.SGD(ps, lr=0.01)))(params)
        wire = P2PWire(
            {c.index: c for c in self.chunks},
            program.rank_of,
            act_pg,  # type: ignore[arg-type]
            grad_pg,  # type: ignore[arg-type]
            device=device,
            timeout_s=engine_timeout_s,
        )
        self.runtime = RankRuntime(
            self.chunks, program.num_stages, wire, {c.index: self.optimizer for c in self.chunks}
        )
        if isinstance(thread_map, str):
            if thread_map not in ("main", "comm"):
                raise ValueError(f"thread_map {thread_map!r}: 'main', 'comm', a mapping or a callable")
            comm = thread_map == "comm"
            threads: Any = lambda a: "comm" if comm and a.kind in P2P else MAIN_THREAD
        else:
            threads = thread_map
        self.lowered: IterationProgram = lower_rank(program, self.rank, threads)
        self.engine = ProgramEngine(
            self.runtime.bindings(),
            streams=stream_pool_for(device),  # checked on the CPU with SWP_STREAM_CHECK=1
            timeout_s=engine_timeout_s,
            name=f"{program.name}-rank{self.rank}",
        )
        self._teardown.threads(self.engine.stop_threads)
        self.uses_sparse_split = any(a.kind is Kind.SPARSE for a in program.ranks[self.rank])

    def parameters(self) -> list[nn.Parameter]:
        return [p for c in self.chunks for p in c.parameters]

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """Parameters by ``stage<s>.<name>`` (the names of the stage's ``StageChain``)."""
        return {f"stage{s}.{n}": p for s, m in self.modules.items() for n, p in m.named_parameters()}

    def progress(self, microbatches: Sequence[Sequence[Any]], *, step: bool = True) -> dict[int, torch.Tensor]:
        """One optimizer step over ``microbatches`` (raw batches: one input per model layer);
        returns the last stage's loss per microbatch (empty elsewhere). ``step=False`` leaves
        the gradients in ``.grad`` (the program's ``O`` actions do not step)."""
        if len(microbatches) != self.program.num_microbatches:
            raise ValueError(f"{len(microbatches)} microbatches for a program of {self.program.num_microbatches}")
        starts = [sum(self.layers_per_stage[:s]) for s in range(self.program.num_stages)]
        inputs = {
            c.index: [
                list(mb[starts[c.index] : starts[c.index] + self.layers_per_stage[c.index]]) for mb in microbatches
            ]
            for c in self.chunks
        }
        self.optimizer.zero_grad()
        self.runtime.start_step(inputs)
        saved = self.runtime.optimizers
        if not step:
            self.runtime.optimizers = {}
        try:
            self.engine.run_program(self.lowered)
        except BaseException:
            self.runtime.finish_step(drain=False)
            raise
        finally:
            self.runtime.optimizers = saved
        self.runtime.finish_step()
        return dict(self.runtime.losses)

    def close(self) -> None:
        """Stop the engine's threads, then destroy the two process groups this rank made (idempotent)."""
        self.engine.close()
        self._teardown()
