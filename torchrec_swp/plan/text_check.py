"""The checks of the names a plan's text uses, run on what it gave (a ``PlanBook``, filled by
``text_read``) before the plan is built: every stream, thread, comm group, task and data name is
declared, and declared for something (``torchrec_swp.plan.text_words`` says how), the rows' reads
and writes fit their tasks' functions, and the phases of a phased plan can take turns. Where two
lines disagree, the error names the likelier of them."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

from torchrec_swp.plan.calls import check_call
from torchrec_swp.plan.errors import PlanError
from torchrec_swp.plan.names import Vocabulary, did_you_mean, nearest
from torchrec_swp.plan.text_words import DECLARATIONS, LABEL, NONE, PlanBook, TextLines, Word, error_at


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


def check_names(book: PlanBook, vocabulary: Vocabulary) -> None:
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


def _uses(book: PlanBook, cell: str) -> dict[str, list[Word]]:
    """Each name of a row cell (stream, thread, comm), and where the rows use it."""
    uses: dict[str, list[Word]] = {}
    for row in book.rows.values():
        if row.cells[cell].text != NONE:
            uses.setdefault(row.cells[cell].text, []).append(row.cells[cell])
    return uses


def _check_undeclared(book: PlanBook, kind: str, uses: dict[str, list[Word]], vocabulary: Vocabulary) -> None:
    """A name used but not declared: the declaration is a slip of it (a near name, or the one name
    declared and unused where one row uses it), or is missing it (it is used on several rows, or
    it is the pipeline's), or the row is wrong (a slip of a declared name, or a name of nothing)."""
    label, known = LABEL[kind], vocabulary.of_kind(kind)
    if kind not in book.decls:
        if kind == "threads":
            return  # a thread is only where a task is called: any name, where no line declares them
        for name, words in uses.items():
            if name not in known:
                raise error_at(
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
            raise error_at(
                f"{label} {near!r} is declared but no task row uses it, while {_at(lines)} "
                f"{_verb(words, 'use')} {name!r}, which is not declared: did you mean {name!r}?",
                declared[near],
                others=lines,
            )
        if near is None and (len(lines) > 1 or name in known):
            raise error_at(
                f"{label} {name!r}, used at {_at(lines)}, is not declared on this line: add it",
                keyword,
                culprit=name,
                others=lines,
            )
        raise error_at(
            f"{label} {name!r} is not declared (the '{kind}' line, line {keyword.line}, declares "
            f"{', '.join(declared) or 'none'}){did_you_mean(name, declared)}",
            words[0],
            others=[keyword.line],
        )


def _check_unused(book: PlanBook, kind: str, uses: dict[str, list[Word]]) -> None:
    for name, word in {w.text: w for w in book.decls.get(kind, (None, []))[1]}.items():
        if name not in uses:
            raise error_at(f"{LABEL[kind]} {name!r} is declared but no task row uses it", word)


def _check_tasks(book: PlanBook, vocabulary: Vocabulary) -> None:
    if vocabulary.tasks is not None:
        for name, row in book.rows.items():
            if name not in vocabulary.tasks:
                hint = did_you_mean(name, vocabulary.tasks) or f" (its tasks: {', '.join(sorted(vocabulary.tasks))})"
                raise error_at(f"task {name!r} is not one of the pipeline's tasks{hint}", row.name)
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
            raise error_at(
                f"task {near!r} is named nowhere else, while {_at(_lines_of(words))} {_verb(words, 'name')} "
                f"{name!r}, which is not a task: did you mean {name!r}?",
                book.rows[near].name,
                others=_lines_of(words),
            )
        word, what = refs[0]
        commented = book.commented(partial(_names_task_row, name))
        if commented is not None:
            raise error_at(
                f"task {name!r}, named at {_at(_lines_of(words))}, has no row: this comment looks like its row, "
                "commented out",
                commented,
                culprit=name,
                others=_lines_of(words),
            )
        hint = did_you_mean(name, book.rows)
        message = f"source {name!r} is not a task of the plan{hint}" if what == "source" else f"{what} {name!r}{hint}"
        raise error_at(message, word, others=[book.rows[near].name.line] if near is not None else ())


def _check_data(book: PlanBook, vocabulary: Vocabulary) -> None:
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
    if output is not None and output.text != NONE:
        readers.setdefault(output.text, []).append((None, output, 0))
    unwritten_readers = {r for d, rs in readers.items() if d not in writers for r, _, _ in rs}
    for data, ws in writers.items():
        if len(ws) > 1:
            (a, word_a), (b, word_b) = ws[:2]
            feeding = [r for r, _, _ in readers.get(data, ()) if r is not None]
            fit = [w for w in (a, b) if all(_feeds(book, w, r, k) for r, _, k in readers.get(data, ()) if r)]
            if len(fit) != 1:  # no reader tells: the writer that also reads what nobody writes (a swap)
                fit = [w for w in (a, b) if w not in unwritten_readers]
            if len(fit) != 1:  # else the later (by stage, then fire order): data flows from early to late
                order = list(book.rows)
                fit = [min((a, b), key=lambda t: (book.schedule[t].stage, order.index(t)))]
            wrong, right = ((a, word_a), (b, word_b)) if fit == [b] else ((b, word_b), (a, word_a))
            why = f" (only {right[0]} can feed {', '.join(feeding)})" if len(fit) == 1 and feeding else ""
            raise error_at(f"data {data!r} is written by both {a} and {b}{why}", wrong[1], culprit=wrong[0],
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
            raise error_at(
                f"task {task} writes {near!r}, which nothing reads, while {_at(_lines_of(words))} "
                f"{_verb(words, 'read')} {data!r}, which no task writes: did you mean {data!r}?",
                w,
                culprit=task,
                others=_lines_of(words),
            )
        tasks: list[tuple[str, Word]] = [(r, w) for r, w, _ in rs if r is not None]
        word: Word | None
        if len(_lines_of(words)) > 1 and tasks:
            first, word = min(tasks, key=lambda t: (book.schedule[t[0]].stage, list(book.rows).index(t[0])))
            rest = ", ".join(r for r, _ in tasks if r != first)
            message = f"task {first} reads {data!r}, which no task writes (nor do {rest}, which read it too)"
        elif tasks:
            first, word = tasks[0]
            message = f"task {first} reads {data!r}, which no task writes"
        else:
            word, message = output, f"output {data!r} is not written by any task"
        assert word is not None
        raise error_at(message + did_you_mean(data, writers), word,
                       others=[*_lines_of(words), *([writers[near][0][1].line] if near is not None else [])])


def _check_calls(book: PlanBook, vocabulary: Vocabulary) -> None:
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


def _feeds(book: PlanBook, writer: str, reader: str, k: int) -> bool:
    """Whether ``writer(b - k)`` can run before ``reader(b)`` (stages, then fire order)."""
    lead = book.schedule[reader].stage - (book.schedule[writer].stage - k)
    return lead > 0 or (lead == 0 and list(book.rows).index(writer) < list(book.rows).index(reader))


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


def check_turns(phases: list[tuple[int, Any]], where: list[TextLines], vocabulary: Vocabulary) -> None:
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
        # (the ignore below: v is a (stage, task) pair: values holds such pairs)
        found = _odd_one(values, next((v for _, v in values if v[1] == io), None))  # type: ignore[index]
        if found is not None:
            odd, other = found
            ours, theirs = where[odd].find(task), where[other].find(task)
            assert ours is not None and theirs is not None
            raise error_at(
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


def _names_task_row(name: str, words: list[str]) -> bool:
    """A line whose second word is ``name`` (a task row of it, commented out)."""
    return len(words) >= 2 and words[1] == name
