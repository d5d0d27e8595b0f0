"""The DLRM example launched through torchx on 2 CPU ranks, as the README launches it, for a few steps.

* ``dist.ddp`` with the script (the README's command): ours and upstream's TrainPipelineSparseDist
  on the same synthetic data end with the same losses (the summaries of rank 0 are equal), ours
  loading in the training process, upstream through 2 StatefulDataLoader workers (the same batches);
* the example's own component (``examples/dlrm/component.py:dlrm``) reading a small Criteo TSV file
  written by the test, with the loader on its own thread, and again through the map source
  (``--data_source map``, 2 loads at once): the same losses and weights.

torchx runs ``torchrun`` found on PATH: the venv's bin (this interpreter's) goes first.
The Criteo reader, in order and by index, the map source and the checks of the data source's
arguments are also tested in-process (single process, fast).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torchrec.datasets.utils import Batch

from examples.dlrm.data import CriteoTsv, SyntheticCriteo, write_sample_tsv
from examples.dlrm.loader import MapBatches, SyntheticBatches, make_loader
from torchrec_swp import Autotune, plans
from torchrec_swp.data import MapSource

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "--batch-size",
    "32",
    "--num-embeddings",
    "200",
    "--embedding-dim",
    "8",
    "--dense-arch",
    "16",
    "--over-arch",
    "16",
]
STEPS = 6


def _torchx(args: list[str], tmp_path: Path) -> dict[str, Any]:
    """Run ``torchx run -s local_cwd ARGS`` from the repository root; return rank 0's summary."""
    summary = tmp_path / f"summary-{len(list(tmp_path.glob('summary-*')))}.json"
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1"}
    cmd = [str(bin_dir / "torchx"), "run", "-s", "local_cwd", *args, "--json", str(summary)]
    done = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"torchx failed ({done.returncode}):\n{' '.join(cmd)}\n{output[-4000:]}"
    assert "Job finished: SUCCEEDED" in output, output[-4000:]
    return json.loads(summary.read_text())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dist_ddp_runs_ours_and_upstream_with_equal_losses(tmp_path: Path) -> None:
    base = ["dist.ddp", "-j", "1x2", "--script", "examples/dlrm/train.py", "--", "--steps", str(STEPS), *SMALL]
    ours = _torchx([*base, "--impl", "ours"], tmp_path)
    upstream = _torchx([*base, "--impl", "upstream", "--num-workers", "2"], tmp_path)
    for summary in (ours, upstream):
        assert summary["ranks"] == 2 and summary["steps"] == STEPS, summary
        assert 0.0 < summary["loss_last"] < 2.0, summary
    assert (ours["num_workers"], upstream["num_workers"]) == (0, 2)
    assert ours["losses"] == upstream["losses"]
    assert ours["weights_sha256"] == upstream["weights_sha256"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_example_tunes_itself_and_trains_as_without(tmp_path: Path) -> None:
    # the component with autotune: a loader of 8 ms binds the small model's default plan, so the
    # tuner switches (its first move); the run has the steps of the longest tuning (two rounds, each trial at its
    # bound) and those its searches take in the background, so that the verification ends inside
    # it; it trains the very batches of the untuned one, bit for bit
    from examples.dlrm.train import tuning_steps

    steps = tuning_steps("TrainPipelineSparseDist")
    component = [
        "examples/dlrm/component.py:dlrm", "--steps", str(steps), "--loader_latency_ms", "8", "--data_source", "map",
    ]  # fmt: skip
    tuned = _torchx([*component, "--autotune", "True", "--", *SMALL], tmp_path)
    plain = _torchx([*component, "--", *SMALL], tmp_path)
    decision = tuned["autotune"]
    assert decision is not None and decision["switched"], decision
    assert decision["measured_ms"] > 0 and decision["start_measured_ms"] > 0
    # a prediction: the second round's, from the chosen plan's own profile; none where the first
    # move's trial measured the plan best and the budget stopped the second round's search
    # (on 2 ranks sharing 2 cores its CPU slows their steps: ~1 s over its 200 steps here)
    if decision["predicted_ms"] is None:
        moved = any(line.startswith("the draw Fetch waits: ") for line in decision["why"])
        assert moved and any("the tuning's budget is spent" in line for line in decision["why"]), decision
    else:
        assert decision["predicted_ms"] > 0
    # what moved: the search's change, or the first move (a loader that waits is run ahead at once)
    assert any(line.startswith(("the change: ", "the draw Fetch waits: ")) for line in decision["why"]), decision
    assert tuned["losses"] == plain["losses"] and tuned["weights_sha256"] == plain["weights_sha256"]
    assert plain["autotune"] is None


@pytest.mark.slow
@pytest.mark.multiprocess
def test_component_reads_criteo_tsv_through_the_dataloader_and_the_map_source_in_workers_or_not(
    tmp_path: Path,
) -> None:
    data = tmp_path / "day_0.tsv"
    write_sample_tsv(data, lines=2 * 32 * STEPS + 5)  # the 5 extra lines make an incomplete round
    component = [
        "examples/dlrm/component.py:dlrm",
        "--steps",
        str(STEPS + 10),  # more than the file holds: the data ends first
        "--loader_latency_ms",
        "2",
    ]
    train_args = ["--", *SMALL, "--criteo-tsv", str(data)]
    summary = _torchx([*component, "--thread_map", "io", *train_args], tmp_path)
    assert summary["data"] == "criteo-tsv" and summary["thread_map"] == "io"
    assert summary["steps"] == STEPS, summary
    times = summary["step_ms"]  # every step's time, in order
    assert len(times) == STEPS and all(t > 0 for t in times), times
    mapped = _torchx([*component, "--data_source", "map", "--loads", "2", *train_args], tmp_path)
    assert (mapped["data_source"], mapped["loads"], mapped["steps"]) == ("map", 2, STEPS), mapped
    assert mapped["losses"] == summary["losses"]
    assert mapped["weights_sha256"] == summary["weights_sha256"]
    # in worker processes, each reading its batches by index: the loader's, and the map source's
    workers = [*train_args, "--num-workers", "2"]
    for source in ("dataloader", "map"):
        loads = ["--loads", "2" if source == "map" else "1"]
        processes = _torchx([*component, "--data_source", source, *loads, *workers], tmp_path)
        assert (processes["data_source"], processes["num_workers"], processes["steps"]) == (source, 2, STEPS)
        assert processes["losses"] == summary["losses"], source
        assert processes["weights_sha256"] == summary["weights_sha256"], source


# ----------------------------------------------------------------------------- in-process
def test_criteo_tsv_reader_shares_rounds_between_ranks(tmp_path: Path) -> None:
    path = tmp_path / "day_0.tsv"
    write_sample_tsv(path, lines=4 * 10 + 7)
    per_rank = [list(CriteoTsv([path], batch_size=4, num_embeddings=100, rank=r, world_size=2)) for r in range(2)]
    assert [len(b) for b in per_rank] == [5, 5]  # 47 lines: 5 rounds of 2 x 4, the last 7 dropped
    fields = path.read_text().splitlines()[4].split("\t")  # rank 1's first example
    batch = per_rank[1][0]
    assert batch.labels[0].item() == int(fields[0])
    expected_dense = [torch.log1p(torch.tensor(float(max(int(x), 0)))).item() if x else 0.0 for x in fields[1:14]]
    assert torch.allclose(batch.dense_features[0], torch.tensor(expected_dense))
    first = batch.sparse_features["cat_0"]
    assert first.lengths()[0].item() == (1 if fields[14] else 0)
    if fields[14]:
        assert first.values()[0].item() == int(fields[14], 16) % 100


@pytest.mark.parametrize("read", ["in order", "by index"])
def test_criteo_tsv_reader_names_a_bad_line(tmp_path: Path, read: str) -> None:
    path = tmp_path / "bad.tsv"
    write_sample_tsv(path, lines=7)
    path.write_text(path.read_text() + "1\t2\t3\n")  # line 8: the last of batch 1
    tsv = CriteoTsv([path], batch_size=4, num_embeddings=100)
    with pytest.raises(ValueError, match=r"bad.tsv:8: 3 tab-separated fields"):
        list(tsv) if read == "in order" else tsv.batch(1)
    assert len(tsv) == 2 and tsv.batch(0).labels.numel() == 4  # the good batch still reads by index


def _assert_same_batch(got: Batch, want: Batch) -> None:
    assert torch.equal(got.dense_features, want.dense_features)
    assert torch.equal(got.labels, want.labels)
    assert got.sparse_features.keys() == want.sparse_features.keys()
    assert torch.equal(got.sparse_features.values(), want.sparse_features.values())
    assert torch.equal(got.sparse_features.lengths(), want.sparse_features.lengths())


@pytest.mark.parametrize("max_batches", [None, 2])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_criteo_tsv_batches_by_index_are_the_batches_read_in_order(
    tmp_path: Path, world_size: int, max_batches: int | None
) -> None:
    first, second = tmp_path / "day_0.tsv", tmp_path / "day_1.tsv"
    write_sample_tsv(first, lines=23, seed=1)  # rounds of 4 x world_size straddle the two files
    write_sample_tsv(second, lines=30, seed=2)
    lines = first.read_text().splitlines(keepends=True)
    crlf = [line.replace("\n", "\r\n") for line in lines[5:9]]
    first.write_text("".join([*lines[:5], "\n", "  \n", *crlf, *lines[9:], "\n"]))  # blank lines, CRLF ends
    for rank in range(world_size):
        tsv = CriteoTsv(
            [first, second], batch_size=4, num_embeddings=100, rank=rank, world_size=world_size, max_batches=max_batches
        )
        in_order = list(tsv)
        assert len(in_order) == (53 // (4 * world_size) if max_batches is None else max_batches)
        assert len(tsv) == len(in_order)
        for k in reversed(range(len(tsv))):  # by index, in any order
            _assert_same_batch(tsv.batch(k), in_order[k])
        with pytest.raises(IndexError, match=f"batch {len(tsv)} of {len(tsv)}"):
            tsv.batch(len(tsv))


def test_map_source_hands_out_the_dataloaders_batches_and_resumes_at_its_position() -> None:
    synthetic = SyntheticCriteo(batch_size=8, num_batches=6, num_embeddings=50, num_sparse=3, seed=7)
    from_loader = list(make_loader(SyntheticBatches(synthetic)))
    source = MapSource(MapBatches(synthetic))
    head = [next(source) for _ in range(2)]
    resumed = MapSource(MapBatches(synthetic))
    resumed.load_state_dict(source.state_dict())
    got = head + list(resumed)
    assert len(got) == len(from_loader) == 6
    for batch, want in zip(got, from_loader):
        _assert_same_batch(batch, want)


def test_map_batches_wait_inside_each_load_so_that_parallel_loads_wait_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    synthetic = SyntheticCriteo(batch_size=4, num_batches=4, num_embeddings=50, num_sparse=2)
    dataset = MapBatches(synthetic, latency_s=0.25)
    # the loads' wait (a sleep) made a barrier that all four must reach together: loads that waited
    # one after the other (under a lock, or before the threads) would break it instead of passing
    together = threading.Barrier(4, timeout=30)
    waited: list[float] = []

    def wait(seconds: float) -> None:
        waited.append(seconds)
        together.wait()

    monkeypatch.setattr(time, "sleep", wait)
    loaded: dict[int, Any] = {}
    errors: list[BaseException] = []

    def load(k: int) -> None:
        try:
            loaded[k] = dataset[k]
        except BaseException as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    threads = [threading.Thread(target=load, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and sorted(loaded) == [0, 1, 2, 3] and waited == [0.25] * 4


BAD_ARGUMENTS = {
    # name: (train.py arguments, the error line's message)
    "loads with the dataloader": (
        ["--loads", "2"],
        "--loads 2: a StatefulDataLoader's iterator loads a whole batch per draw, so parallel loads gain nothing; "
        "use --data-source map",
    ),
    "no loads": (["--loads", "0"], "--loads must be >= 1"),
    "negative lookahead": (["--lookahead", "-1"], "--lookahead must be >= 0"),
    "unknown data source": (["--data-source", "mmap"], "argument --data-source: invalid choice: 'mmap'"),
    "lookahead of Staged": (
        ["--lookahead", "2", "--pipeline", "StagedTrainPipeline"],
        "--lookahead: StagedTrainPipeline's plan follows its stages (edit it with --plan)",
    ),
    "input dist group of Base": (
        ["--input-dist-group", "--pipeline", "TrainPipelineBase"],
        "--input-dist-group: our TrainPipelineBase takes no input_dist_group (the SparseDist family does)",
    ),
    "our flags for upstream": (
        ["--impl", "upstream", "--loads", "2", "--input-dist-group"],
        "--loads, --input-dist-group: for our pipelines only (--impl ours)",
    ),
    "global without an epoch": (
        ["--data-source", "global"],
        "--data-source global: give the epoch's length over all ranks, --epoch-batches N (N >= 1)",
    ),
    "steps with global": (
        ["--data-source", "global", "--epoch-batches", "8", "--steps", "4"],
        "--steps: with --data-source global each rank trains what --epoch-batches leaves for it",
    ),
    "an epoch without global": (["--epoch-batches", "8"], "--epoch-batches: with --data-source global only"),
    "a sample log without global": (
        ["--data-source", "map", "--sample-log", "out/s"],
        "--sample-log: with --data-source global only",
    ),
    "evaluations with global": (
        ["--data-source", "global", "--epoch-batches", "8", "--eval-every", "2"],
        "--eval-every: not with --data-source global (yet): the evaluations follow --steps",
    ),
    "a thread map naming no task of the plan with loads": (
        ["--data-source", "map", "--loads", "2", "--thread-map", "Fetch2=io"],
        "thread_map names unknown task 'Fetch2'",
    ),
}


def _check(argv: list[str]) -> tuple[int, str]:
    """``train.py --check ARGV`` in this process: its exit code and what it printed to stderr."""
    from examples.dlrm import train

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = train.main(["--check", *argv])
        except SystemExit as e:  # argparse's parser.error
            code = int(e.code or 0)
    return code, stderr.getvalue()


def assert_refused(argv: list[str], message: str) -> None:
    """``train.py --check ARGV`` exits with status 2, its last line an error that says ``message``."""
    code, err = _check(argv)
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert ": error: " in last and message in last.partition(": error: ")[2], last


@pytest.mark.parametrize("case", BAD_ARGUMENTS)
def test_bad_data_source_arguments_are_refused_with_one_line(case: str) -> None:
    assert_refused(*BAD_ARGUMENTS[case])


@pytest.mark.parametrize(
    "argv",
    [
        ["--data-source", "map", "--loads", "3", "--lookahead", "5", "--pipeline", "TrainPipelineSemiSync"],
        ["--data-source", "map", "--loads", "2", "--thread-map", "InputDistStart=dist"],
        # a source that only draws (LoadBatch) moves to the load lanes as it is; Eval's draw splits off
        ["--data-source", "map", "--loads", "2", "--pipeline", "TrainPipelineBase"],
        ["--data-source", "map", "--loads", "2", "--pipeline", "EvalPipelineSparseDist"],
        ["--data-source", "map", "--loads", "2", "--pipeline", "TrainPipelinePEC"],
        ["--data-source", "map", "--criteo-tsv", __file__],  # a file that exists; not read by --check
        ["--lookahead", "2", "--thread-map", "H2D=io"],
        ["--data-source", "global", "--epoch-batches", "8", "--loads", "2", "--pipeline", "TrainPipelineSemiSync"],
        ["--input-dist-group", "--pipeline", "TrainPipelineFusedSparseDist", "--thread-map", "by_stream"],
    ],
)
def test_good_data_source_arguments_pass_the_check(argv: list[str]) -> None:
    assert _check(argv) == (0, "")


def test_autotune_without_steps_trains_past_the_longest_tuning() -> None:
    # a run with --autotune and no --steps has room for the tuning to end (two rounds, each trial
    # at its bound, the verification, the steps its searches take in the background) and for the
    # chosen plan to train the usual steps after it
    from examples.dlrm import train

    bound = Autotune().tuning_bound(plans.default_plans()["TrainPipelineSparseDist"].pipeline_depth)
    assert train.parse_args(["--autotune"]).steps == bound + train.SEARCH_STEPS + train.STEPS
    assert train.parse_args(["--autotune", "--steps", "40"]).steps == 40  # as given
    assert train.parse_args([]).steps == train.STEPS
