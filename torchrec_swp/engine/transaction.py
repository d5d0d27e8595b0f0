"""A training step as a transaction: declared effects captured, then committed or rolled back.

A plan's task declares the state it changes outside its batch's slot (``PipelineTask.effects``,
``torchrec_swp.plan.effects``). With a ``Transaction`` the engine runs every task of a batch
through ``wrap`` (``running_batch()`` tells hooks whose task runs), and one with an effect as

* before the task, ``capture`` of each effect it declares that no earlier task of the batch
  declared: exactly what will change (``Effect``: the pipeline's, e.g. only the fused rows the
  batch's ids touch);
* after the batch's **deciding task** (``decider``: of the tasks with effects that run for every
  batch, the one the batch runs last), the verdict: the watched values of the batch's slot (its
  loss) and every effect's new state (``Effect.changed``) checked (``nonfinite``: one fused check),
  reduced over the ranks (``reduce``: one collective, issued inside the deciding task, whose
  comm-group ticket orders it with the plan's other collectives); then every effect keeps its
  new state or gets its captured one back (``Effect.restore``). On the host (``host``: the CPU)
  the verdict is read at once; on a device every restore selects on it, nothing waits for it.

On a device what the verdict was reaches the host later (``Account``): at the next verdict, or
when asked (``settled()``); a step rolled back is then counted, told (``report``, once per step)
and, with ``mode="raise"`` (read at once), raised as ``NonFiniteStep`` on every rank alike, once
the ``step()`` that trains the batch is over (``after_step``: the step is rolled back, the next
call trains the next batch).

The rules a plan must keep for its batches to be undone one at a time (``check_plan``): its tasks
with effects are of one stage and one thread, so that batch ``b``'s verdict comes before batch
``b + 1``'s first capture (program order); none changes anything after the deciding task; the
deciding task is ordered among the collectives (in a comm group; ``ordered`` puts it in
``world`` and makes what waits for an effect wait for it too). A batch whose deciding task does
not run (its guard says no) is committed when the next batch captures. Memory: the captures of
one batch at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from torchrec_swp.engine.tasks import Binding
from torchrec_swp.plan import Dep, PipelinePlan, PlanError, When

Mode = Literal["skip", "raise"]
#: The guards of a task that runs for every batch a step trains: where a step can be decided.
_EVERY_BATCH = (When.ALWAYS, When.TRAIN)
MODES = ("off", "skip", "raise")


class Effect(Protocol):
    """What captures and restores one declared effect (``torchrec_swp.plan.effects``). ``empty``:
    there is nothing to capture (e.g. a cache the model does not have): its tasks run as they are."""

    empty: bool

    def capture(self, b: int) -> Any:
        """What the tasks that declare the effect are about to change for batch ``b``, copied."""

    def changed(self, saved: Any) -> tuple[list[torch.Tensor], str]:
        """The new state to check (its floating tensors) and what it is, for the report (``the
        dense gradients``); an effect may also have ``describe(saved) -> str``, asked on the host
        only where its state is not finite (e.g. which parameter's gradient)."""

    def restore(self, saved: Any, keep: torch.Tensor | bool) -> None:
        """Keep the new state where ``keep``, else put ``saved`` back (device-side where ``keep`` is a tensor)."""


class NonFiniteStep(RuntimeError):
    """A step went non-finite and was rolled back on every rank (``on_nonfinite="raise"``)."""


@dataclass(frozen=True)
class Verdict:
    """A step rolled back: the batch (in its epoch), what was not finite on this rank (empty where
    another rank's was not)."""

    batch: int
    serial: int
    what: tuple[str, ...]

    def line(self) -> str:
        found = ", ".join(self.what) if self.what else "on another rank"
        return f"batch {self.batch} of the epoch (drawn #{self.serial}) rolled back on every rank: not finite: {found}"


@dataclass
class Account:
    """The steps rolled back so far (``Verdict``), what ``state_dict()`` carries."""

    skipped: list[Verdict] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": [(v.batch, v.serial, list(v.what)) for v in self.skipped]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.skipped = [Verdict(int(b), int(s), tuple(w)) for b, s, w in state.get("skipped", ())]


_RUNNING = threading.local()


def _what(kind: tuple[str, list[torch.Tensor], Any, Any]) -> str:
    """What a kind of check found not finite, as its effect describes it where it can."""
    what, _, effect, state = kind
    describe = getattr(effect, "describe", None)
    return what if describe is None else describe(state)


def running_batch() -> int | None:
    """The batch of the task this thread runs under a transaction (``Transaction.wrap``; every
    task of an undoable plan is wrapped), None outside one: what tells an effect's hooks whose
    lookup they see (SemiSync looks up the next batch before this one's update)."""
    return getattr(_RUNNING, "batch", None)


@contextmanager
def running_as(b: int | None) -> Iterator[None]:
    """Inside: ``running_batch()`` is ``b`` on this thread, for a task that works on another batch
    than its own (TrainPipelinePEC's NolGradApply applies the batch before's deferred gradient,
    whose step was decided already: ``None``, no batch's, so that no capture counts it)."""
    outer = getattr(_RUNNING, "batch", None)
    _RUNNING.batch = b
    try:
        yield
    finally:
        _RUNNING.batch = outer


def _live(effects: tuple[str, ...], empty: Iterable[str]) -> tuple[str, ...]:
    return tuple(e for e in effects if e not in empty)


def decider(plan: PipelinePlan, empty: Iterable[str] = ()) -> str | None:
    """The task after which a batch's step is decided: of the tasks with effects that run for
    every batch the step trains (``when`` always or train; ``empty``: effects with nothing to
    capture, which do not count), the one of the highest stage fired last; None where there is none."""
    empty = frozenset(empty)
    tasks = [t for t in plan.scheduled() if _live(t.io.effects, empty) and t.when in _EVERY_BATCH]
    return max(tasks, key=lambda t: (t.stage, t.fire_index)).name if tasks else None


def check_plan(plan: PipelinePlan, known: Iterable[str], empty: Iterable[str] = ()) -> None:
    """PlanError where ``plan``'s steps cannot be undone one batch at a time: an effect without a
    capture (``known``), tasks with effects on several stages or threads, a deciding task outside
    the comm groups. ``empty``: known effects with nothing to capture (a cache the model does not
    have), which constrain nothing."""
    known, empty = set(known), frozenset(empty)
    for t in plan.scheduled():
        missing = [e for e in t.io.effects if e not in known]
        if missing:
            raise PlanError(
                f"plan {plan.name}: task {t.name} declares {', '.join(missing)}, which this pipeline cannot capture "
                f"(it captures {', '.join(sorted(known)) or 'nothing'}): its steps cannot be undone",
                culprit=t.name,
            )
    tasks = [t for t in plan.scheduled() if _live(t.io.effects, empty)]
    for attribute, what in (("stage", "stages"), ("thread_group", "threads")):
        values = {getattr(t, attribute) for t in tasks}
        if len(values) > 1:
            raise PlanError(
                f"plan {plan.name}: its tasks with effects are on several {what} "
                f"({', '.join(f'{t.name}: {getattr(t, attribute)}' for t in tasks)}): one batch's step must be decided "
                "before the next batch's first capture, which program order gives only on one stage and one thread",
                culprit=tasks[0].name,
            )
    last = decider(plan, empty)
    if tasks and last is None:
        raise PlanError(
            f"plan {plan.name}: none of its tasks with effects runs for every batch "
            f"({', '.join(f'{t.name}: when={t.when}' for t in tasks)}): no task can decide each step",
            culprit=tasks[0].name,
        )
    if last is not None:
        end = plan.task(last)
        late = [
            t for t in tasks if t.when is not When.NEVER and (t.stage, t.fire_index) > (end.stage, end.fire_index)
        ]
        if late:
            raise PlanError(
                f"plan {plan.name}: task {late[0].name} (when={late[0].when}) changes "
                f"{', '.join(_live(late[0].io.effects, empty))} after {last}, the last task with an effect that "
                "runs for every batch, has decided the step: its change could not be undone",
                culprit=late[0].name,
            )
    if last is not None and plan.task(last).comm_group is None:
        raise PlanError(
            f"plan {plan.name}: {last} decides each step (a collective) but is in no comm group "
            "(torchrec_swp.engine.transaction.ordered puts it in 'world')",
            culprit=last,
        )


def ordered(plan: PipelinePlan, empty: Iterable[str] = (), *, waits: bool = True) -> PipelinePlan:
    """``plan`` made undoable: its deciding task in comm group ``world`` where it is in none (its
    verdict's reduction takes a ticket among the plan's other collectives), and whatever waits for
    a task with an effect waits for the deciding task too (a restore rewrites what that task
    wrote: Fused's lookup of the next batch, on its own stream, must see the rows put back;
    ``waits=False``: not these). A wait the plan cannot keep is PlanError (from the plan's own check)."""
    empty = frozenset(empty)
    last = decider(plan, empty)
    if last is None:
        return plan
    if plan.task(last).comm_group is None:
        plan = plan.with_schedule(last, globally_ordered=True)
    if not waits:
        return plan
    effects = {t.name for t in plan.scheduled() if _live(t.io.effects, empty)}
    have = {(d.consumer, d.producer, d.distance) for d in plan.deps}
    extra = {
        (d.consumer, last, d.distance)
        for d in plan.deps
        if d.producer in effects and d.consumer != last and d.producer != last and d.distance > 0
    } - have
    if not extra:
        return plan
    intra = [d for d in plan.explicit_deps if d.distance == 0]
    inter = [*(d for d in plan.explicit_deps if d.distance != 0), *(Dep(c, p, k) for c, p, k in sorted(extra))]
    return plan.replace(inter_iter_deps=inter, intra_iter_deps=intra)


def _floats(value: Any, out: list[torch.Tensor]) -> None:
    """The floating tensors in ``value`` (a tensor, or lists, tuples and mappings of them), detached."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            out.append(value.detach())
    elif isinstance(value, (list, tuple)):
        for v in value:
            _floats(v, out)
    elif isinstance(value, Mapping):
        for v in value.values():
            _floats(v, out)


_ONE: dict[torch.device, torch.Tensor] = {}


def nonfinite(tensors: list[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """A one-element float tensor on ``device`` (default: the tensors'): 1 where some element of
    ``tensors`` is NaN or Inf, else 0. One fused op per device (GradScaler's
    ``_amp_foreach_non_finite_check_and_unscale_``, scale 1: it multiplies in place by 1, which
    changes no value), so that many small tensors cost one call, and nothing waits on the host."""
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    if device is None:
        device = next(iter(groups), torch.device("cpu"))
    found = torch.zeros(1, device=device)
    for where, group in groups.items():
        one = _ONE.get(where)
        if one is None:
            one = _ONE[where] = torch.ones(1, device=where)
        here = found if where == device else torch.zeros(1, device=where)
        with torch.no_grad():
            try:
                torch._amp_foreach_non_finite_check_and_unscale_(group, here, one)
            except (RuntimeError, NotImplementedError):  # (a dtype or device without the fused op)
                here.copy_(torch.stack([~torch.isfinite(t).all() for t in group]).any().float().reshape(1))
        if here is not found:
            found = torch.maximum(found, here.to(device))
    return found


class Transaction:
    """The captures of the batch whose step is open, the verdict, the account (module docstring).

    ``effects``: ``{effect name: Effect}``; ``watch``: names of slot values that must be finite
    (e.g. ``losses``); ``reduce(flags)``: the flags (a float tensor, 1 = not finite, one per kind
    of check) reduced with MAX over the ranks (None: one rank); ``host``: the verdict is read at
    once on the host (a CPU device: reading costs nothing), else it selects on the device and is
    read at the next verdict; ``report(verdict)``: told of each rolled-back step (e.g. a line at
    rank 0); ``mode``: ``"skip"`` or ``"raise"`` (``NonFiniteStep`` once the step is over,
    ``after_step``; the verdict is read at once)."""

    def __init__(
        self,
        effects: Mapping[str, Effect],
        *,
        mode: Mode,
        watch: tuple[str, ...] = ("losses",),
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        host: bool = True,
        report: Callable[[Verdict], None] | None = None,
    ) -> None:
        if mode not in ("skip", "raise"):
            raise ValueError(f"on_nonfinite must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
        self.effects, self.mode, self.watch = dict(effects), mode, watch
        #: the effects with nothing to capture (``Effect.empty``)
        self.empty = frozenset(n for n, e in self.effects.items() if getattr(e, "empty", False))
        #: the verdict read on the host (else selects on the device; "raise" reads it always, and so
        #: does a transaction whose listener must know at once, ``listen``)
        self.host = host or mode == "raise"
        self._on_device = not host
        self._reduce, self._report = reduce, report
        self._listener: Callable[[int], None] | None = None
        self.account = Account()
        self._lock = threading.Lock()
        self._open: dict[int, dict[str, Any]] = {}  # batch -> {effect: what its capture saved}
        # verdicts not yet read: batch, serial, what was checked, its flags here, everywhere
        self._pending: list[tuple[int, int, list[str], torch.Tensor, torch.Tensor]] = []
        self._failed: Verdict | None = None  # a rolled-back step to raise (mode "raise")

    # ------------------------------------------------------------ the engine's side
    def listen(self, fn: Callable[[int], None] | None, *, at_once: bool = False) -> None:
        """``fn(b)`` is told of each batch ``b`` whose step rolled back (None: nobody), when the
        verdict is read: the engine's clock ``"trained"`` does not count ``b``. ``at_once``: in
        ``b``'s deciding task, before the thread runs anything else - what a next batch's phase
        depends on (a window of gradient accumulation must close one batch later); the verdict is
        then read on the host on a device too (one host synchronisation per step there)."""
        self._listener = fn
        self.host = not self._on_device or self.mode == "raise" or (fn is not None and at_once)

    def wrap(
        self,
        io_effects: tuple[str, ...],
        decides: bool,
        fn: Binding,
        slot: Callable[[int], Mapping[str, Any]],
        serial: Callable[[int], int],
    ) -> Binding:
        """Task function ``fn(b, **reads)`` with the captures of ``io_effects`` before it and, where
        it ``decides``, the verdict after it (``slot(b)``: the batch's values, ``serial(b)``: its
        draw's serial); while it runs, ``running_batch()`` is ``b`` on its thread. Called inside
        the task's stream and labels, as ``fn`` is."""

        io_effects = _live(io_effects, self.empty)

        def transact(b: int, **reads: Any) -> Any:
            if io_effects:
                self.before(io_effects, b)
            outer = getattr(_RUNNING, "batch", None)
            _RUNNING.batch = b
            try:
                result = fn(b, **reads)
            finally:
                _RUNNING.batch = outer
            if decides:
                self.decide(b, slot(b), serial(b))
            return result

        return transact

    def before(self, effects: tuple[str, ...], b: int) -> None:
        """Capture what ``effects`` will change for batch ``b``, each once per batch; an older
        batch still open was never decided (its deciding task did not run): committed."""
        with self._lock:
            for older in [k for k in self._open if k < b]:
                del self._open[older]
            saved = self._open.setdefault(b, {})
        for name in effects:
            if name not in saved:
                saved[name] = self.effects[name].capture(b)

    def decide(self, b: int, slot: Mapping[str, Any], serial: int) -> None:
        """Batch ``b``'s verdict, its reduction over the ranks, then commit or restore. On the host
        (``host``): one check of everything (``nonfinite``), one flag reduced; what was not finite
        is looked for only where something was. On a device: a flag per kind (per watched value,
        per effect), the vector reduced, every restore a select on it."""
        with self._lock:
            saved = self._open.pop(b, {})
        kinds: list[tuple[str, list[torch.Tensor], Any, Any]] = []  # (what, its tensors, effect, its capture)
        for name in self.watch:
            values: list[torch.Tensor] = []
            _floats(slot.get(name), values)
            kinds.append((f"the {name}", values, None, None))
        for name, state in saved.items():
            effect = self.effects[name]
            tensors, what = effect.changed(state)
            kinds.append((what, tensors, effect, state))
        if self.host:
            here = nonfinite([t for _, tensors, _, _ in kinds for t in tensors])
            found = [] if not here.item() else [_what(k) for k in kinds if nonfinite(k[1]).item()]
            everywhere = here if self._reduce is None else self._reduce(here)
            keep = not everywhere.item()
            for name, state in saved.items():
                self.effects[name].restore(state, keep)
            if not keep:
                self._rolled_back(b, serial, found)
            return
        device = next((t.device for _, tensors, _, _ in kinds for t in tensors), torch.device("cpu"))
        flags = torch.cat([nonfinite(tensors, device) for _, tensors, _, _ in kinds])  # same length on every rank
        everywhere = flags if self._reduce is None else self._reduce(flags.clone())
        keep_tensor = ~(everywhere.amax() > 0)
        for name, state in saved.items():
            self.effects[name].restore(state, keep_tensor)
        self._read_pending()
        self._pending.append((b, serial, [k[0] for k in kinds], flags, everywhere))

    def _rolled_back(self, b: int, serial: int, what: list[str]) -> None:
        verdict = Verdict(b, serial, tuple(what))
        self.account.skipped.append(verdict)
        if self._listener is not None:
            self._listener(b)
        if self._report is not None:
            self._report(verdict)
        if self.mode == "raise":
            self._failed = verdict  # raised once the step is over (after_step), not inside a task

    def _read_pending(self) -> None:
        pending, self._pending = self._pending, []
        for b, serial, names, here, everywhere in pending:
            if float(everywhere.amax()) > 0:
                self._rolled_back(b, serial, [n for n, x in zip(names, here.tolist()) if x > 0])

    def after_step(self) -> None:
        """NonFiniteStep for a step this ``step()`` rolled back, with ``mode="raise"``: raised once the
        step is over, so that the engine goes on with the next batch at the next call."""
        failed, self._failed = self._failed, None
        if failed is not None:
            raise NonFiniteStep(failed.line())

    def settled(self) -> Account:
        """The account with every verdict read (a host read of the last one on a GPU), and
        every effect's restore done (an effect with ``settle()`` finishes a late one)."""
        self._read_pending()
        for effect in self.effects.values():
            settle = getattr(effect, "settle", None)
            if settle is not None:
                settle()
        return self.account

    def reset(self) -> None:
        """The batches in flight were dropped: their open captures go (what they changed stays)."""
        with self._lock:
            self._open.clear()
