"""``examples.dlrm.samples.check``: what the runs logged in a ``--sample-log`` directory trained.

Written by hand here (the example writes them in tests/dist/test_checkpoint_resize.py): a run's
lines after the step the next run resumed from do not count, a sample trained twice or never is
named, and the samples of the last run's incomplete last step are told from the others."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from examples.dlrm.samples import check, log_path

B = 2  # samples per batch


def _run(directory: Path, start: int, world_size: int, steps: dict[int, list[list[int]]], tail: int = 0) -> None:
    """A run from step ``start`` on ``world_size`` ranks; ``steps[s][r]``: the batch rank r trained at step s."""
    for rank in range(world_size):
        header = {"world_size": world_size, "rank": rank, "start_step": start, "epoch_samples": 8 * B,
                  "batch_size": B, "tail_batches": tail}  # fmt: skip
        lines = [header]
        for step, batches in sorted(steps.items()):
            g = batches[rank]
            lines.append({"step": step, "batch": g, "samples": list(range(g * B, (g + 1) * B))})
        log_path(directory, start, world_size, rank).write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_a_resize_that_trained_every_sample_once(tmp_path: Path) -> None:
    _run(tmp_path, 0, 2, {1: [0, 1], 2: [2, 3], 3: [4, 5]})  # killed after step 3, resumed from step 2
    _run(tmp_path, 2, 1, {3: [4], 4: [5], 5: [6], 6: [7]})
    tally = check(tmp_path)
    assert tally.exactly_once, tally.line()
    assert tally.line() == (
        "samples: 16 in the epoch, 16 trained once, 0 more than once, 0 never "
        "(steps 1..2 on 2 ranks; steps 3..6 on 1 rank)"
    )


def test_twice_never_and_the_tail_are_named(tmp_path: Path) -> None:
    _run(tmp_path, 0, 2, {1: [0, 1], 2: [2, 3]})
    _run(tmp_path, 2, 3, {3: [3, 4, 5]}, tail=2)  # batch 3 again; 6 and 7: an incomplete step of 3
    tally = check(tmp_path)
    assert not tally.exactly_once
    assert tally.more == {6: 2, 7: 2}
    assert tally.never == tally.tail == (12, 13, 14, 15)
    assert "4 never, 4 of them in the last run's incomplete last step" in tally.line()


def test_a_missing_rank_or_no_log_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no sample log"):
        check(tmp_path)
    _run(tmp_path, 0, 2, {1: [0, 1]})
    log_path(tmp_path, 0, 2, 1).unlink()
    with pytest.raises(ValueError, match="the run from step 0 on 2 ranks has no log of rank 1"):
        check(tmp_path)
