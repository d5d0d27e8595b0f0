"""Checkpoints of the DLRM example through torch.distributed.checkpoint (DCP), written atomically.

Layout of a checkpoint directory ``DIR``::

    DIR/step-000008/        a complete checkpoint: DCP's files (.metadata, one __R_0.distcp per rank),
                            meta.json (step and fingerprint) and MANIFEST (every file: SHA-256, size)
    DIR/latest              "step-000008": the newest complete checkpoint; replaced last
    DIR/.tmp-step-000012/   a save in progress, or one that was interrupted (ignored; the next save removes it)

What a checkpoint holds (``TrainState``): the model's ``state_dict()`` (TorchRec's sharded tables as
sharded tensors: each rank writes its own shards; the replicated MLPs are written once), the dense
optimizer's state by parameter name, TorchRec's fused optimizer state (``model.fused_optimizer``:
the tables' accumulators, sharded like the tables), and for each rank an object of the caller's
(the pipeline's ``state_dict()``, whose ``"loader"`` is the data position), pickled under the key
``rank_R`` so that DCP keeps every rank's own copy.

Atomic: ``save`` writes into ``.tmp-step-N``; once DCP has written every rank's files (with
fsync), rank 0 writes meta.json, then MANIFEST (the marker of completeness, last inside), renames
the directory to ``step-N`` (one rename) and then replaces ``latest`` (written beside it, renamed
over it). A kill at any moment leaves ``latest`` naming the previous complete checkpoint. Older
complete checkpoints beyond ``keep`` are deleted after ``latest`` moved.

Checks (``check``, run before any model is built, by rank 0 of the job and by ``train.py --check``):
the directory is writable; the checkpoint ``latest`` names exists, has its MANIFEST and every file
listed there with that size and hash (a torn or partial checkpoint is named, with the file); its
fingerprint (world size, sharding plan, model, optimizer, data, pipeline) equals this run's (the
first difference is named). A check writes nothing but a probe file, which it removes.

Another world size: a checkpoint records what wrote it (meta.json's ``written_on``: world size,
nodes x processes, sharding plan, torch and TorchRec versions). Resumed on another number of
ranks, ``check`` compares everything but the world size and the plan, and refuses in one line what
cannot move (``why_not_resizable``, the caller's: e.g. a data position kept per rank); ``load``
then reads the model and optimizers through DCP, which reshards TorchRec's sharded tables and
their fused optimizer state from the saved plan's shards to the new plan's (each rank reads the
pieces of the saved shards its new shards overlap) and gives every rank the replicated MLPs and
their optimizer state; every rank reads rank 0's own object (``from_rank=0``). On the same world
size nothing changes: each rank reads its own shards and its own object.

Every rank must see ``DIR`` (one machine, or a file system shared by the nodes), as DCP's
FileSystemWriter requires. Load only checkpoints you trust: the per-rank objects are pickles.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor
from torchrec.optim.keyed import KeyedOptimizer

from torchrec_swp.sharding import check_sharding_types

STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-"
LATEST = "latest"
MANIFEST = "MANIFEST"
META = "meta.json"


class CheckpointError(RuntimeError):
    """A checkpoint directory cannot be used as asked; the message names the directory and why."""


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


# --------------------------------------------------------------------------------------------
# What is saved
# --------------------------------------------------------------------------------------------


@dataclass
class TrainState:
    """The model and its dense optimizer as one DCP state dict (see the module docstring).

    ``state_dict()`` holds the live tensors, so ``dcp.load`` fills them in place;
    ``load_state_dict`` then loads what DCP read through the model's and optimizers' own methods.
    """

    model: nn.Module
    dense_optimizer: torch.optim.Optimizer

    def _dense_keyed(self) -> KeyedOptimizer:
        """The dense optimizer seen by parameter name (a view: it shares the optimizer's state)."""
        names = {param: name for name, param in self.model.named_parameters()}
        params: dict[str, torch.Tensor] = {}
        for group in self.dense_optimizer.param_groups:
            for param in group["params"]:
                if param not in names:
                    raise CheckpointError("the dense optimizer holds a parameter that is not the model's")
                params[names[param]] = param
        return KeyedOptimizer(params, self.dense_optimizer.state, self.dense_optimizer.param_groups)

    def state_dict(self) -> dict[str, Any]:
        state = {"model": self.model.state_dict(), "dense_optimizer": self._dense_keyed().state_dict()}
        fused = getattr(self.model, "fused_optimizer", None)
        if fused is not None:
            state["fused_optimizer"] = fused.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self._dense_keyed().load_state_dict(state["dense_optimizer"])
        fused = getattr(self.model, "fused_optimizer", None)
        if fused is not None:
            fused.load_state_dict(state["fused_optimizer"])

    def local_sha256(self, part: str) -> str:
        """SHA-256 of this rank's ``"model"`` or ``"optimizers"`` (dense and fused) state: the bytes
        of every tensor (a sharded tensor's local shards), by name; equal digests mean bit-identical."""
        state = self.state_dict()
        parts = {"model": ["model"], "optimizers": ["dense_optimizer", "fused_optimizer"]}[part]
        digest = hashlib.sha256()
        tensors = _local_tensors({key: state.get(key, {}) for key in parts}, "")
        for name, tensor in sorted(tensors, key=lambda item: item[0]):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()


def _local_tensors(value: Any, path: str) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for the tensors in ``value`` that this rank holds (local shards by offset)."""
    if isinstance(value, dict):
        return [item for key, v in value.items() for item in _local_tensors(v, f"{path}/{key}")]
    if isinstance(value, ShardedTensor):
        shards = sorted(value.local_shards(), key=lambda shard: shard.metadata.shard_offsets)
        return [(f"{path}@{shard.metadata.shard_offsets}", shard.tensor) for shard in shards]
    if isinstance(value, DTensor):
        return [(path, value.to_local())]
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    return []


def _rank_key(rank: int) -> str:
    return f"rank_{rank}"


# --------------------------------------------------------------------------------------------
# Checks (no process group needed)
# --------------------------------------------------------------------------------------------


def check_writable(directory: Path) -> None:
    """Creates ``directory`` if needed and writes (then removes) a probe file in it."""
    probe = directory / f".write-probe-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"checkpoint directory {directory} is not writable: {e.strerror or e}") from None


def latest(directory: Path) -> Path | None:
    """The checkpoint ``directory/latest`` names, or None when there is no ``latest`` (no checkpoint
    yet). Raises CheckpointError when ``latest`` is unreadable or names no step directory."""
    pointer = directory / LATEST
    if not pointer.exists():
        return None
    try:
        name = pointer.read_text().strip()
    except OSError as e:
        raise CheckpointError(f"{pointer} cannot be read: {e.strerror or e}") from None
    if not name.startswith(STEP_PREFIX) or "/" in name:
        raise CheckpointError(f"{pointer} should name a {STEP_PREFIX}N directory, it holds {name!r}")
    step_dir = directory / name
    if not step_dir.is_dir():
        raise CheckpointError(f"{pointer} names {step_dir}, which does not exist")
    return step_dir


def verify(step_dir: Path) -> dict[str, Any]:
    """Checks that ``step_dir`` is complete and whole; returns its meta.json.

    Complete: its MANIFEST exists (written last by ``save``). Whole: every file the MANIFEST
    lists is there, with the listed size and SHA-256.
    """
    manifest = step_dir / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"checkpoint {step_dir} is incomplete: it has no {MANIFEST} (a save that did not finish)")
    for number, line in enumerate(manifest.read_text().splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        fields = line.split(maxsplit=2)
        if len(fields) != 3 or not fields[1].isdigit():
            raise CheckpointError(f"{manifest}:{number}: not a manifest line (SHA-256, size, name): {line!r}")
        digest, size, name = fields[0], int(fields[1]), fields[2]
        path = step_dir / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {step_dir} is partial: {name} is missing")
        if path.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint {step_dir} is torn: {name} has {path.stat().st_size} bytes, its manifest says {size}"
            )
        if _sha256(path) != digest:
            raise CheckpointError(f"checkpoint {step_dir} is damaged: {name} does not match its SHA-256 in {MANIFEST}")
    try:
        meta = json.loads((step_dir / META).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {step_dir}: {META} cannot be read: {e}") from None
    return meta


def compare_fingerprint(step_dir: Path, saved: dict[str, Any], now: dict[str, Any]) -> None:
    """Raises CheckpointError naming the first entry of ``now`` that ``saved`` does not equal.

    Entries are compared in the order of ``now`` (world size first), going into dicts, so that the
    message names e.g. ``plan.t_cat_0``; entries only ``saved`` has are not compared."""
    difference = _first_difference(saved, _plain(now), "")
    if difference is not None:
        where, in_checkpoint, here = difference
        top = where.split(".")[0]
        raise CheckpointError(
            f"checkpoint {step_dir} is from another {top}: {where} is {in_checkpoint} in the checkpoint, "
            f"{here} in this run (resume with the same {top}, or use another --checkpoint-dir)"
        )


#: The fingerprint's entries that describe the world that wrote a checkpoint, not the run: they may
#: differ on a resume on another world size.
WORLD_ENTRIES = ("world_size", "plan")
#: ``check``'s answer on another world size when its caller does not say that the run can resume there.
NOT_SAID_RESIZABLE = "the caller did not say that this run's state can move to another world size"


def check(
    directory: Path,
    fingerprint: dict[str, Any],
    *,
    resume: bool,
    why_not_resizable: str | None = NOT_SAID_RESIZABLE,
) -> tuple[Path, dict[str, Any]] | None:
    """Everything that can be checked before training: see the module docstring.

    Returns ``(step directory, meta)`` of the checkpoint to resume from, or None when training
    starts at step 0 (``directory`` has no checkpoint yet). Raises CheckpointError, having written
    nothing but a removed probe file, when ``directory`` is not writable, when it holds checkpoints
    but ``resume`` is False (they would be replaced), or when the latest checkpoint is incomplete,
    damaged or from another run configuration. A checkpoint from another world size is refused
    with ``why_not_resizable`` (None: this run's configuration can resume there; the default
    refuses), or when the new world's sharding plan does not hold the saved plan's tables or gives one of
    them another sharding type (``torchrec_swp.sharding.check_sharding_types``)."""
    check_writable(directory)
    step_dir = latest(directory)
    if step_dir is None:
        return None
    if not resume:
        raise CheckpointError(
            f"{directory} already holds checkpoints (latest: {step_dir.name}): pass --resume to continue "
            "from it, or use another --checkpoint-dir"
        )
    meta = verify(step_dir)
    saved = meta.get("fingerprint", {})
    if "world_size" in fingerprint and saved.get("world_size") != fingerprint["world_size"]:
        _check_resize(step_dir, meta, fingerprint, why_not_resizable)
        saved = {k: v for k, v in saved.items() if k not in WORLD_ENTRIES}
        fingerprint = {k: v for k, v in fingerprint.items() if k not in WORLD_ENTRIES}
    compare_fingerprint(step_dir, saved, fingerprint)
    return step_dir, meta


def written_on(meta: dict[str, Any]) -> dict[str, Any]:
    """What wrote the checkpoint of ``meta``: ``world_size``, ``topology``, ``plan``, ``torch``,
    ``torchrec`` (a checkpoint from before they were recorded: its fingerprint's world size)."""
    found = dict(meta.get("written_on") or {})
    found.setdefault("world_size", meta.get("fingerprint", {}).get("world_size"))
    found.setdefault("topology", None)
    return found


def _check_resize(step_dir: Path, meta: dict[str, Any], now: dict[str, Any], why_not: str | None) -> None:
    """CheckpointError, in one line naming why, when the checkpoint of ``meta`` cannot resume on the
    world of fingerprint ``now``."""
    was = written_on(meta)
    topology = f" ({was['topology']})" if was["topology"] else ""
    head = f"checkpoint {step_dir} was written on {_ranks(was['world_size'])}{topology}, "
    head += f"this run has {now['world_size']}"
    if why_not is not None:
        again = f"resume on {_ranks(was['world_size'])}, or use another --checkpoint-dir"
        raise CheckpointError(f"{head}: {why_not} ({again})")
    # described plans ({table: "table_wise on rank 1"}): the tables may move, not change type
    saved_plan, new_plan = meta.get("fingerprint", {}).get("plan", {}), now.get("plan", {})
    try:
        check_sharding_types(_types(saved_plan), _types(new_plan), pin="resume with the same --sharding")
    except ValueError as e:
        raise CheckpointError(f"{head}: {e}") from None


def _types(described: dict[str, str]) -> dict[str, str]:
    """``{table: sharding type}`` of a plan described as ``{table: "table_wise on rank 1"}``."""
    return {table: text.split(" on ")[0] for table, text in described.items()}


# --------------------------------------------------------------------------------------------
# Collective: every rank calls these, in the same order
# --------------------------------------------------------------------------------------------


def check_on_ranks(
    directory: Path,
    fingerprint: dict[str, Any],
    *,
    resume: bool,
    why_not_resizable: str | None = NOT_SAID_RESIZABLE,
) -> tuple[Path, dict[str, Any]] | None:
    """``check`` on rank 0; every rank returns its result or raises the same CheckpointError."""
    answer: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            answer[0] = ("ok", check(directory, fingerprint, resume=resume, why_not_resizable=why_not_resizable))
        except CheckpointError as e:
            answer[0] = ("error", str(e))
    dist.broadcast_object_list(answer, src=0)
    kind, value = answer[0]
    if kind == "error":
        raise CheckpointError(value)
    return value


def save(
    directory: Path,
    step: int,
    state: TrainState,
    per_rank: Any,
    fingerprint: dict[str, Any],
    *,
    keep: int = 2,
    written_on: dict[str, Any] | None = None,
) -> Path:
    """Writes checkpoint ``step`` atomically (see the module docstring); returns its directory.

    ``per_rank`` is this rank's own object (picklable). ``keep`` complete checkpoints are kept
    (0: all). ``written_on`` (JSON) goes to meta.json: what wrote it. Collective.
    """
    rank = dist.get_rank()
    name = step_name(step)
    tmp, final = directory / f"{TMP_PREFIX}{name}", directory / name
    # Rank 0 makes the directory (removing what interrupted saves left) before any rank writes into
    # it; a failure there reaches every rank, which all raise it.
    prepared: list[str | None] = [None]
    if rank == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for stale in directory.glob(f"{TMP_PREFIX}*"):  # an interrupted save: never named by latest
                if stale.is_dir():
                    shutil.rmtree(stale)
                else:
                    stale.unlink()
            tmp.mkdir()
        except OSError as e:
            prepared[0] = f"cannot write checkpoint {tmp}: {e.strerror or e}"
    dist.broadcast_object_list(prepared, src=0)
    if prepared[0] is not None:
        raise CheckpointError(prepared[0])
    to_save = {**_without_empty(state.state_dict()), _rank_key(rank): pickle.dumps(per_rank)}
    try:
        dcp.save(to_save, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True))
    except CheckpointException as e:  # raised on every rank, whichever failed
        raise CheckpointError(f"writing checkpoint {tmp} failed: {_failures(e)}") from None
    # dcp.save returned on rank 0 after every rank's files were written: rank 0 completes the save.
    if rank == 0:
        try:
            _complete(directory, tmp, final, step, fingerprint, keep, written_on)
        except OSError as e:
            raise CheckpointError(f"completing checkpoint {final} failed: {e}") from None
    return final


def _complete(
    directory: Path,
    tmp: Path,
    final: Path,
    step: int,
    fingerprint: dict[str, Any],
    keep: int,
    written_on: dict[str, Any] | None,
) -> None:
    """Rank 0's part of ``save``: meta.json, MANIFEST, the rename, ``latest``, the old ones removed."""
    name = final.name
    meta = {
        "step": step,
        "fingerprint": _plain(fingerprint),
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch": torch.__version__,
    }
    if written_on is not None:
        meta["written_on"] = _plain(written_on)
    _write_synced(tmp / META, json.dumps(meta, indent=2) + "\n")
    _write_manifest(tmp, step)
    _fsync_dir(tmp)
    current = latest(directory)
    if final.exists():
        if current is not None and current.name == name:
            raise CheckpointError(f"{final} is the latest checkpoint; it is not overwritten")
        shutil.rmtree(final)  # the step directory of a save interrupted after its rename
    os.rename(tmp, final)
    _fsync_dir(directory)
    pointer_tmp = directory / f"{TMP_PREFIX}{LATEST}"
    _write_synced(pointer_tmp, name + "\n")
    os.replace(pointer_tmp, directory / LATEST)
    _fsync_dir(directory)
    if keep > 0:
        complete = sorted(
            (d for d in directory.glob(f"{STEP_PREFIX}*") if (d / MANIFEST).is_file()), key=_step_of
        )
        for old in complete[:-keep]:
            if old.name != name:
                shutil.rmtree(old)


def load(step_dir: Path, state: TrainState, *, from_rank: int | None = None) -> Any:
    """Loads checkpoint ``step_dir`` into ``state`` (in place, resharded by DCP when it was written
    on another world size); returns this rank's own object, or rank ``from_rank``'s (a world size
    change: this rank may have had no number then). Collective. Check the directory first
    (``check_on_ranks``)."""
    rank = dist.get_rank() if from_rank is None else from_rank
    full = state.state_dict()
    to_load = {**_without_empty(full), _rank_key(rank): b""}
    try:
        dcp.load(to_load, storage_reader=dcp.FileSystemReader(str(step_dir)))
    except CheckpointException as e:  # raised on every rank, whichever failed
        raise CheckpointError(f"loading checkpoint {step_dir} failed: {_failures(e)}") from None
    per_rank = pickle.loads(to_load.pop(_rank_key(rank)))
    state.load_state_dict(_merged(full, to_load))
    return per_rank


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _failures(e: CheckpointException) -> str:
    """``rank R: Type: message`` for each rank that failed in a DCP save or load."""
    return "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in sorted(e.failures.items()))


def _without_empty(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` without its empty dicts (e.g. SGD's optimizer state), which DCP does not write but
    would ask for on load; the tensors are the same objects (DCP loads into them in place)."""
    pruned = {}
    for key, value in state.items():
        if isinstance(value, dict):
            value = _without_empty(value)
            if not value:
                continue
        pruned[key] = value
    return pruned


def _merged(full: dict[str, Any], loaded: dict[str, Any]) -> dict[str, Any]:
    """``full`` with the values of ``loaded`` (a pruned copy of it that DCP filled) put back in."""
    for key, value in loaded.items():
        if isinstance(value, dict) and isinstance(full.get(key), dict):
            _merged(full[key], value)
        else:
            full[key] = value
    return full


def _plain(value: Any) -> Any:
    """``value`` as JSON gives it back (tuples become lists), so that saved and new compare equal."""
    return json.loads(json.dumps(value))


def _first_difference(saved: Any, now: Any, path: str) -> tuple[str, str, str] | None:
    if isinstance(now, dict) and isinstance(saved, dict):
        for key, value in now.items():
            where = f"{path}.{key}" if path else str(key)
            if key not in saved:
                return where, "absent", json.dumps(value)
            if (difference := _first_difference(saved[key], value, where)) is not None:
                return difference
        return None
    if saved != now:
        return path, json.dumps(saved), json.dumps(now)
    return None


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def _step_of(step_dir: Path) -> int:
    suffix = step_dir.name.removeprefix(STEP_PREFIX)
    return int(suffix) if suffix.isdigit() else -1


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_manifest(step_dir: Path, step: int) -> None:
    files = sorted(p for p in step_dir.iterdir() if p.is_file() and p.name != MANIFEST)
    lines = [f"# checkpoint {step_name(step)}: {len(files)} files (SHA-256, bytes, name); written last"]
    lines += [f"{_sha256(p)} {p.stat().st_size} {p.name}" for p in files]
    _write_synced(step_dir / MANIFEST, "\n".join(lines) + "\n")


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
