"""``--record-batches FILE``: which batch the model ran, on each rank, training or evaluating.

A debugging aid and the evidence of the example's tests: every forward of the model (the one
each pipeline's ``progress()`` makes, training or evaluating) appends one JSON line to this rank's
file (``FILE`` with ``.rank<r>`` before its suffix; a resumed run appends to it)::

    {"phase": "train", "step": 12, "split": "train", "batch": 11}
    {"phase": "eval", "step": 25, "split": "val", "batch": 3}

``phase`` is what the run was doing (training step ``step``; or evaluating after step ``step``),
``split`` and ``batch`` which batch the model got, found by its content among this rank's
training and held-out batches (a batch found in neither raises, and so do two batches with the
same content when the recorder starts). Batches drawn ahead but not
run are not recorded: this is what was used, not what was loaded.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torchrec.datasets.utils import Batch


def batch_key(batch: Batch) -> str:
    """A digest of a batch's content (dense features, labels, sparse ids and lengths)."""
    digest = hashlib.sha256()
    for tensor in (
        batch.dense_features,
        batch.labels,
        batch.sparse_features.values(),
        batch.sparse_features.lengths(),
    ):
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class BatchRecorder:
    """Records the batches ``model`` runs (a forward pre-hook), identified among ``splits``
    (``{"train": batches, "val": batches}``, each an iterable of this rank's batches in order)."""

    def __init__(self, path: Path, model: torch.nn.Module, splits: dict[str, Iterable[Batch]]) -> None:
        self._index: dict[str, tuple[str, int]] = {}
        for split, batches in splits.items():
            for k, batch in enumerate(batches):
                first = self._index.setdefault(batch_key(batch), (split, k))
                if first != (split, k):
                    raise ValueError(
                        f"--record-batches: batch {k} of {split} holds what batch {first[1]} of {first[0]} holds: "
                        "the batches cannot be told apart"
                    )
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", buffering=1)  # a line at a time: a killed rank keeps its lines
        self._phase, self._step = "train", 0
        self._hook = model.register_forward_pre_hook(self._record)

    def at(self, phase: str, step: int) -> None:
        """What the run does from now on: ``("train", step)`` trains step ``step``;
        ``("eval", step)`` evaluates after step ``step``."""
        self._phase, self._step = phase, step

    def _record(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        batch = args[0] if args else None
        if not isinstance(batch, Batch) or not isinstance(batch.dense_features, torch.Tensor):
            return  # a symbolic trace (the pipelines' model rewrite), not a batch
        found = self._index.get(batch_key(batch))
        if found is None:
            raise RuntimeError(f"--record-batches: the model ran a batch that is none of this rank's ({self._phase})")
        split, k = found
        line = {"phase": self._phase, "step": self._step, "split": split, "batch": k}
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._hook.remove()
        self._file.close()
