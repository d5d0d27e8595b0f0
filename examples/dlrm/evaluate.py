"""Validation while training: ``--eval-every N --eval-batches M`` of the DLRM example.

After every ``N``-th training step (and after the last one) the model is evaluated on ``M``
held-out batches per rank (``SyntheticCriteo(split="val")``, or ``--eval-tsv`` files): the
validation AUC and normalized entropy, computed by TorchRec's own metrics module
(``torchrec.metrics``: ``AUCMetric`` and ``NEMetric`` over every rank's predictions; the compute
is collective). Every evaluation runs over the same held-out batches, each exactly once.

How the model changes hands (``SeparatePipeline``, ``--eval-mode pipeline``): an
EvalPipelineSparseDist (ours, or upstream's with ``--impl upstream``) over the training
pipeline's model. At the switch the training pipeline's threads are blocked (ours may run ahead
between steps: nothing of it runs during the evaluation, so every rank issues the same
collectives in the same order) and the training pipeline is detached (TorchRec's ``detach()``:
the model's sharded modules get their own forwards back; its batches in flight stay where they
are, their input dist done); the model goes to eval mode; the eval pipeline attaches, evaluates
the held-out batches under ``torch.no_grad()`` until its StopIteration, and detaches; the model
goes back to train mode, and the training pipeline's next ``progress()`` attaches again and
trains its next batch, the one it had in flight. No training batch is lost or repeated, none
waits: the training batches in flight are the ones a step without evaluation would train next.

How one pipeline does both (``HybridPipeline``, ``--eval-mode hybrid``): the training pipeline is
a TrainEvalHybridPipelineBase (ours, or upstream's), which steps a batch in train or eval mode as
``model.training`` says at each ``progress()`` call. Upstream's switch keeps the pipeline full:
the batches in flight at a switch are stepped in the new mode, so switching right after a training
step would evaluate (and never train) the 2 training batches in flight. So the training data is
cut at the evaluation points: each stretch of steps between two evaluations gets an iterator of
its own over the training loader (``Stretch``) that ends after the batch of the evaluation's step;
the pipeline drains it (the last 2 steps before an evaluation run without their overlap) and holds
no training batch when ``model.eval()`` switches it, with a new iterator over the held-out batches
(evaluated until its StopIteration: the pipeline drains them too). ``model.train()`` and the next
stretch fill it again. A checkpoint due at an evaluation's step keeps the training pipeline's
state taken before the evaluation (the cut at the next training batch, the loader's position with
it): after it the pipeline's last data is the held-out loader's.

An evaluation mode is a class with ``evaluate(batches, each) -> int``, ``training_data(it, trained,
until)`` (the iterator the training pipeline gets for the step after ``trained``), the class
attribute ``SHARES_TRAINING_PIPELINE`` and ``close()`` (``EVAL_MODES`` names them); ``Evaluator``
owns the schedule, the metrics and what was found.
Its ``state_dict()`` goes into the example's checkpoints, so that a resumed run reports the
last validation AUC even before it evaluates again; the schedule itself follows the step count
(evaluations after steps ``N, 2N, ...`` and the last), so a resume evaluates where the
uninterrupted run would have.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torchrec.metrics.auc import AUCMetric
from torchrec.metrics.metrics_config import RecTaskInfo
from torchrec.metrics.ne import NEMetric

#: The metrics' task name: the keys of their results (``auc-val|window_auc``, ``ne-val|lifetime_ne``).
TASK = "val"
STATE_VERSION = 1


class ValidationMetrics:
    """AUC and NE of one evaluation through ``torchrec.metrics``, over the predictions of every
    rank: ``update()`` per batch, ``compute()`` (collective: every rank calls it) at the end,
    ``reset()`` before the next evaluation. The AUC's window holds the whole evaluation
    (``num_batches`` batches of ``batch_size`` on each of ``world_size`` ranks)."""

    def __init__(self, *, world_size: int, rank: int, batch_size: int, num_batches: int) -> None:
        if num_batches < 1:
            raise ValueError(f"num_batches must be >= 1, got {num_batches}")
        task = RecTaskInfo(name=TASK, label_name="label", prediction_name="prediction", weight_name="weight")
        window = world_size * batch_size * num_batches
        common = {
            "world_size": world_size,
            "my_rank": rank,
            "batch_size": batch_size,
            "tasks": [task],
            "window_size": window,
            "compute_on_all_ranks": True,
        }
        self._auc = AUCMetric(**common)
        self._ne = NEMetric(**common)
        self._examples = 0

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """One batch: the model's logits (before the sigmoid) and the 0/1 labels."""
        predictions = {TASK: torch.sigmoid(logits.detach().float().reshape(-1))}
        targets = {TASK: labels.detach().float().reshape(-1)}
        weights = {TASK: torch.ones_like(targets[TASK])}
        for metric in (self._auc, self._ne):
            metric.update(predictions=predictions, labels=targets, weights=weights)
        self._examples += targets[TASK].numel()

    def compute(self) -> tuple[float, float]:
        """``(auc, ne)`` over every rank's batches since the last reset (collective)."""
        auc = self._auc.compute()[f"auc-{TASK}|window_auc"]
        ne = self._ne.compute()[f"ne-{TASK}|lifetime_ne"]
        return float(auc.reshape(-1)[0]), float(ne.reshape(-1)[0])

    def reset(self) -> None:
        for metric in (self._auc, self._ne):
            metric.reset()
        self._examples = 0

    @property
    def examples(self) -> int:
        """This rank's examples since the last reset."""
        return self._examples


def _progress_until_stop(pipeline: Any, it: Iterator[Any], each: Callable[[Any], None]) -> int:
    """``each(pipeline.progress(it))`` until StopIteration; how many outputs there were."""
    count = 0
    while True:
        try:
            output = pipeline.progress(it)
        except StopIteration:
            return count
        each(output)
        count += 1


class SeparatePipeline:
    """``--eval-mode pipeline``: an EvalPipelineSparseDist of ``impl`` over the training
    pipeline's model (see the module docstring for the switch)."""

    #: The training pipeline's state after an evaluation is still its cut at the next training batch.
    SHARES_TRAINING_PIPELINE = False

    def __init__(
        self,
        impl: str,
        train_pipeline: Any,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: Any,
        input_dist_cache_mb: float | None = None,
    ) -> None:
        self._train = train_pipeline
        self._model = model
        if impl == "ours":
            from torchrec_swp import EvalPipelineSparseDist

            self._pipeline = EvalPipelineSparseDist(model, optimizer, device, input_dist_cache_mb=input_dist_cache_mb)
        else:
            from torchrec.distributed.train_pipeline.train_pipelines import EvalPipelineSparseDist

            if input_dist_cache_mb is not None:
                raise ValueError("input_dist_cache_mb: upstream's EvalPipelineSparseDist has no input dist cache")
            self._pipeline = EvalPipelineSparseDist(model, optimizer, device)

    def cache_stats(self) -> dict[str, Any] | None:
        """The eval pipeline's input dist cache on this rank (``--input-dist-cache-mb``), or None."""
        cache = getattr(self._pipeline, "input_dist_cache", None)
        return None if cache is None else cache.stats()

    def evaluate(self, batches: Iterable[Any], each: Callable[[Any], None]) -> int:
        """Evaluate ``batches`` (each exactly once), calling ``each(output)`` with the eval
        pipeline's output ``(loss, logits, labels)`` of every batch; return how many there were."""
        engine = getattr(self._train, "engine", None)
        if engine is not None:
            engine.wait_until_blocked()  # ours: its threads stop where the next step() would wake them
        if hasattr(self._train, "detach"):
            self._train.detach()
        was_training = self._model.training
        self._model.eval()
        count = 0
        try:
            self._pipeline.attach(self._model)  # no batch in flight: the first progress() rewrites the model
            with torch.no_grad():
                count = _progress_until_stop(self._pipeline, iter(batches), each)
            self._pipeline.detach()
            self._pipeline.reset()
        finally:
            self._model.train(was_training)
        return count

    def training_data(self, it: Iterator[Any], trained: int, until: int) -> Iterator[Any]:
        """The training pipeline keeps its batches in flight across an evaluation: the whole data."""
        return it

    def close(self) -> None:
        if hasattr(self._pipeline, "close"):
            self._pipeline.close()


class Stretch:
    """The training batches of the steps up to ``until``: draws from ``it`` while fewer than
    ``until`` batches were drawn since step 0 (``drawn``: how many before this stretch), then
    StopIteration. ``state_dict()`` is the loader iterator's (ours records the data position of
    each batch it draws through it)."""

    def __init__(self, it: Iterator[Any], *, drawn: int, until: int) -> None:
        if drawn > until:
            raise ValueError(f"a stretch until batch {until} starts after it, at {drawn}")
        self._it = it
        self.drawn = drawn
        self.until = until

    def __iter__(self) -> Stretch:
        return self

    def __next__(self) -> Any:
        if self.drawn >= self.until:
            raise StopIteration
        batch = next(self._it)
        self.drawn += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return self._it.state_dict()  # type: ignore[attr-defined]


class HybridPipeline:
    """``--eval-mode hybrid``: the training pipeline, a TrainEvalHybridPipelineBase of ``impl``,
    evaluates too, in eval mode (see the module docstring for the switch)."""

    #: After an evaluation the training pipeline's last data is the held-out loader's.
    SHARES_TRAINING_PIPELINE = True

    def __init__(
        self, impl: str, train_pipeline: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: Any
    ) -> None:
        if impl == "ours":
            from torchrec_swp import TrainEvalHybridPipelineBase
        else:
            from torchrec.distributed.train_pipeline.experimental_pipelines import TrainEvalHybridPipelineBase
        if not isinstance(train_pipeline, TrainEvalHybridPipelineBase):
            raise ValueError(
                f"--eval-mode hybrid evaluates through the training pipeline, a {impl} TrainEvalHybridPipelineBase; "
                f"this one is a {type(train_pipeline).__name__}"
            )
        self._pipeline = train_pipeline
        self._model = model
        self._stretch: Stretch | None = None

    def training_data(self, it: Iterator[Any], trained: int, until: int) -> Iterator[Any]:
        """The stretch of ``it`` that ends after the batch of step ``until`` (the next evaluation's):
        the same iterator object for every step of the stretch (a new one is new data)."""
        stretch = self._stretch
        if stretch is None or stretch.until != until:
            # every batch drawn before is trained by now (the last stretch drained; a resume
            # re-draws from the cut, the first batch not trained)
            stretch = self._stretch = Stretch(it, drawn=trained if stretch is None else stretch.drawn, until=until)
        return stretch

    def _in_flight(self) -> int:
        """Training batches the pipeline has in flight (drawn and not yet returned)."""
        engine = getattr(self._pipeline, "engine", None)
        if engine is not None:
            engine.wait_until_blocked()
            return len(engine.in_flight())
        return len(self._pipeline.batches)

    def evaluate(self, batches: Iterable[Any], each: Callable[[Any], None]) -> int:
        """Evaluate ``batches`` (each exactly once) through the training pipeline in eval mode,
        calling ``each(output)`` with its output ``(loss, logits, labels)`` of every batch; return
        how many there were."""
        in_flight = self._in_flight()
        if in_flight:
            raise RuntimeError(
                f"--eval-mode hybrid: the training pipeline still has {in_flight} training batch(es) in flight: they "
                "would be evaluated instead of trained (the training data must end at the evaluation's step)"
            )
        was_training = self._model.training
        self._model.eval()
        try:
            return _progress_until_stop(self._pipeline, iter(batches), each)
        finally:
            self._model.train(was_training)

    def close(self) -> None:
        """Nothing of its own: the training pipeline is closed with its runner."""


#: ``--eval-mode``: how the model is evaluated between training steps.
EVAL_MODES: dict[str, type[SeparatePipeline] | type[HybridPipeline]] = {
    "pipeline": SeparatePipeline,
    "hybrid": HybridPipeline,
}


@dataclass(frozen=True)
class Evaluation:
    """What one evaluation found: after training step ``step``, ``batches`` held-out batches per
    rank (``examples`` over all ranks), in ``seconds``."""

    step: int
    auc: float
    ne: float
    batches: int
    examples: int
    seconds: float


class Evaluator:
    """The evaluations of one run: when (``due``), how (``mode``, over ``batches()``: a fresh
    iterable of the held-out batches each time), what they found (``evaluations``)."""

    def __init__(
        self,
        *,
        every: int,
        last_step: int,
        mode: SeparatePipeline | HybridPipeline,
        batches: Callable[[], Iterable[Any]],
        metrics: ValidationMetrics,
        world_size: int,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = every
        self._last_step = last_step
        self._mode = mode
        self._batches = batches
        self._metrics = metrics
        self._world_size = world_size
        self.evaluations: list[Evaluation] = []

    def due(self, trained: int) -> bool:
        """Whether to evaluate after training step ``trained``: every ``every`` steps and after the
        last one (once per step: not again after a resume that starts there)."""
        return not self.evaluated_at(trained) and (trained % self.every == 0 or trained == self._last_step)

    def next_due(self, trained: int) -> int:
        """The step of the next evaluation after step ``trained`` (the last step at the latest)."""
        return min((trained // self.every + 1) * self.every, max(self._last_step, trained + 1))

    def training_data(self, it: Iterator[Any], trained: int) -> Iterator[Any]:
        """What the training pipeline's ``progress()`` gets for the step after ``trained``: ``it``,
        or with ``--eval-mode hybrid`` the stretch of it that ends at the next evaluation."""
        return self._mode.training_data(it, trained, self.next_due(trained))

    @property
    def shares_training_pipeline(self) -> bool:
        """Whether the evaluations run through the training pipeline (take its checkpoint state
        before an evaluation)."""
        return self._mode.SHARES_TRAINING_PIPELINE

    def evaluated_at(self, trained: int) -> bool:
        """Whether the last evaluation was after training step ``trained``."""
        return bool(self.evaluations) and self.evaluations[-1].step == trained

    def run(self, trained: int, on_batch: Callable[[int], None] | None = None) -> Evaluation:
        """Evaluate now, after training step ``trained`` (collective); ``on_batch(k)`` after each
        batch (k = 1, 2, ...)."""
        start = time.perf_counter()
        self._metrics.reset()
        count = 0

        def each(output: Any) -> None:
            nonlocal count
            _loss, logits, labels = output
            self._metrics.update(logits, labels)
            count += 1
            if on_batch is not None:
                on_batch(count)

        batches = self._mode.evaluate(self._batches(), each)
        if batches == 0:
            raise ValueError("the held-out data holds no batch for this rank: nothing to evaluate")
        auc, ne = self._metrics.compute()
        found = Evaluation(
            step=trained,
            auc=auc,
            ne=ne,
            batches=batches,
            examples=self._metrics.examples * self._world_size,
            seconds=time.perf_counter() - start,
        )
        self.evaluations.append(found)
        return found

    def cache_stats(self) -> dict[str, Any] | None:
        """The input dist cache of the evaluations on this rank, or None (none asked for)."""
        stats = getattr(self._mode, "cache_stats", None)
        return None if stats is None else stats()

    @property
    def last(self) -> Evaluation | None:
        return self.evaluations[-1] if self.evaluations else None

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "every": self.every, "evaluations": [asdict(e) for e in self.evaluations]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"evaluation state version {state.get('version')!r}, this example reads {STATE_VERSION}")
        self.evaluations = [Evaluation(**e) for e in state["evaluations"]]

    def close(self) -> None:
        self._mode.close()
