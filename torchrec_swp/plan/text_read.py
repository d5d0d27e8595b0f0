"""Text -> plan: the constructor arguments of the plan a text describes (``plan_from_text``) and
of a phased plan (``phased_from_text``), in the form ``torchrec_swp.plan.text_words`` describes:
its lines split into words, each task row's cells parsed, what the text gave kept in a
``PlanBook`` (where each thing is, for the errors) and the names checked (``text_check``) before
the plan is built. Every PlanError names its line (and column)."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, partial
from typing import Any, TypeVar

from torchrec_swp.plan.effects import KNOWN_EFFECTS
from torchrec_swp.plan.errors import PlanError
from torchrec_swp.plan.names import Vocabulary, did_you_mean, is_near
from torchrec_swp.plan.task import Dep, PipelineTask, TaskSchedule, When, check_name, parse_read
from torchrec_swp.plan.text_check import check_names, check_turns
from torchrec_swp.plan.text_words import (
    COLUMNS,
    COLUMNS_WITHOUT_EFFECTS,
    DECLARATIONS,
    HEADER,
    HEADER_ARGS,
    INT,
    KEYWORDS,
    LABEL,
    NONE,
    PlanBook,
    Row,
    TextLines,
    Word,
    error_at,
    words_of,
)

_P = TypeVar("_P")
_Q = TypeVar("_Q")


def plan_from_text(text: str, build: Callable[..., _P], vocabulary: Vocabulary | None = None) -> _P:
    """``build(**constructor arguments)`` of the PipelinePlan ``text`` describes; every PlanError,
    from reading the text or from ``build``, names its line. ``vocabulary``: what the pipeline it is
    for declares (default: TorchRec's streams and comm groups, any task)."""
    args, lines = _read_plan(list(enumerate(text.splitlines(), 1)), _first_line(text), vocabulary or Vocabulary())
    with lines.naming_lines():
        return build(**args)


# ----------------------------------------------------------------------- reading one plan
class _Reading(PlanBook):
    """A PlanBook filled line by line as the text is read."""

    def header(self, key: Word, rest: tuple[Word, ...]) -> None:
        k = key.text
        if k in self.values:
            raise error_at(f"'{k}' given twice (first at line {self.values[k].line})", key, culprit=k,
                           others=[self.values[k].line])
        if len(rest) != 1:
            raise error_at(f"a '{k}' line reads '{k} VALUE'", rest[1] if len(rest) > 1 else key, culprit=k)
        value = rest[0]
        self.values[k] = value
        self.lines.note(k, value)
        self.lines.note(HEADER_ARGS.get(k, k), value)
        if k in ("plan", "source", "output"):
            self.lines.note(value.text, value)  # the plan's name, and the culprit of a source or output error
        if k in ("depth", "lookahead", "loads"):
            _int(value, k)
        if k == "source" and value.text != NONE:
            self.refs.append((value, "source"))

    def declare(self, key: Word, rest: tuple[Word, ...]) -> None:
        k, label = key.text, LABEL[key.text]
        if k in self.decls:
            first = self.decls[k][0].line
            raise error_at(f"'{k}' given twice (first at line {first})", key, culprit=k, others=[first])
        if not rest:
            raise error_at(f"a '{k}' line names the {label}s the task rows use ('{NONE}' for none)", key, culprit=k)
        names: list[Word] = []
        if [w.text for w in rest] != [NONE]:
            for w in rest:
                if w.text == NONE:
                    raise error_at(f"'{NONE}' (no {label}) stands alone on a '{k}' line", w)
                _checked(w, label)
                if w.text in {n.text for n in names}:
                    raise error_at(f"{label} {w.text!r} is declared twice on this line", w)
                names.append(w)
        self.decls[k] = (key, names)

    def row(self, key: Word, rest: tuple[Word, ...]) -> None:
        if len(rest) > 1 and "=" in rest[1].text:  # 'stage=2' where the stage goes: the old key=value form
            raise error_at(
                f"task rows of the old 'key=value' form are no longer read: a task row has {len(COLUMNS)} columns "
                f"({' '.join(COLUMNS)}; '{NONE}' for none)",
                rest[1],
                culprit=rest[0].text,
            )
        if len(rest) == len(COLUMNS):
            cells = dict(zip(COLUMNS, rest))
            self.full_rows = True
        elif len(rest) == len(COLUMNS_WITHOUT_EFFECTS):  # a row written before effects: it declares none
            cells = dict(zip(COLUMNS_WITHOUT_EFFECTS, rest))
            cells = {c: cells.get(c) or rest[0].part(0, NONE) for c in COLUMNS}
            self.short_rows.append(rest[0])
        else:
            raise error_at(
                f"a task row has {len(COLUMNS)} columns ({' '.join(COLUMNS)}; '-' for none; rows of the older "
                f"form have {len(COLUMNS_WITHOUT_EFFECTS)}, without effects), got {len(rest)}",
                rest[0] if rest else key,
                culprit=rest[0].text if rest else "task",
            )
        name = cells["task"]
        _checked(name, "task")
        if name.text in self.rows:
            first = self.rows[name.text].name.line
            raise error_at(f"duplicate task name {name.text} (first at line {first})", name, others=[first])
        sched, io, reads, writes = _parse_cells(tuple(cells.values()))
        self.rows[name.text] = Row(name, cells, reads, writes)
        self.schedule[name.text] = sched
        self.tasks.append(io)
        self.lines.note(name.text, name, task=True)

    def dep(self, key: Word, rest: tuple[Word, ...]) -> None:
        syntax = "a dep line reads 'dep CONSUMER <- PRODUCER [@DISTANCE]'"
        if len(rest) < 3:
            raise error_at(syntax, rest[-1] if rest else key, culprit="dep")
        if rest[1].text != "<-":
            raise error_at(syntax, rest[1], culprit="dep")
        if len(rest) > 4 or (len(rest) == 4 and not rest[3].text.startswith("@")):
            raise error_at(syntax, rest[3] if len(rest) == 4 else rest[4], culprit="dep")
        distance = 0
        if len(rest) == 4:
            at = rest[3]
            if not INT.match(at.text[1:]) or at.text == "@-0":
                raise error_at(f"bad distance {at.text!r}", at)
            distance = int(at.text[1:])
            if distance == 0:
                raise error_at("distance 0 (the same batch) is written without '@'", at)
        consumer, producer = rest[0], rest[2]
        dep = Dep(consumer.text, producer.text, distance)
        if dep in self.deps:
            first = self.deps[dep].line
            raise error_at(f"dep {dep} given twice (first at line {first})", consumer, culprit=str(dep), others=[first])
        self.deps[dep] = consumer
        self.lines.note(str(dep), consumer)
        self.refs.extend([(consumer, f"dependency {dep}: unknown consumer task"),
                          (producer, f"dependency {dep}: unknown producer task")])


def _read_plan(
    numbered: list[tuple[int, str]], whole: Word, vocabulary: Vocabulary
) -> tuple[dict[str, Any], TextLines]:
    """The constructor arguments of the plan on lines ``numbered`` (``(number, text)``), and where
    each thing was given; ``whole``: the line standing for them all."""
    book = _Reading(TextLines(whole))
    for lineno, raw in numbered:
        words = words_of(lineno, raw)
        if not words:
            if raw.strip().startswith("#"):
                book.comments.append((lineno, raw))
            continue
        key, rest = words[0], words[1:]
        if key.text in HEADER:
            book.header(key, rest)
        elif key.text in DECLARATIONS:
            book.declare(key, rest)
        elif key.text == "task":
            book.row(key, rest)
        elif key.text == "dep":
            book.dep(key, rest)
        elif key.text in ("phases", "phase"):
            raise error_at("this is a phased plan: read it with PhasedPlan.from_text or plan.load_plan", key)
        else:
            raise error_at(f"unknown keyword {key.text!r}{did_you_mean(key.text, KEYWORDS)}", key)
    if book.full_rows and book.short_rows:
        raise error_at(
            f"a task row has {len(COLUMNS)} columns ({' '.join(COLUMNS)}; '-' for none), got "
            f"{len(COLUMNS_WITHOUT_EFFECTS)}: a row of the older form, without effects, in a text whose other rows "
            "have effects (is a cell missing?)",
            book.short_rows[0],
        )
    # a text that declares its names (as plan_to_text writes it) gives every line, so that no line
    # can be left out, or commented out, unnoticed; an older one needs only 'plan' and 'depth'
    declares = any(k in book.decls for k in DECLARATIONS)
    for needed in ("plan", "depth", *(("source", "output", "exhausted", *DECLARATIONS) if declares else ())):
        if needed not in book.values and needed not in book.decls:
            why = f"plan text has no '{needed}' line" + (
                " (a text with 'streams', 'threads' and 'comm_groups' lines gives 'plan', 'depth', 'source', "
                "'output' and 'exhausted' too)" if declares and needed not in ("plan", "depth") else ""
            )
            commented = book.commented(partial(_names_line, needed))
            if commented is not None:
                raise error_at(f"{why}: this comment looks like it, commented out", commented, culprit=needed)
            raise book.lines.error(PlanError(why, culprit=needed))
    check_names(book, vocabulary)
    values = {k: w.text for k, w in book.values.items()}
    deps = list(book.deps)
    return {
        "schedule": book.schedule,
        "intra_iter_deps": [d for d in deps if d.distance == 0],
        "inter_iter_deps": [d for d in deps if d.distance != 0],
        "pipeline_depth": int(values["depth"]),
        "tasks": book.tasks,
        "source": _opt(values.get("source")),
        "output": _opt(values.get("output")),
        "on_exhausted": values.get("exhausted", "drain"),
        "name": values["plan"],
        "lookahead": int(values.get("lookahead", 0)),
        "loads": int(values.get("loads", 1)),
    }, book.lines


def _int(word: Word, what: str, low: int | None = None) -> int:
    """``word`` as an int written the one way (``-?(0|[1-9][0-9]*)``), at least ``low``."""
    if not INT.match(word.text) or word.text == "-0":
        raise error_at(f"{what} must be an int, got {word.text!r}", word, culprit=what)
    value = int(word.text)
    if low is not None and value < low:
        raise error_at(f"{what} must be >= {low}, got {value}", word, culprit=what)
    return value


def _checked(word: Word, what: str) -> str:
    try:
        return check_name(word.text, what)
    except PlanError as e:
        raise error_at(str(e), word) from None


def _items(cell: Word) -> list[Word]:
    """The comma-separated names of a cell (``-``: none), each with its column."""
    if cell.text == NONE:
        return []
    out, offset = [], 0
    for piece in cell.text.split(","):
        if not piece:
            raise error_at(f"empty name in {cell.text!r} (names are comma-separated, '-' for none)", cell)
        out.append(cell.part(offset, piece))
        offset += len(piece) + 1
    return out


@lru_cache(maxsize=4096)
def _parse_cells(
    row: tuple[Word, ...],
) -> tuple[TaskSchedule, PipelineTask, tuple[tuple[Word, int], ...], tuple[Word, ...]]:
    """One task row's schedule and reads/writes (its cells in ``COLUMNS`` order); every error at the
    cell, or the name, at fault."""
    cells = dict(zip(COLUMNS, row))
    name = cells["task"].text
    stage = _int(cells["stage"], "stage", low=0)
    stream = _checked(cells["stream"], "stream")
    thread = _checked(cells["thread"], "thread_group")
    comm_cell = cells["comm"]
    comm = _opt(comm_cell.text)
    if comm is not None and "," in comm:
        raise error_at(f"task {name} names several comm groups ({comm}); a task belongs to one", comm_cell,
                       culprit=name)
    if comm is not None:
        _checked(comm_cell, "comm_group")
    when_cell = cells["when"]
    try:
        when = When.ALWAYS if when_cell.text == NONE else When(when_cell.text)
    except ValueError:
        guards = [w.value for w in When]
        raise error_at(
            f"when must be one of {', '.join(guards)}, got {when_cell.text!r}{did_you_mean(when_cell.text, guards)}",
            when_cell,
            culprit=name,
        ) from None
    reads, writes = _items(cells["reads"]), _items(cells["writes"])
    for kind, items in (("reads", reads), ("writes", writes)):
        seen: set[str] = set()
        for w in items:
            data = parse_read(w.text)[0] if kind == "reads" else w.text
            _checked(w.part(0, data), f"data (in task {name})")
            if w.text in seen:
                raise error_at(f"task {name} {kind} a name twice: {w.text!r}", w, culprit=name)
            seen.add(w.text)
    effects: list[str] = []
    for w in _items(cells["effects"]):
        if w.text not in KNOWN_EFFECTS:
            raise error_at(
                f"task {name} declares unknown effect {w.text!r} (effects: {', '.join(KNOWN_EFFECTS)})"
                + did_you_mean(w.text, KNOWN_EFFECTS),
                w,
                culprit=name,
            )
        if w.text in effects:
            raise error_at(f"task {name} declares effect {w.text!r} twice", w, culprit=name)
        effects.append(w.text)
    anchor = False
    noop_on: tuple[str, ...] = ()
    for flag in _items(cells["flags"]):
        if flag.text == "anchor" and not anchor:
            anchor = True
        elif flag.text.startswith("noop_on=") and not noop_on:
            noop_on = tuple(flag.text.removeprefix("noop_on=").split("+"))
            for k, device in enumerate(noop_on):
                _checked(flag.part(len("noop_on=") + sum(len(d) + 1 for d in noop_on[:k]), device), "device type")
        else:
            raise error_at(
                f"unknown flag {flag.text!r} of task {name} (flags: anchor, noop_on=DEVICE, each once)"
                + (" (an effect: effects go in the effects column, before flags)" if flag.text in KNOWN_EFFECTS
                   else did_you_mean(flag.text, ["anchor", "noop_on"])),
                flag,
                culprit=name,
            )
    try:
        sched = TaskSchedule(stage=stage, stream=stream, thread_group=thread, comm_group=comm, when=when)
        io = PipelineTask(name, reads=tuple(w.text for w in reads), writes=tuple(w.text for w in writes),
                          noop_on=noop_on, anchor=anchor, effects=tuple(effects))
    except PlanError as e:
        raise error_at(str(e), cells["flags"] if noop_on else cells["task"], culprit=name) from None
    return sched, io, tuple((w.part(0, parse_read(w.text)[0]), parse_read(w.text)[1]) for w in reads), tuple(writes)


# ------------------------------------------------------------------------------ phased plans
def phased_from_text(
    text: str, build_plan: Callable[..., _P], build: Callable[..., _Q], vocabulary: Vocabulary | None = None
) -> _Q:
    """``build(phases, name=, clock=, cycle=)`` of the PhasedPlan ``text`` describes, each phase's
    plan made by ``build_plan(**constructor arguments)``; every PlanError, from reading the text or
    from either builder, names its line."""
    name: Word | None = None
    clock: Word | None = None
    cycle: tuple[Word, tuple[int, int]] | None = None
    bodies: list[tuple[int, Word, list[tuple[int, str]]]] = []  # start, its line, the plan's lines
    lines = TextLines(_first_line(text))
    for lineno, raw in enumerate(text.splitlines(), 1):
        if bodies and raw.split("#", 1)[0].split()[:1] != ["phase"]:
            bodies[-1][2].append((lineno, raw))
            continue
        words = words_of(lineno, raw)
        if not words:
            continue
        key, rest = words[0], words[1:]
        if key.text == "phases":
            if name is not None:
                raise error_at(f"'phases' must come first, once (first at line {name.line})", key, culprit="phases")
            if len(rest) != 1:
                raise error_at("a phases line reads 'phases NAME'", rest[1] if rest else key, culprit="phases")
            name = rest[0]
            lines.note("phases", name)
            lines.note(name.text, name)
        elif key.text in ("clock", "cycle") and name is not None:
            given = clock if key.text == "clock" else (cycle[0] if cycle else None)
            if given is not None:
                raise error_at(f"'{key.text}' given twice (first at line {given.line})", key, culprit=key.text)
            if key.text == "clock":
                if len(rest) != 1:
                    raise error_at("a clock line reads 'clock CLOCK'", rest[1] if rest else key, culprit="clock")
                clock = rest[0]
            else:
                cycle = (key, _cycle(key, rest))
            lines.note(key.text, rest[0] if rest else key)
        elif key.text == "phase" and name is not None:
            if len(rest) != 1 or not INT.match(rest[0].text) or rest[0].text.startswith("-"):
                raise error_at("a phase line reads 'phase START'", rest[0] if rest else key, culprit="phase")
            bodies.append((int(rest[0].text), rest[0], []))
            lines.note(rest[0].text, rest[0], latest=True)
        elif key.text in ("clock", "cycle", "phase"):
            raise error_at(f"phased plan text has no 'phases' line before this '{key.text}' line", key,
                           culprit="phases")
        else:
            raise error_at("expected 'phases NAME' first, then 'clock', 'cycle' or 'phase START' lines", key)
    if name is None:
        raise lines.error(PlanError("phased plan text has no 'phases' line", culprit="phases"))
    phases, where = [], []
    for start, at, body in bodies:
        whole = Word(at.text, at.line, None, at.raw)
        args, plan_lines = _read_plan(body, whole, vocabulary or Vocabulary())
        with plan_lines.naming_lines():
            phases.append((start, build_plan(**args)))
        where.append(plan_lines)
    check_turns(phases, where, vocabulary or Vocabulary())
    with lines.naming_lines():
        return build(phases, name=name.text, clock=clock.text if clock else "index", cycle=cycle[1] if cycle else None)


def _cycle(key: Word, rest: tuple[Word, ...]) -> tuple[int, int]:
    if len(rest) != 2 or not all(INT.match(w.text) and w.text != "-0" for w in rest):
        raise error_at("a cycle line reads 'cycle FIRST PERIOD'", rest[0] if rest else key, culprit="cycle")
    return int(rest[0].text), int(rest[1].text)


def _first_line(text: str) -> Word:
    """The first line that is not blank or a comment (line 1 if none): where a missing line belongs."""
    n, raw = next(((n, ln) for n, ln in enumerate(text.splitlines(), 1) if ln.split("#", 1)[0].strip()), (1, ""))
    return Word("", n, None, raw)


def is_phased_text(text: str) -> bool:
    first = next((ln.split("#", 1)[0].strip() for ln in text.splitlines() if ln.split("#", 1)[0].strip()), "")
    return first.startswith("phases ")


def _opt(value: str | None) -> str | None:
    return None if value in (None, "", NONE) else value


def _names_line(key: str, words: list[str]) -> bool:
    """A line whose first word is ``key``, or near it (a commented-out line of a plan text)."""
    return words[0] == key or is_near(words[0], key)
