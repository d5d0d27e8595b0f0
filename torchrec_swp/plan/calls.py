"""What a task's function can be called with (``TaskCall``), and the check of a plan row against it.

A task's function is called ``fn(b, **reads)`` (``torchrec_swp.engine.tasks``): the batch index
positionally, each read as keyword ``PipelineTask.arguments`` (``x`` for ``x``, ``prev_x`` for
``x@1``), and the source also ``data=`` once ``step()`` was given an iterator. It returns None
(no writes), the value (one write) or a tuple of as many values as there are writes.

``TaskCall.of(task, fn)`` reads that much off ``fn``'s signature, without calling it; ``check_call``
refuses a row that cannot be called so, before anything runs (a PlanError naming the task, and the
read or write at fault as its ``token``, so that a plan's text points at its column):

1. a read whose keyword names no parameter, where the function takes no ``**kwargs``;
2. a parameter without a default that no read gives (``data`` of the source excepted: the engine
   gives it);
3. a function that cannot take the batch index as its first positional argument;
4. two writes or more, where the function's return annotation says how many values it returns
   (``-> None``, or a ``tuple[...]`` of fixed length) and they are another number; one write
   where it says ``-> None``.

Whatever the signature does not say (``**kwargs``, ``*args``, a result annotated ``Any`` or not at
all, a callable whose signature cannot be read) passes: the check refuses only calls that fail.
"""

from __future__ import annotations

import ast
import inspect
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchrec_swp.plan.errors import PlanError
from torchrec_swp.plan.task import PipelineTask, read_argument

#: The keyword the source gets what it draws from as (``engine.source.Feed.argument``).
DATA_ARGUMENT = "data"

_PREVIOUS_KEYWORD = re.compile(r"prev(?P<k>[2-9]|[1-9][0-9]+)?_(?P<name>[A-Za-z_][A-Za-z0-9_]*)\Z")


@dataclass(frozen=True, slots=True)
class TaskCall:
    """What ``task``'s function ``function`` (its name and signature, for messages) can be
    called with: ``takes``, the keywords it accepts (None: any, it has ``**kwargs``); ``needs``,
    the keywords it must get (parameters without a default); ``batch``, whether its first
    positional parameter takes the batch index; ``results``, how many values its return
    annotation says it returns (0 for ``-> None``; None: it does not say)."""

    task: str
    function: str
    takes: frozenset[str] | None
    needs: frozenset[str]
    batch: bool = True
    results: int | None = None

    @classmethod
    def of(cls, task: str, fn: Callable[..., Any]) -> TaskCall | None:
        """What ``fn`` can be called with as ``task``'s function; None where its signature cannot
        be read (a builtin without one): nothing is then checked."""
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            return None
        parameters = list(signature.parameters.values())
        positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        first = positional[0] if positional else None  # takes the batch index
        batch = first is not None or any(p.kind is p.VAR_POSITIONAL for p in parameters)
        keyword = [p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p is not first]
        takes = None if any(p.kind is p.VAR_KEYWORD for p in parameters) else frozenset(p.name for p in keyword)
        # a positional-only parameter after the batch index cannot be given by a keyword: needed, never given
        stuck = [p for p in positional[1:] if p.kind is p.POSITIONAL_ONLY]
        needs = frozenset(p.name for p in [*keyword, *stuck] if p.default is p.empty)
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        bare = signature.replace(  # annotations left out: messages show what a call passes
            parameters=[p.replace(annotation=p.empty) for p in parameters], return_annotation=signature.empty
        )
        return cls(task, f"{name}{bare}", takes, needs, batch, _results(signature.return_annotation))


def _results(annotation: object) -> int | None:
    """How many values a return annotation says a function returns (None: it does not say)."""
    if annotation is inspect.Signature.empty:
        return None
    if isinstance(annotation, str):  # ``from __future__ import annotations``: read the text
        try:
            node = ast.parse(annotation, mode="eval").body
        except SyntaxError:
            return None
        if isinstance(node, ast.Constant) and node.value is None:
            return 0
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("tuple", "Tuple", "typing.Tuple"):
            items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if any(isinstance(i, ast.Constant) and i.value is Ellipsis for i in items):
                return None
            return len(items)
        return None
    if annotation is None or annotation is type(None):
        return 0
    if typing.get_origin(annotation) is tuple:
        args = typing.get_args(annotation)
        return None if Ellipsis in args else len(args)
    return None


def _read_for(keyword: str) -> str:
    """The read that gives ``keyword`` (``read_argument`` backwards): ``x@1`` for ``prev_x``."""
    match = _PREVIOUS_KEYWORD.match(keyword)
    if match is None:
        return keyword
    return f"{match['name']}@{match['k'] or 1}"


def check_call(io: PipelineTask, call: TaskCall | None, *, source: bool = False) -> None:
    """A PlanError where ``io``'s row cannot be handed to its function as ``call`` says (the
    module docstring's rules); ``source``: the task is the plan's source (it also gets ``data``)."""
    if call is None:
        return
    task, function = io.name, call.function
    if not call.batch:
        raise PlanError(
            f"task {task}: its function {function} takes no positional argument, and tasks are called "
            "fn(b, **reads) with the batch index first",
            culprit=task,
        )
    given = {read_argument(r): r for r in io.reads}
    if call.takes is not None:
        for keyword, read in given.items():
            if keyword not in call.takes:
                as_keyword = "" if keyword == read else f" (as keyword {keyword})"
                raise PlanError(
                    f"task {task} reads {read!r}{as_keyword}, which its function {function} has no parameter "
                    f"for{_takes(call)}",
                    culprit=task,
                    token=read,
                )
    lacking = sorted(call.needs - set(given) - ({DATA_ARGUMENT} if source else set()))
    if lacking:
        reads = ", ".join(repr(_read_for(k)) for k in lacking)
        raise PlanError(
            f"task {task} does not read {reads}, which its function {function} needs "
            f"(it reads {', '.join(io.reads) or 'nothing'})",
            culprit=task,
        )
    results, writes = call.results, io.writes
    if results is not None and (len(writes) > 1 or (len(writes) == 1 and results == 0)) and results != len(writes):
        says = "None" if results == 0 else f"a tuple of {results} values"
        raise PlanError(
            f"task {task} writes {len(writes)} value{'s' if len(writes) > 1 else ''} ({', '.join(writes)}), "
            f"but its function {function} returns {says}",
            culprit=task,
            token=writes[0],
        )


def _takes(call: TaskCall) -> str:
    keywords = sorted(call.takes or ())
    reads = [_read_for(k) for k in keywords]
    return f" (it takes {', '.join(reads)})" if reads else " (it takes no read)"
