"""The keyword options of the Maglev drop-ins, defined once: ``ProgramOptions``.

Each drop-in's constructor takes upstream's arguments plus these, keyword-only, and hands them to
``ProgramOptions.take(kwargs, owner, names)``, which checks them before anything is built (an
unknown keyword, or one the class does not take, is a TypeError naming the class):

* ``schedule`` / ``program`` / ``recv_ahead``: which program the rank runs (``MaglevPipelineBase``
  takes ``program`` only);
* ``thread_map`` (an ``ActionThreadMap``): which engine thread runs each action;
* ``grad_sync``: ``"wrapper"`` or ``"explicit"``;
* ``engine_timeout_s`` and ``sync_dataloader_exhaustion``: the same options as the plan-driven
  pipelines', checked and made by their definition there
  (``torchrec_swp.integrations.torchrec.pipelines.engine_options.EngineOptions``).

What each does: ``torchrec_swp.integrations.torchrec.maglev.pipelines``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from torchrec_swp.engine.exhaustion import ExhaustionSync
from torchrec_swp.integrations.torchrec.pipelines.engine_options import EngineOptions
from torchrec_swp.plan import MAIN_THREAD
from torchrec_swp.pp import Program, build
from torchrec_swp.pp.actions import P2P, Action
from torchrec_swp.pp.builders import SCHEDULES

#: Which engine thread runs each action of the program: a preset name, ``{kind text: thread}`` or
#: ``Action -> thread`` (not ``torchrec_swp.plan.ThreadMap``, which places a plan's tasks).
ActionThreadMap = Literal["main", "comm", "send_recv"] | Mapping[str, str] | Callable[[Action], str]
GradSync = Literal["wrapper", "explicit"]

PRESETS: dict[str, Callable[[Action], str]] = {
    "main": lambda a: MAIN_THREAD,
    "comm": lambda a: "comm" if a.kind in P2P else MAIN_THREAD,
    "send_recv": lambda a: ("send" if a.kind.value.startswith("S") else "recv") if a.kind in P2P else MAIN_THREAD,
}

#: Builders the drop-ins accept by name: one stage per rank, so they run on a StageWrapper.
ONE_STAGE_PER_RANK = ("1F1B", "GPipe", "ZB-H1", "1F1B-split")

#: The options the plan-driven pipelines take too, with the same meaning (``EngineOptions``).
SHARED = ("engine_timeout_s", "sync_dataloader_exhaustion")


class ProgramKeywords(TypedDict, total=False):
    """The options, for typing ``**options: Unpack[ProgramKeywords]``."""

    schedule: str | None
    program: Program | str | None
    recv_ahead: int | None
    thread_map: ActionThreadMap
    grad_sync: GradSync
    engine_timeout_s: float
    sync_dataloader_exhaustion: bool | None


#: Every option's keyword, in ``ProgramKeywords``' order.
NAMES = tuple(ProgramKeywords.__annotations__)


@dataclass(frozen=True)
class ProgramOptions:
    """One Maglev drop-in's options (module docstring); checked when built."""

    schedule: str | None = None
    program: Program | str | None = None
    recv_ahead: int | None = None
    thread_map: ActionThreadMap = "main"
    grad_sync: GradSync = "wrapper"
    #: ``engine_timeout_s`` and ``sync_dataloader_exhaustion``, as the plan-driven pipelines'
    engine: EngineOptions = field(default_factory=EngineOptions)

    def __post_init__(self) -> None:
        if self.program is not None and self.schedule is not None:
            raise ValueError("give schedule= or program=, not both")
        if not (self.program is None or isinstance(self.program, (Program, str))):
            raise TypeError(f"program must be a torchrec_swp.pp.Program or its text, got {type(self.program).__name__}")
        if self.schedule is not None and self.schedule not in ONE_STAGE_PER_RANK:
            raise ValueError(
                f"schedule {self.schedule!r}: a Maglev stage runs one stage per rank; choose one of "
                f"{', '.join(ONE_STAGE_PER_RANK)} (or pass a program=; interleaved and V schedules "
                "run on torchrec_swp.integrations.torchrec.maglev.PipelineRank)"
            )
        if self.grad_sync not in ("wrapper", "explicit"):
            raise ValueError(f"grad_sync must be 'wrapper' or 'explicit', got {self.grad_sync!r}")
        tm = self.thread_map
        if isinstance(tm, str) and tm not in PRESETS:
            raise ValueError(f"thread_map {tm!r}: use one of {', '.join(PRESETS)}, a mapping or a callable")
        if not (isinstance(tm, (str, Mapping)) or callable(tm)):
            raise TypeError(f"thread_map must be a preset name, a mapping or a callable, got {type(tm).__name__}")

    @classmethod
    def take(cls, kwargs: Mapping[str, Any], owner: str, names: tuple[str, ...]) -> ProgramOptions:
        """The options given as ``kwargs``, of which ``owner`` (the class) takes ``names``; a
        keyword outside them is a TypeError naming ``owner``, as Python's own, and a bad value a
        TypeError or ValueError in one line naming ``owner`` and the option."""
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}")
        own = {k: v for k, v in kwargs.items() if k not in SHARED}
        engine = EngineOptions.take({k: v for k, v in kwargs.items() if k in SHARED}, owner)
        try:
            return cls(engine=engine, **own)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{owner}: {e}") from None

    def program_for(self, default: Program, num_stages: int, num_microbatches: int, default_recv_ahead: int) -> Program:
        """The program the pipeline runs: ``program`` (or its text), the builder's ``schedule``
        (with ``recv_ahead``, else ``default_recv_ahead``), or ``default``; ValueError unless it
        has ``num_stages`` stages, one per rank, and ``num_microbatches`` microbatches."""
        S, M = num_stages, num_microbatches
        if self.schedule is not None:
            if not SCHEDULES[self.schedule].supports(S, M):
                raise ValueError(f"schedule {self.schedule!r} does not support {S} stages x {M} microbatches")
            recv_ahead = default_recv_ahead if self.recv_ahead is None else self.recv_ahead
            program = build(self.schedule, S, M, recv_ahead=recv_ahead)
        elif self.program is None:
            program = default
        else:
            program = Program.from_text(self.program) if isinstance(self.program, str) else self.program
        if program.num_stages != S or program.placement != tuple(range(S)):
            raise ValueError(
                f"program {program.name} places stages {program.placement} on ranks; this pipeline has {S} "
                "stages, one per rank (stage s on pipeline rank s)"
            )
        if program.num_microbatches != M:
            raise ValueError(f"program {program.name} has {program.num_microbatches} microbatches, the pipeline {M}")
        return program

    @property
    def threads(self) -> Mapping[str, str] | Callable[[Action], str]:
        """``thread_map`` with a preset name resolved, as ``pp.lower.lower_rank`` takes it."""
        return PRESETS[self.thread_map] if isinstance(self.thread_map, str) else self.thread_map

    @property
    def engine_timeout_s(self) -> float:
        return self.engine.engine_timeout_s

    def exhaustion_sync(self, owner: str) -> ExhaustionSync | None:
        """``EngineOptions.exhaustion_sync``: the collective of ``sync_dataloader_exhaustion``."""
        return self.engine.exhaustion_sync(owner)
