"""torchrec_swp: TorchRec's training pipelines as declarative plans on one shared engine.

``torchrec_swp.plan``, ``.compile`` and ``.sim`` are pure Python; the plan names are importable
from here (``from torchrec_swp import load_plan, PipelinePlan``), and the edits of TorchRec's
plans from ``torchrec_swp.plans`` (``from torchrec_swp import plans``). The pipeline classes (importable
from here too) need torch and the supported TorchRec version, and are loaded on first use so that
the pure layers import without them.
"""

from __future__ import annotations

import importlib
from typing import Any

from torchrec_swp import drop_ins

# torchrec_swp.plan's public names, importable from here (loaded on first use, like the pipelines:
# ``import torchrec_swp.streamcheck`` must not load the plan layer)
_PLAN_NAMES = ("PhasedPlan", "PipelinePlan", "PipelineTask", "PlanError", "TaskSchedule", "When", "load_plan")

__version__ = "0.2.0"

#: The pipelines upstream defines in ``experimental_pipelines.py`` (TorchRec 1.8.0 and 1.9.2 ship
#: the same file): a train/eval hybrid, a background copy, the optimizer step in backward, memory
#: stashing, sparse work on the CPU.
EXPERIMENTAL_PIPELINES = tuple(d.name for d in drop_ins.drop_ins() if d.experimental)

# The upstream pipelines, one per row of ``torchrec_swp.drop_ins`` (TrainPipelinePEC from TorchRec 1.9).
_PIPELINES = drop_ins.names()


def _available() -> tuple[str, ...]:
    """The train pipelines the installed TorchRec has (TrainPipelinePEC from 1.9 on); all of
    them when none or an unsupported one is installed (using them raises an ImportError saying why)."""
    return drop_ins.names(_series())


def _series() -> str:
    return "1.9" if _is_1_9() else "1.8"


def _is_1_9() -> bool:
    from importlib import metadata

    from torchrec_swp.integrations.torchrec.compat import parse_version

    try:
        return parse_version(metadata.version("torchrec")).has_pec
    except (metadata.PackageNotFoundError, ValueError):
        return True


__all__ = [
    "__version__",
    "plans",
    "Autotune",
    "NonFiniteStep",
    *_PLAN_NAMES,
    *_available(),
    # the other classes, a row each in ``drop_ins.EXTRAS``: TorchRec 1.9's pipeline-parallel
    # (Maglev) schedules and a rank holding several stages; gradient accumulation around any pipeline
    *(e.name for e in drop_ins.extras(_series())),
]


def __dir__() -> list[str]:
    """What tab completion shows: the public names, pipelines included (loaded on first use)."""
    return sorted({*globals(), *__all__, *_available()})


def __getattr__(name: str) -> Any:
    if name in _PLAN_NAMES:
        from torchrec_swp import plan

        return getattr(plan, name)
    if name == "Autotune":  # the options of a pipeline that tunes itself (autotune=Autotune(...))
        from torchrec_swp.autotune import Autotune

        return Autotune
    if name == "NonFiniteStep":  # what on_nonfinite="raise" raises
        from torchrec_swp.engine.transaction import NonFiniteStep

        return NonFiniteStep
    if name == "plans":
        import torchrec_swp.plans

        return torchrec_swp.plans
    if (row := drop_ins.DROP_INS.get(name)) is not None:
        from torchrec_swp.integrations.torchrec import pipelines
        from torchrec_swp.integrations.torchrec.compat import TESTED_PAIRINGS

        if name not in drop_ins.names(pipelines.TORCHREC.series):
            raise ImportError(
                f"{name} is new in TorchRec {row.since}; torchrec {pipelines.TORCHREC.text} is installed "
                f"(pip install --no-deps torchrec=={TESTED_PAIRINGS[row.since].torchrec})"
            )
        return getattr(importlib.import_module(row.module_path), name)
    if (extra := drop_ins.EXTRAS.get(name)) is not None:  # Maglev's: an ImportError naming TorchRec 1.9 on 1.8
        return getattr(importlib.import_module(extra.module), name)
    raise AttributeError(f"module 'torchrec_swp' has no attribute {name!r}")
