"""What every drop-in whose ``progress()`` runs on an engine shares: ``EngineDriven``.

Two kinds of drop-in drive an engine: the plan-driven pipelines (``pipelines._driven.PlanDriven``,
an ``Engine`` running a plan) and the Maglev ones (``maglev.pipelines``, a ``ProgramEngine``
running the rank's program). Both take their engine from here (``_swp_drive``) and share:

* the pipeline's life (``PipelineLife``, also GradientAccumulationWrapper's): ``close()`` stops
  the engine's threads, destroys the process groups the pipeline made (``teardown``: also when
  it is collected, and at exit for a pipeline never closed) and ends the pipeline (a later
  ``progress()`` raises ``PipelineClosed`` naming the class; closing again does nothing), and
  ``with pipeline:`` closes it at the end of the block (exceptions pass through). Upstream's
  pipelines have neither, so nothing of theirs is replaced;
* the check of ``progress()``'s argument (``_swp_check_progress``): upstream's ``progress(None)``
  fails in ``next(None)`` with a TypeError; ours says so first, naming the class and the
  argument, instead of a StopIteration that a user's ``except StopIteration: break`` loop would
  take for the end of the data;
* an unknown constructor keyword is a TypeError naming the class, raised before any constructor
  runs (upstream's logs an ERROR line before Python's own TypeError): ``check_keywords`` for the
  plan-driven pipelines, whose keywords pass through to upstream's constructors; the Maglev
  drop-ins name theirs (``maglev.program_options.ProgramOptions.take``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any, Self

from torchrec_swp.engine import Engine, ProgramEngine
from torchrec_swp.integrations.torchrec.teardown import Teardown


class PipelineClosed(RuntimeError):
    """``progress()`` on a pipeline after ``close()`` (or after its ``with`` block)."""


def check_keywords(cls: type, kwargs: Mapping[str, Any], also: Iterable[str] = ()) -> None:
    """TypeError in one line naming ``cls``, as Python's own, for a keyword in ``kwargs`` that no
    ``__init__`` among ``cls``'s bases names as a parameter and that is not in ``also`` (keywords
    a constructor takes from its ``**kwargs``)."""
    known = _named_parameters(cls)
    if known is None:  # a constructor whose signature cannot be read: leave it to Python
        return
    for name in kwargs:
        if name not in known and name not in also:
            raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {name!r}")


@functools.cache
def _named_parameters(cls: type) -> frozenset[str] | None:
    """The parameters every ``__init__`` among ``cls``'s bases takes by name (None where one's
    signature cannot be read)."""
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names: set[str] = set()
    for base in cls.__mro__:
        init = base.__dict__.get("__init__")
        if init is None:
            continue
        try:
            parameters = inspect.signature(init).parameters
        except (TypeError, ValueError):
            return None
        names.update(n for n, p in parameters.items() if p.kind in by_name)
    return frozenset(names)


class PipelineLife:
    """A pipeline's life: ``close()`` ends it (a subclass's ``close()`` also stops what it runs on,
    then calls this one), a later ``progress()`` raises PipelineClosed (``_swp_check_open()``),
    ``with pipeline:`` closes it at the end of the block (exceptions pass through); closing again
    does nothing."""

    _swp_closed = False  # until close()

    @property
    def closed(self) -> bool:
        """Whether ``close()`` ended the pipeline."""
        return self._swp_closed

    def close(self) -> None:
        """End the pipeline: a later ``progress()`` raises PipelineClosed. Closing again does nothing."""
        self._swp_closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def _swp_check_open(self) -> None:
        """PipelineClosed, naming the class, after ``close()``."""
        if self._swp_closed:
            raise PipelineClosed(
                f"{type(self).__name__}.progress(): the pipeline was closed (close() or its with block ended)"
            )


class EngineDriven(PipelineLife):
    """The engine a drop-in drives, its life (``PipelineLife``) and the check of ``progress()``'s
    argument (module docstring)."""

    _swp_engine: Engine | ProgramEngine
    #: the last ``progress()`` argument ``_swp_check_progress`` passed (a call with it again, on a
    #: pipeline still open, needs no check): none yet
    _swp_checked_iterator: Any = object()

    def _swp_drive(self, engine: Engine | ProgramEngine) -> None:
        """Drive ``engine`` from now on (set once every check of the constructor passed)."""
        self._swp_engine = engine
        self._swp_teardown().threads(engine.stop_threads)

    def _swp_teardown(self) -> Teardown:
        """What this pipeline shuts down at ``close()``, when collected, or at exit: its engines'
        threads, then the process groups it made (``teardown.Teardown``); made on first use."""
        teardown = self.__dict__.get("_swp_teardown_now")
        if teardown is None:
            teardown = self._swp_teardown_now = Teardown(self)
        return teardown

    @property
    def engine(self) -> Any:
        """The engine ``progress()`` runs on."""
        return self._swp_engine

    @engine.setter
    def engine(self, engine: Engine | ProgramEngine) -> None:
        """Run on ``engine`` from the next ``progress()`` (between steps; the old engine is the
        caller's to close)."""
        self._swp_engine = engine
        self._swp_teardown().threads(engine.stop_threads)

    def close(self) -> None:
        """End the pipeline: stop its engine's worker threads, then destroy the process groups it
        made (``teardown``; also done when the pipeline is collected, and at exit for a pipeline
        never closed); a later ``progress()`` raises PipelineClosed. Closing again does nothing."""
        self._swp_engine.close()
        self._swp_teardown()()
        super().close()

    def _swp_check_progress(self, dataloader_iter: Any, *, read: bool = True) -> None:
        """What ``progress(dataloader_iter)`` checks first: the pipeline is open (else
        PipelineClosed) and, where the call reads it (``read``), the argument is an iterator,
        something ``next()`` takes (else TypeError); each in one line naming the class."""
        self._swp_check_open()
        if read and not hasattr(type(dataloader_iter), "__next__"):
            given = "None" if dataloader_iter is None else type(dataloader_iter).__name__
            raise TypeError(
                f"{type(self).__name__}.progress(dataloader_iter): dataloader_iter must be an iterator "
                f"(e.g. iter(dataloader)), got {given}"
            )
