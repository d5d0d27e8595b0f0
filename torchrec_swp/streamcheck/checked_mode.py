"""Checked mode for whole runs: ``SWP_STREAM_CHECK=1`` and the process's checker, which says what
it found by itself.

With the variable set, every engine built on the CPU gets a ``CheckedStreamPool`` watched by
``process_checker()``: one ``StreamChecker`` per process (per rank), installed on first use. It
writes to stderr, so that no output can be told from not running:

* on its first finding, once: ``stream check (SWP_STREAM_CHECK, pid P[, rank R]): first
  finding: ...`` with the finding as ``StreamCheckError`` prints it;
* at exit, one line: ``stream check (...): clean, N ops checked``, or ``K finding(s) (D
  distinct), N ops checked``.

``torchrec_swp.streamcheck.active_checker().check()`` raises ``StreamCheckError`` listing the
findings so far (``.findings`` has them as data). A checker installed before the first
``process_checker()`` call (``StreamChecker().install()``: a tool that reports by itself) is
used as it is, and writes nothing.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Mapping
from typing import TextIO

from torchrec_swp.streamcheck.checker import StreamChecker, active_checker
from torchrec_swp.streamcheck.findings import Finding

#: The environment variable that turns the checked mode on for whole test runs.
ENV_VAR = "SWP_STREAM_CHECK"


def stream_check_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``SWP_STREAM_CHECK`` asks for the checked mode (set, and not ``""``/``"0"``)."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return value not in ("", "0")


def _rank() -> int | None:
    """This process's rank in the default process group, if one is up."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


class CheckReport:
    """What a checker found, said by itself: ``found`` is the checker's ``on_finding`` (it writes
    the first finding once), ``summary`` the line for the end of the run. ``out`` None: the
    ``sys.stderr`` of the moment."""

    def __init__(self, out: TextIO | None = None) -> None:
        self._out = out
        self._lock = threading.Lock()
        self._rank = _rank()
        self.findings = 0  # every finding, repeats included (a checker's clear() does not reset it)
        self.distinct = 0  # new distinct ones (after a clear(), a signature seen before counts again)

    def who(self) -> str:
        """``SWP_STREAM_CHECK, pid P[, rank R]``: which process speaks."""
        rank = _rank()
        if rank is not None:
            self._rank = rank
        return f"{ENV_VAR}, pid {os.getpid()}" + ("" if self._rank is None else f", rank {self._rank}")

    def found(self, finding: Finding, new: bool) -> None:
        """The checker found ``finding`` (``new``: its signature was not known); the first one is
        written at once."""
        with self._lock:
            self.findings += 1
            self.distinct += new
            first = self.findings == 1
        if first:
            self._write(
                f"stream check ({self.who()}): first finding: {finding}\n    (a summary line follows at exit; "
                "torchrec_swp.streamcheck.active_checker().check() raises listing every finding)"
            )

    def summary(self, ops: int) -> str:
        """The end-of-run line, ``ops`` the ops the checker saw."""
        if not self.findings:
            return f"stream check ({self.who()}): clean, {ops} ops checked"
        return f"stream check ({self.who()}): {self.findings} finding(s) ({self.distinct} distinct), {ops} ops checked"

    def _write(self, line: str) -> None:
        out = self._out if self._out is not None else sys.stderr
        print(line, file=out, flush=True)

    def write_summary(self, checker: StreamChecker) -> None:
        self._write(self.summary(checker.stats.ops))


_PROCESS_CHECKER: StreamChecker | None = None


def process_checker() -> StreamChecker:
    """The stream checker of this process in checked mode: installed on first use, shared by
    every checked pool, so that the findings of a whole run land in one place; it reports on
    stderr by itself (module docstring). An installed checker found at the first call is used as
    it is."""
    global _PROCESS_CHECKER
    if _PROCESS_CHECKER is None:
        installed = active_checker()
        if installed is not None:
            _PROCESS_CHECKER = installed
        else:
            report = CheckReport()
            _PROCESS_CHECKER = StreamChecker(on_finding=report.found).install()
            atexit.register(report.write_summary, _PROCESS_CHECKER)
    return _PROCESS_CHECKER
