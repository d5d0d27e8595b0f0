"""The calling thread's iteration compiled into straight-line code: the walk's loop unrolled.

Where no other thread walks (``PlanShape.threaded`` False: the plan runs on the calling thread
alone), the calling thread's program of an installed plan is compiled into Python code that
executes the iteration's instructions in order: what the walker's loop (``Interpreter._walk``)
does instruction by instruction through each op, with these cheaper steps, each valid only
because nothing else walks:

* a plain task call (``run T``: no ticket, not checked) is inlined: its batch, whether the batch
  exists (asked once per stage and iteration: a batch's existence changes only through the ops
  of this very thread, so the answer is kept until an op that is not inlined runs), its guard
  when it needs only ``b``, ``P``, the highest stage and the call's training mode (``first``,
  ``not_first``, ``fill``, ``train``, ``never``; the others ask the op's gate), then the task's
  call, its reads and writes inline where nothing is around it (``Batches.call_code``, the code
  of ``Batches.invoker``'s call), an alias's copy likewise (``Batches.alias_code``);
* the source's draw on one lane (``run! T``, no ticket, not checked) passes its gates inline
  where the batch is still to be drawn and the credit allows, then draws (``Source.drawer``);
  its op does the rest; what is known of the
  batches of the stages above it (earlier batches) stays known;
* every other instruction calls its op, as the loop does;
* where an instruction raises, the line it raised on says which it was (``Body.where``): the
  walker's ``i`` (where it parks, to execute that instruction again when it walks on, nothing
  twice) and ``current`` (the task instance a failure names) are set then, not before every
  instruction; a read that finds nothing is the ops' EngineError, a task's StopIteration their
  RuntimeError; the interrupt is not checked between instructions: only another thread sets it
  while this one walks.

The body is compiled twice: ``Body.run(w, P)``, one iteration, which ``Interpreter._walk`` calls
in place of its loop (from the iteration's first instruction); and ``steady_step``, the whole of
``Engine.step`` for a call in the steady state (the same data, no failure or switch pending, the
calling thread at the iteration the call trains, the plan's phase, the batches in flight the
steady state has), which hands every other call to the general step. Generated sources are kept
in ``linecache`` under a name saying plan and thread, so that a traceback through them shows
the instruction's line, marked with the instruction.
"""

from __future__ import annotations

import itertools
import linecache
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torchrec_swp.compile import Alias, Instr, Run
from torchrec_swp.engine.errors import describe
from torchrec_swp.engine.tasks import Invoker
from torchrec_swp.engine.walkers import Op, Walker, WalkState
from torchrec_swp.plan import PipelinePlan, When


class SourceCalls(Protocol):
    """What a body needs of the source (``torchrec_swp.engine.source.Source``)."""

    feed: Any  # its Feed: ``draws_for(b)``

    def drawer(self, instr: Run) -> Callable[[Walker, int, PipelinePlan], None]: ...

    def credit(self, b: int, plan: PipelinePlan) -> bool: ...

    def found_end(self, b: int, plan: PipelinePlan) -> None: ...


class BatchesCode(Protocol):
    """What a body needs of the batches (``torchrec_swp.engine.batches.Batches``): the code of a
    task's call and of an alias, a batch's slot opened and dropped, the batch drawn."""

    def slot_code(self, slot: str, b: str) -> tuple[str, dict[str, Any]]: ...

    def call_code(
        self, io: Any, fn: str, slot: str, b: str = "b", extra: str = ""
    ) -> tuple[list[str], list[str], dict[str, Any]]: ...

    def alias_code(self, pairs: tuple[tuple[str, str], ...], slot: str) -> list[str]: ...

    def open_slot(self, b: int) -> None: ...

    def drop_slot(self, b: int) -> None: ...

    def drawn(self, b: int) -> bool: ...


#: ``run(w, P)``: one iteration of one thread, from its first instruction.
Unrolled = Callable[[Walker, int], None]

#: What ``steady_step`` returns for a call that is not in the steady state: ``Engine.step`` takes it.
NOT_STEADY = object()

_IDS = itertools.count(1)

#: guards decided from ``b``, ``P``, the highest stage and the call's training mode (an
#: expression in the batch ``{b}``, ``P``, ``top`` and ``training``); None: never runs. ``train`` (a task of the
#: highest stage) is the mode of the call that trains ``b``: on the calling thread, this call's.
_INLINE_GUARDS: dict[When, str | None] = {
    When.ALWAYS: "",
    When.FIRST: "{b} == 0",
    When.NOT_FIRST: "{b} != 0",
    When.FILL: "P < top",
    When.TRAIN: "training",
    When.NEVER: None,
}

#: a generated line and, where an exception raised on it means something, (instruction, part):
#: ``op`` (an op's call), ``reads`` (a task's reads: a KeyError is a read never written),
#: ``call`` (the task's call and its writes)
Line = tuple[str, tuple[int, str] | None]


def inlinable(instr: Instr, checked: bool) -> bool:
    """Whether ``instr`` compiles into code here (else its op is called): a task's call with no
    ticket, the source's draw on one lane or an alias, outside checked mode."""
    if checked:
        return False
    return isinstance(instr, Alias) or (isinstance(instr, Run) and instr.ticket is None and instr.lanes == 1)


@dataclass(frozen=True)
class Body:
    """One thread's iteration as code: its lines for a walk (``lines``) and for the steady step
    (``steady_lines``, where the batches of the stages above the source's exist and the
    source's is still to draw: None for a plan without a source or drawing beyond its credit),
    the names they use (``env``), and ``run``, the iteration compiled (module docstring)."""

    name: str
    instrs: tuple[Instr, ...]
    lines: tuple[Line, ...]
    steady_lines: tuple[Line, ...] | None
    source_stage: int | None
    env: Mapping[str, Any]
    trains: bool  # whether the lines read ``training``, the call's training mode
    run: Unrolled


def unroll(
    name: str,
    instrs: tuple[Instr, ...],
    ops: Sequence[Op],
    invokers: Mapping[str, Invoker],
    bare: Mapping[str, Any],
    bare_aliases: set[str],
    tasks: Callable[[str], Any],
    source: SourceCalls,
    batches: BatchesCode,
    plan: PipelinePlan,
    *,
    top: int,
    checked: bool,
    exists_at: Callable[[int, int], bool | None],
    await_exists: Callable[[int, int], bool],
    admits: Callable[[When, bool, int, int], bool],
    training: Callable[[], bool],
) -> Body:
    """The ``Body`` of ``instrs`` (with their ``ops``), of the thread ``name`` says (module
    docstring). ``invokers``: the task calls (``InstalledPlan.invokers``); ``bare``: the
    bindings of those with nothing around them, called inline (``InstalledPlan.bare``), and
    ``bare_aliases`` likewise; ``tasks(name)``: a task's ``PipelineTask`` (its reads and
    writes); ``source``: the source's draw after its gates (``Source.drawer``), its credit and
    its data (``Source.feed``), drawn into ``batches``' slots; ``plan``: the plan the
    instructions are of; ``exists_at``, ``await_exists``, ``admits``: the gates the ops ask
    (``EndOfData.exists_at``, ``PlanOps.await_exists``, ``PlanOps._admits``); ``training()``:
    the call's training mode (``PlanOps.training``)."""
    inlined: dict[int, tuple[str, int]] = {}  # instruction -> (task, stage): what a failure names
    env: dict[str, Any] = {"exists_at": exists_at, "await_exists": await_exists, "top": top, "plan": plan}
    env["step_training"] = training

    def code(known: set[int], steady: bool) -> list[Line]:
        """The iteration's lines, where the batches of the stages ``known`` are known to exist at
        its start and, ``steady``, the source's batch is known to be still to draw, within the
        credit (the steady step's question answered it, ``steady_step``)."""
        present = set(known)  # stages whose batch exists for sure: nothing to ask
        asked: set[int] = set()  # stages whose batch's existence ``e{stage}`` holds
        fetched: set[int] = set()  # stages whose batch's slot ``s{stage}`` holds
        body: list[Line] = [(f"b{s} = P - {s}", None) for s in range(top + 1)]
        for k, instr in enumerate(instrs):
            bare_alias = isinstance(instr, Alias) and instr.task in bare_aliases
            if not inlinable(instr, checked) or (isinstance(instr, Alias) and not bare_alias):
                env[f"op_{k}"] = ops[k]
                body.append((f"op_{k}(w, P)  # {instr}", (k, "op")))
                present.clear()  # the op may have drawn a batch or found the end
                asked.clear()
                fetched.clear()
                continue
            assert isinstance(instr, (Run, Alias))
            s, task = instr.stage, instr.task
            inlined[k] = (task, s)
            b, e, slot = f"b{s}", f"e{s}", f"s{s}"
            if isinstance(instr, Run) and instr.source:
                body += _draw(k, instr, steady, ops[k], source, env)
                # it drew batch b or found the end there: the batches of the stages above are as they were
                for stages in (present, asked, fetched):
                    stages.difference_update(range(s + 1))
                continue
            conditions = []
            if s not in present:
                if s not in asked:
                    body += [(f"{e} = exists_at({b}, P)", (k, "op")), (f"if {e} is None:", None)]
                    body.append((f"    {e} = await_exists({b}, P)", (k, "op")))
                    asked.add(s)
                conditions.append(e)
            nested: list[Line] = []  # the next batch's existence, asked once the task's own exists
            if isinstance(instr, Run):
                when = _INLINE_GUARDS.get(instr.when, "?")
                if when is None:  # never: the gate was passed, nothing runs
                    continue
                if instr.when.needs_next and s >= 1:  # has_next / last: batch b + 1 is stage s - 1's
                    if s - 1 in present:  # it exists: has_next always, last never
                        if instr.when is When.LAST:
                            continue
                        when = ""
                    else:
                        after = f"e{s - 1}" if s - 1 in asked else f"n{k}"
                        if s - 1 not in asked:
                            nested += [(f"{after} = exists_at(b{s - 1}, P)", (k, "op")), (f"if {after} is None:", None)]
                            nested.append((f"    {after} = await_exists(b{s - 1}, P)", (k, "op")))
                        when = after if instr.when is When.HAS_NEXT else f"not {after}"
                elif when == "?":
                    env[f"when_{k}"], env["admits"] = instr.when, admits
                    when = f"admits(when_{k}, {instr.when.needs_next}, {{b}}, P)"
                if when and not nested:
                    conditions.append(when.format(b=b))
            if isinstance(instr, Alias):
                lines: list[Line] = [(line, (k, "call")) for line in batches.alias_code(instr.pairs, slot)]
                uses_slot = True
            elif (binding := bare.get(task)) is None:
                env[f"invoke_{k}"] = invokers[task]
                lines, uses_slot = [(f"invoke_{k}({b})", (k, "call"))], False
            else:
                env[f"fn_{k}"] = binding
                io = tasks(task).io
                reads, call, names = batches.call_code(io, f"fn_{k}", slot, b)
                env.update(names)
                lines = [(line, (k, "reads")) for line in reads] + [(line, (k, "call")) for line in call]
                uses_slot = bool(io.reads or io.writes)
            if uses_slot and s not in fetched:
                fetch, names = batches.slot_code(slot, b)
                env.update(names)
                lines.insert(0, (fetch, (k, "reads")))
                if not conditions:
                    fetched.add(s)  # (fetched under a condition, it is fetched again where needed)
            lines = _mark(lines, (f"fn_{k}(", f"invoke_{k}(", f"{slot}["), instr)
            if nested:  # the guard's question, asked where the task's batch exists
                lines = [*nested, (f"if {when}:", None), *_indent(lines, 1)]
                fetched.discard(s)
            if conditions:
                body.append((f"if {' and '.join(conditions)}:", None))
                body += _indent(lines, 1)
            else:
                body += lines
        return body or [("pass", None)]

    lines = code(set(), steady=False)
    # the steady step draws batch P - source_stage: within the credit where the plan's batches in
    # flight reach past the source (Source.credit with d returned and d + 1 requested)
    source_stage = plan.task(plan.source).stage if plan.source is not None else None
    credited = source_stage is not None and plan.pipeline_depth + plan.lookahead > top - source_stage
    steady = code(set(range(source_stage + 1, top + 1)), steady=True) if credited and source_stage is not None else None
    trains = any("training" in line for line, _ in [*lines, *(steady or [])])
    env["inlined"], env["prog"] = inlined, instrs
    run_code = [
        ("def run(w, P):", None),
        *([("    training = step_training()", None)] if trains else []),
        ("    try:", None),
        *_indent(lines, 2),
        ("    except BaseException as e:", None),
        ("        x = raised(w, P, e)", None),
        ("        if x is None:", None),
        ("            raise", None),
        ("        raise x", None),
    ]
    run = _compile(f"iteration of {name}", run_code, dict(env))["run"]
    return Body(name, instrs, tuple(lines), None if steady is None else tuple(steady), source_stage, env, trains, run)


def steady_step(
    body: Body,
    *,
    main: Walker,
    feed: Any,
    failures: list[Any],
    installed: Any,
    batches: Any,
    begin_step: Callable[[bool, bool], None],
    is_grad_enabled: Callable[[], bool],
    training: Callable[[], bool] | None,
    plan_at: Callable[[int], PipelinePlan] | None,
    inst: Any,
    walk_stopped: Callable[[Walker], None],
    finish: Callable[[int], Any],
    again: object,
    retire: Callable[[int], Any],
) -> Callable[[Any], Any]:
    """``step(data)``: ``Engine.step`` for a call in the steady state, ``body``'s iteration in it,
    or ``NOT_STEADY`` at once (nothing done) for any other call. The steady state: ``data`` is
    the iterator of the last call (or None: the same), no failure is recorded and no switch
    pending, the calling thread's walker ``main`` stands ready at the start of the iteration
    ``P`` that trains the batch ``d`` asked for, whose plan (``plan_at``, with phases) is
    ``body``'s, and the end of data says the call is steady (``EndOfData.steady``: not ended,
    the batches of the stages above the source's in flight, the source's still to draw, which
    the credit then allows: ``Body.steady_lines`` ask no more).

    As the general step, it sets the call's grad and training mode (``begin_step``), asks for
    batch ``d`` (``Batches.ask``), walks ``main`` through internal iteration ``d + top`` (the
    walker's fields as ``Interpreter._walk`` and ``PlanOps.program`` / ``iteration_done`` leave
    them; ``inst``: the installed plan) and returns ``d``'s output (``retire``). An instruction
    that raises parks or fails the walker as the walk does (``walk_stopped``), and the call ends
    as the general step ends it (``finish``: the output, an exception, or ``again`` for the
    general step to go on)."""
    if body.steady_lines is None or body.source_stage is None:
        raise ValueError(f"{body.name}: no steady step (a plan without a source, or one drawing beyond its credit)")
    env = dict(body.env)
    env.update(
        {
            "NOT_STEADY": NOT_STEADY, "READY": WalkState.READY, "main": main, "feed": feed, "failures": failures,
            "installed": installed, "batches": batches, "begin_step": begin_step, "is_grad_enabled": is_grad_enabled,
            "training_mode": training, "plan_at": plan_at, "inst": inst, "walk_stopped": walk_stopped,
            "finish": finish, "again": again, "retire": retire, "ask": batches.ask, "steady": batches.end.steady,
        }
    )  # fmt: skip
    phase = ["if plan_at(P) is not plan:", "    return NOT_STEADY"] if plan_at is not None else []
    mode = "True" if training is None else "bool(training_mode())"
    tickets = [f"w.bases[{g!r}] = w.bases.get({g!r}, 0) + {n}" for g, n in inst.tickets]
    head = [
        "def step(data):",
        "    if (data is not feed.data and data is not None) or failures or installed.pending is not None:",
        "        return NOT_STEADY",
        "    book = batches.book",
        "    d = book.returned",
        "    P = d + top",
        "    w = main",
        f"    if w.P != P or w.i or w.state is not READY or not steady(d, P - {body.source_stage}):",
        "        return NOT_STEADY",
        *_indent_text(phase, 1),
        f"    training = {mode}",
        "    begin_step(is_grad_enabled(), training)",
        "    ask(d)",
        "    w.inst = inst",
        "    try:",
    ]
    tail = [
        "    except BaseException as e:",
        "        x = raised(w, P, e)",
        "        try:",
        "            if x is None:",
        "                raise",
        "            raise x",
        "        except BaseException:",
        "            walk_stopped(w)  # parked or failed, as the walk leaves it",
        "        out = finish(d)",
        "        return NOT_STEADY if out is again else out",
        "    w.P = P + 1",
        "    w.done_through = P",
        *_indent_text(tickets, 1),
        "    if d in book.in_flight:",
        "        return retire(d)",
        "    out = finish(d)",
        "    return NOT_STEADY if out is again else out",
    ]
    code = [(line, None) for line in head] + _indent(body.steady_lines, 2) + [(line, None) for line in tail]
    return _compile(f"steady step of {body.name}", code, env)["step"]


def _draw(k: int, instr: Run, steady: bool, op: Op, source: SourceCalls, env: dict[str, Any]) -> list[Line]:
    """The source's instruction ``k``: its gates (already passed in the steady step, else the
    batch still to draw and the credit; the op for the rest), then batch ``b``'s draw
    (``Source.drawer``: its slot, the source's call with its ``Draws``, the batch drawn or the
    end found, an item kept for a retry where the call failed)."""
    b = f"b{instr.stage}"
    env.update({f"op_{k}": op, f"draw_{k}": source.drawer(instr), "credit": source.credit})
    draw: list[Line] = [(f"draw_{k}(w, {b}, plan)  # {instr}", (k, "op"))]
    if steady:
        return draw
    gate = f"if {b} >= 0 and exists_at({b}, P) is None and credit({b}, plan):"
    return [(gate, (k, "op")), *_indent(draw, 1), ("else:", None), (f"    op_{k}(w, P)  # {instr}", (k, "op"))]


def raised(
    w: Walker, P: int, e: BaseException, where: Mapping[int, tuple[int, str]], inlined: Mapping[int, tuple[str, int]]
) -> BaseException | None:
    """Where generated code's instruction raised ``e`` (the line it raised on: ``where``): the
    walker's ``i`` and, for an inlined task, its ``current``; the exception to raise instead (the
    ops' errors: a read never written, a task's StopIteration), or None for ``e`` itself."""
    from torchrec_swp.engine.batches import never_written

    tb = e.__traceback__
    k, part = where.get(tb.tb_lineno, (w.i, "op")) if tb is not None else (w.i, "op")
    w.i = k
    at = inlined.get(k)
    if at is not None:
        w.current = (at[0], P - at[1])
    if part == "reads" and isinstance(e, KeyError):
        x: BaseException = never_written(w.current[0], e, w.current[1])
        x.__suppress_context__ = True
        return x
    if part != "op" and isinstance(e, StopIteration):  # would end a generator up the stack silently
        task, b = w.current
        x = RuntimeError(f"{describe(task, b, w.name, w.P)} raised StopIteration")
        x.__cause__ = e
        return x
    return None


def _mark(lines: list[Line], calls: tuple[str, ...], instr: Instr) -> list[Line]:
    """``lines`` with the first that makes one of ``calls`` (the task's call, else an alias's
    copy) marked with its instruction: the line a traceback through it shows."""
    for call in calls:
        for i, (line, at) in enumerate(lines):
            if call in line:
                return [*lines[:i], (f"{line}  # {instr}", at), *lines[i + 1 :]]
    return lines


def _indent(lines: Sequence[Line], levels: int) -> list[Line]:
    pad = "    " * levels
    return [(pad + line, at) for line, at in lines]


def _indent_text(lines: Sequence[str], levels: int) -> list[str]:
    pad = "    " * levels
    return [pad + line for line in lines]


def _compile(name: str, code: list[Line], env: dict[str, Any]) -> dict[str, Any]:
    """``code`` run in ``env``, its source kept in ``linecache`` under ``<name #k>``; ``raised``
    there knows which instruction each line is of."""
    from functools import partial

    where = {n: at for n, (_, at) in enumerate(code, 1) if at is not None}
    env["raised"] = partial(raised, where=where, inlined=env["inlined"])
    source = "\n".join(line for line, _ in code) + "\n"
    filename = f"<{name} #{next(_IDS)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), env)  # the code is this module's, made from the program
    return env
