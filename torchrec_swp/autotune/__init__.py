"""A pipeline that tunes itself while it trains: ``autotune=True`` (or ``autotune=Autotune(...)``)
on any plan-driven pipeline.

How one tuning goes (``tuner.py``): the starting plan warms up, then a ``TaskProfiler`` measures
``steps`` steps; at the next ``progress()`` call every rank's profile reaches rank 0
(``ranks.py``), which calibrates the multi-rank simulator and searches the changes that keep the
numerics (``torchrec_swp.autosched.overlap``); the running plan and the search's best few then
run in turn for a few steps each (``trial.py``: A, B, C, A, B, C ..., every switch at a batch
boundary, ``Engine.switch_plan``) until rank 0 tells them apart from every rank's measurements,
and every rank keeps the measured best; a plan is kept when nothing is predicted, or measured, to
win by more than the noise. The decision and its reasons go to ``Autotune.report`` on rank 0 (by
default one line per event on stdout, every line at INFO on logger ``torchrec_swp.autotune``;
``report=log_info``: the log only; None: nothing); the measured step with the new plan follows
``verify`` steps later. ``pipeline.autotune_decision`` holds it, and ``state_dict()`` carries it
so that a resume applies it without tuning again. Where the data ends first, a line says so and
``autotune_decision`` is a Decision with ``decided`` False ("not decided: the data ended ...").
What its searches and trials may lose against the plans they start from is bounded
(``Autotune.budget_steps``, ``budget_s``; ``budget.py``): where that is spent, the tuning stops
and its decision says so.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what __getattr__ gives, for the type checker
    from torchrec_swp.autotune.decision import Decision
    from torchrec_swp.autotune.options import PRINTED, Autotune, PrintedReport, log_info
    from torchrec_swp.autotune.trial import Tried
    from torchrec_swp.autotune.tuner import Hooks, Tuner

#: where each public name lives (loaded on first use: the search's process imports
#: ``torchrec_swp.autotune.search`` without the tuner, and so without torch)
_NAMES = {
    "PRINTED": "options",
    "Autotune": "options",
    "PrintedReport": "options",
    "log_info": "options",
    "Tried": "trial",
    "Decision": "decision",
    "Hooks": "tuner",
    "Tuner": "tuner",
}

__all__ = ["PRINTED", "Autotune", "Decision", "Hooks", "PrintedReport", "Tried", "Tuner", "log_info"]


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(f"torchrec_swp.autotune.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'torchrec_swp.autotune' has no attribute {name!r}")
