"""``make stream-check``: the pipelines' real tasks under the CPU stream checker, then mutants.

1. Every pipeline (ours, on 1 gloo rank in this process, the DLRM example's small model, 12
   batches) runs in checked mode (``SWP_STREAM_CHECK=1``): emulated streams for the plan's
   streams and for TorchRec's stream attributes, every aten op's storage accesses recorded per
   task, batch, thread and stream. A pipeline is clean when the checker finds nothing.
2. Mutants: for TrainPipelineSparseDist (default plan, and ``by_stream``), each compiled stream
   wait and each event record is removed from the compiled program, one at a time, and each
   call site of ``record_stream`` (in TorchRec's code or ours) is ignored, one at a time; a
   mutant is caught when the checker then reports something. Prints ``caught N/M mutants`` and
   each escaped one with what was removed.

Exit status: 1 if a pipeline of part 1 is not clean or a part raised, 0 otherwise (escaped
mutants are reported, with what they removed, but do not fail: a wait can be redundant).

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

PIPELINES = (
    ("TrainPipelineBase", None),
    ("TrainPipelineSparseDist", None),
    ("TrainPipelineSparseDist", "by_stream"),
    ("TrainPipelineSparseDist", "io"),
    ("TrainPipelineSparseDistLite", None),
    ("TrainPipelineFusedSparseDist", None),
    ("TrainPipelineSemiSync", None),
    ("PrefetchTrainPipelineSparseDist", None),
    ("EvalPipelineSparseDist", None),
    ("EvalPipelineFusedSparseDist", None),
    ("StagedTrainPipeline", None),
    ("TrainPipelinePEC", None),
)
STEPS = 12


def _setup() -> Any:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    from torchrec_swp.engine.streams import process_checker

    return process_checker()


def train(name: str, thread_map: str | None, mutate: Callable[[Any], None] | None = None) -> int:
    """Train ``STEPS`` batches with our ``name``; the number of steps run."""
    from benchmarks.common import SIZES, batches
    from examples.dlrm.model import build_dlrm
    from harness.dlrm import make_runner

    size = SIZES["small"]
    tmap = {"H2D": "io"} if thread_map == "io" else thread_map
    runner = make_runner(name, "ours", lambda: build_dlrm(0, 1, size), thread_map=tmap)
    if mutate is not None:
        mutate(runner.pipeline.engine)
    data = batches(size, 0, STEPS, 0.0)
    steps = 0
    try:
        while True:
            try:
                runner.step(data)
            except StopIteration:
                return steps
            steps += 1
    finally:
        runner.close()


def check_pipelines(checker: Any, wanted: list[tuple[str, str | None]]) -> bool:
    clean = True
    for name, thread_map in wanted:
        checker.clear()
        label = name + (f" ({thread_map})" if thread_map else "")
        try:
            steps = train(name, thread_map)
        except Exception:  # noqa: BLE001 - reported, the others still run
            print(f"{label}: ERROR\n{traceback.format_exc()}")
            clean = False
            continue
        findings = checker.findings
        print(f"{label}: {steps} steps, {'clean' if not findings else f'{len(findings)} finding(s)'}")
        for f in findings[:3]:
            print("    " + str(f).replace("\n", "\n    "))
        clean = clean and not findings
    return clean


def _sync_instructions(engine: Any) -> list[tuple[int, str, int, str]]:
    from torchrec_swp.compile import RecordEvent, WaitStream

    found = []
    for k, inst in enumerate(engine._installed.values()):
        for thread, prog in inst.programs.items():
            found += [(k, thread, i, str(instr)) for i, instr in enumerate(prog) if isinstance(instr, (WaitStream, RecordEvent))]
    return found


def _without(k: int, thread: str, index: int) -> Callable[[Any], None]:
    def mutate(engine: Any) -> None:
        inst = list(engine._installed.values())[k]
        prog = inst.programs[thread]
        inst.programs[thread] = prog[:index] + prog[index + 1 :]

    return mutate


def mutants(checker: Any) -> tuple[int, int]:
    """Run every mutant; (caught, total)."""
    import torch

    caught = total = 0
    for name, thread_map in (("TrainPipelineSparseDist", None), ("TrainPipelineSparseDist", "by_stream")):
        syncs: list[tuple[int, str, int, str]] = []
        train(name, thread_map, mutate=lambda e, out=syncs: out.extend(_sync_instructions(e)))
        for k, thread, index, text in syncs:
            checker.clear()
            train(name, thread_map, mutate=_without(k, thread, index))
            total += 1
            if checker.findings:
                caught += 1
            else:
                print(f"escaped: {name} ({thread_map or 'default plan'}) without `{text}` on thread {thread}: no access of the tasks needed it")
    # record_stream call sites: find them in a clean run, then ignore one at a time
    original = checker.record_stream
    sites: dict[str, int] = {}

    def counting(tensor: torch.Tensor, stream: Any) -> None:
        frame = sys._getframe(2)  # patches.record_stream -> here; its caller is the call site
        sites.setdefault(f"{frame.f_code.co_filename}:{frame.f_lineno}", 0)
        original(tensor, stream)

    checker.record_stream = counting
    try:
        train("TrainPipelineSparseDist", None)
    finally:
        checker.record_stream = original
    for site in sites:
        def skipping(tensor: torch.Tensor, stream: Any, site: str = site) -> None:
            frame = sys._getframe(2)
            if f"{frame.f_code.co_filename}:{frame.f_lineno}" != site:
                original(tensor, stream)

        checker.clear()
        checker.record_stream = skipping
        try:
            train("TrainPipelineSparseDist", None)
        finally:
            checker.record_stream = original
        total += 1
        short = site.split("site-packages/")[-1].split("/work/main/")[-1]
        if checker.findings:
            caught += 1
        else:
            print(f"escaped: record_stream at {short} ignored: nothing used that memory on another stream before it was freed")
    return caught, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", type=lambda s: [p for p in s.split(",") if p], default=None)
    parser.add_argument("--no-mutants", action="store_true")
    args = parser.parse_args(argv)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    checker = _setup()
    wanted = [p for p in PIPELINES if args.pipelines is None or p[0] in args.pipelines]
    clean = check_pipelines(checker, wanted)
    if not args.no_mutants:
        caught, total = mutants(checker)
        print(f"caught {caught}/{total} mutants")
    print("stream-check: every pipeline clean" if clean else "stream-check: findings above")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
