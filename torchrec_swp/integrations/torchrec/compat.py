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
  (our engine does not call it).
* Not inherited: 1.9.2's ``_start_embedding_lookup`` orders the lookup stream after the data-dist
  stream with an event (1.8's races, kept in 1.9.2 as ``_start_embedding_lookup_legacy``); ours
  use 1.9.2's synced body on both versions (``pipelines/lookup_sync.py``).
"""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from torchrec_swp import drop_ins

#: Minor series supported: every x.y.z release of these.
SUPPORTED_SERIES = ("1.8", "1.9")
#: The releases CI tests against upstream (parity tests on 2 gloo ranks).
TESTED_VERSIONS = ("1.8.0", "1.9.2")
INSTALL_HINT = (
    "pip install torchrec==1.9.2 with the torch and fbgemm-gpu it was released with (torch 2.14; "
    "for 1.8: torchrec==1.8.0 with torch 2.13); see docs/install.md"
)


@dataclass(frozen=True)
class Pairing:
    """One TorchRec release with the torch series and fbgemm release it ships with (TorchRec and
    fbgemm share version numbers, each for one torch): the stacks CI tests on."""

    torchrec: str
    torch: str  # a series: any 2.14.x
    fbgemm: str

    def __str__(self) -> str:
        return f"torchrec {self.torchrec} + torch {self.torch}.x + fbgemm {self.fbgemm}"


#: The tested stacks, one per supported series (requirements/stack-*.txt build them).
TESTED_PAIRINGS = {"1.8": Pairing("1.8.0", "2.13", "1.8.0"), "1.9": Pairing("1.9.2", "2.14", "1.9.0")}
#: The fbgemm distributions TorchRec runs on: the CUDA build, PyPI's CPU build, and others' names.
FBGEMM_DISTRIBUTIONS = ("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-nightly", "fbgemm-gpu-nightly-cpu")


class UntestedStackWarning(UserWarning):
    """The installed TorchRec, torch and fbgemm are supported but not a pairing CI tests."""

#: The upstream classes whose 1.9 constructor takes ``async_inplace_copy`` (ours take it on 1.8
#: too): the rows of ``torchrec_swp.drop_ins`` that say so.
ASYNC_INPLACE_COPY_PIPELINES = frozenset(d.name for d in drop_ins.drop_ins() if d.async_inplace_copy)

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
            raise ImportError(
                f"torchrec_swp needs torchrec {supported}, which is not installed: {INSTALL_HINT}"
            ) from None
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
    """The installed TorchRec (checked: ImportError if unsupported; one UntestedStackWarning per
    process where the stack around it is not a tested pairing)."""
    version = parse_version(check_torchrec_version())
    _warn_untested_once()
    return version


def found_stack() -> dict[str, str | None]:
    """The installed torchrec, torch and fbgemm (name of the distribution included) versions."""
    found: dict[str, str | None] = {}
    for name in ("torchrec", "torch"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    found["fbgemm"] = None
    for dist in FBGEMM_DISTRIBUTIONS:
        try:
            found["fbgemm"] = f"{dist} {metadata.version(dist)}"
            break
        except metadata.PackageNotFoundError:
            continue
    return found


def untested_stack(torchrec: str, torch: str | None, fbgemm: str | None) -> str | None:
    """One line naming what was found and what is tested, or None for a tested pairing.

    ``torchrec`` must be a supported version (check_torchrec_version); ``torch`` a version
    (local part allowed: ``2.13.0+cpu``); ``fbgemm`` "DISTRIBUTION VERSION" or None.
    """
    version = parse_version(torchrec)
    pairing = TESTED_PAIRINGS[version.series]
    torch_release = _RELEASE.match(torch or "")
    torch_series = f"{torch_release.group(1)}.{torch_release.group(2)}" if torch_release else None
    fbgemm_version = fbgemm.split()[-1].split("+", 1)[0] if fbgemm else None
    found = (torchrec.split("+", 1)[0], torch_series, fbgemm_version)
    if found == (pairing.torchrec, pairing.torch, pairing.fbgemm):
        return None
    tested = "; ".join(str(p) for p in TESTED_PAIRINGS.values())
    return (
        f"untested stack: found torchrec {torchrec}, torch {torch or '(none)'}, "
        f"{fbgemm or 'no fbgemm'}; tested: {tested} (it may work; parity with upstream is proven only there)"
    )


_warned = False


def _warn_untested_once() -> None:
    global _warned
    if _warned:
        return
    _warned = True
    found = found_stack()
    message = untested_stack(found["torchrec"] or "", found["torch"], found["fbgemm"])
    if message is not None:
        # Attributed to no source line, so that Python prints it as one line
        # ("torchrec_swp:0: UntestedStackWarning: ..."); filter it by its category.
        warnings.warn_explicit(message, UntestedStackWarning, filename="torchrec_swp", lineno=0, module="torchrec_swp")


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
