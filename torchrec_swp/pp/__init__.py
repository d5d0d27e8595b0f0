"""Pipeline-parallel schedules as plans: per-rank programs of actions, pure Python (no torch).

* ``actions``: the vocabulary (``Action`` ``0F1``/``1RB0``/``2G``..., ``Program`` with an exact text
  round trip, stage placements).
* ``builders``: one pure function per schedule (GPipe, 1F1B, interleaved 1F1B, ZB-H1 / ZB1P,
  ZBV, DualPipeV, TorchRec's sparse-hoist 1F1B split), compute-only; ``build`` adds the rest.
* ``comm``: passes adding sends/receives (just in time, or Maglev's receive-ahead), gradient
  sync and optimizer step.
* ``program_checks``: ``validate``, the static rules; ``simulate``: all ranks replayed together
  with durations (deadlocks, makespan, bubble, live activations); ``grid``: text grids.
* ``exact``: CP-SAT optimal programs (OR-Tools imported on first use).
* ``lower_rank``: one rank's program -> per-thread engine instructions (``run 0F3``, ``wait``,
  ``signal``, collective tickets), run by ``torchrec_swp.engine.ProgramEngine.run_program``; the
  torch bindings of every action kind and TorchRec's Maglev drop-ins are in
  ``torchrec_swp.integrations.torchrec.maglev``.
"""

from torchrec_swp.pp.actions import (
    TORCH_KINDS,
    Action,
    Kind,
    Program,
    act,
    from_torch_text,
    loop_placement,
    to_torch_text,
    v_placement,
)
from torchrec_swp.pp.builders import SCHEDULES, build
from torchrec_swp.pp.comm import add_p2p, add_step, recv_ahead
from torchrec_swp.pp.errors import PPDeadlock, PPError, Stuck
from torchrec_swp.pp.grid import format_grid, format_ticks
from torchrec_swp.pp.program_checks import validate
from torchrec_swp.pp.simulate import ActionDurations, ProgramSimResult, Span, simulate

__all__ = [
    "TORCH_KINDS",
    "from_torch_text",
    "to_torch_text",
    "SCHEDULES",
    "Action",
    "ActionDurations",
    "Kind",
    "PPDeadlock",
    "PPError",
    "Program",
    "ProgramSimResult",
    "Span",
    "Stuck",
    "act",
    "add_p2p",
    "add_step",
    "build",
    "format_grid",
    "format_ticks",
    "loop_placement",
    "recv_ahead",
    "simulate",
    "v_placement",
    "validate",
]
