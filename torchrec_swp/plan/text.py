"""The text form of a plan: one readable table, rows in fire order, with an exact round trip.

    plan TrainPipelineSparseDist
    depth 3
    source H2D
    output output
    exhausted drain
    streams default data_dist memcpy
    threads default
    comm_groups world
    #    task            stage  stream     thread   comm   when   reads          writes          effects      flags
    task ZeroGrad        2      default    default  -      -      -              -               dense_grads  -
    task InputDistStart  1      data_dist  default  world  -      batch,context  -               -            -
    task H2D             0      memcpy     default  -      -      -              batch,context   -            -
    task Forward         2      default    default  world  -      batch,context  losses,output   -            anchor
    dep Forward <- OptimizerStep @1

Task rows are in fire order; ``-`` is an empty cell. ``when`` is a ``When`` (``first``,
``not_first``, ``fill``, ``has_next``, ``last``, ``train``, ``never``); a read ``x@1`` comes from the
previous batch. ``effects`` names the state the task changes outside its batch's slot, comma-separated,
each once, from ``effects.KNOWN_EFFECTS`` (``fused_rows``, ``dense_grads``, ``dense_params``,
``dense_optim``, ``stashed_grads``, ``emb_cache``, ``stashed_state``, ``counters``; ``-``: none, the task
is pure). ``flags`` holds ``anchor`` and ``noop_on=DEVICE[+DEVICE...]``, comma-separated. Only explicit deps are
written (inferred ones follow from reads/writes). ``lookahead`` and ``loads`` lines are written only
when they differ from 0 and 1. ``#`` starts a comment; blank lines are
ignored. Rows of the older forms are read too: nine cells, without ``effects``, as a task that
declares none (in a text whose rows all have nine: one short row among full ones is a missing
cell), and ``task NAME stage=2 stream=... reads=a,b effects=x,y``.

Names are declared once and checked everywhere (``torchrec_swp.plan.names``): the ``streams``,
``threads`` and ``comm_groups`` lines declare the streams, threads and comm groups the rows use
(``-``: none), exactly those: a name a row uses that its line does not declare, or one declared that
no row uses, is an error, so that a slip in a name (``wrold`` for ``world``) cannot make a new
stream or comm group. A text without such a line may use only TorchRec's streams and comm groups
(``names.KNOWN_STREAMS``, ``KNOWN_COMM_GROUPS``), and any thread. Task rows declare the tasks
(deps and ``source`` must name one of them; given a pipeline's ``Vocabulary``, each row must name
one of its tasks) and writes declare the data (reads and ``output`` must name written data).
Numbers are written one way (no ``+``, ``_`` or leading zeros; ``@0`` is no distance), and nothing
is given twice, so that every text means one plan and every plan has one text.

A phased plan (``PhasedPlan``) is ``phases NAME``, a ``clock CLOCK`` line where its clock is not
the default ``index``, a ``cycle FIRST PERIOD`` line where its phases repeat, then ``phase START``
lines, each followed by one plan.

``plan_from_text(plan_to_text(p), PipelinePlan) == p`` (what ``PipelinePlan.from_text`` does) and
the text comes back unchanged from a plan read so (likewise for phased plans). Every error about a
plan's text names its line, and the column of the word at fault where there is one: ``line N,
column C: what is wrong (in 'the line')`` (``line N: ...`` where the whole line is), whether it is
found while reading the text or when the plan is built from it (a dep on an unknown task names the
dep's line, a bad stage the task's row, a missing ``depth`` line the first line); ``PlanError.line``
holds N, ``PlanError.column`` C. Where the mistake is one of two lines that disagree, the error
names the likelier (a misspelt name on its declaration when the name used elsewhere is the
pipeline's, or when that declaration is used nowhere else) and ``PlanError.lines`` both.
This module reads and writes text only: it makes the plan's constructor arguments and reads a
plan's attributes, so that the plan classes import it (and pass themselves in to be built) and not
the other way round.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from torchrec_swp.plan.calls import check_call
from torchrec_swp.plan.effects import KNOWN_EFFECTS
from torchrec_swp.plan.errors import PlanError
from torchrec_swp.plan.names import Vocabulary, did_you_mean, is_near, nearest
from torchrec_swp.plan.task import Dep, PipelineTask, TaskSchedule, When, check_name, parse_read

if TYPE_CHECKING:
    from torchrec_swp.plan.view import PhasedView, PlanView

_P = TypeVar("_P")
_Q = TypeVar("_Q")

_NONE = "-"
COLUMNS = ("task", "stage", "stream", "thread", "comm", "when", "reads", "writes", "effects", "flags")
#: The columns of the rows written before effects were declared (read as a task that declares none).
COLUMNS_WITHOUT_EFFECTS = tuple(c for c in COLUMNS if c != "effects")
_OLD_KEYS = ("stage", "stream", "thread", "comm", "reads", "writes", "noop_on", "when", "effects")
#: The lines that declare the names the task rows use, and the row cell each declares.
DECLARATIONS = {"streams": "stream", "threads": "thread", "comm_groups": "comm"}
_LABEL = {"streams": "stream", "threads": "thread", "comm_groups": "comm group"}
_HEADER = ("plan", "depth", "source", "output", "exhausted", "lookahead", "loads")
_KEYWORDS = (*_HEADER, *DECLARATIONS, "task", "dep")
_HEADER_ARGS = {"depth": "pipeline_depth", "exhausted": "on_exhausted"}  # header word -> constructor argument
_INT = re.compile(r"-?(0|[1-9][0-9]*)\Z")


def _cells(task: str, s: TaskSchedule, io: PipelineTask) -> list[str]:
    flags = (["anchor"] if io.anchor else []) + (["noop_on=" + "+".join(io.noop_on)] if io.noop_on else [])
    return [
        task,
        str(s.stage),
        s.stream,
        s.thread_group,
        s.comm_group or _NONE,
        _NONE if s.when is When.ALWAYS else s.when.value,
        ",".join(io.reads) or _NONE,
        ",".join(io.writes) or _NONE,
        ",".join(io.effects) or _NONE,
        ",".join(flags) or _NONE,
    ]


def plan_to_text(plan: PlanView) -> str:
    lines = [
        f"plan {plan.name}",
        f"depth {plan.pipeline_depth}",
        f"source {plan.source or _NONE}",
        f"output {plan.output or _NONE}",
        f"exhausted {plan.on_exhausted}",
    ]
    if plan.lookahead:
        lines.append(f"lookahead {plan.lookahead}")
    if plan.loads != 1:
        lines.append(f"loads {plan.loads}")
    scheduled = plan.scheduled()
    rows = [_cells(t.name, t.schedule, t.io) for t in scheduled]
    for kind, cell in DECLARATIONS.items():
        used = dict.fromkeys(r[COLUMNS.index(cell)] for r in rows) if rows else {}
        lines.append(f"{kind} " + (" ".join(n for n in used if n != _NONE) or _NONE))
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    lines.append("#    " + "  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)).rstrip())
    lines.extend("task " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
    lines.extend(f"dep {d}" for d in plan.explicit_deps)
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------ where things are
class Word(NamedTuple):
    """A word of a plan's text: its text, line, column (1-based; None: the whole line) and line."""

    text: str
    line: int
    column: int | None
    raw: str

    def part(self, offset: int, text: str) -> Word:
        """The piece ``text`` of this word that begins ``offset`` characters in."""
        return Word(text, self.line, None if self.column is None else self.column + offset, self.raw)


_WORD = re.compile(r"\S+")


@lru_cache(maxsize=4096)  # texts are read again and again (the catalog's tables, edited copies)
def _words(lineno: int, raw: str) -> tuple[Word, ...]:
    """The words of a line, its comment left out."""
    return tuple(Word(m.group(), lineno, m.start() + 1, raw) for m in _WORD.finditer(raw.split("#", 1)[0]))


def at_line(
    lineno: int, raw: str, e: PlanError, *, column: int | None = None, others: Iterable[int] = ()
) -> PlanError:
    """``e`` as an error of line ``lineno`` (text ``raw``) of a plan's text, at ``column`` if given;
    ``others``: the other lines it involves."""
    where = f"line {lineno}" + (f", column {column}" if column is not None else "")
    return PlanError(
        f"{where}: {e} (in {raw.strip()!r})",
        culprit=e.culprit or raw.strip(),
        line=lineno,
        column=column,
        lines=tuple(dict.fromkeys([lineno, *others])),
    )


def _error(message: str, word: Word, *, culprit: str = "", others: Iterable[int] = ()) -> PlanError:
    """A PlanError about ``word``: its line and column."""
    return at_line(word.line, word.raw, PlanError(message, culprit=culprit or word.text), column=word.column,
                   others=others)


def _column_of(token: str, word: Word) -> int | None:
    """The column of ``token`` as a name on ``word``'s line (after its first word), else ``word``'s."""
    code = word.raw.split("#", 1)[0]
    first = re.match(r"\s*\S+", code)
    m = re.compile(r"(?<![\w.@=+])" + re.escape(token) + r"(?![\w.@])").search(code, first.end() if first else 0)
    return m.start() + 1 if m else word.column


class TextLines:
    """Where in a plan's text each thing was given (header key, task, dep, phase, plan name), so that
    every error about the text, found while reading it or once the plan is built from it, names its
    line the same way: ``line N[, column C]: what is wrong (in 'the line')``."""

    def __init__(self, whole: Word) -> None:
        self._whole = whole  # the line that stands for the whole text: its first, or a phase's line
        self._tasks: dict[str, Word] = {}
        self._others: dict[str, Word] = {}

    def note(self, key: str, word: Word, *, task: bool = False, latest: bool = False) -> None:
        """``key`` (a culprit an error may carry) was given at ``word``: its first place, or its
        latest where ``latest`` (a phase start given twice is wrong the second time)."""
        book = self._tasks if task else self._others
        if latest or key not in book:
            book[key] = word

    def find(self, culprit: str) -> Word | None:
        """Where ``culprit`` was given (an inferred dep: the consumer's row, which reads the data)."""
        consumer = culprit.partition(" <- ")[0]
        return self._tasks.get(culprit) or self._others.get(culprit) or self._tasks.get(consumer)

    def error(self, e: PlanError) -> PlanError:
        """``e`` naming the line its culprit was given on (the line standing for the whole text where
        the culprit is the whole plan or was never written), and the column of its token; ``e``
        itself if it names its line already."""
        if e.line is not None:
            return e
        word = self.find(e.culprit) or self._whole
        column = _column_of(e.token, word) if e.token and word.column is not None else word.column
        others = [w.line for w in map(self.find, e.also) if w is not None]
        return at_line(word.line, word.raw, e, column=column, others=others)

    @contextmanager
    def naming_lines(self) -> Iterator[None]:
        """Raise every PlanError from the block as ``error()`` makes it."""
        try:
            yield
        except PlanError as e:
            raise self.error(e) from None


def plan_from_text(text: str, build: Callable[..., _P], vocabulary: Vocabulary | None = None) -> _P:
    """``build(**constructor arguments)`` of the PipelinePlan ``text`` describes; every PlanError,
    from reading the text or from ``build``, names its line. ``vocabulary``: what the pipeline it is
    for declares (default: TorchRec's streams and comm groups, any task)."""
    args, lines = _read_plan(list(enumerate(text.splitlines(), 1)), _first_line(text), vocabulary or Vocabulary())
    with lines.naming_lines():
        return build(**args)


# ----------------------------------------------------------------------- reading one plan
@dataclass
class _Row:
    name: Word
    cells: dict[str, Word]
    reads: tuple[tuple[Word, int], ...]  # each read's data name (``x`` of ``x@1``) and batch distance (1)
    writes: tuple[Word, ...]


@dataclass
class _Book:
    """What a plan's text gave, and where."""

    lines: TextLines
    values: dict[str, Word] = field(default_factory=dict)  # header key -> its value
    decls: dict[str, tuple[Word, list[Word]]] = field(default_factory=dict)  # kind -> (keyword, names)
    rows: dict[str, _Row] = field(default_factory=dict)
    schedule: dict[str, TaskSchedule] = field(default_factory=dict)
    tasks: list[PipelineTask] = field(default_factory=list)
    deps: dict[Dep, Word] = field(default_factory=dict)  # dep -> its consumer's word
    refs: list[tuple[Word, str]] = field(default_factory=list)  # a task named by a dep or the source, and by what
    comments: list[tuple[int, str]] = field(default_factory=list)  # lines that are only a comment
    # the rows of COLUMNS_WITHOUT_EFFECTS (the older form) and whether a row has every column: a text
    # is in one form or the other (one row short of a cell in a text of full rows is a slip)
    short_rows: list[Word] = field(default_factory=list)
    full_rows: bool = False

    def commented(self, looks_like: Callable[[list[str]], bool]) -> Word | None:
        """The first comment line whose words (after its ``#``) ``looks_like`` a line of a plan."""
        for lineno, raw in self.comments:
            words = raw.strip()[1:].split()
            if words and looks_like(words):
                return Word(words[0], lineno, raw.index("#") + 1, raw)
        return None

    def header(self, key: Word, rest: tuple[Word, ...]) -> None:
        k = key.text
        if k in self.values:
            raise _error(f"'{k}' given twice (first at line {self.values[k].line})", key, culprit=k,
                         others=[self.values[k].line])
        if len(rest) != 1:
            raise _error(f"a '{k}' line reads '{k} VALUE'", rest[1] if len(rest) > 1 else key, culprit=k)
        value = rest[0]
        self.values[k] = value
        self.lines.note(k, value)
        self.lines.note(_HEADER_ARGS.get(k, k), value)
        if k in ("plan", "source", "output"):
            self.lines.note(value.text, value)  # the plan's name, and the culprit of a source or output error
        if k in ("depth", "lookahead", "loads"):
            _int(value, k)
        if k == "source" and value.text != _NONE:
            self.refs.append((value, "source"))

    def declare(self, key: Word, rest: tuple[Word, ...]) -> None:
        k, label = key.text, _LABEL[key.text]
        if k in self.decls:
            first = self.decls[k][0].line
            raise _error(f"'{k}' given twice (first at line {first})", key, culprit=k, others=[first])
        if not rest:
            raise _error(f"a '{k}' line names the {label}s the task rows use ('{_NONE}' for none)", key, culprit=k)
        names: list[Word] = []
        if [w.text for w in rest] != [_NONE]:
            for w in rest:
                if w.text == _NONE:
                    raise _error(f"'{_NONE}' (no {label}) stands alone on a '{k}' line", w)
                _checked(w, label)
                if w.text in {n.text for n in names}:
                    raise _error(f"{label} {w.text!r} is declared twice on this line", w)
                names.append(w)
        self.decls[k] = (key, names)

    def row(self, key: Word, rest: tuple[Word, ...]) -> None:
        if len(rest) > 1 and "=" in rest[1].text and rest[1].text.partition("=")[0] in _OLD_KEYS:
            cells = _old_cells(key, rest)
        elif len(rest) == len(COLUMNS):
            cells = dict(zip(COLUMNS, rest))
            self.full_rows = True
        elif len(rest) == len(COLUMNS_WITHOUT_EFFECTS):  # a row written before effects: it declares none
            cells = dict(zip(COLUMNS_WITHOUT_EFFECTS, rest))
            cells = {c: cells.get(c) or rest[0].part(0, _NONE) for c in COLUMNS}
            self.short_rows.append(rest[0])
        else:
            raise _error(
                f"a task row has {len(COLUMNS)} columns ({' '.join(COLUMNS)}; '-' for none; rows of the older "
                f"form have {len(COLUMNS_WITHOUT_EFFECTS)}, without effects), got {len(rest)}",
                rest[0] if rest else key,
                culprit=rest[0].text if rest else "task",
            )
        name = cells["task"]
        _checked(name, "task")
        if name.text in self.rows:
            first = self.rows[name.text].name.line
            raise _error(f"duplicate task name {name.text} (first at line {first})", name, others=[first])
        sched, io, reads, writes = _parse_cells(tuple(cells.values()))
        self.rows[name.text] = _Row(name, cells, reads, writes)
        self.schedule[name.text] = sched
        self.tasks.append(io)
        self.lines.note(name.text, name, task=True)

    def dep(self, key: Word, rest: tuple[Word, ...]) -> None:
        syntax = "a dep line reads 'dep CONSUMER <- PRODUCER [@DISTANCE]'"
        if len(rest) < 3:
            raise _error(syntax, rest[-1] if rest else key, culprit="dep")
        if rest[1].text != "<-":
            raise _error(syntax, rest[1], culprit="dep")
        if len(rest) > 4 or (len(rest) == 4 and not rest[3].text.startswith("@")):
            raise _error(syntax, rest[3] if len(rest) == 4 else rest[4], culprit="dep")
        distance = 0
        if len(rest) == 4:
            at = rest[3]
            if not _INT.match(at.text[1:]) or at.text == "@-0":
                raise _error(f"bad distance {at.text!r}", at)
            distance = int(at.text[1:])
            if distance == 0:
                raise _error("distance 0 (the same batch) is written without '@'", at)
        consumer, producer = rest[0], rest[2]
        dep = Dep(consumer.text, producer.text, distance)
        if dep in self.deps:
            first = self.deps[dep].line
            raise _error(f"dep {dep} given twice (first at line {first})", consumer, culprit=str(dep), others=[first])
        self.deps[dep] = consumer
        self.lines.note(str(dep), consumer)
        self.refs.extend([(consumer, f"dependency {dep}: unknown consumer task"),
                          (producer, f"dependency {dep}: unknown producer task")])


def _read_plan(
    numbered: list[tuple[int, str]], whole: Word, vocabulary: Vocabulary
) -> tuple[dict[str, Any], TextLines]:
    """The constructor arguments of the plan on lines ``numbered`` (``(number, text)``), and where
    each thing was given; ``whole``: the line standing for them all."""
    book = _Book(TextLines(whole))
    for lineno, raw in numbered:
        words = _words(lineno, raw)
        if not words:
            if raw.strip().startswith("#"):
                book.comments.append((lineno, raw))
            continue
        key, rest = words[0], words[1:]
        if key.text in _HEADER:
            book.header(key, rest)
        elif key.text in DECLARATIONS:
            book.declare(key, rest)
        elif key.text == "task":
            book.row(key, rest)
        elif key.text == "dep":
            book.dep(key, rest)
        elif key.text in ("phases", "phase"):
            raise _error("this is a phased plan: read it with PhasedPlan.from_text or plan.load_plan", key)
        else:
            raise _error(f"unknown keyword {key.text!r}{did_you_mean(key.text, _KEYWORDS)}", key)
    if book.full_rows and book.short_rows:
        raise _error(
            f"a task row has {len(COLUMNS)} columns ({' '.join(COLUMNS)}; '-' for none), got "
            f"{len(COLUMNS_WITHOUT_EFFECTS)}: a row of the older form, without effects, in a text whose other rows "
            "have effects (is a cell missing?)",
            book.short_rows[0],
        )
    # a text that declares its names (as plan_to_text writes it) gives every line, so that no line
    # can be left out, or commented out, unnoticed; an older one needs only 'plan' and 'depth'
    declares = any(k in book.decls for k in DECLARATIONS)
    for key in ("plan", "depth", *(("source", "output", "exhausted", *DECLARATIONS) if declares else ())):
        if key not in book.values and key not in book.decls:
            why = f"plan text has no '{key}' line" + (
                " (a text with 'streams', 'threads' and 'comm_groups' lines gives 'plan', 'depth', 'source', "
                "'output' and 'exhausted' too)" if declares and key not in ("plan", "depth") else ""
            )
            commented = book.commented(lambda words, key=key: words[0] == key or is_near(words[0], key))
            if commented is not None:
                raise _error(f"{why}: this comment looks like it, commented out", commented, culprit=key)
            raise book.lines.error(PlanError(why, culprit=key))
    _check_names(book, vocabulary)
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
    if not _INT.match(word.text) or word.text == "-0":
        raise _error(f"{what} must be an int, got {word.text!r}", word, culprit=what)
    value = int(word.text)
    if low is not None and value < low:
        raise _error(f"{what} must be >= {low}, got {value}", word, culprit=what)
    return value


def _checked(word: Word, what: str) -> str:
    try:
        return check_name(word.text, what)
    except PlanError as e:
        raise _error(str(e), word) from None


def _items(cell: Word) -> list[Word]:
    """The comma-separated names of a cell (``-``: none), each with its column."""
    if cell.text == _NONE:
        return []
    out, offset = [], 0
    for piece in cell.text.split(","):
        if not piece:
            raise _error(f"empty name in {cell.text!r} (names are comma-separated, '-' for none)", cell)
        out.append(cell.part(offset, piece))
        offset += len(piece) + 1
    return out


def _old_cells(key: Word, rest: tuple[Word, ...]) -> dict[str, Word]:
    """The cells of a row of the older form ``task NAME stage=2 stream=... reads=a,b``."""
    name, pairs = rest[0], rest[1:]
    given: dict[str, Word] = {}
    for w in pairs:
        k, sep, value = w.text.partition("=")
        if not sep or k not in _OLD_KEYS or k in given:
            raise _error(f"bad task field {w.text!r}", w, culprit=name.text)
        given[k] = w.part(len(k) + 1, value or _NONE)
    default = {"stage": "0", "stream": "default", "thread": "default"}
    cells = {"task": name}
    for cell in COLUMNS[1:]:
        key_ = "noop_on" if cell == "flags" else cell
        cells[cell] = given.get(key_) or name.part(0, default.get(cell, _NONE))
    if "noop_on" in given:
        w = given["noop_on"]
        cells["flags"] = w.part(-len("noop_on="), "noop_on=" + w.text.replace(",", "+"))
    return cells


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
        raise _error(f"task {name} names several comm groups ({comm}); a task belongs to one", comm_cell,
                     culprit=name)
    if comm is not None:
        _checked(comm_cell, "comm_group")
    when_cell = cells["when"]
    try:
        when = When.ALWAYS if when_cell.text == _NONE else When(when_cell.text)
    except ValueError:
        guards = [w.value for w in When]
        raise _error(
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
                raise _error(f"task {name} {kind} a name twice: {w.text!r}", w, culprit=name)
            seen.add(w.text)
    effects: list[str] = []
    for w in _items(cells["effects"]):
        if w.text not in KNOWN_EFFECTS:
            raise _error(
                f"task {name} declares unknown effect {w.text!r} (effects: {', '.join(KNOWN_EFFECTS)})"
                + did_you_mean(w.text, KNOWN_EFFECTS),
                w,
                culprit=name,
            )
        if w.text in effects:
            raise _error(f"task {name} declares effect {w.text!r} twice", w, culprit=name)
        effects.append(w.text)
    anchor, noop_on = False, ()
    for flag in _items(cells["flags"]):
        if flag.text == "anchor" and not anchor:
            anchor = True
        elif flag.text.startswith("noop_on=") and not noop_on:
            noop_on = tuple(flag.text.removeprefix("noop_on=").split("+"))
            for k, device in enumerate(noop_on):
                _checked(flag.part(len("noop_on=") + sum(len(d) + 1 for d in noop_on[:k]), device), "device type")
        else:
            raise _error(
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
        raise _error(str(e), cells["flags"] if noop_on else cells["task"], culprit=name) from None
    return sched, io, tuple((w.part(0, parse_read(w.text)[0]), parse_read(w.text)[1]) for w in reads), tuple(writes)


# ------------------------------------------------------------------------ checking the names
def _lines_of(words: Iterable[Word]) -> list[int]:
    return list(dict.fromkeys(w.line for w in words))


def _verb(words: list[Word], verb: str) -> str:
    return verb + "s" if len(_lines_of(words)) == 1 else verb


def _at(lines: list[int]) -> str:
    return f"line {lines[0]}" if len(lines) == 1 else "lines " + ", ".join(map(str, lines))


def _declaration_is_wrong(used: str, declared: str, uses: list[Word], known: frozenset[str] | None) -> bool:
    """Of a name used but not declared (``used``, at ``uses``) and a near one declared but not used
    (``declared``): whether the declaration is the slip. Yes where the used name is used on several
    lines or only it is ``known`` (the pipeline's); no where only the declared one is known; else yes
    (a declaration used nowhere is the odd one out)."""
    if len(_lines_of(uses)) > 1:
        return True
    if known is not None and (used in known) != (declared in known):
        return used in known
    return True


def _check_names(book: _Book, vocabulary: Vocabulary) -> None:
    """Every stream, thread, comm group, task and data name the text uses is declared (module
    docstring), else a PlanError at the likelier of the places that disagree."""
    uses = {kind: _uses(book, cell) for kind, cell in DECLARATIONS.items()}
    for kind in DECLARATIONS:
        _check_undeclared(book, kind, uses[kind], vocabulary)
    for kind in DECLARATIONS:  # once every name used is declared: nothing declared for nothing
        _check_unused(book, kind, uses[kind])
    _check_tasks(book, vocabulary)
    _check_data(book, vocabulary)
    _check_calls(book, vocabulary)


def _uses(book: _Book, cell: str) -> dict[str, list[Word]]:
    """Each name of a row cell (stream, thread, comm), and where the rows use it."""
    uses: dict[str, list[Word]] = {}
    for row in book.rows.values():
        if row.cells[cell].text != _NONE:
            uses.setdefault(row.cells[cell].text, []).append(row.cells[cell])
    return uses


def _check_undeclared(book: _Book, kind: str, uses: dict[str, list[Word]], vocabulary: Vocabulary) -> None:
    """A name used but not declared: the declaration is a slip of it (a near name, or the one name
    declared and unused where one row uses it), or is missing it (it is used on several rows, or
    it is the pipeline's), or the row is wrong (a slip of a declared name, or a name of nothing)."""
    label, known = _LABEL[kind], vocabulary.of_kind(kind)
    if kind not in book.decls:
        if kind == "threads":
            return  # a thread is only where a task is called: any name, where no line declares them
        for name, words in uses.items():
            if name not in known:
                raise _error(
                    f"{label} {name!r} is not declared: the text has no '{kind}' line, and {name!r} is not one "
                    f"of {', '.join(sorted(known))}{did_you_mean(name, known)} (a '{kind}' line declares the "
                    f"{label}s the rows use)",
                    words[0],
                )
        return
    keyword, names = book.decls[kind]
    declared = {w.text: w for w in names}
    unused = [n for n in declared if n not in uses]
    for name, words in uses.items():
        if name in declared:
            continue
        lines = _lines_of(words)
        near = nearest(name, unused) or (unused[0] if len(unused) == 1 and len(lines) == 1 else None)
        if near is not None and _declaration_is_wrong(name, near, words, known):
            raise _error(
                f"{label} {near!r} is declared but no task row uses it, while {_at(lines)} "
                f"{_verb(words, 'use')} {name!r}, which is not declared: did you mean {name!r}?",
                declared[near],
                others=lines,
            )
        if near is None and (len(lines) > 1 or name in known):
            raise _error(
                f"{label} {name!r}, used at {_at(lines)}, is not declared on this line: add it",
                keyword,
                culprit=name,
                others=lines,
            )
        raise _error(
            f"{label} {name!r} is not declared (the '{kind}' line, line {keyword.line}, declares "
            f"{', '.join(declared) or 'none'}){did_you_mean(name, declared)}",
            words[0],
            others=[keyword.line],
        )


def _check_unused(book: _Book, kind: str, uses: dict[str, list[Word]]) -> None:
    for name, word in {w.text: w for w in book.decls.get(kind, (None, []))[1]}.items():
        if name not in uses:
            raise _error(f"{_LABEL[kind]} {name!r} is declared but no task row uses it", word)


def _check_tasks(book: _Book, vocabulary: Vocabulary) -> None:
    if vocabulary.tasks is not None:
        for name, row in book.rows.items():
            if name not in vocabulary.tasks:
                hint = did_you_mean(name, vocabulary.tasks) or f" (its tasks: {', '.join(sorted(vocabulary.tasks))})"
                raise _error(f"task {name!r} is not one of the pipeline's tasks{hint}", row.name)
    named: dict[str, list[tuple[Word, str]]] = {}
    for word, what in book.refs:
        named.setdefault(word.text, []).append((word, what))
    unnamed = [t for t in book.rows if t not in named]
    for name, refs in named.items():
        if name in book.rows:
            continue
        words = [w for w, _ in refs]
        near = nearest(name, unnamed)
        if near is not None and _declaration_is_wrong(name, near, words, vocabulary.tasks):
            raise _error(
                f"task {near!r} is named nowhere else, while {_at(_lines_of(words))} {_verb(words, 'name')} "
                f"{name!r}, which is not a task: did you mean {name!r}?",
                book.rows[near].name,
                others=_lines_of(words),
            )
        word, what = refs[0]
        commented = book.commented(lambda words, name=name: len(words) >= 2 and words[1] == name)
        if commented is not None:
            raise _error(
                f"task {name!r}, named at {_at(_lines_of(words))}, has no row: this comment looks like its row, "
                "commented out",
                commented,
                culprit=name,
                others=_lines_of(words),
            )
        hint = did_you_mean(name, book.rows)
        message = f"source {name!r} is not a task of the plan{hint}" if what == "source" else f"{what} {name!r}{hint}"
        raise _error(message, word, others=[book.rows[near].name.line] if near is not None else ())


def _check_data(book: _Book, vocabulary: Vocabulary) -> None:
    """Each data name is written by one row, and what rows read (and the output) is written. Of two
    writers, the one that cannot feed the readers is wrong; a read of what no row writes is a slip
    of a name written for nothing (near it, or holding it: ``batchcontext``), else, where several
    rows read it, the first of them (its writer turned reader), else the read."""
    writers: dict[str, list[tuple[str, Word]]] = {}
    for task, row in book.rows.items():
        for w in row.writes:
            writers.setdefault(w.text, []).append((task, w))
    readers: dict[str, list[tuple[str | None, Word, int]]] = {}  # reading task (None: output), word, k of x@k
    for task, row in book.rows.items():
        for w, k in row.reads:
            readers.setdefault(w.text, []).append((task, w, k))
    output = book.values.get("output")
    if output is not None and output.text != _NONE:
        readers.setdefault(output.text, []).append((None, output, 0))
    unwritten_readers = {r for d, rs in readers.items() if d not in writers for r, _, _ in rs}
    for data, ws in writers.items():
        if len(ws) > 1:
            (a, word_a), (b, word_b) = ws[:2]
            tasks = [r for r, _, _ in readers.get(data, ()) if r is not None]
            fit = [w for w in (a, b) if all(_feeds(book, w, r, k) for r, _, k in readers.get(data, ()) if r)]
            if len(fit) != 1:  # no reader tells: the writer that also reads what nobody writes (a swap)
                fit = [w for w in (a, b) if w not in unwritten_readers]
            if len(fit) != 1:  # else the later (by stage, then fire order): data flows from early to late
                order = list(book.rows)
                fit = [min((a, b), key=lambda t: (book.schedule[t].stage, order.index(t)))]
            wrong, right = ((a, word_a), (b, word_b)) if fit == [b] else ((b, word_b), (a, word_a))
            why = f" (only {right[0]} can feed {', '.join(tasks)})" if len(fit) == 1 and tasks else ""
            raise _error(f"data {data!r} is written by both {a} and {b}{why}", wrong[1], culprit=wrong[0],
                         others=[right[1].line])
    unread = [d for d in writers if d not in readers]
    for data, rs in readers.items():
        if data in writers:
            continue
        words = [w for _, w, _ in rs]
        near = nearest(data, unread) or next(
            (u for u in unread if min(len(u), len(data)) >= 3 and (data in u or u in data)), None
        )
        if near is not None and _declaration_is_wrong(data, near, words, vocabulary.data or None):
            task, w = writers[near][0]
            raise _error(
                f"task {task} writes {near!r}, which nothing reads, while {_at(_lines_of(words))} "
                f"{_verb(words, 'read')} {data!r}, which no task writes: did you mean {data!r}?",
                w,
                culprit=task,
                others=_lines_of(words),
            )
        tasks = [(r, w) for r, w, _ in rs if r is not None]
        if len(_lines_of(words)) > 1 and tasks:
            first, word = min(tasks, key=lambda t: (book.schedule[t[0]].stage, list(book.rows).index(t[0])))
            rest = ", ".join(r for r, _ in tasks if r != first)
            message = f"task {first} reads {data!r}, which no task writes (nor do {rest}, which read it too)"
        elif tasks:
            first, word = tasks[0]
            message = f"task {first} reads {data!r}, which no task writes"
        else:
            word, message = output, f"output {data!r} is not written by any task"  # type: ignore[assignment]
        assert word is not None
        raise _error(message + did_you_mean(data, writers), word,
                     others=[*_lines_of(words), *([writers[near][0][1].line] if near is not None else [])])


def _check_calls(book: _Book, vocabulary: Vocabulary) -> None:
    """Each row's reads and writes fit its task's function, where the vocabulary knows what it can be
    called with (``calls.check_call``): the error at the row, and the read or write at fault."""
    if not vocabulary.calls:
        return
    source = book.values.get("source")
    for io in book.tasks:
        try:
            check_call(io, vocabulary.call_of(io.name), source=source is not None and source.text == io.name)
        except PlanError as e:
            raise book.lines.error(e) from None


def _feeds(book: _Book, writer: str, reader: str, k: int) -> bool:
    """Whether ``writer(b - k)`` can run before ``reader(b)`` (stages, then fire order)."""
    lead = book.schedule[reader].stage - (book.schedule[writer].stage - k)
    return lead > 0 or (lead == 0 and list(book.rows).index(writer) < list(book.rows).index(reader))


# ------------------------------------------------------------------------------ phased plans
def phased_to_text(phased: PhasedView) -> str:
    lines = [f"phases {phased.name}"]
    if phased.clock != "index":
        lines.append(f"clock {phased.clock}")
    if phased.cycle is not None:
        lines.append(f"cycle {phased.cycle[0]} {phased.cycle[1]}")
    for start, plan in phased.phases:
        lines.append(f"phase {start}")
        lines.append(plan_to_text(plan).rstrip("\n"))
    return "\n".join(lines) + "\n"


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
        words = _words(lineno, raw)
        if not words:
            continue
        key, rest = words[0], words[1:]
        if key.text == "phases":
            if name is not None:
                raise _error(f"'phases' must come first, once (first at line {name.line})", key, culprit="phases")
            if len(rest) != 1:
                raise _error("a phases line reads 'phases NAME'", rest[1] if rest else key, culprit="phases")
            name = rest[0]
            lines.note("phases", name)
            lines.note(name.text, name)
        elif key.text in ("clock", "cycle") and name is not None:
            given = clock if key.text == "clock" else (cycle[0] if cycle else None)
            if given is not None:
                raise _error(f"'{key.text}' given twice (first at line {given.line})", key, culprit=key.text)
            if key.text == "clock":
                if len(rest) != 1:
                    raise _error("a clock line reads 'clock CLOCK'", rest[1] if rest else key, culprit="clock")
                clock = rest[0]
            else:
                cycle = (key, _cycle(key, rest))
            lines.note(key.text, rest[0] if rest else key)
        elif key.text == "phase" and name is not None:
            if len(rest) != 1 or not _INT.match(rest[0].text) or rest[0].text.startswith("-"):
                raise _error("a phase line reads 'phase START'", rest[0] if rest else key, culprit="phase")
            bodies.append((int(rest[0].text), rest[0], []))
            lines.note(rest[0].text, rest[0], latest=True)
        elif key.text in ("clock", "cycle", "phase"):
            raise _error(f"phased plan text has no 'phases' line before this '{key.text}' line", key, culprit="phases")
        else:
            raise _error("expected 'phases NAME' first, then 'clock', 'cycle' or 'phase START' lines", key)
    if name is None:
        raise lines.error(PlanError("phased plan text has no 'phases' line", culprit="phases"))
    phases, where = [], []
    for start, at, body in bodies:
        whole = Word(at.text, at.line, None, at.raw)
        args, plan_lines = _read_plan(body, whole, vocabulary or Vocabulary())
        with plan_lines.naming_lines():
            phases.append((start, build_plan(**args)))
        where.append(plan_lines)
    _check_turns(phases, where, vocabulary or Vocabulary())
    with lines.naming_lines():
        return build(phases, name=name.text, clock=clock.text if clock else "index", cycle=cycle[1] if cycle else None)


def _odd_one(values: list[tuple[int, object]], right: object = None) -> tuple[int, int] | None:
    """Of ``(phase, value)`` pairs, the phase whose value is the odd one out (against the value most
    phases have, else ``right`` where one has it, else the later of two) and a phase it differs from;
    None where all agree."""
    counts: dict[str, int] = {}
    for _, v in values:
        counts[repr(v)] = counts.get(repr(v), 0) + 1
    if len(counts) < 2:
        return None
    most = [r for r, c in counts.items() if c == max(counts.values())]
    agreed = most[0] if len(most) == 1 else repr(right) if right is not None and repr(right) in counts else None
    if agreed is None:
        return values[-1][0], values[0][0]
    return next(k for k, v in values if repr(v) != agreed), next(k for k, v in values if repr(v) == agreed)


def _check_turns(phases: list[tuple[int, Any]], where: list[TextLines], vocabulary: Vocabulary) -> None:
    """The phases agree on each task's stage, reads/writes and effects, a task of only some phases writes
    nothing, and they share their source and output (what lets them take turns), else a PlanError
    at the phase that disagrees with the others: with most of them, or with the pipeline's ``io``,
    else the later of two."""
    tasks = list(dict.fromkeys(t for _, p in phases for t in p.fire_order))
    for task in sorted(tasks, key=lambda t: sum(t in p.schedule for _, p in phases)):  # the rarest first
        having = [(k, p) for k, (_, p) in enumerate(phases) if task in p.schedule]
        writer = next((k for k, p in having if p.tasks[task].writes), None)
        if len(having) < len(phases) and writer is not None:
            other, writes = next(j for j, (_, p) in enumerate(phases) if task not in p.schedule), phases[writer][1]
            raise where[writer].error(PlanError(
                f"phases {phases[writer][0]} and {phases[other][0]} cannot take turns: task {task}, in phase "
                f"{phases[writer][0]} and not {phases[other][0]}, writes data "
                f"({', '.join(writes.tasks[task].writes)})",
                culprit=task, token=writes.tasks[task].writes[0]))
    for task in tasks:
        having = [(k, p) for k, (_, p) in enumerate(phases) if task in p.schedule]
        io = vocabulary.io_of(task)
        values: list[tuple[int, object]] = [(k, (p.schedule[task].stage, p.tasks[task])) for k, p in having]
        found = _odd_one(values, next((v for _, v in values if v[1] == io), None))  # type: ignore[index]
        if found is not None:
            odd, other = found
            ours, theirs = where[odd].find(task), where[other].find(task)
            assert ours is not None and theirs is not None
            raise _error(
                f"phases {phases[other][0]} and {phases[odd][0]} cannot take turns: task {task} changes its stage, "
                f"its reads/writes or its effects (phase {phases[odd][0]} here, phase {phases[other][0]} at line "
                f"{theirs.line})",
                ours, culprit=task, others=[theirs.line])
    for field_ in ("source", "output"):
        found = _odd_one([(k, getattr(p, field_)) for k, (_, p) in enumerate(phases)])
        if found is not None:
            odd, other = found
            raise where[odd].error(PlanError(
                f"phases {phases[other][0]} and {phases[odd][0]} cannot take turns: source, output and highest "
                f"stage must stay the same ({field_} {getattr(phases[odd][1], field_)} here, "
                f"{getattr(phases[other][1], field_)} in phase {phases[other][0]})", culprit=field_))


def _cycle(key: Word, rest: tuple[Word, ...]) -> tuple[int, int]:
    if len(rest) != 2 or not all(_INT.match(w.text) and w.text != "-0" for w in rest):
        raise _error("a cycle line reads 'cycle FIRST PERIOD'", rest[0] if rest else key, culprit="cycle")
    return int(rest[0].text), int(rest[1].text)


def _first_line(text: str) -> Word:
    """The first line that is not blank or a comment (line 1 if none): where a missing line belongs."""
    n, raw = next(((n, ln) for n, ln in enumerate(text.splitlines(), 1) if ln.split("#", 1)[0].strip()), (1, ""))
    return Word("", n, None, raw)


def is_phased_text(text: str) -> bool:
    first = next((ln.split("#", 1)[0].strip() for ln in text.splitlines() if ln.split("#", 1)[0].strip()), "")
    return first.startswith("phases ")


def _opt(value: str | None) -> str | None:
    return None if value in (None, "", _NONE) else value
