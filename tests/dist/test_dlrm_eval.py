"""Training and validation in one run of the DLRM example (``--eval-every N --eval-batches M``).

On 2 gloo ranks (small model):
* ``make run``'s path (launch.py through torchx) prints the validation AUC and NE after each
  evaluation and the summary carries the last one; the torchx component takes ``--eval_every``
  (here over Criteo TSV files with held-out ones: the data's end is evaluated too);
* every training batch and every held-out batch is used exactly once, recorded by the model
  itself (``--record-batches``): in a run that switches between the two pipelines, and in a run
  stopped after a checkpoint and resumed (the evaluation schedule goes on where it was). The
  evaluations change nothing in the training: the losses and the final weights are those of a
  run without evaluation, and the validation results of the resumed run, of an uninterrupted run
  whose threads run ahead (``--thread-map by_stream``) and of upstream's pipelines are the same,
  bit for bit;
* the same with ``--eval-mode hybrid`` (one TrainEvalHybridPipelineBase trains and evaluates):
  every batch once, across the switches and two resumes (one from a checkpoint taken at an
  evaluation's step), training and validation results equal to those of ``--eval-mode pipeline``
  over the same pipeline, and upstream's hybrid finds the same, bit for bit.

In process (fast): the validation metrics against AUC and NE computed by hand, the schedule,
the hybrid mode's stretches of training data, the held-out split, and the one-line errors for bad
validation arguments.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.dlrm.data import SyntheticCriteo, write_sample_tsv
from examples.dlrm.evaluate import Evaluation, Evaluator, Stretch, ValidationMetrics
from examples.dlrm.record import batch_key
from tests.dist.test_torchx_dlrm import SMALL, _check, _torchx, assert_refused

ROOT = Path(__file__).resolve().parents[2]
TRAIN = "examples/dlrm/train.py"
#: What rank 0 prints after each evaluation: the step and the AUC.
EVAL_LINE = re.compile(r"eval after step (\d+): validation AUC (\d\.\d{4}), NE \d+\.\d{4} \(\d+ batches x 2 ranks")


def _ranks(args: list[str], tmp_path: Path, name: str) -> tuple[dict[str, Any], str]:
    """``train.py ARGS`` on 2 gloo ranks (torch.distributed.run); rank 0's summary and the output."""
    summary = tmp_path / f"{name}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", TRAIN]
    cmd += [*args, *SMALL, "--device", "cpu", "--json", str(summary)]
    done = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{name} failed ({done.returncode}):\n{' '.join(cmd)}\n{output[-4000:]}"
    return json.loads(summary.read_text()), output


def _records(path: Path, rank: int) -> list[dict[str, Any]]:
    return [
        json.loads(line) for line in path.with_name(f"{path.stem}.rank{rank}{path.suffix}").read_text().splitlines()
    ]


def _assert_each_batch_once(
    records: list[dict[str, Any]], steps: int, eval_steps: list[int], eval_batches: int
) -> None:
    """Training step s ran training batch s - 1, once, in order; each evaluation ran held-out
    batches 0..M-1 once each, after the steps ``eval_steps`` and no others."""
    train = [r for r in records if r["phase"] == "train"]
    assert [(r["step"], r["split"], r["batch"]) for r in train] == [(s, "train", s - 1) for s in range(1, steps + 1)]
    evals = [r for r in records if r["phase"] == "eval"]
    assert {r["split"] for r in evals} == {"val"}, "an evaluation ran a training batch"
    by_step: dict[int, Counter[int]] = {}
    for r in evals:
        by_step.setdefault(r["step"], Counter())[r["batch"]] += 1
    assert list(by_step) == eval_steps
    for step, seen in by_step.items():
        assert seen == Counter(range(eval_batches)), (step, seen)
    # the switches: training goes on right after each evaluation, with the next training batch
    order = [(r["phase"], r["step"]) for r in records]
    for step in eval_steps:
        after = order.index(("eval", step)) + eval_batches
        assert order[after - 1] == ("eval", step)
        if step < steps:
            assert order[after] == ("train", step + 1)


def _evaluations(summary: dict[str, Any]) -> list[tuple[int, float, float, int]]:
    return [(e["step"], e["auc"], e["ne"], e["batches"]) for e in summary["evaluations"]]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_make_run_prints_validation_auc_at_each_evaluation(tmp_path: Path) -> None:
    summary = tmp_path / "run.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["--eval-every", "25", "--eval-batches", "5", "--steps", "100", *SMALL, "--json", str(summary)]
    done = subprocess.run(
        [sys.executable, "examples/dlrm/launch.py", *args],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    found = EVAL_LINE.findall(output)
    assert [step for step, _auc in found] == ["25", "50", "75", "100"], output[-4000:]
    assert "validation: every 25 steps and after the last, 5 held-out batches per rank x 2 ranks" in output
    s = json.loads(summary.read_text())
    assert [e["step"] for e in s["evaluations"]] == [25, 50, 75, 100]
    assert [auc for _step, auc in found] == [f"{e['auc']:.4f}" for e in s["evaluations"]]
    assert s["val_auc"] == s["evaluations"][-1]["auc"] and 0.0 < s["val_auc"] < 1.0
    assert s["val_ne"] == s["evaluations"][-1]["ne"] > 0.0
    assert f"validation: AUC {s['val_auc']:.4f}, NE {s['val_ne']:.4f} after step 100 (4 evaluations" in output


@pytest.mark.slow
@pytest.mark.multiprocess
def test_every_batch_used_exactly_once_across_switches_and_a_resume(tmp_path: Path) -> None:
    steps, every, m = 40, 10, 3
    evals = ["--eval-every", str(every), "--eval-batches", str(m)]
    plain, _ = _ranks(["--steps", str(steps)], tmp_path, "plain")

    # uninterrupted, the training pipeline's threads running ahead between steps
    record = tmp_path / "through.jsonl"
    through, _ = _ranks(
        ["--steps", str(steps), *evals, "--thread-map", "by_stream", "--record-batches", str(record)],
        tmp_path,
        "through",
    )
    for rank in range(2):
        _assert_each_batch_once(_records(record, rank), steps, [10, 20, 30, 40], m)

    # stopped after step 25 (its checkpoint), resumed: the evaluation after 20 is not repeated
    record = tmp_path / "resumed.jsonl"
    long = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "5", "--record-batches", str(record)]
    first, _ = _ranks(["--steps", str(steps), *evals, *long, "--stop-after", "25"], tmp_path, "first")
    assert [e["step"] for e in first["evaluations"]] == [10, 20]
    second, output = _ranks(["--steps", str(steps), *evals, *long, "--resume"], tmp_path, "second")
    assert second["start_step"] == 25 and [e["step"] for e in second["evaluations"]] == [10, 20, 30, 40]
    assert [step for step, _auc in EVAL_LINE.findall(output)] == ["30", "40"]
    for rank in range(2):
        _assert_each_batch_once(_records(record, rank), steps, [10, 20, 30, 40], m)

    # the evaluations change nothing in the training, and find the same everywhere
    assert through["losses"] == plain["losses"] == first["losses"] + second["losses"]
    assert through["weights_sha256"] == plain["weights_sha256"] == second["weights_sha256"]
    assert _evaluations(through) == _evaluations(second)
    assert plain["evaluations"] == [] and plain["val_auc"] is None


@pytest.mark.slow
@pytest.mark.multiprocess
def test_upstream_pipelines_evaluate_alike_and_the_component_evaluates_criteo_files(tmp_path: Path) -> None:
    evals = ["--steps", "12", "--eval-every", "4", "--eval-batches", "2"]
    ours, _ = _ranks(evals, tmp_path, "ours")
    upstream, _ = _ranks([*evals, "--impl", "upstream"], tmp_path, "upstream")
    assert [e["step"] for e in ours["evaluations"]] == [4, 8, 12]
    assert _evaluations(upstream) == _evaluations(ours)
    assert upstream["weights_sha256"] == ours["weights_sha256"]
    # the component, on Criteo TSV files: the training data ends after 6 steps, which is evaluated
    # too; the held-out file holds 3 batches per rank, fewer than asked for
    train, held_out = tmp_path / "day_0.tsv", tmp_path / "day_23.tsv"
    write_sample_tsv(train, lines=2 * 32 * 6, seed=1)
    write_sample_tsv(held_out, lines=2 * 32 * 3 + 5, seed=2)
    component = _torchx(
        ["examples/dlrm/component.py:dlrm", "--steps", "12", "--eval_every", "4", "--eval_batches", "5"]
        + ["--", *SMALL, "--criteo-tsv", str(train), "--eval-tsv", str(held_out)],
        tmp_path,
    )
    assert component["steps"] == 6 and [(e["step"], e["batches"]) for e in component["evaluations"]] == [(4, 3), (6, 3)]
    assert component["val_auc"] == component["evaluations"][-1]["auc"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_hybrid_mode_uses_every_batch_once_across_switches_and_resumes_and_equals_upstream(tmp_path: Path) -> None:
    steps, every, m = 24, 8, 3
    evals = ["--steps", str(steps), "--eval-every", str(every), "--eval-batches", str(m)]
    hybrid = ["--pipeline", "TrainEvalHybridPipelineBase"]
    expected = [8, 16, 24]
    # the same pipeline evaluated beside it, by an EvalPipelineSparseDist
    separate, output = _ranks([*evals, *hybrid, "--eval-mode", "pipeline"], tmp_path, "separate")
    assert "(--eval-mode pipeline)" in output

    # uninterrupted, the pipeline's threads running ahead between steps; hybrid is the hybrid's default mode
    record = tmp_path / "through.jsonl"
    through, output = _ranks(
        [*evals, *hybrid, "--thread-map", "by_stream", "--record-batches", str(record)], tmp_path, "through"
    )
    assert "through the training pipeline in eval mode (ours TrainEvalHybridPipelineBase) (--eval-mode hybrid)" in (
        output
    )
    assert [step for step, _auc in EVAL_LINE.findall(output)] == ["8", "16", "24"]
    for rank in range(2):
        _assert_each_batch_once(_records(record, rank), steps, expected, m)

    # stopped at an evaluation's step (its checkpoint holds the cut taken before the evaluation),
    # resumed and stopped again within a stretch, resumed to the end; the hybrid picked for the mode
    record = tmp_path / "resumed.jsonl"
    long = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "4", "--record-batches", str(record)]
    mode = ["--eval-mode", "hybrid"]
    first, output = _ranks([*evals, *mode, *long, "--stop-after", "16"], tmp_path, "first")
    assert "--eval-mode hybrid: training and evaluating through ours TrainEvalHybridPipelineBase" in output
    second, _ = _ranks([*evals, *mode, *long, "--resume", "--stop-after", "21"], tmp_path, "second")
    third, output = _ranks([*evals, *mode, *long, "--resume"], tmp_path, "third")
    assert [e["step"] for e in first["evaluations"]] == [8, 16] and second["start_step"] == 16
    assert third["start_step"] == 21 and [step for step, _auc in EVAL_LINE.findall(output)] == ["24"]
    for rank in range(2):
        _assert_each_batch_once(_records(record, rank), steps, expected, m)

    # upstream's hybrid, its batches recorded too
    record = tmp_path / "upstream.jsonl"
    upstream, _ = _ranks([*evals, *mode, "--impl", "upstream", "--record-batches", str(record)], tmp_path, "upstream")
    for rank in range(2):
        _assert_each_batch_once(_records(record, rank), steps, expected, m)

    # the evaluations change nothing in the training, and find the same everywhere
    assert through["losses"] == separate["losses"] == first["losses"] + second["losses"] + third["losses"]
    assert through["losses"] == upstream["losses"]
    assert len({r["weights_sha256"] for r in (through, separate, third, upstream)}) == 1
    assert _evaluations(through) == _evaluations(separate) == _evaluations(third) == _evaluations(upstream)
    assert [e["step"] for e in through["evaluations"]] == expected and through["eval_mode"] == "hybrid"


# ----------------------------------------------------------------------------- in-process
def _auc_by_hand(scores: list[float], labels: list[int]) -> float:
    positives = [s for s, y in zip(scores, labels) if y]
    negatives = [s for s, y in zip(scores, labels) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


def _ne_by_hand(probabilities: list[float], labels: list[int]) -> float:
    n = len(labels)
    loss = -sum(y * math.log(p) + (1 - y) * math.log(1 - p) for p, y in zip(probabilities, labels)) / n
    rate = sum(labels) / n
    return loss / -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))


def test_validation_metrics_are_auc_and_ne_over_every_batch_since_the_reset() -> None:
    metrics = ValidationMetrics(world_size=1, rank=0, batch_size=16, num_batches=3)
    g = torch.Generator().manual_seed(3)
    metrics.update(torch.randn(16, generator=g), torch.randint(0, 2, (16,), generator=g))  # reset away
    metrics.reset()
    logits, labels = torch.randn(48, generator=g, dtype=torch.float64), torch.randint(0, 2, (48,), generator=g)
    for k in range(3):
        metrics.update(logits[16 * k : 16 * (k + 1)].float(), labels[16 * k : 16 * (k + 1)])
    auc, ne = metrics.compute()
    scores = torch.sigmoid(logits.float()).tolist()
    assert metrics.examples == 48
    assert auc == pytest.approx(_auc_by_hand(scores, labels.tolist()), abs=1e-6)
    assert ne == pytest.approx(_ne_by_hand(scores, labels.tolist()), rel=1e-4)


class _Mode:
    """An evaluation mode that hands each batch to ``each`` as the model's output would be."""

    def __init__(self) -> None:
        self.closed = False

    def evaluate(self, batches: Any, each: Any) -> int:
        count = 0
        for logits, labels in batches:
            each((None, logits, labels))
            count += 1
        return count

    def close(self) -> None:
        self.closed = True


def test_evaluator_runs_every_n_steps_and_after_the_last_once_and_resumes_its_history() -> None:
    g = torch.Generator().manual_seed(0)
    held_out = [(torch.randn(8, generator=g), torch.randint(0, 2, (8,), generator=g)) for _ in range(2)]

    def evaluator() -> Evaluator:
        metrics = ValidationMetrics(world_size=1, rank=0, batch_size=8, num_batches=2)
        return Evaluator(every=4, last_step=10, mode=_Mode(), batches=lambda: held_out, metrics=metrics, world_size=1)

    first = evaluator()
    due = [s for s in range(1, 11) if first.due(s)]
    assert due == [4, 8, 10]
    seen: list[int] = []
    found = first.run(4, on_batch=seen.append)
    assert seen == [1, 2] and found.step == 4 and found.batches == 2 and found.examples == 16
    assert not first.due(4)  # once per step
    resumed = evaluator()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as a checkpoint keeps it
    assert resumed.evaluations == first.evaluations and isinstance(resumed.last, Evaluation)
    assert not resumed.due(4) and resumed.due(8)
    assert resumed.run(8).auc == found.auc  # the same held-out batches
    resumed.close()


class _Loader:
    """An iterator with a position, as a StatefulDataLoader's."""

    def __init__(self, n: int) -> None:
        self.position, self._n = 0, n

    def __iter__(self) -> Any:
        return self

    def __next__(self) -> int:
        if self.position >= self._n:
            raise StopIteration
        self.position += 1
        return self.position - 1

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}


def test_stretches_end_at_each_evaluation_and_draw_each_batch_once() -> None:
    metrics = ValidationMetrics(world_size=1, rank=0, batch_size=8, num_batches=1)
    evaluator = Evaluator(every=4, last_step=10, mode=_Mode(), batches=list, metrics=metrics, world_size=1)
    assert [evaluator.next_due(t) for t in (0, 3, 4, 7, 8, 9)] == [4, 4, 8, 8, 10, 10]
    loader = _Loader(9)
    first = Stretch(loader, drawn=0, until=4)
    assert list(first) == [0, 1, 2, 3] and next(first, None) is None and loader.position == 4
    assert first.state_dict() == {"position": 4}  # the loader's: the data position ours records
    second = Stretch(loader, drawn=first.drawn, until=8)
    assert [next(second), next(second)] == [4, 5] and second.state_dict() == {"position": 6}
    assert list(second) == [6, 7] and list(Stretch(loader, drawn=8, until=10)) == [8]  # the data ends first
    with pytest.raises(ValueError, match="a stretch until batch 4 starts after it, at 5"):
        Stretch(loader, drawn=5, until=4)


def test_the_component_passes_the_eval_mode_and_leaves_the_pipeline_to_train_py() -> None:
    from examples.dlrm.component import dlrm

    def command(**kwargs: Any) -> str:
        return dlrm(eval_every=4, **kwargs).roles[0].args[-1]

    hybrid = command(eval_mode="hybrid")
    assert "--eval-every 4 --eval-mode hybrid" in hybrid and "--pipeline" not in hybrid  # train.py picks the hybrid
    assert "--pipeline TrainEvalHybridPipelineBase" in command(pipeline="TrainEvalHybridPipelineBase")
    assert "--eval-mode" not in command()


def test_held_out_split_is_never_a_training_batch_and_shares_the_hidden_model() -> None:
    common = {"batch_size": 16, "num_embeddings": 100, "num_sparse": 4}
    for rank in range(2):
        train = SyntheticCriteo(num_batches=200, rank=rank, **common)
        val = SyntheticCriteo(num_batches=20, rank=rank, split="val", **common)
        train_keys = {batch_key(b) for b in train}
        val_keys = {batch_key(b) for b in val}
        assert len(train_keys) == 200 and len(val_keys) == 20 and not train_keys & val_keys
        assert torch.equal(train._dense_weight, val._dense_weight)
    with pytest.raises(ValueError, match="split must be one of train, val, got 'test'"):
        SyntheticCriteo(num_batches=1, split="test", **common)


BAD_EVAL_ARGUMENTS = {
    "no held-out batches": (
        ["--eval-every", "25", "--eval-batches", "0"],
        "--eval-every 25: no held-out data to evaluate on (--eval-batches 0)",
    ),
    "negative every": (["--eval-every", "-1"], "--eval-every must be >= 0 (0: no evaluation)"),
    "negative batches": (["--eval-every", "5", "--eval-batches", "-2"], "--eval-batches must be >= 0"),
    "batches without every": (["--eval-batches", "5"], "--eval-batches: no evaluation without --eval-every N"),
    "criteo without held-out files": (
        ["--eval-every", "5", "--criteo-tsv", __file__],
        "--eval-every 5: no held-out data to evaluate on: with --criteo-tsv, name held-out files with --eval-tsv",
    ),
    "held-out files without criteo": (
        ["--eval-every", "5", "--eval-tsv", __file__],
        "--eval-tsv: held-out Criteo files go with --criteo-tsv",
    ),
    "held-out files are training files": (
        ["--eval-every", "5", "--criteo-tsv", __file__, "--eval-tsv", __file__],
        "is training data too (--criteo-tsv): hold other files out",
    ),
    "missing held-out file": (
        ["--eval-every", "5", "--criteo-tsv", __file__, "--eval-tsv", "no/such.tsv"],
        "--eval-tsv: no such file: no/such.tsv",
    ),
    "an eval pipeline": (
        ["--eval-every", "5", "--pipeline", "EvalPipelineSparseDist"],
        "--eval-every: EvalPipelineSparseDist evaluates only",
    ),
    "the staged pipeline": (
        ["--eval-every", "5", "--pipeline", "StagedTrainPipeline"],
        "--eval-every: StagedTrainPipeline trains in the caller's loop",
    ),
    "unknown mode": (["--eval-every", "5", "--eval-mode", "bulk"], "argument --eval-mode: invalid choice: 'bulk'"),
    "hybrid mode with another pipeline": (
        ["--eval-every", "5", "--eval-mode", "hybrid", "--pipeline", "TrainPipelineSparseDist"],
        "--eval-mode hybrid evaluates through the training pipeline, which must be TrainEvalHybridPipelineBase "
        "(--pipeline TrainPipelineSparseDist has no eval mode)",
    ),
    "hybrid mode over the map source": (
        ["--eval-every", "5", "--eval-mode", "hybrid", "--data-source", "map"],
        "--eval-mode hybrid: --data-source map loads on the pipeline's threads",
    ),
    "hybrid mode tuning itself": (
        ["--eval-every", "5", "--eval-mode", "hybrid", "--autotune", "--data-source", "dataloader"],
        "--eval-mode hybrid: --autotune is not supported",
    ),
    "hybrid mode without evaluation": (["--eval-mode", "hybrid"], "--eval-mode: no evaluation without --eval-every N"),
}


@pytest.mark.parametrize("case", BAD_EVAL_ARGUMENTS)
def test_bad_validation_arguments_are_refused_with_one_line(case: str) -> None:
    assert_refused(*BAD_EVAL_ARGUMENTS[case])


@pytest.mark.parametrize(
    "argv",
    [
        ["--eval-every", "25"],
        ["--eval-every", "25", "--eval-batches", "5", "--eval-mode", "pipeline", "--pipeline", "TrainPipelineSemiSync"],
        ["--eval-every", "5", "--criteo-tsv", __file__, "--eval-tsv", str(ROOT / "README.md")],
        ["--eval-every", "5", "--impl", "upstream"],
        ["--eval-every", "5", "--eval-mode", "hybrid"],
        ["--eval-every", "5", "--eval-mode", "hybrid", "--impl", "upstream"],
        ["--eval-every", "5", "--pipeline", "TrainEvalHybridPipelineBase", "--eval-mode", "pipeline"],
        ["--eval-every", "5", "--pipeline", "TrainEvalHybridPipelineBase", "--checkpoint-dir", "{tmp}"],
    ],
)
def test_good_validation_arguments_pass_the_check(argv: list[str], tmp_path: Path) -> None:
    assert _check([a.replace("{tmp}", str(tmp_path / "ckpt")) for a in argv]) == (0, "")
