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
ignored. Rows of the older form are read too: nine cells, without ``effects``, as a task that
declares none (in a text whose rows all have nine: one short row among full ones is a missing
cell). The ``key=value`` rows of the first text form (``task NAME stage=2 stream=... reads=a,b``)
are refused at their line, with the columns to write instead.

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
The text form's modules read and write text only: they make the plan's constructor arguments and
read a plan's attributes, so that the plan classes import them (and pass themselves in to be built)
and not the other way round. This one holds what they share: the columns and keywords, a ``Word``
and where it is (``TextLines``, ``at_line``), and the ``PlanBook`` of what a text gave.
``text_write`` writes a plan's text, ``text_read`` reads it, and ``text_check`` checks the names a
text uses; imports flow one way: write -> words, read -> check -> words (and read -> words).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

from torchrec_swp.plan.errors import PlanError
from torchrec_swp.plan.task import Dep, PipelineTask, TaskSchedule

NONE = "-"  # an empty cell
COLUMNS = ("task", "stage", "stream", "thread", "comm", "when", "reads", "writes", "effects", "flags")
#: The columns of the rows written before effects were declared (read as a task that declares none).
COLUMNS_WITHOUT_EFFECTS = tuple(c for c in COLUMNS if c != "effects")
#: The lines that declare the names the task rows use, and the row cell each declares.
DECLARATIONS = {"streams": "stream", "threads": "thread", "comm_groups": "comm"}
LABEL = {"streams": "stream", "threads": "thread", "comm_groups": "comm group"}
HEADER = ("plan", "depth", "source", "output", "exhausted", "lookahead", "loads")
KEYWORDS = (*HEADER, *DECLARATIONS, "task", "dep")
HEADER_ARGS = {"depth": "pipeline_depth", "exhausted": "on_exhausted"}  # header word -> constructor argument
INT = re.compile(r"-?(0|[1-9][0-9]*)\Z")


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
def words_of(lineno: int, raw: str) -> tuple[Word, ...]:
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


def error_at(message: str, word: Word, *, culprit: str = "", others: Iterable[int] = ()) -> PlanError:
    """A PlanError about ``word``: its line and column."""
    return at_line(word.line, word.raw, PlanError(message, culprit=culprit or word.text), column=word.column,
                   others=others)


def column_of(token: str, word: Word) -> int | None:
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
        column = column_of(e.token, word) if e.token and word.column is not None else word.column
        others = [w.line for w in map(self.find, e.also) if w is not None]
        return at_line(word.line, word.raw, e, column=column, others=others)

    @contextmanager
    def naming_lines(self) -> Iterator[None]:
        """Raise every PlanError from the block as ``error()`` makes it."""
        try:
            yield
        except PlanError as e:
            raise self.error(e) from None


@dataclass
class Row:
    name: Word
    cells: dict[str, Word]
    reads: tuple[tuple[Word, int], ...]  # each read's data name (``x`` of ``x@1``) and batch distance (1)
    writes: tuple[Word, ...]


@dataclass
class PlanBook:
    """What a plan's text gave, and where."""

    lines: TextLines
    values: dict[str, Word] = field(default_factory=dict)  # header key -> its value
    decls: dict[str, tuple[Word, list[Word]]] = field(default_factory=dict)  # kind -> (keyword, names)
    rows: dict[str, Row] = field(default_factory=dict)
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
