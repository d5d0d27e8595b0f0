"""``make stream-check``: the pipelines' real tasks under the CPU stream checker, then mutants.

1. Every pipeline (ours, on 1 gloo rank in this process, the DLRM example's small model, 12
   batches; the runs its row in ``torchrec_swp.drop_ins`` names, ``example.stream_checks``:
   default plans, ``by_stream`` where the plan has several streams, H2D on an ``io`` thread,
   Staged with its stages' own streams; and TrainPipelinePEC on TorchRec's PEC test
   model, ``PEC_MODEL_RUNS``; and SparseDist, Fused, Prefetch and SemiSync with
   ``on_nonfinite="skip"`` over data with a poisoned batch, which they must roll back) runs in
   checked mode (``SWP_STREAM_CHECK=1``):
   emulated streams for the plan's streams and for TorchRec's stream attributes, every aten
   op's storage accesses recorded per task, batch, thread and stream, host-memory H2D copies
   made on the current stream, backward ops on their forward op's stream; then the Maglev
   drop-ins (one stage, thread maps main/comm/send_recv: ``harness.upstream_streams``). A
   pipeline is clean when the checker finds nothing; the ops seen per stream are printed with it.
2. Mutants, on SparseDist (default plan and ``by_stream``), Fused, SemiSync, Prefetch and PEC
   on its model (default plan and "spread": outcomes there vary with the threads' interleaving)
   (``MUTANT_STEPS`` batches each):
   * plan mutants: TorchRec's own ``wait_stream``/``wait_event`` in the tasks (and those of our
     copy of one of its helpers, ``UPSTREAM_COPIES``) are ignored, so that the plan's compiled
     syncs (and our tasks' hand-offs) alone order the streams (shown clean first), then each
     compiled stream wait and event record is removed, one at a time, from the program text
     (``Engine.program_texts``, ``Engine.edit_program``);
   * task mutants: each call site of ``wait_stream``, ``wait_event`` and ``record_stream`` in
     the tasks' code (TorchRec's helpers and ours) is ignored, one at a time, plan intact.
   A mutant is caught when the checker then reports something. Prints ``caught N/M mutants``
   and each escaped one with what was removed and why nothing needed it.

3. Upstream TorchRec's pipelines under the same checker (``harness.upstream_streams``: their
   stream attributes made emulated streams, their methods labelled as tasks); reported only.

What the installed TorchRec lacks is not run, with a line saying so (``not run here``): on
TorchRec 1.8, TrainPipelinePEC (ours, the PEC model's runs, upstream's, the PEC mutants) and the
Maglev drop-ins (their rows' ``since``, ``torchrec_swp.drop_ins``).

Exit status: 1 if a pipeline of part 1 is not clean or a part raised, 0 otherwise (escaped
mutants are reported, with what they removed, but do not fail: a sync can be redundant).

    .venv/bin/python tools/stream_check.py [--pipelines A,B] [--no-mutants]
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["SWP_STREAM_CHECK"] = "1"

from harness.pec_model import PEC_THREAD_MAPS, build_pec_model  # noqa: E402 - needs the path above
from torchrec_swp import drop_ins  # noqa: E402 - needs the path above

#: Our pipelines' runs: each row's ``example.stream_checks`` (``torchrec_swp.drop_ins``), those with
#: on_nonfinite="skip" (batch NONFINITE_BATCH poisoned: the captures, the verdict and the rollback
#: run in the tasks' streams like their own work) last.
PIPELINES = tuple(
    sorted(
        ((d.name, run) for d in drop_ins.drop_ins() if d.example is not None for run in d.example.stream_checks),
        key=lambda p: p[1] is not None and p[1].startswith("nonfinite"),
    )
)
STEPS = 12
#: The batch the ``nonfinite`` runs poison (a NaN dense feature), rolled back by on_nonfinite="skip".
NONFINITE_BATCH = 5


def _setup() -> Any:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    from torchrec_swp.streamcheck import StreamChecker, process_checker

    # installed before the checked mode's own: this tool reports (and makes findings on
    # purpose, in the mutants) by itself, so the process checker's stderr report stays off
    StreamChecker().install()
    return process_checker()


# TrainPipelinePEC on TorchRec's PEC test model (the DLRM example has no PEC module), with thread
# maps of the PEC parity test (harness.pec_model.PEC_THREAD_MAPS)
PEC_MODEL = "TrainPipelinePEC[PEC model]"
PEC_MODEL_RUNS = ((PEC_MODEL, None), (PEC_MODEL, "by_stream"), (PEC_MODEL, "spread"))
THREAD_MAPS: dict[str, Any] = {"io": {"H2D": "io"}, "spread": PEC_THREAD_MAPS["spread"]}


def train(name: str, thread_map: str | None, mutate: Callable[[Any], None] | None = None, steps: int = STEPS) -> int:
    """Train ``steps`` batches with our ``name`` (``PEC_MODEL``: TrainPipelinePEC on the PEC test
    model; the others on the DLRM example's small model); the number of steps run. ``mutate`` gets
    the pipeline's engine before the first step."""
    from examples.dlrm.model import build_dlrm
    from harness.dlrm import make_runner
    from harness.dlrm_data import SIZES, batches

    nonfinite = thread_map is not None and thread_map.startswith("nonfinite")
    if nonfinite:
        thread_map = thread_map.removeprefix("nonfinite").strip() or None
    tmap = THREAD_MAPS.get(thread_map, thread_map) if thread_map is not None else None
    options = {"on_nonfinite": "skip"} if nonfinite else None
    if name == "TrainPipelineSemiSync" and nonfinite:
        options = {**(options or {}), "start_batch": 1}  # (its semi-synchronous phase from batch 1)
    if name == PEC_MODEL:
        model, optimizer, pec_batches = build_pec_model(0, steps)
        runner = make_runner("TrainPipelinePEC", "ours", lambda: (model, optimizer), thread_map=tmap)
        data = iter(pec_batches)
    else:
        size = SIZES["small"]
        runner = make_runner(name, "ours", lambda: build_dlrm(0, 1, size), thread_map=tmap, options=options)
        made = list(batches(size, 0, steps, 0.0))  # made before: host memory, copied by H2D
        if nonfinite:
            made[NONFINITE_BATCH].dense_features[0, 0] = float("nan")
        data = iter(made)
    if mutate is not None:
        mutate(runner.pipeline.engine)
    steps = 0
    try:
        while True:
            try:
                runner.step(data)
            except StopIteration:
                return steps
            steps += 1
    finally:
        skipped = [v.batch for v in runner.pipeline.skipped_steps] if nonfinite else None
        runner.close()
        if nonfinite and skipped != [NONFINITE_BATCH]:
            raise AssertionError(f"on_nonfinite: rolled back batches {skipped}, not batch {NONFINITE_BATCH}")


def unavailable(name: str) -> str | None:
    """Why ``name`` (ours, upstream's or ``PEC_MODEL``) cannot run on the installed TorchRec;
    None where it can."""
    from torchrec_swp.integrations.torchrec.compat import installed

    torchrec = installed()
    pipeline = name.split("[")[0]  # PEC_MODEL: TrainPipelinePEC
    row = drop_ins.DROP_INS.get(pipeline) or drop_ins.EXTRAS.get(pipeline)
    available = {*drop_ins.names(torchrec.series), *(e.name for e in drop_ins.extras(torchrec.series))}
    if row is not None and pipeline not in available:
        return f"TorchRec {torchrec.text} has no {pipeline} (new in {row.since})"
    return None


def report(checker: Any, label: str, steps: int) -> bool:
    """Print one run's result (steps, findings, ops per stream, the first 3 findings); whether clean."""
    findings = checker.findings
    streams = ", ".join(f"{s} {n}" for s, n in sorted(checker.ops_by_stream.items()))
    result = "clean" if not findings else f"{len(findings)} finding(s)"
    print(f"{label}: {steps} steps, {result} (ops per stream: {streams})")
    for f in findings[:3]:
        print("    " + str(f).replace("\n", "\n    "))
    return not findings


def check_pipelines(checker: Any, wanted: list[tuple[str, str | None]]) -> bool:
    clean = True
    for name, thread_map in wanted:
        checker.clear()
        label = name + (f" ({thread_map})" if thread_map else "")
        why = unavailable(name)
        if why is not None:
            print(f"{label}: not run here: {why}")
            continue
        try:
            steps = train(name, thread_map)
        except Exception:  # noqa: BLE001 - reported, the others still run
            print(f"{label}: ERROR\n{traceback.format_exc()}")
            clean = False
            continue
        clean = report(checker, label, steps) and clean
    return clean


def check_maglev(checker: Any) -> bool:
    """Our Maglev drop-ins (one stage in this process, on a ProgramEngine with this checker: each
    action a task, each signal/wait pair a hand-off), with each thread map."""
    from harness.upstream_streams import MAGLEV_PIPELINES, train_maglev_checked

    clean = True
    for name in MAGLEV_PIPELINES:
        why = unavailable(name)
        if why is not None:
            print(f"{name}: not run here: {why}")
            continue
        for thread_map in ("main", "comm", "send_recv"):
            checker.clear()
            try:
                steps = train_maglev_checked(name, checker, thread_map=thread_map)
            except Exception:  # noqa: BLE001 - reported, the others still run
                print(f"{name} ({thread_map}): ERROR\n{traceback.format_exc()}")
                clean = False
                continue
            clean = report(checker, f"{name} ({thread_map})", steps) and clean
    return clean


PACKAGE_DIR = str(Path(__file__).resolve().parents[1] / "torchrec_swp")
ENGINE_DIR = str(Path(__file__).resolve().parents[1] / "torchrec_swp" / "engine")
#: Our copies of TorchRec's helpers (TorchRec 1.9.2's synced lookup, used on 1.8): their waits are
#: TorchRec's, ignored with TorchRec's own in the plan mutants, as on 1.9.2
UPSTREAM_COPIES = (str(Path(PACKAGE_DIR) / "integrations" / "torchrec" / "pipelines" / "lookup_sync.py"),)
MUTANT_RUNS = (
    ("TrainPipelineSparseDist", None),
    ("TrainPipelineSparseDist", "by_stream"),
    ("TrainPipelineFusedSparseDist", None),
    ("TrainPipelineSemiSync", None),
    ("PrefetchTrainPipelineSparseDist", None),
    (PEC_MODEL, None),
    (PEC_MODEL, "spread"),
)
MUTANT_STEPS = 6
TASK_WAITS = ("wait_stream", "wait_event")


def _short(site: str) -> str:
    return site.split("site-packages/")[-1].split(str(Path(__file__).resolve().parents[1]) + "/")[-1]


def _run(
    checker: Any,
    name: str,
    tmap: str | None,
    skip: Callable[[str, str], bool] | None,
    edit: tuple[int, str] | None = None,
) -> list[str]:
    """One checked run of MUTANT_STEPS batches, its engine's programs edited to ``edit`` (plan
    index, program text) if given; the programs' text of each installed plan as compiled."""
    texts: list[str] = []

    def mutate(engine: Any) -> None:
        texts.extend(engine.program_texts())
        if edit is not None:
            engine.edit_program(*edit)

    checker.clear()
    checker.skip_sync = skip
    try:
        train(name, tmap, mutate=mutate, steps=MUTANT_STEPS)
    finally:
        checker.skip_sync = None
    return texts


def sync_mutants(texts: list[str]) -> list[tuple[int, str, str, str]]:
    """Each compiled stream wait and event record removed, one at a time, by editing the program
    text: ``(plan index, thread, the removed line, the mutant text)``."""
    out = []
    for k, text in enumerate(texts):
        lines, thread = text.splitlines(), ""
        for n, line in enumerate(lines):
            if line.startswith("thread "):
                thread = line.removeprefix("thread ").rstrip(":")
            elif line.strip().startswith(("stream ", "record ")):
                out.append((k, thread, line.strip(), "\n".join(lines[:n] + lines[n + 1 :])))
    return out


def mutants(checker: Any) -> tuple[int, int]:
    """Run every mutant; (caught, total). Two families per pipeline:

    * plan mutants: with the tasks' own ``wait_stream``/``wait_event`` ignored (so the plan's
      compiled syncs are all that orders the streams; first shown clean), each compiled stream
      wait and event record removed, one at a time;
    * task mutants: each call site of ``wait_stream``, ``wait_event`` and ``record_stream`` in
      the tasks' code (TorchRec's helpers, ours) ignored, one at a time, the plan intact.
    """
    caught = total = 0
    for name, tmap in MUTANT_RUNS:
        label = f"{name} ({tmap or 'default plan'})"
        why = unavailable(name)
        if why is not None:
            print(f"{label} mutants: not run here: {why}")
            continue
        sites: dict[tuple[str, str], set[str]] = {}

        def note(kind: str, site: str, sites: dict[tuple[str, str], set[str]] = sites) -> bool:
            task = checker.current_task()
            if not site.startswith(ENGINE_DIR):
                sites.setdefault((kind, site), set()).add("-" if task is None else task.task)
            return False

        texts = _run(checker, name, tmap, note)

        def plan_only(kind: str, site: str) -> bool:  # TorchRec's own waits ignored; ours kept
            return kind in TASK_WAITS and (not site.startswith(PACKAGE_DIR) or site.startswith(UPSTREAM_COPIES))

        _run(checker, name, tmap, plan_only)
        if checker.findings:
            print(f"{label}: NOT clean with the tasks' own waits ignored, so plan mutants are not meaningful:")
            print("    " + str(checker.findings[0]).replace("\n", "\n    "))
        else:
            for k, thread, text, mutant in sync_mutants(texts):
                _run(checker, name, tmap, plan_only, edit=(k, mutant))
                total += 1
                if checker.findings:
                    caught += 1
                else:
                    print(
                        f"escaped: {label} plan without `{text}` (thread {thread}): no access needed it once the "
                        "other compiled syncs (and our tasks' hand-offs) ran"
                    )
        for (kind, site), tasks in sorted(sites.items()):
            host, waited = checker.stats.frees_after_host_sync, checker.stats.frees_after_wait
            _run(checker, name, tmap, lambda k, s, want=(kind, site): (k, s) == want)
            total += 1
            if checker.findings:
                caught += 1
                continue
            if kind in TASK_WAITS:
                why = "the plan's compiled syncs (or other task waits) order the same accesses"
            else:
                host, waited = checker.stats.frees_after_host_sync - host, checker.stats.frees_after_wait - waited
                why = (
                    f"every block whose use it covered was safe anyway: {host} freed after a host sync had "
                    f"completed the uses, {waited} reused only after the allocation stream waited for them"
                )
            print(f"escaped: {label} {kind} at {_short(site)} (in {', '.join(sorted(tasks))}) ignored: {why}")
    return caught, total


def check_upstream(checker: Any) -> None:
    """Part 3: upstream TorchRec's pipelines under the same checker (their stream attributes made
    emulated streams, their methods labelled as tasks: harness.upstream_streams). Reported only:
    what upstream does is not ours to fail on."""
    from harness.dlrm import PipelineUnavailable
    from harness.upstream_streams import UPSTREAM_PIPELINES, train_upstream_checked

    for name in UPSTREAM_PIPELINES:
        checker.clear()
        why = unavailable(name)
        if why is not None:
            print(f"upstream {name}: not run here: {why}")
            continue
        try:
            steps = train_upstream_checked(name, checker, STEPS)
        except PipelineUnavailable as e:
            print(f"upstream {name}: not run here: {e}")
            continue
        report(checker, f"upstream {name}", steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", type=lambda s: [p for p in s.split(",") if p], default=None)
    parser.add_argument("--no-mutants", action="store_true")
    parser.add_argument("--no-upstream", action="store_true", help="skip part 3, upstream's pipelines")
    args = parser.parse_args(argv)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    checker = _setup()
    wanted = [p for p in PIPELINES + PEC_MODEL_RUNS if args.pipelines is None or p[0] in args.pipelines]
    clean = check_pipelines(checker, wanted)
    if args.pipelines is None or any(p.startswith("Maglev") for p in args.pipelines):
        clean = check_maglev(checker) and clean
    if not args.no_upstream:
        check_upstream(checker)
    if not args.no_mutants:
        caught, total = mutants(checker)
        print(f"caught {caught}/{total} mutants")
    print("stream-check: every pipeline clean" if clean else "stream-check: findings above")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
