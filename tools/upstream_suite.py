"""Run upstream TorchRec's own pipeline tests twice: with upstream's classes, then with ours.

Usage (the repository is a clone or mirror of github.com/meta-pytorch/torchrec; CI has none, so
this is a by-hand tool, never part of ``make test``)::

    .venv/bin/python tools/upstream_suite.py --torchrec-repo PATH --rev HEAD --force-cpu
    .venv-tr18/bin/python tools/upstream_suite.py --torchrec-repo PATH --rev release/v1.8.0 --force-cpu
    python tools/upstream_suite.py --render out/upstream_suite/torchrec-1.9.2/report.json

What it does, in a fresh temporary directory (nothing upstream is ever written into this repo):

1. extracts ``torchrec/distributed/train_pipeline/tests/<file>`` at ``--rev`` (``git show``) as the
   package ``upstream_tests`` (imports between those files renamed to it), and every test-only
   ``torchrec.*`` module that they or the wheel's ``test_utils`` import and the installed wheel
   lacks (e.g. ``torchrec.distributed.tests.test_sequence_model``) under its own name into
   ``overlay/``, served by a meta-path finder that the directory's ``sitecustomize`` installs in
   every interpreter (rank processes included);
2. with ``--force-cpu``, rewrites the copies so that tests that only need *a* device run on the CPU
   with gloo: a ``skipIf`` whose whole condition is ``not torch.cuda.is_available()`` or
   ``torch.cuda.device_count() < N`` / ``<= N`` becomes ``skipIf(False, ...)``, ``torch.device("cuda")``
   / ``torch.device("cuda:0")`` becomes ``torch.device("cpu")``, and a ``backend: str = "nccl"``
   default becomes ``"gloo"``. Every substitution is logged (file, line, before, after) in the
   report; test code that still calls CUDA APIs (``torch.cuda.Stream()``...) is left alone and
   fails the same way for both runs;
3. inserts into every extracted module, right after its imports (and again at its end), a call to
   :func:`module_loaded`: in the ``ours`` run it rebinds, in that module's namespace, every name
   bound to one of upstream's pipeline classes to torchrec_swp's subclass of the same name, before
   any class body (and its decorators, e.g. hypothesis's ``sampled_from([...])``) is evaluated.
   The call runs wherever the module is imported, so also in the rank processes that
   ``MultiProcessTestBase`` starts (they import the test module to unpickle the function they run);
4. runs pytest on each file, once per mode, one file at a time, with a per-test timeout
   (pytest-timeout) and this module loaded as a plugin (``-p upstream_suite_runtime``) that
   records the running test and kills leftover rank processes after each test;
5. writes ``report.json`` and ``report.md``: per test, upstream's outcome and ours, the first line
   of each failure, the pipeline classes each test constructed in each run (a hook on upstream's
   ``TrainPipeline.__new__``, in every process), so the swap is verified per test: an upstream
   class that has a twin, constructed during the ``ours`` run, is listed as a missed swap.

torchrec_swp is taken from a snapshot of this checkout's ``torchrec_swp/`` at ``--ours-rev`` (default
HEAD; ``worktree`` for uncommitted files), first on PYTHONPATH, so that edits made while the suite
runs do not mix into one run. The test-only packages upstream's tests import (hypothesis,
parameterized) and pytest-timeout are installed with ``pip install --target`` into ``--deps-dir``,
never into the venv.

Exit status: 0 if no test fails with ours while passing with upstream's classes, 1 if some do,
2 if the tool cannot run (no repository, no such revision, no torch/torchrec in ``--python``).

Only the standard library is imported at module level: the same file is the CLI, the pytest
plugin and the runtime hook imported by the rewritten test modules.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
TESTS_DIR = "torchrec/distributed/train_pipeline/tests"
PACKAGE = "upstream_tests"
RUNTIME_MODULE = "upstream_suite_runtime"


def twins() -> tuple[str, ...]:
    """The upstream pipeline classes torchrec_swp has a subclass of (``torchrec_swp._PIPELINES``;
    its ``__init__`` imports neither torch nor torchrec). In test processes this is the snapshot."""
    try:
        import torchrec_swp
    except ImportError:
        sys.path.insert(0, str(REPO_ROOT))
        import torchrec_swp
    return tuple(torchrec_swp._PIPELINES)


#: Test files always run when they exist at the revision; any other file of TESTS_DIR that names
#: one of twins() is added (test_postproc.py builds TrainPipelineSparseDist, for instance).
DEFAULT_FILES = (
    "test_train_pipelines.py",
    "test_train_pipelines_base.py",
    "test_train_pipeline_fused_sparse_dist.py",
    "test_train_pipeline_prefetch_sparse_dist.py",
    "test_train_pipelines_utils.py",
    "test_pec_train_pipeline.py",
)

#: Test-only packages the tests import, with pytest-timeout; installed with --no-deps.
TEST_DEPS = {
    "hypothesis": "hypothesis==6.170.15",
    "sortedcontainers": "sortedcontainers==2.4.0",
    "parameterized": "parameterized==0.9.0",
    "pytest_timeout": "pytest-timeout==2.4.0",
}

MODES = ("upstream", "ours")
OUTCOMES = ("passed", "failed", "error", "skipped")


class SuiteError(Exception):
    """A precondition of the tool failed; the message says what to do."""


# ---------------------------------------------------------------------------------------------
# Pure: rewriting the extracted test files
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Substitution:
    """One logged change to an extracted file (``line`` is 1-based, in the upstream file)."""

    file: str
    line: int
    rule: str
    before: str
    after: str


_CUDA_ONLY_CONDITION = re.compile(
    r"^\s*(?:not\s+torch\.cuda\.is_available\(\)|torch\.cuda\.device_count\(\)\s*(?:<|<=)\s*\d+)\s*$"
)
_SKIPIF = re.compile(r"@unittest\.skipIf\(\s*")
_CPU_DEVICE = (re.compile(r'torch\.device\("cuda(?::0)?"\)'), 'torch.device("cpu")', "device-cpu")
_GLOO_DEFAULT = (re.compile(r'backend: str = "nccl"'), 'backend: str = "gloo"', "backend-gloo")


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _split_first_argument(text: str, start: int) -> int | None:
    """Offset of the comma ending the call argument that starts at ``start`` (None if none)."""
    depth = 0
    quote: str | None = None
    i = start
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 2
                continue
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return None
            depth -= 1
        elif ch == "," and depth == 0:
            return i
        i += 1
    return None


def force_cpu(source: str, file: str) -> tuple[str, list[Substitution]]:
    """Rewrite a test file so that tests needing only *a* device run on the CPU with gloo.

    Rules (each logged): ``skip-cuda`` (a skipIf whose whole condition is a CUDA availability or
    device-count check becomes ``skipIf(False, ...)``), ``device-cpu``, ``backend-gloo``. Other CUDA
    calls are left as they are. Line numbers refer to ``source``.
    """
    subs: list[Substitution] = []
    out: list[str] = []
    pos = 0
    for match in _SKIPIF.finditer(source):
        start = match.end()
        end = _split_first_argument(source, start)
        if end is None or not _CUDA_ONLY_CONDITION.match(source[start:end]):
            continue
        condition = " ".join(source[start:end].split())
        subs.append(Substitution(file, _line_of(source, start), "skip-cuda", condition, "False"))
        out.append(source[pos:start])
        out.append("False")
        pos = end
    out.append(source[pos:])
    text = "".join(out)
    for pattern, replacement, rule in (_CPU_DEVICE, _GLOO_DEFAULT):
        for match in pattern.finditer(source):
            subs.append(Substitution(file, _line_of(source, match.start()), rule, match.group(0), replacement))
        text = pattern.sub(replacement, text)
    subs.sort(key=lambda s: s.line)
    return text, subs


def rename_modules(source: str, renames: Mapping[str, str]) -> str:
    """Replace dotted module names (whole names only), longest first, e.g. in imports and
    ``patch("...")`` strings."""
    for old in sorted(renames, key=len, reverse=True):
        source = re.sub(rf"(?<![\w.]){re.escape(old)}(?![\w])", renames[old], source)
    return source


_TORCHREC_IMPORT = re.compile(
    r"^\s*(?:from\s+(torchrec(?:\.\w+)+)\s+import|import\s+(torchrec(?:\.\w+)+))", re.MULTILINE
)


def torchrec_imports(source: str) -> set[str]:
    """Dotted ``torchrec.*`` module names a file imports (``from X import`` / ``import X``)."""
    return {a or b for a, b in _TORCHREC_IMPORT.findall(source)}


_HOOK_CALL = f"import {RUNTIME_MODULE} as _upstream_suite_runtime; _upstream_suite_runtime.module_loaded(globals())"


def add_hooks(source: str) -> str:
    """Call :func:`module_loaded` right after the imports that precede the first definition (so
    that decorator arguments such as hypothesis's ``st.sampled_from([TrainPipelineSparseDist, ...])``,
    evaluated when the class body runs, already see the swapped names), and again at the end."""
    import ast

    body = ast.parse(source).body
    last_import = 0
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            last_import = node.end_lineno or node.lineno
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            break
    lines = source.splitlines(keepends=True)
    marker = "  # added by tools/upstream_suite.py: pipeline swap and construction log\n"
    lines.insert(last_import, _HOOK_CALL + marker)
    return "".join(lines) + "\n\n" + _HOOK_CALL + marker


def names_twin(source: str) -> bool:
    return any(re.search(rf"\b{name}\b", source) for name in twins())


# ---------------------------------------------------------------------------------------------
# Pure: results, comparison, rendering
# ---------------------------------------------------------------------------------------------


def first_line(text: str | None, limit: int = 300) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            line = line.strip()
            return line if len(line) <= limit else line[: limit - 3] + "..."
    return ""


_ERROR_LINE = re.compile(r"^[\sE|>]*((?:[\w.]+\.)?\w*(?:Error|Exception|Unsupported)\w*: .+)$")
_GENERIC = re.compile(r"ExceptionGroup|Detected at least one unsuccessful run|^failed on (?:setup|teardown)")
_RANK = {"passed": 0, "skipped": 1, "error": 2, "failed": 3}


def failure_reason(message: str | None, text: str | None) -> str:
    """The first line of a failure; where that line only says that something failed (a
    hypothesis ExceptionGroup, a rank process of MultiProcessTestBase), followed by the distinct
    errors found in the traceback text, e.g. ``ExceptionGroup: ... [ValueError: x; RuntimeError: y]``."""
    head = first_line(message) or first_line(text)
    if not _GENERIC.search(head):
        return head
    found: list[str] = []
    for line in (text or "").splitlines():
        match = _ERROR_LINE.match(line)
        if not match:
            continue
        error = first_line(match.group(1), 200)
        if error in head or error.startswith(("RuntimeError: Worker raised", "ExceptionGroup")) or error in found:
            continue
        found.append(error)
    return head if not found else first_line(f"{head} [{'; '.join(found[:3])}]", 400)


def parse_junit(xml_text: str) -> dict[str, dict[str, str]]:
    """``{"Class::test": {"outcome": ..., "reason": ...}}`` from pytest's junit XML.

    pytest writes a second ``testcase`` for an error in teardown: the outcomes merge into the
    worst (failed > error > skipped > passed) and the reasons are joined.
    """
    results: dict[str, dict[str, str]] = {}
    root = ET.fromstring(xml_text)
    for case in root.iter("testcase"):
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        key = f"{cls}::{case.get('name', '')}" if cls else case.get("name", "")
        outcome, reason = "passed", ""
        for tag in ("skipped", "error", "failure"):  # the worst element of one testcase wins
            element = case.find(tag)
            if element is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                reason = failure_reason(element.get("message"), element.text)
        if key in results:
            previous = results[key]
            if _RANK[outcome] < _RANK[previous["outcome"]]:
                outcome = previous["outcome"]
            reason = "; ".join(r for r in (previous["reason"], reason) if r)
        results[key] = {"outcome": outcome, "reason": reason}
    return results


#: First matching pattern (on the first line of a failure) names the reason's category.
CATEGORIES: tuple[tuple[str, str], ...] = (
    (r"Timeout", "timeout"),
    (r"FSDP|FullyShardedDataParallel", "FSDP needs an accelerator"),
    (r"Torch not compiled with CUDA|torch\.cuda|requires CUDA|NCCL|nccl", "test-side CUDA-only code"),
    (r"compute kernel|[Pp]lanner|kernel: ", "planner / kernels (CPU lacks the kernel the test asks for)"),
    (
        r"compiled_autograd|captures|C\+\+ DDP Reducer|fake tensors|Dynamo|dynamo|[Ii]nductor",
        "torch.compile / compiled autograd",
    ),
    (r"unknown parameter type|record_stream|'Stream' object|Stream", "upstream pipeline code that needs CUDA streams"),
    (r"ModuleNotFoundError|ImportError|No module named", "import error"),
    (r"not close|Mismatched elements", "numerics differ"),
)


def categorize(reason: str) -> str:
    for pattern, category in CATEGORIES:
        if re.search(pattern, reason):
            return category
    return "other"


def compare(upstream: Mapping[str, Mapping[str, str]], ours: Mapping[str, Mapping[str, str]]) -> list[dict[str, str]]:
    """One row per test of either run, sorted by name."""
    rows = []
    for key in sorted(set(upstream) | set(ours)):
        up = upstream.get(key, {"outcome": "missing", "reason": ""})
        our = ours.get(key, {"outcome": "missing", "reason": ""})
        rows.append(
            {
                "test": key,
                "upstream": up["outcome"],
                "ours": our["outcome"],
                "upstream_reason": up.get("reason", ""),
                "ours_reason": our.get("reason", ""),
            }
        )
    return rows


def counts(rows: Iterable[Mapping[str, str]], mode: str) -> dict[str, int]:
    result = {outcome: 0 for outcome in (*OUTCOMES, "missing")}
    for row in rows:
        result[row[mode]] = result.get(row[mode], 0) + 1
    return result


_BAD = ("failed", "error", "missing")


def regressions(report: Mapping[str, Any]) -> list[tuple[str, dict[str, str]]]:
    """(file, row) where ours fails and upstream passes."""
    return [
        (f["file"], row)
        for f in report["files"]
        for row in f["rows"]
        if row["upstream"] == "passed" and row["ours"] in _BAD
    ]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(report: Mapping[str, Any]) -> str:
    """The human report: provenance, counts, what differs, both-fail by category, swap check,
    substitutions, then every test."""
    env = report["environment"]
    lines = [
        f"# Upstream pipeline tests, upstream vs torchrec_swp: torchrec {env['torchrec']}",
        "",
        f"- tests from `{report['torchrec_repo']}` at `{report['rev']}` = `{report['commit'][:12]}` "
        f"({report['commit_date']})",
        f"- torch {env['torch']}, python {env['python']}, fbgemm-gpu-cpu {env.get('fbgemm_gpu', '?')}",
        f"- ours: torchrec_swp of `{report['ours']['source']}` at {report['ours'].get('rev', 'HEAD')} "
        f"= `{report['ours']['commit']}`"
        + (" + uncommitted changes" if report["ours"]["dirty"] else ""),
        f"- force CPU: {'yes' if report['force_cpu'] else 'no (as shipped)'}; "
        f"per-test timeout {report['timeout_s']} s; "
        f"hypothesis seed {report.get('hypothesis_seed', '-')}; started {report['started']}"
        + (f"; only `-k {report['keyword']}`" if report.get("keyword") else ""),
        "",
        "## Counts",
        "",
        "| run | passed | failed | error | skipped | total | wall time |",
        "|---|---|---|---|---|---|---|",
    ]
    all_rows = [row for f in report["files"] for row in f["rows"]]
    for mode in MODES:
        c = counts(all_rows, mode)
        wall = sum(f["wall_s"].get(mode, 0.0) for f in report["files"])
        total = sum(c[o] for o in OUTCOMES)
        lines.append(
            f"| {mode} | {c['passed']} | {c['failed']} | {c['error']} | {c['skipped']} | {total} | {wall:.0f} s |"
        )
    lines += ["", "Per file (upstream / ours passed, failed+error, skipped; wall time):", ""]
    lines += ["| file | passed | failed | skipped | wall time |", "|---|---|---|---|---|"]
    for f in report["files"]:
        cu, co = counts(f["rows"], "upstream"), counts(f["rows"], "ours")
        lines.append(
            f"| {f['file']} | {cu['passed']} / {co['passed']} | {cu['failed'] + cu['error']} / "
            f"{co['failed'] + co['error']} | {cu['skipped']} / {co['skipped']} | "
            f"{f['wall_s'].get('upstream', 0):.0f} s / {f['wall_s'].get('ours', 0):.0f} s |"
        )

    def table(title: str, selected: list[tuple[str, dict[str, str]]], reason_of: str) -> None:
        lines.extend(["", f"## {title} ({len(selected)})", ""])
        if not selected:
            lines.append("None.")
            return
        lines.extend(["| file | test | upstream | ours | reason |", "|---|---|---|---|---|"])
        for file, row in selected:
            reason = row[f"{reason_of}_reason"]
            lines.append(f"| {file} | {row['test']} | {row['upstream']} | {row['ours']} | {_cell(reason)} |")

    table("Ours fails, upstream passes", regressions(report), "ours")
    fixed = [
        (f["file"], row)
        for f in report["files"]
        for row in f["rows"]
        if row["ours"] == "passed" and row["upstream"] in _BAD
    ]
    table("Upstream fails, ours passes", fixed, "upstream")

    both = [
        (f["file"], row)
        for f in report["files"]
        for row in f["rows"]
        if row["ours"] in _BAD and row["upstream"] in _BAD
    ]
    lines.extend(["", f"## Both fail ({len(both)}), by category of upstream's reason", ""])
    by_category: dict[str, list[tuple[str, dict[str, str]]]] = {}
    for file, row in both:
        by_category.setdefault(categorize(row["upstream_reason"]), []).append((file, row))
    for category in sorted(by_category):
        lines.extend([f"### {category} ({len(by_category[category])})", ""])
        lines.extend(["| file | test | upstream's reason | ours' reason, if different |", "|---|---|---|---|"])
        for file, row in by_category[category]:
            ours_reason = "" if row["ours_reason"] == row["upstream_reason"] else row["ours_reason"]
            lines.append(f"| {file} | {row['test']} | {_cell(row['upstream_reason'])} | {_cell(ours_reason)} |")
        lines.append("")

    lines.extend(["## Swap check", ""])
    lines.append(
        "Pipeline classes constructed per run (any process, ranks included), from a hook on upstream's "
        "`TrainPipeline.__new__`. A twin of upstream's built in the `ours` run would be a missed swap."
    )
    lines.append("")
    missed = report.get("missed_swaps", [])
    lines.append(f"Missed swaps: {len(missed)}" + ("" if not missed else ": " + ", ".join(f"`{m}`" for m in missed)))
    for mode in MODES:
        built = report.get("constructed", {}).get(mode, {})
        lines.append(
            f"- {mode}: " + ", ".join(f"`{cls}` x{n}" for cls, n in sorted(built.items()))
            if built
            else f"- {mode}: none"
        )
    swapped = report.get("swapped_names", {})
    if swapped:
        lines.append(
            "- names rebound in the ours run: " + "; ".join(f"{m}: {', '.join(n)}" for m, n in sorted(swapped.items()))
        )

    lines.extend(["", "## CPU substitutions", ""])
    subs = report.get("substitutions", [])
    if not subs:
        lines.append("None (as shipped).")
    else:
        lines.extend(["| file | line | rule | before | after |", "|---|---|---|---|---|"])
        for s in subs:
            lines.append(
                f"| {s['file']} | {s['line']} | {s['rule']} | `{_cell(s['before'])}` | `{_cell(s['after'])}` |"
            )
    if report.get("support_modules"):
        lines.extend(
            [
                "",
                "Test-only modules extracted from the repository (absent from the wheel): "
                + ", ".join(f"`{m}`" for m in report["support_modules"]),
            ]
        )

    for f in report["files"]:
        lines.extend(["", f"## {f['file']}", ""])
        if not f["rows"]:
            lines.append("No tests collected." + (f" pytest: {f['note']}" if f.get("note") else ""))
            continue
        lines.extend(["| test | upstream | ours | reason (upstream / ours) |", "|---|---|---|---|"])
        for row in f["rows"]:
            reasons = [r for r in (row["upstream_reason"], row["ours_reason"]) if r]
            reason = reasons[0] if len(set(reasons)) == 1 else " / ".join(reasons)
            lines.append(f"| {row['test']} | {row['upstream']} | {row['ours']} | {_cell(reason)} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Runtime side: imported by the rewritten test modules (every process) and loaded as a pytest
# plugin. Reads UPSTREAM_SUITE_MODE and UPSTREAM_SUITE_LOG_DIR from the environment.
# ---------------------------------------------------------------------------------------------

_HOOKED = False


class _OverlayFinder:
    """Serves ``torchrec.*`` modules that exist under the overlay folder (test-only modules the
    installed wheel lacks), under their own names."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not fullname.startswith("torchrec."):
            return None
        import importlib.util

        base = self.root.joinpath(*fullname.split("."))
        if (base / "__init__.py").exists():
            return importlib.util.spec_from_file_location(
                fullname, base / "__init__.py", submodule_search_locations=[str(base)]
            )
        if base.with_name(base.name + ".py").exists():
            return importlib.util.spec_from_file_location(fullname, base.with_name(base.name + ".py"))
        return None


def install_overlay() -> None:
    """Called by the workspace's ``sitecustomize`` at the start of every interpreter."""
    root = os.environ.get("UPSTREAM_SUITE_OVERLAY")
    if root and not any(isinstance(f, _OverlayFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _OverlayFinder(root))


def _log_dir() -> Path | None:
    value = os.environ.get("UPSTREAM_SUITE_LOG_DIR")
    return Path(value) if value else None


def _current_test() -> str:
    log_dir = _log_dir()
    try:
        return (log_dir / "current_test").read_text() if log_dir else ""
    except OSError:
        return ""


def _append(name: str, record: Mapping[str, Any]) -> None:
    log_dir = _log_dir()
    if log_dir is None:
        return
    with open(log_dir / name, "a") as f:
        f.write(json.dumps(record) + "\n")


def _install_construction_hook() -> None:
    """Log every pipeline constructed in this process: a ``__new__`` on upstream's base class."""
    global _HOOKED
    if _HOOKED:
        return
    _HOOKED = True
    from torchrec.distributed.train_pipeline import train_pipelines

    base = train_pipelines.TrainPipeline

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        _append(
            "constructions.jsonl",
            {"test": _current_test(), "pid": os.getpid(), "cls": f"{cls.__module__}.{cls.__qualname__}"},
        )
        return object.__new__(cls)

    base.__new__ = __new__  # type: ignore[method-assign,assignment]


def _twin_pairs() -> list[tuple[type, type]]:
    """(upstream class, torchrec_swp class) for each twin this TorchRec has. Upstream's class is
    found in ours' MRO (the first ``torchrec.*`` class of the same name), wherever it is defined
    (``train_pipelines``, ``pec_train_pipeline``, ...)."""
    import torchrec_swp

    pairs = []
    for name in twins():
        try:
            ours = getattr(torchrec_swp, name)
        except (AttributeError, ImportError):  # e.g. TrainPipelinePEC under TorchRec 1.8
            continue
        upstream_cls = next(
            (c for c in ours.__mro__[1:] if c.__name__ == name and c.__module__.startswith("torchrec.")), None
        )
        if not ours.__module__.startswith("torchrec_swp") or upstream_cls is None:
            raise RuntimeError(
                f"upstream_suite: torchrec_swp.{name} is not torchrec_swp's subclass of upstream's {name}"
            )
        pairs.append((upstream_cls, ours))
    return pairs


def module_loaded(namespace: dict[str, Any]) -> None:
    """Called after the imports and at the end of every extracted module: install the hook and,
    in the ``ours`` run, rebind upstream's pipeline classes in ``namespace`` to torchrec_swp's."""
    _install_construction_hook()
    if os.environ.get("UPSTREAM_SUITE_MODE") != "ours":
        return
    swapped = []
    for upstream_cls, ours in _twin_pairs():
        for key, value in list(namespace.items()):
            if value is upstream_cls:
                namespace[key] = ours
                swapped.append(key)
    _append("swaps.jsonl", {"module": namespace.get("__name__", "?"), "pid": os.getpid(), "names": sorted(swapped)})


def pytest_runtest_setup(item: Any) -> None:
    log_dir = _log_dir()
    if log_dir is not None:
        (log_dir / "current_test").write_text(item.nodeid)


def pytest_runtest_teardown(item: Any) -> None:
    """Rank processes left behind by a failed or timed-out multi-process test would keep running
    (and holding the 2 cores): kill them."""
    import multiprocessing

    for process in multiprocessing.active_children():
        process.kill()
        process.join(5)


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def _git(repo: Path, *args: str) -> str:
    result = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SuiteError(f"git {' '.join(args)} failed in {repo}: {first_line(result.stderr)}")
    return result.stdout


def _git_has(repo: Path, object_name: str) -> bool:
    return (
        subprocess.run(
            ["git", "-C", str(repo), "cat-file", "-e", object_name], capture_output=True, check=False
        ).returncode
        == 0
    )


def check_repository(repo: Path, rev: str) -> tuple[str, str]:
    """(commit, commit date) of ``rev``; SuiteError with what to do when there is no repository."""
    if not repo.exists():
        raise SuiteError(
            f"no torchrec repository at {repo}: this tool extracts upstream's tests from a clone or mirror "
            "of github.com/meta-pytorch/torchrec (--torchrec-repo PATH --rev REV). CI has none; run it by hand."
        )
    probe = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--verify", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        raise SuiteError(f"{repo} is not a git repository with revision {rev!r}: {first_line(probe.stderr)}")
    commit = probe.stdout.strip()
    return commit, _git(repo, "log", "-1", "--format=%cd", "--date=iso", commit).strip()


def probe_python(python: str) -> dict[str, str]:
    code = (
        "import json, sys, torch, torchrec\n"
        "from importlib import metadata\n"
        "v = lambda n: (metadata.version(n) if n else '')\n"
        "try: fb = metadata.version('fbgemm-gpu-cpu')\n"
        "except Exception: fb = '?'\n"
        "print(json.dumps({'python': sys.version.split()[0], 'torch': torch.__version__, "
        "'torchrec': metadata.version('torchrec'), 'fbgemm_gpu': fb}))\n"
    )
    result = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        last = result.stderr.splitlines()[-1] if result.stderr else ""
        raise SuiteError(f"{python} cannot import torch and torchrec: {first_line(last)}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def missing_modules(python: str, names: Iterable[str], pythonpath: str) -> set[str]:
    """Which dotted names the target interpreter cannot find (test-only modules the wheel lacks)."""
    names = sorted(set(names))
    code = (
        "import importlib.util, json, sys\n"
        "missing = []\n"
        "for n in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        found = importlib.util.find_spec(n) is not None\n"
        "    except Exception:\n"
        "        found = False\n"
        "    if not found: missing.append(n)\n"
        "print(json.dumps(missing))\n"
    )
    env = {**os.environ, "PYTHONPATH": pythonpath}
    result = subprocess.run(
        [python, "-c", code, json.dumps(names)], capture_output=True, text=True, env=env, check=False
    )
    if result.returncode != 0:
        raise SuiteError(f"probing modules failed: {first_line(result.stderr)}")
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


def select_files(repo: Path, commit: str, requested: Sequence[str] | None) -> list[str]:
    present = [Path(p).name for p in _git(repo, "ls-tree", "--name-only", commit, f"{TESTS_DIR}/").split()]
    if requested:
        unknown = [f for f in requested if f not in present]
        if unknown:
            raise SuiteError(f"not in {TESTS_DIR} at {commit[:12]}: {', '.join(unknown)} (there: {', '.join(present)})")
        return list(requested)
    chosen = [f for f in DEFAULT_FILES if f in present]
    for name in present:
        if (
            name.startswith("test_")
            and name not in chosen
            and names_twin(_git(repo, "show", f"{commit}:{TESTS_DIR}/{name}"))
        ):
            chosen.append(name)
    return chosen


def ensure_test_deps(python: str, deps_dir: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(deps_dir)}
    probe = [python, "-c", "import " + ", ".join(TEST_DEPS)]
    if subprocess.run(probe, capture_output=True, env=env, check=False).returncode == 0:
        return
    print(f"installing test-only packages into {deps_dir} (pip --target, not into the venv)", flush=True)
    deps_dir.mkdir(parents=True, exist_ok=True)
    install = [python, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(deps_dir), *TEST_DEPS.values()]
    result = subprocess.run(install, capture_output=True, text=True, check=False)
    if result.returncode != 0 or subprocess.run(probe, capture_output=True, env=env, check=False).returncode != 0:
        raise SuiteError(
            f"could not install {', '.join(TEST_DEPS.values())} into {deps_dir}: {first_line(result.stderr)}"
        )


@dataclasses.dataclass
class Workspace:
    root: Path
    package: Path
    overlay: Path
    ours: Path
    logs: Path

    def env(self, deps_dir: Path, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(self.ours), str(self.root), str(deps_dir)]),
            "UPSTREAM_SUITE_OVERLAY": str(self.overlay),
            "PYTHONDONTWRITEBYTECODE": "1",
            **extra,
        }


_PROBE_IMPORTS = """
import importlib, json, sys
missing = set()
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name and err.name.startswith("torchrec."):
            missing.add(err.name)
print(json.dumps(sorted(missing)))
"""


def _probe_imports(python: str, ws: Workspace, deps_dir: Path, modules: Sequence[str]) -> set[str]:
    env = ws.env(deps_dir)
    env.pop("UPSTREAM_SUITE_LOG_DIR", None)
    result = subprocess.run(
        [python, "-c", _PROBE_IMPORTS, json.dumps(list(modules))],
        cwd=ws.root,
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if result.returncode != 0:
        last = result.stderr.splitlines()[-1] if result.stderr else ""
        raise SuiteError(f"importing the extracted tests failed: {first_line(last)}")
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


def snapshot_ours(ours_rev: str, target: Path) -> None:
    """torchrec_swp as committed at ``ours_rev`` of this checkout (``worktree``: the files as they are now)."""
    target.mkdir(parents=True)
    if ours_rev == "worktree":
        shutil.copytree(
            REPO_ROOT / "torchrec_swp", target / "torchrec_swp", ignore=shutil.ignore_patterns("__pycache__")
        )
        return
    archive = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "archive", ours_rev, "torchrec_swp"], capture_output=True, check=False
    )
    if archive.returncode != 0:
        raise SuiteError(f"git archive {ours_rev} torchrec_swp failed: {first_line(archive.stderr.decode())}")
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)


def prepare(
    repo: Path, commit: str, files: Sequence[str], python: str, force: bool, root: Path, deps_dir: Path, ours_rev: str
) -> tuple[Workspace, list[Substitution], list[str]]:
    """Extract, rename, rewrite and hook the test files under ``root``; snapshot torchrec_swp.

    The selected test files become ``upstream_tests.<name>`` (pytest imports them by path). Test-only
    modules the wheel lacks (imported by the tests or by the wheel's own test_utils, e.g.
    ``torchrec.distributed.tests.test_sequence_model``) keep their names: they are written under
    ``overlay/`` and served by a meta-path finder that ``sitecustomize`` installs in every process.
    """
    ws = Workspace(root, root / PACKAGE, root / "overlay", root / "ours", root / "logs")
    ws.package.mkdir(parents=True)
    (ws.package / "__init__.py").write_text("")
    ws.overlay.mkdir()
    ws.logs.mkdir()
    shutil.copy(Path(__file__), root / f"{RUNTIME_MODULE}.py")
    (root / "sitecustomize.py").write_text(f"import {RUNTIME_MODULE}\n\n{RUNTIME_MODULE}.install_overlay()\n")
    snapshot_ours(ours_rev, ws.ours)
    (root / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")

    renames = {f"{TESTS_DIR}/{name}"[:-3].replace("/", "."): f"{PACKAGE}.{name[:-3]}" for name in files}
    substitutions: list[Substitution] = []

    def write(path: str, target: Path) -> str:
        text = rename_modules(_git(repo, "show", f"{commit}:{path}"), renames)
        if force:
            text, subs = force_cpu(text, path.removeprefix(TESTS_DIR + "/"))
            substitutions.extend(subs)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(add_hooks(text))
        return text

    sources = {name: write(f"{TESTS_DIR}/{name}", ws.package / name) for name in files}
    support: list[str] = []
    lacks: dict[str, bool] = {}

    def wheel_lacks(package: str) -> bool:
        if package not in lacks:
            lacks[package] = package in missing_modules(python, [package], "")
        return lacks[package]

    def add_package(parts: Sequence[str]) -> None:
        """Overlay ``__init__.py`` (the repository's, else empty) for each package the wheel lacks."""
        for i in range(2, len(parts) + 1):
            package = ws.overlay.joinpath(*parts[:i], "__init__.py")
            if not package.exists() and wheel_lacks(".".join(parts[:i])):
                try:
                    text = _git(repo, "show", f"{commit}:{'/'.join(parts[:i])}/__init__.py")
                except SuiteError:
                    text = ""
                package.parent.mkdir(parents=True, exist_ok=True)
                package.write_text(text)

    def add_support(dotted: str) -> bool:
        """Extract module or package ``dotted`` into the overlay; False if the repository lacks it."""
        parts = dotted.split(".")
        path = "/".join(parts)
        if _git_has(repo, f"{commit}:{path}.py"):
            add_package(parts[:-1])
            sources[dotted] = write(path + ".py", ws.overlay / (path + ".py"))
        elif _git_has(repo, f"{commit}:{path}"):
            add_package(parts)
        else:
            return False
        support.append(dotted)
        return True

    # Static closure over the extracted files' imports, then whatever importing them still misses.
    wanted = set().union(*(torchrec_imports(t) for t in sources.values())) - set(renames)
    for dotted in sorted(missing_modules(python, wanted, "")):
        add_support(dotted)
    modules = [renames[f"{TESTS_DIR}/{name}"[:-3].replace("/", ".")] for name in files]
    for _ in range(20):
        missing = _probe_imports(python, ws, deps_dir, modules) - set(support)
        added = [add_support(d) for d in sorted(missing)]  # all of them, not up to the first
        if not missing or not any(added):
            break
    return ws, substitutions, sorted(support)


def run_pytest(
    python: str,
    ws: Workspace,
    deps_dir: Path,
    file: str,
    mode: str,
    timeout_s: int,
    keyword: str | None,
    out: Path,
    hypothesis_seed: int = 0,
) -> tuple[dict[str, dict[str, str]], float, str]:
    """One pytest process for one file in one mode: (results, wall seconds, note)."""
    log_dir = ws.logs / mode
    log_dir.mkdir(exist_ok=True)
    xml = out / "junit" / f"{mode}-{file[:-3]}.xml"
    xml.parent.mkdir(parents=True, exist_ok=True)
    env = ws.env(deps_dir, UPSTREAM_SUITE_MODE=mode, UPSTREAM_SUITE_LOG_DIR=str(log_dir))
    cmd = [
        python,
        "-m",
        "pytest",
        f"{PACKAGE}/{file}",
        "-p",
        RUNTIME_MODULE,
        "-q",
        "-rfE",
        f"--timeout={timeout_s}",
        "--timeout-method=signal",
        f"--junitxml={xml}",
        f"--hypothesis-seed={hypothesis_seed}",  # both runs draw the same examples
    ]
    if keyword:
        cmd += ["-k", keyword]
    log = out / "logs" / f"{mode}-{file[:-3]}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ws.root, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait()
        finally:
            try:  # rank processes, a forkserver: everything the run started
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    wall = time.monotonic() - started
    tail = log.read_text().splitlines()[-1:] or [""]
    if not xml.exists():
        return {}, wall, f"exit {proc.returncode}, no junit XML: {first_line(tail[0])}"
    note = "" if proc.returncode in (0, 1) else f"pytest exit {proc.returncode}: {first_line(tail[0])}"
    return parse_junit(xml.read_text()), wall, note


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ours_provenance(ours_rev: str) -> dict[str, Any]:
    rev = "HEAD" if ours_rev == "worktree" else ours_rev
    commit = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", rev], capture_output=True, text=True, check=False
    ).stdout.strip()
    status = ""
    if ours_rev == "worktree":
        status = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--", "torchrec_swp"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
    return {
        "source": str(REPO_ROOT / "torchrec_swp"),
        "rev": ours_rev,
        "commit": commit or "?",
        "dirty": bool(status.strip()),
        "dirty_files": status.split("\n")[:50],
    }


def reparse(report: dict[str, Any], out: Path) -> None:
    """Rebuild each file's rows from the junit XML beside the report (after a change to parsing)."""
    per_test = report.get("constructed_per_test", {})
    for f in report["files"]:
        results = {}
        for mode in MODES:
            xml = out / "junit" / f"{mode}-{f['file'][:-3]}.xml"
            if xml.exists():
                results[mode] = parse_junit(xml.read_text())
        if results:
            f["rows"] = compare(results.get("upstream", {}), results.get("ours", {}))
            _add_classes(f, per_test)


def _add_classes(entry: dict[str, Any], per_test: Mapping[str, Mapping[str, list[str]]]) -> None:
    for row in entry["rows"]:
        nodeid = f"{PACKAGE}/{entry['file']}::{row['test']}"
        for mode in MODES:
            row[f"{mode}_classes"] = ", ".join(per_test.get(mode, {}).get(nodeid, []))


def run_suite(args: argparse.Namespace) -> dict[str, Any]:
    repo = Path(args.torchrec_repo)
    commit, date = check_repository(repo, args.rev)
    environment = probe_python(args.python)
    files = select_files(repo, commit, args.files)
    deps_dir = Path(args.deps_dir)
    ensure_test_deps(args.python, deps_dir)
    out = Path(args.out or REPO_ROOT / "out" / "upstream_suite" / f"torchrec-{environment['torchrec']}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="upstream_suite_"))
    try:
        ws, substitutions, support = prepare(
            repo, commit, files, args.python, args.force_cpu, root, deps_dir, args.ours_rev
        )
        report: dict[str, Any] = {
            "torchrec_repo": str(repo),
            "rev": args.rev,
            "commit": commit,
            "commit_date": date,
            "environment": environment,
            "ours": ours_provenance(args.ours_rev),
            "force_cpu": args.force_cpu,
            "timeout_s": args.timeout,
            "hypothesis_seed": args.hypothesis_seed,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "keyword": args.k,
            "substitutions": [dataclasses.asdict(s) for s in substitutions],
            "support_modules": support,
            "files": [],
        }
        for file in files:
            results: dict[str, dict[str, dict[str, str]]] = {}
            entry: dict[str, Any] = {"file": file, "wall_s": {}, "note": ""}
            for mode in args.modes:
                print(f"[{time.strftime('%H:%M:%S')}] {mode}: {file}", flush=True)
                results[mode], entry["wall_s"][mode], note = run_pytest(
                    args.python, ws, deps_dir, file, mode, args.timeout, args.k, out, args.hypothesis_seed
                )
                if note:
                    entry["note"] = (entry["note"] + f"; {mode}: {note}").strip("; ")
                c = {o: sum(r["outcome"] == o for r in results[mode].values()) for o in OUTCOMES}
                print(f"    {entry['wall_s'][mode]:.0f} s: {c}", flush=True)
            entry["rows"] = compare(results.get("upstream", {}), results.get("ours", {}))
            report["files"].append(entry)
        # Swap verification from the construction logs of every process.
        constructed: dict[str, dict[str, int]] = {}
        per_test: dict[str, dict[str, list[str]]] = {}
        missed: set[str] = set()
        for mode in args.modes:
            for rec in _read_jsonl(ws.logs / mode / "constructions.jsonl"):
                constructed.setdefault(mode, {}).setdefault(rec["cls"], 0)
                constructed[mode][rec["cls"]] += 1
                per_test.setdefault(mode, {}).setdefault(rec["test"], [])
                if rec["cls"] not in per_test[mode][rec["test"]]:
                    per_test[mode][rec["test"]].append(rec["cls"])
                module, _, name = rec["cls"].rpartition(".")
                if mode == "ours" and module.startswith("torchrec.") and name in twins():
                    missed.add(f"{rec['test']}: {rec['cls']}")
        swapped: dict[str, list[str]] = {}
        for rec in _read_jsonl(ws.logs / "ours" / "swaps.jsonl"):  # the module's two calls, every process
            swapped[rec["module"]] = sorted(set(swapped.get(rec["module"], [])) | set(rec["names"]))
        report.update(
            constructed=constructed, constructed_per_test=per_test, missed_swaps=sorted(missed), swapped_names=swapped
        )
        for f in report["files"]:  # the classes each test built, next to its outcomes
            _add_classes(f, per_test)
        (out / "report.json").write_text(json.dumps(report, indent=1))
        (out / "report.md").write_text(render_markdown(report))
        print(f"wrote {out / 'report.md'} and report.json", flush=True)
        return report
    finally:
        if args.keep_workdir:
            print(f"workspace kept: {root}", flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--torchrec-repo", help="clone or mirror of the torchrec repository (a bare one works)")
    parser.add_argument("--rev", default="HEAD", help="revision whose tests to run (match the installed torchrec)")
    parser.add_argument("--python", default=sys.executable, help="interpreter of the venv to test (default: this one)")
    parser.add_argument("--files", nargs="*", help=f"test files of {TESTS_DIR} (default: the pipeline ones)")
    parser.add_argument("--force-cpu", action="store_true", help="run tests that only need a device on CPU/gloo")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--timeout", type=int, default=600, help="per-test timeout in seconds (default 600)")
    parser.add_argument("-k", help="pytest -k expression, for a partial run")
    parser.add_argument(
        "--hypothesis-seed", type=int, default=0, help="seed of hypothesis, the same for both runs (default 0)"
    )
    parser.add_argument("--out", help="report folder (default out/upstream_suite/torchrec-<version>)")
    parser.add_argument(
        "--deps-dir",
        default=str(Path(tempfile.gettempdir()) / "upstream_suite_deps"),
        help="where hypothesis, parameterized and pytest-timeout are pip-installed (--target)",
    )
    parser.add_argument(
        "--ours-rev",
        default="HEAD",
        help=(
            "commit of this checkout whose torchrec_swp to test (default HEAD), "
            "or 'worktree' for the files as they are"
        ),
    )
    parser.add_argument("--keep-workdir", action="store_true", help="keep the temporary directory of rewritten tests")
    parser.add_argument("--render", metavar="REPORT_JSON", help="only re-render report.md from a report.json")
    args = parser.parse_args(argv)
    try:
        if args.render:
            path = Path(args.render)
            report = json.loads(path.read_text())
            reparse(report, path.parent)
            path.write_text(json.dumps(report, indent=1))
            path.with_suffix(".md").write_text(render_markdown(report))
            return 0
        if not args.torchrec_repo:
            raise SuiteError("--torchrec-repo PATH is required (a clone or mirror of github.com/meta-pytorch/torchrec)")
        report = run_suite(args)
    except SuiteError as err:
        print(f"upstream_suite: {err}", file=sys.stderr)
        return 2
    return 1 if regressions(report) else 0


if __name__ == "__main__":
    sys.exit(main())
