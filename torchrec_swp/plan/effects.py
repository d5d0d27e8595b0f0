"""The effects a task may declare: the state it changes outside its batch's slot.

A task's ``reads`` and ``writes`` say what it exchanges through its batch's slot; its ``effects``
say what else it changes that outlives the step (the model's weights, an optimizer's state, a
pipeline's own stash). The engine captures an effect before the first task that declares it
runs for a batch, and commits or restores it once the batch's last task with an effect has run
(``torchrec_swp.engine.transaction``): what makes a step that went non-finite undoable
(``on_nonfinite=``). A task that declares none is pure: it changes nothing but its slot.

The names are fixed here, each with what it stands for, so that a slip (``dense_param``) is an
error at its line rather than an effect no one captures. What captures each one is the
pipeline's (``torchrec_swp.integrations.torchrec.nonfinite``); a plan whose effects a pipeline
cannot capture runs, with ``on_nonfinite="off"`` only.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from torchrec_swp.plan.errors import PlanError

#: Every effect a plan may declare, and what it stands for.
KNOWN_EFFECTS: Mapping[str, str] = MappingProxyType(
    {
        "fused_rows": "the rows of the fused embedding tables (optimizer in backward) that the batch's ids "
        "touch on this rank, and those rows' optimizer state",
        "dense_grads": "the gradients (.grad) of the parameters the dense optimizer steps",
        "dense_params": "the parameters the dense optimizer steps",
        "dense_optim": "the dense optimizer's state (its moments, its step counts)",
        "stashed_grads": "gradients a pipeline keeps for a later step (SemiSync's, the stashing pipelines')",
        "emb_cache": "an embedding cache's contents (what a prefetch loads into it)",
        "stashed_state": "state a pipeline stashes and restores around a step (optimizer state, embeddings)",
        "counters": "counters that outlive the step (a pipeline's step count)",
    }
)


def check_effect(effect: object, task: str) -> str:
    """``effect`` if it is a known effect, else PlanError naming it and the task (the text form adds
    the nearest name, ``names.did_you_mean``)."""
    if not isinstance(effect, str) or effect not in KNOWN_EFFECTS:
        raise PlanError(
            f"task {task} declares unknown effect {effect!r} (effects: {', '.join(KNOWN_EFFECTS)})", culprit=task
        )
    return effect
