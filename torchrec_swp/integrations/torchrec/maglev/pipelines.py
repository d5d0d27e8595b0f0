"""Drop-in subclasses of TorchRec 1.9's Maglev schedules whose ``progress()`` is the engine
running one rank's program.

::

    # before: from torchrec.distributed.maglev.pipeline import Maglev1F1B
    from torchrec_swp.integrations.torchrec.maglev import Maglev1F1B     # same constructor
    pipeline = Maglev1F1B(stage, optimizer, num_microbatches=8)          # upstream's calls, in its order
    pipeline = Maglev1F1B(stage, optimizer, 8, thread_map="comm")        # sends/receives on their own thread
    pipeline = Maglev1F1B(stage, optimizer, 8, schedule="ZB-H1")         # another schedule, same stage
    print(pipeline.program.to_text())                                    # every rank's actions
    print(format_program(pipeline.lowered))                              # this rank's engine threads

What ``progress(dataloader_iter)`` does, as upstream: ``stage.take_inputs`` (the cascade
all-to-all, outside the program), ``optimizer.zero_grad()``, then ``engine.run_program`` of
this rank's lowered program (its ``F``/``B``/sends/receives/``G``/``O``), then the sends still in
flight are drained. With the default options the program is the builder's copy of upstream's
order (``pp.builders.maglev_1f1b``; ``MaglevPipelineBase``: one microbatch) and every action is
the call upstream makes (``runtime.StageWrapperWire``): results are bit-identical, which
``tests/dist/test_maglev_parity.py`` checks on CPU gloo ranks.

Keyword-only options (the constructor is upstream's otherwise; defined once in
``program_options.ProgramOptions``):

* ``schedule``: a builder with one stage per rank (``"1F1B"``, ``"GPipe"``, ``"ZB-H1"``,
  ``"1F1B-split"``; ``recv_ahead`` = how many computes ahead receives are posted, default the
  class's: 0, RecvAhead 1), or ``program``: any ``pp.Program`` (or its text) for the stages
  and microbatches of this pipeline; it is validated on every rank before anything runs.
* ``thread_map``: which engine thread runs each action kind: ``"main"`` (default: everything
  on the calling thread, upstream's behaviour), ``"comm"`` (sends and receives on one ``comm``
  thread), ``"send_recv"`` (sends on ``send``, receives on ``recv``), a ``{kind: thread}``
  mapping or a callable ``Action -> thread``.
* ``grad_sync``: ``"wrapper"`` (default, upstream's): every forward but the pass's last runs in
  ``no_sync``, so a DDP/FSDP wrapper reduces once, inside the backward that follows the last
  forward; ``G`` marks where. ``"explicit"``: every forward runs in ``no_sync`` and ``G``
  averages the stage's gradients over ``stage.stage_pg`` after the stage's last backward. They
  differ where the backward after the last forward is not the last one (every stage but the
  last: 1F1B's warm-up), see docs/pp.md.
* ``engine_timeout_s``: the engine's timeout (no thread made progress that long) and the bound on each
  transfer of the wire, receive or send (``runtime.StageWrapperWire``).
* ``sync_dataloader_exhaustion`` (default None: on with a process group of several ranks;
  False: upstream's behaviour, where a rank whose data ends first raises StopIteration alone and
  its peers' next input-dist round fails or hangs): every raw batch ``take_inputs`` draws is
  followed by a MIN all-reduce of "I have it" on a gloo
  group of its own (``torchrec_swp.engine.exhaustion``), so every rank raises StopIteration in
  the same round. The draw is upstream's, on the calling thread, so the all-reduce is too (one
  per round). An item a rank drew for that round is not trained (``dropped_past_end`` counts them).

After a failure the step's state is dropped and the error re-raised (with the action, thread
and step named); like upstream's, the pipeline (and its process groups) must then be rebuilt.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torchrec.distributed.maglev import pipeline as upstream
from torchrec.distributed.maglev.stage import StageWrapper
from typing_extensions import Unpack

from torchrec_swp.compile import IterationProgram
from torchrec_swp.engine import ProgramEngine, stream_pool_for
from torchrec_swp.engine.exhaustion import SyncedIterator
from torchrec_swp.integrations.torchrec.engine_driven import EngineDriven
from torchrec_swp.integrations.torchrec.maglev.cpu import unwrap
from torchrec_swp.integrations.torchrec.maglev.program_options import (
    NAMES,
    GradSync,
    ProgramKeywords,
    ProgramOptions,
)
from torchrec_swp.integrations.torchrec.maglev.runtime import Chunk, RankRuntime, StageWrapperWire, all_reduce_grads
from torchrec_swp.pp import PPError, Program, validate
from torchrec_swp.pp.actions import Kind
from torchrec_swp.pp.builders import maglev_1f1b, maglev_base
from torchrec_swp.pp.lower_rank import lower_rank

__all__ = ["Maglev1F1B", "Maglev1F1BRecvAhead", "MaglevPipelineBase"]


class ProgramDriven(EngineDriven):
    """What the three drop-ins share: the program, its lowering, the engine (``EngineDriven``:
    ``close()``, ``with``, the check of ``progress()``'s argument), the bindings."""

    stage: StageWrapper
    optimizer: torch.optim.Optimizer
    _no_sync: Callable[[], contextlib.AbstractContextManager[None]]
    _forward_context: Callable[[int, int], contextlib.AbstractContextManager[None]]  # upstream's
    _swp_engine: ProgramEngine

    def _setup(self, num_microbatches: int, default: Program, default_recv_ahead: int, options: ProgramOptions) -> None:
        stage = self.stage
        owner = type(self).__name__
        self._num_microbatches = num_microbatches
        S, me = stage.num_stages, stage.stage_index
        program = options.program_for(default, S, num_microbatches, default_recv_ahead)
        validate(program)  # every rank checks the same program: a bad one fails everywhere, before any P2P
        grad_sync = options.grad_sync
        split = any(a.kind in (Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT) for a in program.ranks[me])
        if split and grad_sync == "wrapper" and upstream._no_sync_modules(stage.module):
            raise ValueError(
                f"program {program.name} splits backwards into I and W; with a data-parallel wrapper on the stage "
                "module that needs grad_sync='explicit' (the wrapper's reducer expects whole backwards)"
            )
        self.program: Program = program
        self.grad_sync: GradSync = grad_sync
        self.lowered: IterationProgram = lower_rank(program, me, options.threads)
        module = stage.module
        chunk = Chunk(
            me,
            stage.forward,
            tuple(stage.in_activation_specs()),
            tuple(stage.out_activation_specs()),
            [p for p in module.parameters() if p.requires_grad],
            split_module=unwrap(module) if any(a.kind is Kind.SPARSE for a in program.ranks[me]) else None,
        )
        M = num_microbatches
        if grad_sync == "wrapper":
            forward_context = lambda s, m: self._forward_context(m, M)
            sync = None
        else:
            forward_context = lambda s, m: self._no_sync()
            sync = lambda s: all_reduce_grads(chunk.parameters, stage.stage_pg)
        wire = StageWrapperWire(stage, timeout_s=options.engine_timeout_s)
        self.runtime = RankRuntime(
            [chunk], S, wire, {me: self.optimizer}, forward_context=forward_context, grad_sync=sync
        )
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        # made once every check passed (a collective: every rank builds the same pipelines)
        self._exhaustion = options.exhaustion_sync(owner)
        if self._exhaustion is not None:  # its group: destroyed at close(), collection or exit
            self._swp_teardown().group(self._exhaustion.group, self._exhaustion.finish)
        self._synced: SyncedIterator | None = None
        engine = ProgramEngine(
            self.runtime.bindings(),
            streams=stream_pool_for(device),  # checked on the CPU with SWP_STREAM_CHECK=1
            timeout_s=options.engine_timeout_s,
            name=f"{program.name}-stage{me}",
        )
        self._swp_drive(engine)

    def _run_step(self, dataloader_iter: Iterator[Any]) -> dict[int, torch.Tensor]:
        self._swp_check_progress(dataloader_iter)
        stage = self.stage
        if self._exhaustion is not None:
            if self._synced is None or self._synced.iterator is not dataloader_iter:
                self._synced = SyncedIterator(dataloader_iter, self._exhaustion)
            dataloader_iter = self._synced
        inputs = stage.take_inputs(dataloader_iter, self._num_microbatches)
        self.optimizer.zero_grad()
        self.runtime.start_step({stage.stage_index: inputs})
        try:
            self._swp_engine.run_program(self.lowered)
        except BaseException:
            self.runtime.finish_step(drain=False)
            raise
        self.runtime.finish_step()
        return self.runtime.losses

    @property
    def dropped_past_end(self) -> int:
        """Items of the current iterator drawn for the round where another rank's data ended
        (``sync_dataloader_exhaustion``): never trained."""
        return 0 if self._synced is None else self._synced.dropped


class MaglevPipelineBase(ProgramDriven, upstream.MaglevPipelineBase):
    """Upstream's one-microbatch schedule on the engine; returns the loss on the last stage."""

    def __init__(
        self,
        stage: StageWrapper,
        optimizer: torch.optim.Optimizer,
        no_sync: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
        **options: Unpack[ProgramKeywords],
    ) -> None:
        """Upstream's constructor; ``options``: ``program``, ``thread_map``, ``grad_sync``,
        ``engine_timeout_s``, ``sync_dataloader_exhaustion`` (``ProgramOptions``)."""
        names = ("program", "thread_map", "grad_sync", "engine_timeout_s", "sync_dataloader_exhaustion")
        taken = ProgramOptions.take(options, type(self).__name__, names)
        upstream.MaglevPipelineBase.__init__(self, stage, optimizer, no_sync)
        self._setup(1, maglev_base(stage.num_stages), 0, taken)

    def progress(self, dataloader_iter: Iterator[Any]) -> torch.Tensor | None:
        return self._run_step(dataloader_iter).get(0)


class Maglev1F1B(MaglevPipelineBase, upstream.Maglev1F1B):
    """Upstream's 1F1B (receives right before their consumer) on the engine; returns None."""

    _recv_ahead = False

    def __init__(
        self,
        stage: StageWrapper,
        optimizer: torch.optim.Optimizer,
        num_microbatches: int,
        no_sync: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
        **options: Unpack[ProgramKeywords],
    ) -> None:
        """Upstream's constructor; ``options``: every one of ``ProgramOptions``'."""
        taken = ProgramOptions.take(options, type(self).__name__, NAMES)
        upstream.Maglev1F1B.__init__(self, stage, optimizer, num_microbatches, no_sync)
        try:
            default = maglev_1f1b(stage.num_stages, num_microbatches, recv_ahead=self._recv_ahead)
        except PPError as e:  # upstream's constructor already refused what the builder refuses
            raise ValueError(str(e)) from None
        self._setup(num_microbatches, default, int(self._recv_ahead), taken)

    def progress(self, dataloader_iter: Iterator[Any]) -> torch.Tensor | None:
        self._run_step(dataloader_iter)
        return None


class Maglev1F1BRecvAhead(Maglev1F1B, upstream.Maglev1F1BRecvAhead):
    """Upstream's 1F1B with every receive posted one compute ahead, on the engine."""

    _recv_ahead = True
