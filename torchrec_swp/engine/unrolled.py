"""The calling thread's iteration compiled into straight-line code: the walk's loop unrolled.

Where no other thread walks (``PlanShape.threaded`` False: the plan runs on the calling thread
alone), the calling thread's program of an installed plan is compiled into Python code
(``body``) that executes the iteration's instructions in order: what the walker's loop
(``Interpreter._walk``) does instruction by instruction through each op, with these cheaper
steps, each valid only because nothing else walks:

* a plain task call (``run T``: no ticket, not checked) is inlined: its batch, whether the batch
  exists (asked once per stage and iteration: a batch's existence changes only through the ops
  of this very thread, so the answer is kept until an op that is not inlined runs), its guard
  when it needs only ``b``, ``P`` and the highest stage (``first``, ``not_first``, ``fill``,
  ``never``; the others ask the op's gate), then the task's call, its reads and writes inline
  where nothing is around it (``Batches.call_code``, the code of ``Batches.invoker``'s call);
* the source's draw on one lane (``run! T``, no ticket, not checked) passes its gates inline
  where the batch is still to be drawn and the credit allows, then draws (``Source.drawer``);
  its op does the rest; what is known of the batches of the stages above it (earlier batches)
  stays known;
* every other instruction calls its op, as the loop does;
* ``w.i`` is set before each instruction, so that a walker that parks there (a failure, the end
  of data) executes that instruction again when it walks on, and nothing twice; ``w.current``
  (the task instance a failure names) is set from it only when an instruction raises; the
  interrupt is not checked between instructions: only another thread sets it while this one
  walks.

The body is compiled twice: ``Body.run(w, P)``, one iteration, which ``Interpreter._walk`` calls
in place of its loop (from the iteration's first instruction); and ``steady_step``, the whole of
``Engine.step`` for a call in the steady state (the same data, no failure or switch pending, the
calling thread at the iteration the call trains, the plan's phase), which hands every other call
to the general step. Generated sources are kept in ``linecache`` under a name saying plan and
thread, so that a traceback through them shows the instruction's line.
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


class Source(Protocol):
    """What a body needs of the source (``torchrec_swp.engine.source.Source``)."""

    feed: Any  # its Feed: ``draws_for(b)``

    def drawer(self, instr: Run) -> Callable[[Walker, int, PipelinePlan], None]: ...

    def credit(self, b: int, plan: PipelinePlan) -> bool: ...

    def found_end(self, b: int, plan: PipelinePlan) -> None: ...


class Batches(Protocol):
    """What a body needs of the batches (``torchrec_swp.engine.batches.Batches``): the slot of a
    batch drawn, dropped, the batch drawn."""

    def open_slot(self, b: int) -> None: ...

    def drop_slot(self, b: int) -> None: ...

    def drawn(self, b: int) -> None: ...

#: ``run(w, P)``: one iteration of one thread, from its first instruction.
Unrolled = Callable[[Walker, int], None]

#: What ``steady_step`` returns for a call that is not in the steady state: ``Engine.step`` takes it.
NOT_STEADY = object()

_IDS = itertools.count(1)

#: guards decided from ``b``, ``P``, the highest stage and the call's training mode (an
#: expression in ``b``, ``P``, ``top`` and ``training``); None: never runs. ``train`` (a task of the
#: highest stage) is the mode of the call that trains ``b``: on the calling thread, this call's.
_INLINE_GUARDS: dict[When, str | None] = {
    When.ALWAYS: "",
    When.FIRST: " and b == 0",
    When.NOT_FIRST: " and b != 0",
    When.FILL: " and P < top",
    When.TRAIN: " and training",
    When.NEVER: None,
}

#: what the iteration's code does when an instruction raises: names the inlined task instance (an
#: op names its own), and turns a StopIteration into a RuntimeError, as the ops do
_RAISED = [
    "at = inlined.get(w.i)",
    "if at is not None:",
    "    w.current = (at[0], P - at[1])",
    "if isinstance(e, StopIteration):  # would end a generator up the stack silently",
    "    task, b = w.current",
    "    raise RuntimeError(f'{describe(task, b, w.name, w.P)} raised StopIteration') from e",
]


def inlinable(instr: Instr, checked: bool) -> bool:
    """Whether ``instr`` compiles into code here (else its op is called): a task's call with no
    ticket, the source's draw on one lane or an alias, outside checked mode."""
    if checked:
        return False
    return isinstance(instr, Alias) or (isinstance(instr, Run) and instr.ticket is None and instr.lanes == 1)


@dataclass(frozen=True)
class Body:
    """One thread's iteration as code: ``lines`` (in ``w`` and ``P``), the names they use
    (``env``), and ``run``, the iteration compiled (module docstring)."""

    name: str
    instrs: tuple[Instr, ...]
    lines: tuple[str, ...]
    env: Mapping[str, Any]
    run: Unrolled
    trains: bool  # whether ``lines`` read ``training``, the call's training mode


def unroll(
    name: str,
    instrs: tuple[Instr, ...],
    ops: Sequence[Op],
    invokers: Mapping[str, Invoker],
    calls: Callable[..., tuple[list[str], dict[str, Any]] | None],
    aliases: Callable[[Alias], tuple[list[str], dict[str, Any]] | None],
    source: Source,
    batches: Batches,
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
    docstring). ``invokers``: the task calls (``InstalledPlan.invokers``); ``calls(task, fn)``:
    the code of a task's call inline, calling ``fn``, and the names it needs (None: call its
    invoker); ``aliases(instr)``: the code of an alias (None: its op); ``source``: the source's
    draw after its gates (``Source.drawer``), its credit and its data (``Source.feed``), drawn
    into ``batches``' slots; ``plan``: the plan the instructions are of; ``exists_at``,
    ``await_exists``, ``admits``: the gates the ops ask (``EndOfData.exists_at``,
    ``PlanOps.await_exists``, ``PlanOps._admits``); ``training()``: the call's training mode
    (``PlanOps.training``)."""
    inlined: dict[int, tuple[str, int]] = {}  # instruction -> (task, stage): what a failure names
    env: dict[str, Any] = {"exists_at": exists_at, "await_exists": await_exists, "describe": describe}
    env.update({"top": top, "inlined": inlined, "plan": plan})
    cached: set[int] = set()  # stages whose batch's existence is known in this iteration
    body: list[str] = []
    stage = None  # the stage ``b`` is of
    for k, instr in enumerate(instrs):
        body.append(f"w.i = {k}  # {instr}")
        copy = aliases(instr) if isinstance(instr, Alias) and inlinable(instr, checked) else None
        if not inlinable(instr, checked) or (isinstance(instr, Alias) and copy is None):
            env[f"op_{k}"] = ops[k]
            body.append(f"op_{k}(w, P)")
            cached.clear()  # the op may have drawn a batch or found the end
            continue
        assert isinstance(instr, (Run, Alias))
        s, task = instr.stage, instr.task
        inlined[k] = (task, s)
        known = f"e{s}"
        if s != stage:
            body.append(f"b = P - {s}")
            stage = s
        if isinstance(instr, Alias):
            assert copy is not None
            if s not in cached:
                body += [f"{known} = exists_at(b, P)", f"if {known} is None:", f"    {known} = await_exists(b, P)"]
                cached.add(s)
            env.update(copy[1])
            body += [f"if {known}:", *_indent(_marked(copy[0], "slot[", instr), 1)]
            continue
        if instr.source:  # the op's gates for the common case (a batch to draw, credit); the op for the rest
            env.update({f"op_{k}": ops[k], f"draw_{k}": source.drawer(instr), "credit": source.credit})
            body += [
                "if b >= 0 and exists_at(b, P) is None and credit(b, plan):",
                *_indent(_draw(k, instr, calls(task, f"fn_{k}", "data=data.iterator"), source, batches, env), 1),
                "else:",
                f"    op_{k}(w, P)",
            ]
            # it drew batch b or found the end there: batches of the stages above (earlier ones) are as they were
            cached.difference_update(range(s + 1))
            continue
        if s not in cached:
            body += [f"{known} = exists_at(b, P)", f"if {known} is None:", f"    {known} = await_exists(b, P)"]
            cached.add(s)
        guard = _INLINE_GUARDS.get(instr.when, "?")
        if guard is None:  # never: the gate was passed, nothing runs
            continue
        if guard == "?":
            env[f"when_{k}"], env["admits"] = instr.when, admits
            guard = f" and admits(when_{k}, {instr.when.needs_next}, b, P)"
        call = calls(task, f"fn_{k}")
        if call is None:
            env[f"invoke_{k}"] = invokers[task]
            lines = [f"invoke_{k}(b)"]
        else:
            lines, names = call
            env.update(names)
        lines = _marked(lines, f"fn_{k}(", instr)
        body.append(f"if {known}{guard}:")
        body += [f"    {line}" for line in lines]
    body = body or ["pass"]
    trains = any(" and training" in line for line in body)
    env["step_training"] = training
    code = [
        "def run(w, P):",
        *(["    training = step_training()"] if trains else []),
        "    try:",
        *_indent(body, 2),
        "    except BaseException as e:",
        *_indent(_RAISED, 2),
        "        raise",
    ]
    run = _compile(f"iteration of {name}", code, dict(env))["run"]
    return Body(name, instrs, tuple(body), env, run, trains)


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
    the iterator of the last call (or None: the same), no failure is recorded and no switch pending, the data has not
    ended, the calling thread's walker ``main`` stands ready at the start of the iteration that
    trains the batch asked for, whose plan (``plan_at``, with phases) is ``body``'s.

    As the general step, it sets the call's grad and training mode (``begin_step``), asks for
    batch ``d`` (``Batches.ask``), walks ``main`` through internal iteration ``d + top`` (the
    walker's fields as ``Interpreter._walk`` and ``PlanOps.program`` / ``iteration_done`` set
    them; ``inst``: the installed plan) and returns ``d``'s output (``retire``). An instruction
    that raises parks or fails the walker as the walk does (``walk_stopped``), and the call ends
    as the general step ends it (``finish``: the output, an exception, or ``again`` for the
    general step to go on)."""
    env = dict(body.env)
    env.update(
        {
            "NOT_STEADY": NOT_STEADY, "RUNNING": WalkState.RUNNING, "READY": WalkState.READY, "main": main,
            "feed": feed, "failures": failures, "installed": installed, "batches": batches, "ended": batches.end.ended,
            "begin_step": begin_step, "is_grad_enabled": is_grad_enabled, "training_mode": training, "plan_at": plan_at,
            "inst": inst, "prog": body.instrs, "walk_stopped": walk_stopped, "finish": finish, "again": again,
            "retire": retire, "ask": batches.ask,
        }
    )  # fmt: skip
    phase = ["if plan_at(P) is not plan:", "    return NOT_STEADY"] if plan_at is not None else []
    mode = "True" if training is None else "bool(training_mode())"
    tickets = [f"w.bases[{g!r}] = w.bases.get({g!r}, 0) + {n}" for g, n in inst.tickets]
    code = [
        "def step(data):",
        "    if (data is not feed.data and data is not None) or failures or installed.pending is not None or ended():",
        "        return NOT_STEADY",
        "    book = batches.book",
        "    d = book.returned",
        "    P = d + top",
        "    w = main",
        "    if w.P != P or w.i or w.state is not READY:",
        "        return NOT_STEADY",
        *_indent(phase, 1),
        f"    training = {mode}",
        "    begin_step(is_grad_enabled(), training)",
        "    ask(d)",
        "    w.state, w.inst, w.prog = RUNNING, inst, prog",
        "    try:",
        *_indent(body.lines, 2),
        "    except BaseException as e:",
        "        try:",
        *_indent(_RAISED, 3),
        "            raise",
        "        except BaseException:",
        "            walk_stopped(w)  # parked or failed, as the walk leaves it",
        "        out = finish(d)",
        "        return NOT_STEADY if out is again else out",
        "    w.i, w.P, w.prog = 0, P + 1, ()",
        "    w.done_through = P",
        *_indent(tickets, 1),
        "    w.state = READY",
        "    if d in book.in_flight:",
        "        return retire(d)",
        "    out = finish(d)",
        "    return NOT_STEADY if out is again else out",
    ]
    return _compile(f"steady step of {body.name}", code, env)["step"]


def _draw(
    k: int,
    instr: Run,
    call: tuple[list[str], dict[str, Any]] | None,
    source: Source,
    batches: Batches,
    env: dict[str, Any],
) -> list[str]:
    """Batch ``b``'s draw once its gates passed: where the data is drawn by a plain ``next()``
    (``Draws.direct``) and the source's call has nothing around it, ``Source.drawer``'s draw
    inline (its slot, the call with the iterator itself as ``data``, the batch drawn or the end
    found); else that drawer (``draw_k``)."""
    if call is None:
        return [f"draw_{k}(w, b, plan)"]
    lines, names = call
    lines = _marked(lines, f"fn_{k}(", instr)
    env.update(names)
    env.update(
        {"draws_for": source.feed.draws_for, "found_end": source.found_end, "open_slot": batches.open_slot,
         "drop_slot": batches.drop_slot, "drawn": batches.drawn}
    )  # fmt: skip
    return [
        "data = draws_for(b)",
        "if data is None or not data.direct:",
        f"    draw_{k}(w, b, plan)",
        "else:",
        "    open_slot(b)",
        "    try:",
        *_indent(lines, 2),
        "    except StopIteration:",
        "        drop_slot(b)",
        "        found_end(b, plan)",
        "    except BaseException:",
        "        drop_slot(b)",
        "        raise",
        "    else:",
        "        drawn(b)",
    ]


def _marked(lines: list[str], call: str, instr: object) -> list[str]:
    """``lines`` with the line of the task's call (``call``) marked with its instruction: what a
    traceback through it shows."""
    return [f"{line}  # {instr}" if call in line else line for line in lines]


def _indent(lines: Sequence[str], levels: int) -> list[str]:
    pad = "    " * levels
    return [pad + line for line in lines]


def _compile(name: str, code: list[str], env: dict[str, Any]) -> dict[str, Any]:
    """``code`` run in ``env``, its source kept in ``linecache`` under ``<name #k>``."""
    source = "\n".join(code) + "\n"
    filename = f"<{name} #{next(_IDS)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), env)  # the code is this module's, made from the program
    return env
