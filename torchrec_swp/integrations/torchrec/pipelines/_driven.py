"""What every torchrec_swp pipeline adds to its upstream class: a plan and an engine.

Every pipeline class keeps its upstream constructor (every argument passes through unchanged)
and adds the engine's keyword-only options, defined once in ``engine_options.EngineOptions``
(``PlanDriven`` says what each does and the order they apply in). What it shares with the Maglev
drop-ins (``close()``, ``with``, the check of ``progress()``'s argument) is
``integrations/torchrec/engine_driven.py``'s ``EngineDriven``; the task functions several
classes share are ``training_tasks.TrainingTasks``.

Task functions call upstream's helpers through ``self`` (``enqueue_batch``,
``start_sparse_data_dist``, ``wait_sparse_data_dist``, ``_wait_for_batch``, ...), so user code
that patches them by name keeps working, and get the batch and context of the batch they work
on from the engine, not from a position in ``self.batches``.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch.distributed as dist
from torch.nn import Module

from torchrec_swp import drop_ins
from torchrec_swp.autotune import Decision, Hooks, Tuner
from torchrec_swp.ddp_layout import layout_state, restore_layout_state
from torchrec_swp.engine import BatchLedger, Engine, StreamPool
from torchrec_swp.engine.transaction import Transaction, Verdict, check_plan, ordered
from torchrec_swp.integrations.torchrec import nonfinite
from torchrec_swp.integrations.torchrec.engine_driven import EngineDriven, check_keywords
from torchrec_swp.integrations.torchrec.pipelines.cpu_safe import without_stream_lookups
from torchrec_swp.integrations.torchrec.pipelines.engine_options import EngineOptions
from torchrec_swp.integrations.torchrec.pipelines.protocol import check_class, task_methods
from torchrec_swp.plan import DEFAULT_STREAM, PhasedPlan, PipelinePlan, PlanError
from torchrec_swp.plans import DRAW_TASKS, with_lookahead, with_parallel_loads

if TYPE_CHECKING:
    from torchrec_swp.autotune.tuner import TunedEngine


class PlanDriven(EngineDriven, metaclass=ABCMeta):
    """What every torchrec_swp pipeline adds to its upstream class: a plan and an engine.

    It comes before the upstream class among the bases (``class X(PlanDriven, upstream.X)``),
    so that its ``progress()`` and ``reset()`` replace upstream's; an unknown constructor keyword
    is a TypeError naming the class before any constructor runs (``__new__``). The pipeline's
    life (``close()``, ``with pipeline:``) and the check of ``progress()``'s argument are
    ``EngineDriven``'s, shared with the Maglev drop-ins.

    The engine's options (keyword-only, after upstream's arguments; ``EngineOptions``) make the
    plan in this order:

    1. ``plan=``: a PipelinePlan or PhasedPlan (or the path of a plan text file) replacing the
       default plan; its tasks must be among the class's task functions (``available_tasks()``).
    2. ``thread_map=``: ``"by_stream"``, ``"per_task"``, ``"main"``, ``"io"`` (the stage-0 tasks,
       loading the batch and copying it to the device, on thread ``io``), a dict
       ``{task: thread}`` or a callable; moves tasks to CPU threads, same results.
    3. ``loads=`` (default 1): with ``loads > 1`` the plan becomes
       ``plans.with_parallel_loads(plan, loads, lookahead=lookahead)``: the source's draws run
       ``loads`` at once on threads ``load``, ``load.1``, ... (H2D's draw is split off into a
       Fetch task; Base's and PT2's LoadBatch only draws and moves as it is). Draws still take
       turns in batch order: over a plain iterator, whose ``next()`` does all the work, loads
       train correctly but gain nothing; ``torchrec_swp.data.MapSource`` (a map-style dataset)
       is what makes them overlap, each load fetching its item at once.
    4. ``lookahead=`` (default None: the plan's own; 0 in the default plans, ``loads`` after
       ``loads > 1``): ``plans.with_lookahead(plan, lookahead)``: the source may draw that many
       batches beyond the plan's depth, also between ``progress()`` calls when it runs on a
       thread of its own.

    ``engine_timeout_s=`` bounds every blocking wait of the engine. The SparseDist family also
    takes ``input_dist_group=`` (``TrainPipelineSparseDist``): the input dist on a process group
    of its own, and the default plan with ``plans.with_input_dist_group``. ``plan.print_schedule(n)``
    shows the result, loads and lookahead in its header line.

    ``sync_dataloader_exhaustion`` (default None: on wherever torch.distributed's default group
    has several ranks when the pipeline is built; True: required, ValueError without a process
    group; False: upstream's behaviour, a rank whose data ends first stops alone and its peers'
    next collectives fail or hang): ranks whose data runs out unevenly stop together. Every draw
    begins a MIN all-reduce of "I have this batch" on a gloo group made here, and the batch's
    next task waits for it (``_swp_draw_undoer``: what undoes the draw of a batch some rank
    lacks; without one the draw itself waits); the first batch some rank lacks ends the data on
    every rank, and an item drawn for it is not trained (``torchrec_swp.engine.exhaustion``). A
    world of one needs no sync (nothing is made).

    What a drop-in declares (``protocol``): its task functions, methods marked ``@task(name)``;
    its default plan (``_swp_default_plan``) and its streams (``_swp_streams``), abstract here; its
    row in ``torchrec_swp.drop_ins``. All is checked when the class is defined."""

    _swp_engine: Engine
    #: The step's transaction of ``on_nonfinite=`` (None: "off").
    _swp_nonfinite: Transaction | None = None

    #: ``{task: method name}``: the class's task functions (``protocol.task_methods``), set when
    #: the class is defined.
    _swp_tasks: ClassVar[Mapping[str, str]] = {}
    #: The hooks every drop-in implements (checked when a drop-in's class is defined).
    _SWP_REQUIRED = ("_swp_default_plan", "_swp_streams")

    #: The pipeline's own counters its plan's ``counters`` effect changes (put back by a rolled-back
    #: step, ``on_nonfinite=``); empty: the effect cannot be captured and such a plan is refused.
    _swp_counters: ClassVar[tuple[str, ...]] = ()

    #: Keywords a class's constructor takes from ``**kwargs`` itself, beyond those its signature
    #: and its bases' name and the engine's options (``check_keywords``).
    _swp_keywords: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._swp_tasks = task_methods(cls)
        from_arguments = cls._swp_task_functions is not PlanDriven._swp_task_functions
        check_class(cls, abstract=PlanDriven._SWP_REQUIRED, tasks_from_arguments=from_arguments)

    @abstractmethod
    def _swp_default_plan(self) -> PipelinePlan | PhasedPlan:
        """The plan ``progress()`` runs unless ``plan=`` says otherwise, for the options this
        pipeline was built with: ``self._swp_row_plan(**those options)``."""

    def _swp_row_plan(self, **arguments: Any) -> Any:
        """The plan the catalog function of this class's row (``torchrec_swp.drop_ins``; a user's
        subclass: its drop-in's) makes with ``arguments``: the row alone names the function, the
        class says which of its options are the function's arguments. (Any: a row's function
        makes a PipelinePlan or a PhasedPlan, and each class declares which.)"""
        from torchrec_swp.catalog import torchrec as catalog

        row = drop_ins.row_of(type(self))
        if row is None:
            raise TypeError(f"{type(self).__name__} is no drop-in of torchrec_swp.drop_ins and has no catalog plan")
        return catalog.default_plan(replace(row, plan_arguments=arguments))

    @abstractmethod
    def _swp_streams(self) -> StreamPool:
        """The streams the plan's stream names stand for (``stream_pool_for``; in checked mode
        ``_swp_checked``'s)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """The one place that sees the whole constructor call before any ``__init__`` runs: a
        keyword that no constructor among the bases takes is a TypeError naming the class here,
        before the class's own work (process groups) or upstream's constructor (which logs)."""
        check_keywords(cls, kwargs, EngineOptions.names() + cls._swp_keywords)
        return super().__new__(cls)

    def _swp_setup(self, default_plan: PipelinePlan | PhasedPlan, options: EngineOptions, streams: StreamPool) -> None:
        owner = type(self).__name__
        without_stream_lookups(self)
        self._swp_default = default_plan
        chosen = options.plan_for(default_plan, owner, tasks=self._swp_task_functions())
        for p in _plans(chosen):
            if p.loads > 1 and p.source not in DRAW_TASKS:
                fix = f": pass the plan with one load and loads={p.loads}, which splits the draw off"
                fix = fix if p.source == "H2D" else ""
                raise PlanError(
                    f"{owner}: plan {p.name} has {p.loads} loads of its source {p.source}, whose function does more "
                    f"than draw from the data (its calls would overlap); only a source that only draws "
                    f"({', '.join(DRAW_TASKS)}) may have loads{fix}",
                    culprit=str(p.source),
                )
        tuning = options.tuning
        if tuning is not None and tuning.too_short(chosen.pipeline_depth) is None:
            chosen = start_for_tuning(chosen)
        transaction = None
        if options.on_nonfinite != "off":
            if tuning is not None:
                raise ValueError(
                    f"{owner}: on_nonfinite={options.on_nonfinite!r} with autotune is not supported yet (the tuner's "
                    "plans are not checked to be undoable); choose one"
                )
            transaction = self._swp_transaction(options.on_nonfinite)
        self._swp_nonfinite = transaction
        self._swp_engine_options: dict[str, Any] = {  # Engine's keyword arguments
            "streams": streams,
            "timeout_s": options.engine_timeout_s,
            "name": f"swp-{owner}",
            # checked mode runs what a CUDA run would: no task is a no-op for the CPU there
            "device_type": (
                None
                if getattr(streams, "checker", None) is not None
                else getattr(getattr(self, "_device", None), "type", None)
            ),
            "training": self._swp_training_mode(),
            "exhaustion": options.exhaustion_sync(owner),
            "on_new_data": self._swp_on_new_data,
            "undo_draw": self._swp_draw_undoer(),
            "transaction": transaction,
        }
        if (sync := self._swp_engine_options["exhaustion"]) is not None:
            self._swp_teardown().group(sync.group, sync.finish)  # its last agreement waited for first
        self._swp_drive(self._swp_new_engine(chosen))
        self._swp_tuner = None
        if tuning is not None:
            hooks = replace(self._swp_autotune_hooks(), group=self._swp_tuner_group)
            # (cast: Engine's plan and phased are read-only properties, which the tuner only reads)
            self._swp_tuner = Tuner(tuning, cast("TunedEngine", self._swp_engine), hooks, owner)
            self._swp_teardown().threads(self._swp_tuner.close)  # a search running in the background

    def _swp_new_engine(self, plan: PipelinePlan | PhasedPlan) -> Engine:
        owner = type(self).__name__
        functions = self._swp_task_functions()
        tasks = list(dict.fromkeys(t for p in _plans(plan) for t in p.fire_order))
        unknown = [t for t in tasks if t not in functions]
        if unknown:
            raise PlanError(
                f"{owner} has no task {unknown[0]!r}; its tasks are {', '.join(functions)}",
                culprit=unknown[0],
            )
        if self._swp_nonfinite is not None:
            edit = self._swp_undoable_plan
            plan = plan.each(edit) if isinstance(plan, PhasedPlan) else edit(plan)
            plan = undoable(plan, self._swp_nonfinite, owner, self._swp_default)
        return Engine(plan, {t: functions[t] for t in tasks}, **self._swp_engine_options)

    @property
    def can_replan(self) -> bool:
        """Whether ``replan()`` may run now: before the first ``progress()`` or right after
        ``reset()``, on a pipeline that does not tune its own plan (``autotune=``)."""
        engine = self._swp_engine
        return self._swp_tuner is None and not engine.book.requested and not engine.in_flight()

    def replan(self, plan: PipelinePlan | PhasedPlan) -> None:
        """Run ``plan`` from now on, with any tasks of this class (unlike ``engine.switch_plan``,
        which keeps the tasks); only where ``can_replan``. What GradientAccumulationWrapper uses to
        put its window into the plan."""
        owner = type(self).__name__
        if not self.can_replan:
            why = "it tunes its own plan (autotune=)" if self._swp_tuner is not None else "it has run"
            raise PlanError(
                f"{owner}.replan(): only before the first progress() or right after reset(), not when {why}"
            )
        new = self._swp_new_engine(plan)
        self._swp_engine.close()
        self.engine = new

    def _swp_training_mode(self) -> Callable[[], bool] | None:
        """What decides the plan's ``when=train`` guards at each ``progress()`` call (None: the
        class's plans have none; overridden where they do, e.g. ``model.training``)."""
        return None

    def _swp_autotune_hooks(self) -> Hooks:
        """What the tuner may change beyond the plan (overridden where the input dist can get a
        process group of its own)."""
        return Hooks()

    def _swp_tuner_group(self) -> dist.ProcessGroup:
        """The tuner's own process group (``Hooks.group``: gloo, for its polls while it searches
        in the background), destroyed by the pipeline's teardown."""
        # (cast: every rank is in a group over all ranks, never GroupMember.NON_GROUP_MEMBER)
        group = cast(dist.ProcessGroup, dist.new_group(backend="gloo"))
        self._swp_teardown().group(group)
        return group

    @property
    def autotune_decision(self) -> Decision | None:
        """What the tuner decided: the plan, why, predicted and measured step times. None without
        ``autotune`` or while it tunes; where the data ended before it decided, a Decision with
        ``decided`` False (``why``: "not decided: the data ended after N steps, having profiled P
        of the S steps it needs ..."), replaced if more data lets it decide."""
        return None if self._swp_tuner is None else self._swp_tuner.decision

    def _swp_checked(self, pool: StreamPool, attributes: Mapping[str, str]) -> StreamPool:
        """In checked mode (``SWP_STREAM_CHECK``, a pool with emulated streams on the CPU), the
        upstream class's stream attributes (``{attribute: plan stream}``, e.g. ``{"_memcpy_stream":
        "memcpy"}``) become the pool's emulated streams, so that TorchRec's helpers take their CUDA
        branches (``wait_stream``, events, ``record_stream``) and the checker sees what a GPU run
        would do."""
        if getattr(pool, "checker", None) is not None:
            for attribute, name in attributes.items():
                setattr(self, attribute, pool.stream(name))
        return pool

    def _swp_compute_stream(self) -> Any:
        """The stream the plan's ``default`` tasks run on (the device's current stream when the
        pipeline was built; an emulated one in checked mode; None without streams): where an
        upstream helper means "the compute stream" but would take the current one, which is a
        side stream when the plan runs it there."""
        return self._swp_engine.streams.stream(DEFAULT_STREAM)

    def _swp_task_functions(self) -> Mapping[str, Callable[..., Any]]:
        """``{task name: fn(b, **reads)}``: the methods marked ``@task`` (``_swp_tasks``), bound.
        A class whose task names come from its arguments (StagedTrainPipeline's stages) overrides this."""
        return {name: getattr(self, method) for name, method in type(self)._swp_tasks.items()}

    def available_tasks(self) -> tuple[str, ...]:
        """Names of the tasks a plan for this pipeline may use."""
        return tuple(self._swp_task_functions())

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """The engine's step over ``dataloader_iter``, which reaches the plan's source task as
        its ``data``. A new iterator, or the same one after StopIteration at the end of the data
        (a new epoch of a DataLoader whose iterator object is reused, e.g. with persistent
        workers), is new data: the upstream class's own end-of-data flag is cleared and nothing
        in flight is lost (Engine.new_data). None or another non-iterator is a TypeError naming
        the class, as upstream's ``next(dataloader_iter)`` would raise; after ``close()``,
        PipelineClosed."""
        if self._swp_closed or dataloader_iter is not self._swp_checked_iterator:
            self._swp_check_progress(dataloader_iter)
            self._swp_checked_iterator = dataloader_iter
        self._swp_before_step()
        tuner = self._swp_tuner
        if tuner is None:
            return self._swp_engine.step(dataloader_iter)
        tuner.before_step()
        try:
            return self._swp_engine.step(dataloader_iter)
        except StopIteration:
            tuner.data_ended()  # says what tuning the data's end left undone
            raise

    def _swp_before_step(self) -> None:
        """What the upstream class's ``progress()`` does before its step besides the schedule
        (its state flags; overridden where there is something)."""

    def _swp_on_new_data(self) -> None:
        """Clear the upstream class's own end-of-data flag (overridden where it has one): the
        engine calls it whenever its source gets new data (``Engine(on_new_data=)``)."""

    def _swp_draw_undoer(self) -> Callable[[int, Mapping[str, Any]], None] | None:
        """What undoes the source task's call for a batch that the ranks' agreement on uneven
        data retracted (``Engine(undo_draw=)``: called with the batch and its slot): what that
        call did outside its slot. None (the default) where it cannot be undone: the ranks
        then agree inside the draw, on the thread that draws (``torchrec_swp.engine.exhaustion``)."""
        return None

    def _swp_undoable_plan(self, plan: PipelinePlan) -> PipelinePlan:
        """``plan`` (a phase) as this class runs it under ``on_nonfinite``, before ``undoable``'s
        checks: the plan itself, unless a class must reorder what its steps change (PEC)."""
        return plan

    def _swp_extra_effects(self) -> dict[str, Any]:
        """Effects of this class's own state, besides the model's and the optimizer's
        (``nonfinite.effects_for``): none unless a class stashes what a later step applies (PEC)."""
        return {}

    def _swp_transaction(self, mode: str) -> Transaction:
        """The transaction of ``on_nonfinite=mode``: the effects of upstream's ``_model`` and
        ``_optimizer`` (``nonfinite.effects_for``), the verdict reduced over the default group's
        ranks, each rolled-back step told at rank 0. A class whose tasks change other state
        overrides this (a plan declaring an effect nobody captures is refused, ``undoable``)."""
        device = getattr(self, "_device", None)
        host = device is None or getattr(device, "type", "cpu") == "cpu"
        model, optimizer = getattr(self, "_model", None), getattr(self, "_optimizer", None)
        if not isinstance(model, Module) or optimizer is None:
            raise PlanError(f"{type(self).__name__}: on_nonfinite needs a model and an optimizer to roll back")
        effects, fused = nonfinite.effects_for(model, optimizer, host=host)
        if self._swp_counters:
            effects["counters"] = nonfinite.Counters(self, self._swp_counters)
        effects.update(self._swp_extra_effects())
        self._swp_teardown().threads(fused.close)  # (a stop like the threads': the lookups' hooks go)
        return Transaction(
            effects, mode=mode, reduce=_reduce_max(), host=host,  # type: ignore[arg-type]
            report=nonfinite.report_at_rank_0(dist.get_rank() if dist.is_initialized() else 0, type(self).__name__),
        )  # fmt: skip

    @property
    def skipped_steps(self) -> list[Verdict]:
        """The steps rolled back because something was not finite (``on_nonfinite=``), each as
        ``Verdict`` (batch in its epoch, draw serial, what was not finite on this rank); empty
        with ``on_nonfinite="off"``. Carried by ``state_dict()``."""
        transaction = self._swp_nonfinite
        return [] if transaction is None else list(transaction.settled().skipped)

    def reset(self) -> None:
        """The upstream class's ``reset()``, then the engine's: the batches in flight are
        dropped (``untrained_batches()`` names them) and the next ``progress()`` refills."""
        super().reset()  # type: ignore[misc]
        self._swp_engine.reset()

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """A consistent cut at the batches trained so far (``torchrec_swp.engine.cuts``).

        ``state["loader"]`` is the data position just before the first batch not yet trained,
        taken from the iterator given to ``progress()`` (it must have ``state_dict()``, as
        torchdata's StatefulDataLoader iterators do; otherwise this raises EngineError rather
        than lose the batches in flight). ``state["engine"]`` holds the batch number (phases,
        TorchRec's context index) and the ledger; ``state["pipeline"]`` what the class itself
        keeps (e.g. SemiSync's looked-up embeddings of the batch in flight);
        ``state["world_size"]`` the number of ranks it was cut on (``world_size()``). Resume:
        ``loader.load_state_dict(state["loader"])`` on a new loader,
        ``pipeline.load_state_dict(state)`` on a new pipeline (model and optimizer restored from
        the same cut), then ``progress(iter(loader))``. ``state["ddp_layout"]`` is the bucket
        layout of each DDP in the model (``torchrec_swp.ddp_layout``): a resumed run's new DDP
        reduces with it, so that on 3 or more ranks its sums add in the same order."""
        engine_state = self._swp_engine.state_dict()
        return {
            "pipeline_class": type(self).__name__,
            # the ranks that trained in lock step to this cut: a load on another number must say so
            "world_size": world_size(),
            "loader": engine_state.pop("loader"),
            "engine": engine_state,
            "pipeline": self._swp_state_dict(),
            "ddp_layout": layout_state(self._swp_model()),
            # the tuner's decision: a resume with autotune applies it instead of tuning again
            "autotune": None if self._swp_tuner is None else self._swp_tuner.state_dict(),
            # the steps on_nonfinite rolled back
            "nonfinite": None if self._swp_nonfinite is None else self._swp_nonfinite.settled().state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any], *, resized: bool = False) -> None:
        """Go on from ``state_dict()``'s cut; before the first ``progress()``. The loader is
        restored by the caller (``state["loader"]``).

        ``resized=True``: the state was cut on another number of ranks (one rank's state, the
        same batch number on every rank of a data-parallel job). The engine's part (batch number,
        clocks, ledger) carries over; the data position must be global (e.g.
        ``torchrec_swp.data.GlobalMapSource``), so the batches in flight at the cut go back to
        the data and are drawn again by the new ranks. What the class keeps of its own batches in
        flight was made on the old rank for a batch that rank no longer gets: each class says
        what it does with it (``_swp_resized``), and refuses in one line what cannot move.

        ``resized`` must say what the state's ``world_size`` says (``check_world_size``): a state cut
        on another number of ranks without it, or on this number with it, is refused in one line
        (a state from before ``world_size`` was recorded is taken at the caller's word)."""
        if not isinstance(state, Mapping) or not {"engine", "pipeline", "pipeline_class"} <= set(state):
            raise PlanError(f"{type(self).__name__}.load_state_dict(): not a pipeline state (a dict from state_dict())")
        if state["pipeline_class"] != type(self).__name__:
            raise PlanError(
                f"{type(self).__name__}.load_state_dict(): the state was saved by {state['pipeline_class']}"
            )
        check_world_size(state, resized=resized, owner=type(self).__name__)
        extras = self._swp_resized(state["pipeline"]) if resized else state["pipeline"]
        self._swp_engine.load_state_dict(dict(state["engine"]))
        if hasattr(self, "_next_index"):  # TorchRec's context index counts the same source calls
            self._next_index = int(state["engine"]["batch_number"])
        self._swp_load_state_dict(extras)
        restore_layout_state(self._swp_model(), state.get("ddp_layout", {}))  # none in a state saved before it
        # a plan tuned for the old world's ranks is tuned again on the new one
        if self._swp_tuner is not None and state.get("autotune") and not resized:
            self._swp_tuner.load_state_dict(state["autotune"])
        if self._swp_nonfinite is not None and state.get("nonfinite"):
            self._swp_nonfinite.account.load_state_dict(state["nonfinite"])

    def _swp_model(self) -> Module:
        """The model whose DDPs a cut records the bucket layout of: upstream's ``_model`` (an empty
        module for a class without one)."""
        model = getattr(self, "_model", None)
        return model if isinstance(model, Module) else Module()

    def _swp_state_dict(self) -> dict[str, Any]:
        """What the class itself must carry over a cut (overridden where there is something)."""
        return {}

    def _swp_load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``_swp_state_dict()``'s values."""

    def _swp_resized(self, state: Mapping[str, Any]) -> Mapping[str, Any]:
        """``_swp_state_dict()``'s values as a rank of another world size may load them
        (``load_state_dict(resized=True)``); PlanError where they cannot move. Here: nothing to
        move (the classes that keep nothing); a class that keeps something overrides this."""
        if state:
            raise PlanError(
                f"{type(self).__name__}.load_state_dict(resized=True): its state keeps {', '.join(map(str, state))}, "
                "which it cannot carry to another world size"
            )
        return state

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


def undoable(
    plan: PipelinePlan | PhasedPlan, transaction: Transaction, owner: str, default: PipelinePlan | PhasedPlan
) -> PipelinePlan | PhasedPlan:
    """``plan`` (each phase) made undoable (``transaction.ordered``: its deciding task ordered
    among the collectives, what waits for an effect waiting for it too), checked to be undoable
    one batch at a time with ``transaction``'s effects (``check_plan``: PlanError naming ``owner``
    otherwise). A plan that declares no effect where the pipeline's ``default`` plan does (a plan
    file saved before effects were declared) would undo nothing: refused."""
    if _declares_effects(default) and not _declares_effects(plan):
        raise PlanError(
            f"{owner}(on_nonfinite={transaction.mode!r}): plan {plan.name} declares no effects (its rows have no "
            "effects column, e.g. a plan file saved before there was one), so a step could not be undone; declare "
            f"them as the default plan {default.name} does (print it with .to_text())"
        )

    def edit(p: PipelinePlan) -> PipelinePlan:
        try:
            check_plan(ordered(p, transaction.empty, waits=False), transaction.effects, transaction.empty)
            return ordered(p, transaction.empty)
        except PlanError as e:
            raise PlanError(f"{owner}(on_nonfinite={transaction.mode!r}): {e}", culprit=e.culprit) from None

    return plan.each(edit) if isinstance(plan, PhasedPlan) else edit(plan)


def _declares_effects(plan: PipelinePlan | PhasedPlan) -> bool:
    return any(t.io.effects for p in _plans(plan) for t in p.scheduled())


def _reduce_max() -> Callable[[Any], Any] | None:
    """The verdict's reduction: MAX over the default group's ranks (None in a world of one)."""
    if world_size() == 1:
        return None

    def reduce(flags: Any) -> Any:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return flags

    return reduce


def world_size() -> int:
    """The number of ranks that train in lock step: the default process group's (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def check_world_size(state: Mapping[str, Any], *, resized: bool, owner: str) -> None:
    """PlanError, in one line, where ``resized`` contradicts the world size ``state`` was cut on
    (``state["world_size"]``) and the one this process runs on (``world_size()``).

    Why refuse rather than resize on our own: the pipeline cannot see the rest of a resize (the
    data position must be global, the model and optimizer resharded), so another world size must
    be asked for; and ``resized=True`` changes what is loaded (the class's batches in flight and
    the tuned plan are dropped), so on the same world size it would quietly cost the bit-for-bit
    resume. A state without ``world_size`` (saved before it was recorded) is taken at ``resized``."""
    saved = state.get("world_size")
    if saved is None:
        return
    here = world_size()
    if saved != here and not resized:
        raise PlanError(
            f"{owner}.load_state_dict(): the state was cut on {_ranks(saved)}, this process runs on {_ranks(here)}: "
            "pass resized=True, with the data position global (torchrec_swp.data.GlobalMapSource) and the model "
            "and optimizer resharded through torch.distributed.checkpoint (docs/long_jobs.md, Resume on another "
            "world size)"
        )
    if saved == here and resized:
        raise PlanError(
            f"{owner}.load_state_dict(resized=True): the state was cut on {_ranks(saved)}, as many as this process "
            "runs on: load it without resized=True, which is for another world size (it drops what the pipeline kept "
            "of its batches in flight and its tuned plan, with which a same-size resume goes on bit for bit)"
        )


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def _plans(plan: PipelinePlan | PhasedPlan) -> tuple[PipelinePlan, ...]:
    return plan.plans if isinstance(plan, PhasedPlan) else (plan,)


def start_for_tuning(plan: PipelinePlan | PhasedPlan) -> PipelinePlan | PhasedPlan:
    """The plan a self-tuning pipeline starts from: ``plan`` without lookahead (the tuner then
    switches where every thread stands at the same batch boundary), its draw split off where it
    splits (H2D's draw as a Fetch task on H2D's own thread: the same calls in the same order, and a
    profile that tells loading from copying, which the parallel loads the tuner may choose need)."""
    first = _plans(plan)[0]
    if first.source == "H2D" and first.loads == 1:
        plan = with_parallel_loads(plan, 1, lookahead=0, thread=first.task("H2D").thread_group)
    return with_lookahead(cast(Any, plan), 0)  # (cast: PlanT is constrained to either plan type, not their union)


def nothing_to_undo(b: int, slot: Mapping[str, Any]) -> None:
    """The ``_swp_draw_undoer`` of a source task that only draws: it changed nothing outside its slot."""
