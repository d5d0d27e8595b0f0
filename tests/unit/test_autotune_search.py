"""The tuner's search in a process of its own (``autotune.search``): the pipeline trains on while
it runs and takes its result at a later call, bit for bit as untuned; a search that fails or runs
past ``search_s`` keeps the plan and says why; a stopped search leaves no process and no files;
the search's process imports no torch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from tests.unit.test_autotune import FAST, same, train
from torchrec_swp import Autotune, plans
from torchrec_swp.autotune.search import BackgroundSearch, Request, cpu_seconds

ROOT = Path(__file__).resolve().parents[2]


def test_the_search_process_imports_no_torch() -> None:
    code = "import sys, torchrec_swp.autotune.search; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_a_background_search_lets_the_pipeline_train_on_bit_for_bit() -> None:
    """The decision comes at a later call than the profile's end (the steps between trained on
    the starting plan), and the run trains as the untuned one."""
    lines: list[str] = []
    # the search ends, or is stopped, within 3 s: at most 1,500 steps of >= 2 ms after the profile
    # no drift watch: a re-tune's search (a load on the machine moving the step) would add a line
    options = {**FAST, "background": True, "search_s": 3.0, "rounds": 1, "drift": None}
    n = Autotune(**options).tuning_bound(plans.default_plans()["TrainPipelineBase"].pipeline_depth) + 1600
    tuned, pipeline, weights = train(n, 0.002, autotune=Autotune(**options, report=lines.append))
    plain, _, plain_weights = train(n, 0.002)
    assert same(tuned, plain) and all(torch.equal(weights[k], plain_weights[k]) for k in weights)
    d = pipeline.autotune_decision
    assert d is not None and d.decided, lines
    said = r"the search took [\d.]+ s in a process of its own while (\d+) steps trained"
    took = [re.fullmatch(said, w) for w in d.why]
    trained = [int(m.group(1)) for m in took if m]
    assert len(trained) == 1 and trained[0] >= 1, d.why
    assert lines[0].endswith(
        "and the steps that train while it searches in a process of its own (at most 3 s a round); "
        "it trains on its starting plan meanwhile, with the same results"
    ), lines[0]


def test_where_the_search_process_cannot_start_it_searches_here_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torchrec_swp.autotune.search as search

    def no_process(*args: object, **kwargs: object) -> None:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(search.subprocess, "Popen", no_process)
    left = set(Path(tempfile.gettempdir()).glob("swp-search-*"))
    options = {**FAST, "background": True, "rounds": 1, "candidates": 0, "drift": None}
    n = Autotune(**options).tuning_bound(plans.default_plans()["TrainPipelineBase"].pipeline_depth)
    _, pipeline, _ = train(n, 0.002, autotune=Autotune(**options, report=None))
    d = pipeline.autotune_decision
    assert d is not None and d.decided, d
    said = (
        "the search's process could not start (OSError: [Errno 24] Too many open files): searched on the "
        "training thread"
    )
    took = [w for w in d.why if w.startswith("the search took")]
    assert said in d.why and len(took) == 1 and took[0].endswith("on the training thread (every rank waited)"), d.why
    assert set(Path(tempfile.gettempdir()).glob("swp-search-*")) <= left  # no folder left behind


def _request(gathered: list[dict[str, object]]) -> Request:
    return Request(Autotune(report=None), 1, gathered, 0.01, (), False)


def test_a_search_whose_process_fails_keeps_the_plan_and_says_why() -> None:
    search = BackgroundSearch(_request([{"trouble": ""}]), limit_s=60.0)  # no profile: a KeyError there
    found = search.result()
    assert not found.decision.switched and found.candidates == []
    (why,) = found.decision.why
    assert why.startswith("keeps the plan: the search's process failed (exit code 1: KeyError: 'profile'"), why
    assert found.decision.measured_start_s == 0.01


def test_a_search_past_its_time_is_stopped_and_keeps_the_plan() -> None:
    search = BackgroundSearch(_request([{"trouble": ""}]), limit_s=0.02)
    process, folder = search._process, search._dir
    time.sleep(0.03)
    assert search.ended  # past its time: the process is still importing (its imports alone take longer)
    found = search.result()
    assert found.decision.why == ("keeps the plan: the search did not end within 0.02 s (Autotune.search_s)",)
    assert process.poll() is not None and not folder.exists()


def test_a_cancelled_search_leaves_no_process_and_no_files() -> None:
    search = BackgroundSearch(_request([{"trouble": ""}]), limit_s=None)
    process, folder = search._process, search._dir
    search.cancel()
    assert process.poll() is not None and not folder.exists()
    search.cancel()  # again: nothing to do


def test_a_search_that_ends_says_what_it_found() -> None:
    # every rank in trouble: the search keeps the plan with the first rank's reason, and ends
    search = BackgroundSearch(_request([{"profile": None, "trouble": "rank 0: no steps"}]), limit_s=60.0)
    deadline = time.monotonic() + 60
    while not search.ended and time.monotonic() < deadline:
        time.sleep(0.01)
    found = search.result()
    assert found.decision.why == ("keeps the plan: cannot profile (rank 0: no steps)",)
    assert found.seconds >= 0


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or cpu_seconds(os.getpid()) is None, reason="Linux only")
def test_a_search_starved_of_cpu_starts_again_at_a_higher_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job that keeps every core busy: the search at the lowest priority gets no CPU (here a
    busy loop shares the search's one core); past ``STARVED_S`` it starts again where it gets a
    share, ends, and says so."""
    import torchrec_swp.autotune.search as search_module

    monkeypatch.setattr(search_module, "STARVED_S", 1.0)
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(mine)})  # the children inherit one core
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        search = BackgroundSearch(_request([{"profile": None, "trouble": "rank 0: no steps"}]), limit_s=60.0)
        first = search._process
        deadline = time.monotonic() + 60
        while not search.ended and time.monotonic() < deadline:
            time.sleep(0.05)
        found = search.result()
    finally:
        hog.kill()
        hog.wait()
        os.sched_setaffinity(0, mine)
    assert first.poll() is not None and first is not search._process
    reason, restarted = found.decision.why
    assert reason == "keeps the plan: cannot profile (rank 0: no steps)"
    said = (
        r"the search got ([\d.]+) s of CPU in its first ([\d.]+) s at the lowest priority \(the job left no core "
        r"idle\): it started again 10 nice levels below the job"
    )
    m = re.fullmatch(said, restarted)
    assert m and float(m.group(1)) <= 0.1 * float(m.group(2)) + 0.01 and float(m.group(2)) >= 1.0, restarted


def test_cpu_seconds_reads_a_process_s_cpu_time() -> None:
    busy = time.process_time() + 0.05
    while time.process_time() < busy:
        pass
    mine = cpu_seconds(os.getpid())
    if mine is None:
        pytest.skip("no /proc here")
    assert mine >= 0.05
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    assert cpu_seconds(gone.pid) is None  # reaped: no such process


@pytest.mark.parametrize(
    "options, message",
    [
        ({"background": 1}, "background must be a bool"),
        ({"search_s": 0}, "search_s must be a number of seconds > 0 or None"),
        ({"search_s": True}, "search_s must be a number of seconds > 0 or None"),
    ],
)
def test_bad_search_options_are_refused(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Autotune(**options)  # type: ignore[arg-type]
