"""The TorchRec versions torchrec_swp supports, and what differs between them, in one place.

Checked before anything of TorchRec is imported. Every difference between supported versions
that our code must know about is a field of :class:`TorchRecVersion`, read from ``TORCHREC``;
task bodies and plans never compare version numbers themselves.

What differs (``train_pipelines.py`` and friends, 1.8.0 -> 1.9.2):

* ``TrainPipelineSparseDist(async_inplace_copy=...)`` exists from 1.9 (its ``AsyncInplaceCopyMixin``
  moves the in-place H2D copy onto a background thread, on CUDA/MTIA only). Our classes accept
  the option on every supported version and map it onto the plan (see ``plans``), never passing
  it to upstream's constructor.
* ``TrainPipelinePEC`` (``pec_train_pipeline.py``) and ``torchrec.distributed.maglev`` exist
  from 1.9.
* ``experimental_pipelines.py`` (TrainEvalHybridPipelineBase, TrainPipelineSparseDistT,
  TrainPipelineSparseDistBwdOpt, ...) is the same file in 1.8.0 and 1.9.2: no field.
* Upstream-internal changes our subclasses inherit unchanged through the helpers they call:
  ``_wait_for_batch`` skips ``record_stream`` under in-place copy, TrainPipelineSemiSync
  synchronizes ``get_device_module(self._device)`` instead of the default device module,
  PrefetchTrainPipelineSparseDist's ``_fill_pipeline`` treats 2 batches (not 3) as filled
  (our engine does not call it), and ``_start_embedding_lookup`` orders the lookup stream after
  the data-dist stream with an event.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

#: Minor series supported: every x.y.z release of these.
SUPPORTED_SERIES = ("1.8", "1.9")
#: The releases CI tests against upstream (parity tests on 2 gloo ranks).
TESTED_VERSIONS = ("1.8.0", "1.9.2")
INSTALL_HINT = (
    "pip install --no-deps torchrec==1.9.2 (requirements/torchrec.txt; for 1.8: torchrec==1.8.0, "
    "requirements/torchrec-1.8.txt)"
)

#: The upstream classes whose 1.9 constructor takes ``async_inplace_copy`` (ours take it on 1.8 too).
ASYNC_INPLACE_COPY_PIPELINES = frozenset(
    {
        "TrainPipelineSparseDist",
        "TrainPipelineSparseDistLite",
        "PrefetchTrainPipelineSparseDist",
        "TrainEvalHybridPipelineBase",  # TrainPipelineSparseDist's constructor, unchanged
    }
)

_RELEASE = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


@dataclass(frozen=True)
class TorchRecVersion:
    """An installed TorchRec release and the facts about it our code depends on."""

    text: str
    release: tuple[int, int, int]

    @property
    def series(self) -> str:
        return f"{self.release[0]}.{self.release[1]}"

    @property
    def has_async_inplace_copy(self) -> bool:
        """Upstream's TrainPipelineSparseDist family takes ``async_inplace_copy``."""
        return self.release >= (1, 9, 0)

    @property
    def has_pec(self) -> bool:
        """``TrainPipelinePEC`` and the PEC embedding modules exist."""
        return self.release >= (1, 9, 0)

    @property
    def has_maglev(self) -> bool:
        """``torchrec.distributed.maglev`` (pipeline-parallel schedules) exists."""
        return self.release >= (1, 9, 0)


def parse_version(text: str) -> TorchRecVersion:
    """``"1.9.2"``, ``"1.9.2+cpu"``, ``"1.9.0rc1"`` -> TorchRecVersion; ValueError if not a version."""
    match = _RELEASE.match(text.strip())
    if match is None:
        raise ValueError(f"not a torchrec version: {text!r}")
    major, minor, patch = (int(x) if x is not None else 0 for x in match.groups())
    return TorchRecVersion(text, (major, minor, patch))


def check_torchrec_version(found: str | None = None) -> str:
    """Return the installed torchrec version, or raise ImportError saying what is supported."""
    supported = " and ".join(f"{s}.x" for s in SUPPORTED_SERIES)
    if found is None:
        try:
            found = metadata.version("torchrec")
        except metadata.PackageNotFoundError:
            raise ImportError(f"torchrec_swp needs torchrec {supported}, which is not installed: {INSTALL_HINT}") from None
    try:
        version = parse_version(found)
    except ValueError:
        version = None
    if version is None or version.series not in SUPPORTED_SERIES:
        raise ImportError(
            f"torchrec_swp supports torchrec {supported} (tested: {', '.join(TESTED_VERSIONS)}), but torchrec "
            f"{found} is installed. Its pipelines are drop-in subclasses of those versions' classes; install one "
            f"with: {INSTALL_HINT}"
        )
    return found


def installed() -> TorchRecVersion:
    """The installed TorchRec (checked: ImportError if unsupported)."""
    return parse_version(check_torchrec_version())


def take_argument(
    init: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """Remove argument ``name`` from a call ``init(*args, **kwargs)``, given by position or keyword.

    Returns the arguments without it and its value (None if not given). Where ``init`` has no
    such parameter (an older TorchRec), only a keyword can carry it.
    """
    signature = inspect.signature(init)
    if name not in signature.parameters:
        kwargs = dict(kwargs)
        return args, kwargs, kwargs.pop(name, None)
    bound = signature.bind_partial(*args, **kwargs)
    value = bound.arguments.pop(name, None)
    return bound.args, bound.kwargs, value
