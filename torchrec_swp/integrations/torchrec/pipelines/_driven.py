"""What every torchrec_swp pipeline adds to its upstream class: a plan and an engine.

Every pipeline class keeps its upstream constructor (every argument passes through unchanged)
and adds keyword-only engine options:

* ``plan``: a PipelinePlan or PhasedPlan (or the path of a plan text file) replacing the
  default plan; its tasks must be among the class's task functions (``available_tasks()``).
* ``thread_map``: ``"by_stream"``, ``"per_task"``, ``"main"``, a dict ``{task: thread}`` or a
  callable, applied on top of the plan.
* ``engine_timeout_s``: bound on every blocking wait of the engine.

Task functions call upstream's helpers through ``self`` (``enqueue_batch``,
``start_sparse_data_dist``, ``wait_sparse_data_dist``, ``_wait_for_batch``, ...), so user code
that patches them by name keeps working, and get the batch and context of the batch they work
on from the engine, not from a position in ``self.batches``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torchrec_swp.engine import BatchLedger, Engine, StreamPool
from torchrec_swp.plan import PhasedPlan, PipelinePlan, PlanError, ThreadMap, load_plan

PlanLike = PipelinePlan | PhasedPlan | str | os.PathLike[str]


class _PlanDriven:
    """What every torchrec_swp pipeline adds to its upstream class: a plan and an engine."""

    _swp_engine: Engine
    _swp_iter: Iterator[Any] | None

    def _swp_setup(
        self,
        default_plan: PipelinePlan | PhasedPlan,
        plan: PlanLike | None,
        thread_map: ThreadMap | None,
        timeout_s: float,
        streams: StreamPool,
    ) -> None:
        if plan is None:
            chosen = default_plan
            option_map = self._swp_option_thread_map()
            if option_map and all(t in p.schedule for p in _plans(chosen) for t in option_map):
                chosen = chosen.with_thread_map(option_map)
        elif isinstance(plan, (PipelinePlan, PhasedPlan)):
            chosen = plan
        elif isinstance(plan, (str, os.PathLike)):
            chosen = load_plan(os.fspath(plan))
        else:
            raise TypeError(f"plan must be a PipelinePlan, a PhasedPlan or a path to a plan file, got {type(plan).__name__}")
        if thread_map is not None:
            chosen = chosen.with_thread_map(thread_map)
        functions = self._swp_task_functions()
        tasks = list(dict.fromkeys(t for p in _plans(chosen) for t in p.fire_order))
        unknown = [t for t in tasks if t not in functions]
        if unknown:
            raise PlanError(
                f"{type(self).__name__} has no task {unknown[0]!r}; its tasks are {', '.join(functions)}",
                culprit=unknown[0],
            )
        self._swp_iter = None
        self._swp_engine = Engine(
            chosen,
            {t: functions[t] for t in tasks},
            streams=streams,
            timeout_s=timeout_s,
            name=f"swp-{type(self).__name__}",
            device_type=getattr(getattr(self, "_device", None), "type", None),
        )

    def _swp_option_thread_map(self) -> dict[str, str]:
        """Thread groups that constructor options give tasks of the default plan (applied
        before the user's ``thread_map``); e.g. ``async_inplace_copy`` moves H2D."""
        return {}

    # Each pipeline lists its task functions: {task name: fn(b, **reads)}.
    _swp_task_functions: Callable[[], Mapping[str, Callable[..., Any]]]

    def available_tasks(self) -> tuple[str, ...]:
        """Names of the tasks a plan for this pipeline may use."""
        return tuple(self._swp_task_functions())

    def _swp_take_iterator(self, dataloader_iter: Iterator[Any]) -> None:
        """Note the iterator progress() was given; new data for the engine when it is a new
        iterator, or when progress() is called again after it raised StopIteration at the end
        of the data (a new epoch of a DataLoader whose iterator object is reused, e.g. with
        persistent workers). Nothing in flight is lost either way: see Engine.new_data."""
        engine = self._swp_engine
        if engine.end_reported or (self._swp_iter is not None and dataloader_iter is not self._swp_iter):
            engine.new_data()
            self._swp_on_new_data()
        self._swp_iter = dataloader_iter

    def _swp_on_new_data(self) -> None:
        """Clear the upstream class's own end-of-data flag (overridden where it has one)."""

    @property
    def batch_ledger(self) -> BatchLedger:
        """How many batches were drawn and trained, and which were dropped (and why)."""
        return self._swp_engine.ledger

    def untrained_batches(self) -> list[tuple[int, str]]:
        """Every batch drawn from the data and not trained, as (serial, reason): dropped by a
        reset(), left in flight by a stop at the end of data, or still in flight."""
        return self._swp_engine.untrained()

    @property
    def plan(self) -> PipelinePlan | PhasedPlan:
        """The plan ``progress()`` runs, a PhasedPlan where it has several phases (print it with
        ``plan.print_schedule(n)``)."""
        engine = self._swp_engine
        return engine.phased if len(engine.phased.phases) > 1 else engine.plan

    @property
    def engine(self) -> Engine:
        return self._swp_engine

    def close(self) -> None:
        """Stop the engine's worker threads (they also stop when the pipeline is collected)."""
        self._swp_engine.close()




def _plans(plan: PipelinePlan | PhasedPlan) -> tuple[PipelinePlan, ...]:
    return plan.plans if isinstance(plan, PhasedPlan) else (plan,)
