"""The engine's keyword options of every plan-driven pipeline, defined once: ``EngineOptions``.

Each pipeline's constructor takes upstream's arguments plus these, keyword-only, and hands them
to ``EngineOptions.take(kwargs, owner)``, which pops them from the keywords (what is left goes to
upstream's constructor) and checks them before anything is built. ``plan_for(default)`` turns
them into the plan the engine runs, in this order:

1. ``plan``: the user's PipelinePlan or PhasedPlan (or the path of a plan file); else the
   pipeline's default plan;
2. ``thread_map``: ``"by_stream"``, ``"per_task"``, ``"main"``, ``"io"`` (the stage-0 tasks on
   thread ``io``), a dict ``{task: thread}`` or a callable (``PipelinePlan.with_thread_map``);
3. ``loads``: with ``loads > 1``, ``plans.with_parallel_loads(plan, loads, lookahead=...)``: the
   source's draws run ``loads`` at once on threads ``load``, ``load.1``, ... (1: the plan's own);
4. ``lookahead``: ``plans.with_lookahead(plan, lookahead)``, batches the source may draw beyond
   the plan's depth (None: the plan's own; after ``loads > 1``, ``loads``).

``engine_timeout_s``: a wait of the engine gives up once no thread made progress for that long
(a slow task is progress; ``torchrec_swp.engine.board``). ``autotune`` (``True`` or
``torchrec_swp.Autotune(...)``): the pipeline tunes itself while it trains
(``torchrec_swp.autotune``), starting from the plan above run without lookahead and with its draw
split off where it splits. ``sync_dataloader_exhaustion`` (the name of upstream's proposal):
ranks whose data runs out unevenly stop together (``torchrec_swp.engine.exhaustion``); on by
default (None) wherever torch.distributed's default group is initialized with more than one
rank when the pipeline is built, required with True (ValueError without a process group), off
with False: a rank whose data ends first then stops alone, as upstream's do. ``on_nonfinite``
(``"off"``, the default: upstream's behaviour, nothing captured; ``"skip"``; ``"raise"``): a step
whose loss or gradients are not finite on some rank is rolled back on every rank, its declared
effects restored (``torchrec_swp.engine.transaction``, docs/nonfinite.md), and the pipeline goes
on with the next batch (``"skip"``) or raises ``NonFiniteStep`` (``"raise"``). A new option is a field here (with
its check in ``__post_init__``), a key of ``EngineKeywords``, and, if it edits the plan, a step in
``plan_for``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, TypedDict, cast

from torchrec_swp.autotune import Autotune
from torchrec_swp.engine import DEFAULT_TIMEOUT_S
from torchrec_swp.engine.exhaustion import ExhaustionSync
from torchrec_swp.engine.transaction import MODES as NONFINITE_MODES
from torchrec_swp.plan import PhasedPlan, PipelinePlan, PlanError, ThreadMap, Vocabulary, load_plan
from torchrec_swp.plan.calls import TaskCall
from torchrec_swp.plans import with_lookahead, with_parallel_loads

PlanLike = PipelinePlan | PhasedPlan | str | os.PathLike[str]


class EngineKeywords(TypedDict, total=False):
    """The engine's keyword options, for typing ``**kwargs: Unpack[EngineKeywords]``."""

    plan: PlanLike | None
    thread_map: ThreadMap | None
    loads: int
    lookahead: int | None
    engine_timeout_s: float
    autotune: bool | Autotune
    sync_dataloader_exhaustion: bool | None
    on_nonfinite: str


def _check_number(name: str, value: object, kind: type | tuple[type, ...], low: float, *, above: bool = False) -> None:
    """TypeError unless ``value`` is a ``kind`` (never a bool), ValueError unless it is ``>= low``
    (``> low`` with ``above``); the message names the option and the value."""
    what = "an int" if kind is int else "a number"
    rule = f"{what} {'>' if above else '>='} {low}"
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"{name} must be {rule}, got {value!r}")
    if value < low or (above and value == low):  # type: ignore[operator]
        raise ValueError(f"{name} must be {rule}, got {value!r}")


@dataclass(frozen=True)
class EngineOptions:
    """The engine's options of one pipeline (module docstring); checked when built."""

    plan: PlanLike | None = None
    thread_map: ThreadMap | None = None
    loads: int = 1
    lookahead: int | None = None
    engine_timeout_s: float = DEFAULT_TIMEOUT_S
    autotune: bool | Autotune = False
    sync_dataloader_exhaustion: bool | None = None
    on_nonfinite: str = "off"

    def __post_init__(self) -> None:
        if self.plan is not None and not isinstance(self.plan, (PipelinePlan, PhasedPlan, str, os.PathLike)):
            raise TypeError(
                f"plan must be a PipelinePlan, a PhasedPlan or a path to a plan file, got {type(self.plan).__name__}"
            )
        tm = self.thread_map
        if not (tm is None or isinstance(tm, (str, Mapping)) or callable(tm)):
            raise TypeError(
                f"thread_map must be a strategy name, a dict {{task: thread}} or a callable, got {type(tm).__name__}"
            )
        _check_number("loads", self.loads, int, 1)
        if self.lookahead is not None:
            _check_number("lookahead", self.lookahead, int, 0)
        _check_number("engine_timeout_s", self.engine_timeout_s, (int, float), 0, above=True)
        if not isinstance(self.autotune, (bool, Autotune)):
            raise TypeError(
                f"autotune must be a bool or torchrec_swp.Autotune(...), got {type(self.autotune).__name__}"
            )
        if self.sync_dataloader_exhaustion is not None and not isinstance(self.sync_dataloader_exhaustion, bool):
            raise TypeError(
                f"sync_dataloader_exhaustion must be a bool or None (the default: on with a process group of "
                f"several ranks), got {self.sync_dataloader_exhaustion!r}"
            )
        if self.on_nonfinite not in NONFINITE_MODES:
            modes = ", ".join(map(repr, NONFINITE_MODES))
            raise ValueError(f"on_nonfinite must be one of {modes}, got {self.on_nonfinite!r}")

    @property
    def tuning(self) -> Autotune | None:
        """The tuner's options (None: no tuning)."""
        return Autotune.of(self.autotune, "autotune")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The keywords the options are given by."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def take(cls, kwargs: dict[str, Any], owner: str) -> EngineOptions:
        """Pop the engine's keywords from ``kwargs`` and check them; a bad one raises TypeError
        or ValueError in one line naming ``owner`` (the pipeline class), the option and its value."""
        given = {name: kwargs.pop(name) for name in cls.names() if name in kwargs}
        try:
            return cls(**given)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{owner}: {e}") from None

    def exhaustion_sync(self, owner: str) -> ExhaustionSync | None:
        """The collective of ``sync_dataloader_exhaustion`` (made now, on a gloo group of its own;
        None with False, in a world of one, or by default without a process group); with True and
        no process group, ValueError naming ``owner``."""
        if self.sync_dataloader_exhaustion is False:
            return None
        return ExhaustionSync.create(owner, self.engine_timeout_s, required=self.sync_dataloader_exhaustion is True)

    def plan_for(
        self,
        default: PipelinePlan | PhasedPlan,
        owner: str,
        tasks: Mapping[str, Callable[..., Any]] | Iterable[str] | None = None,
    ) -> PipelinePlan | PhasedPlan:
        """The plan the engine runs: ``plan`` (or ``default``), then ``thread_map``, ``loads``
        and ``lookahead`` applied in this order. A plan these cannot be applied to raises the
        edit's error (PlanError, or ValueError for a source whose draws cannot be split), in one
        line naming ``owner`` and the option. A plan file is read with the names the pipeline
        declares (``Vocabulary.of`` ``default`` and ``tasks``, its task functions), so that a task
        it has no function for is refused at its row, and so is a row whose reads or writes its
        function cannot take (``plan.calls.check_call``) where ``tasks`` maps each name to it."""
        if self.plan is None:
            plan = default
        elif isinstance(self.plan, (PipelinePlan, PhasedPlan)):
            plan = self.plan
        else:
            defaults = default.plans if isinstance(default, PhasedPlan) else (default,)
            calls = [TaskCall.of(t, fn) for t, fn in tasks.items()] if isinstance(tasks, Mapping) else []
            names = Vocabulary.of(*defaults, tasks=tasks, calls=calls)
            plan = load_plan(os.fspath(self.plan), names if tasks is not None else replace(names, tasks=None))
        steps = (
            ("thread_map", self.thread_map, lambda p: p.with_thread_map(self.thread_map)),
            ("loads", self.loads if self.loads > 1 else None,
             lambda p: with_parallel_loads(p, self.loads, lookahead=self.lookahead)),
            # (cast: the loop below skips a step whose value is None)
            ("lookahead", self.lookahead, lambda p: with_lookahead(p, cast(int, self.lookahead))),
        )
        for name, value, edit in steps:
            if value is None:
                continue
            try:
                plan = edit(plan)
            except PlanError as e:
                raise PlanError(f"{owner}({name}={value!r}): {e}", culprit=e.culprit) from None
            except ValueError as e:
                raise ValueError(f"{owner}({name}={value!r}): {e}") from None
        return plan
