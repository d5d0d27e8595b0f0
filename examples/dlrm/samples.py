"""``--sample-log DIR``: which samples each rank trained, and a check that an epoch trained each once.

The evidence of a resume on another world size (``--data-source global``): the model, not the
loader, says what was trained. Every forward of the model while training appends one JSON line
to this run's file of this rank (a forward pre-hook, ``record.BatchRecorder``: the batch is found
by its content among the epoch's batches, so a batch drawn ahead and not run is not logged)::

    DIR/from-step-000020.w2.rank1.jsonl
    {"world_size": 2, "rank": 1, "start_step": 20, "epoch_samples": 3072, "batch_size": 32, "tail_batches": 0}
    {"step": 21, "batch": 41, "samples": [1312, 1313, ...]}

``batch`` is the batch's place in the epoch's global order, ``samples`` its examples' ids (batch
``g`` holds samples ``g * batch_size`` to ``(g + 1) * batch_size - 1``). Each run writes its own
files, named by the step it starts from; a run that starts again from the same step (a restart
after a failure) replaces them.

``check(DIR)`` (``python -m examples.dlrm.samples DIR``) reads every run's files and keeps what the
training kept: a run's lines up to the step the next run resumed from (the steps after it were
trained again from the checkpoint, whose weights never saw them). It counts each sample of the
epoch: trained once, more than once, never; of the samples never trained, it names those of the
last run's tail (``tail_batches`` in its header: the batches of an incomplete last step, in no
rank's share, ``GlobalMapSource.tail``), which no rank was to train.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torchrec.datasets.utils import Batch

from examples.dlrm.record import BatchRecorder, batch_key

_NAME = re.compile(r"^from-step-(\d+)\.w(\d+)\.rank(\d+)\.jsonl$")


def log_path(directory: Path, start_step: int, world_size: int, rank: int) -> Path:
    return directory / f"from-step-{start_step:06d}.w{world_size}.rank{rank}.jsonl"


def clear_run(directory: Path, start_step: int) -> None:
    """Removes the files of an earlier run that started from ``start_step`` (rank 0, before any
    rank opens its own): a restart from the same checkpoint replaces them."""
    for old in directory.glob(f"from-step-{start_step:06d}.*.jsonl"):
        old.unlink()


class SampleLog(BatchRecorder):
    """Logs the samples of each batch ``model`` trains (see the module docstring); ``batches`` is
    the epoch's batches in their global order."""

    def __init__(
        self,
        directory: Path,
        model: torch.nn.Module,
        batches: Iterable[Batch],
        *,
        rank: int,
        world_size: int,
        start_step: int,
        batch_size: int,
        tail_batches: int = 0,
    ) -> None:
        batches = list(batches)
        super().__init__(log_path(directory, start_step, world_size, rank), model, {"train": batches})
        self._batch_size = batch_size
        header = {
            "world_size": world_size,
            "rank": rank,
            "start_step": start_step,
            "epoch_samples": len(batches) * batch_size,
            "batch_size": batch_size,
            "tail_batches": tail_batches,
        }
        self._file.write(json.dumps(header) + "\n")

    def _record(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        batch = args[0] if args else None
        if self._phase != "train" or not isinstance(batch, Batch) or not isinstance(batch.dense_features, torch.Tensor):
            return
        found = self._index.get(batch_key(batch))
        if found is None:
            raise RuntimeError(f"--sample-log: step {self._step} trained a batch that is none of the epoch's")
        g = found[1]
        samples = list(range(g * self._batch_size, (g + 1) * self._batch_size))
        self._file.write(json.dumps({"step": self._step, "batch": g, "samples": samples}) + "\n")


@dataclass(frozen=True)
class Tally:
    """What the runs in a sample-log directory trained, sample by sample."""

    epoch_samples: int
    runs: tuple[str, ...]  # "steps 1..20 on 2 ranks", in order
    once: int
    more: dict[int, int]  # sample -> times trained, where more than once
    never: tuple[int, ...]
    tail: tuple[int, ...] = ()  # the samples of the last run's incomplete last step (none trained them)

    def line(self) -> str:
        tail = f", {len(self.tail)} of them in the last run's incomplete last step" if self.tail else ""
        return (
            f"samples: {self.epoch_samples} in the epoch, {self.once} trained once, {len(self.more)} more than once, "
            f"{len(self.never)} never{tail} ({'; '.join(self.runs)})"
        )

    @property
    def exactly_once(self) -> bool:
        return not self.more and not self.never


def check(directory: Path) -> Tally:
    """Counts the samples the runs logged in ``directory`` trained (see the module docstring);
    ValueError when there is no log, or the runs disagree on the epoch."""
    runs: dict[int, dict[int, list[dict[str, Any]]]] = {}
    headers: dict[int, dict[str, Any]] = {}
    epoch: set[int] = set()
    worlds: dict[int, int] = {}
    for path in sorted(directory.glob("*.jsonl")):
        m = _NAME.match(path.name)
        if m is None:
            continue
        start, world_size, rank = map(int, m.groups())
        lines = [json.loads(text) for text in path.read_text().splitlines() if text.strip()]
        if not lines or "epoch_samples" not in lines[0]:
            raise ValueError(f"{path}: no header line")
        epoch.add(int(lines[0]["epoch_samples"]))
        if worlds.setdefault(start, world_size) != world_size:
            raise ValueError(f"{directory}: two runs from step {start} with {worlds[start]} and {world_size} ranks")
        runs.setdefault(start, {})[rank] = lines[1:]
        headers[start] = lines[0]
    if not runs:
        raise ValueError(f"{directory}: no sample log (from-step-N.wW.rankR.jsonl)")
    if len(epoch) != 1:
        raise ValueError(f"{directory}: the runs logged epochs of {sorted(epoch)} samples")
    starts = sorted(runs)
    counts: Counter[int] = Counter()
    described = []
    for i, start in enumerate(starts):
        until = starts[i + 1] if i + 1 < len(starts) else None
        missing = sorted(set(range(worlds[start])) - set(runs[start]))
        if missing:
            raise ValueError(
                f"{directory}: the run from step {start} on {worlds[start]} ranks has no log of rank {missing[0]}"
            )
        last = start
        for lines in runs[start].values():
            for line in lines:
                if until is None or line["step"] <= until:
                    counts.update(line["samples"])
                    last = max(last, line["step"])
        described.append(f"steps {start + 1}..{last} on {worlds[start]} rank{'s' if worlds[start] != 1 else ''}")
    (total,) = epoch
    more = {s: n for s, n in sorted(counts.items()) if n > 1}
    never = tuple(s for s in range(total) if s not in counts)
    once = sum(1 for n in counts.values() if n == 1)
    last = headers[starts[-1]]
    tail_from = total - int(last.get("tail_batches", 0)) * int(last["batch_size"])
    return Tally(total, tuple(described), once, more, never, tuple(s for s in never if s >= tail_from))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check that the runs logged in DIR trained every sample once.")
    parser.add_argument("directory", type=Path, metavar="DIR", help="the --sample-log directory")
    args = parser.parse_args(argv)
    try:
        tally = check(args.directory)
    except ValueError as e:
        print(f"samples.py: error: {e}", file=sys.stderr)
        return 2
    print(tally.line())
    return 0 if tally.exactly_once else 1


if __name__ == "__main__":
    sys.exit(main())
