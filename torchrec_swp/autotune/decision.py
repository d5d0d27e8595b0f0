"""What a tuning decided (``Decision``): the record ``pipeline.autotune_decision`` gives, the
tuner's report is made from, and a checkpoint carries."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from torchrec_swp.autotune.trial import Tried


@dataclass(frozen=True)
class Decision:
    """What the ranks decided: ``plan`` the found plan's text (of the profiled phase; None: keep
    the starting plan), whether it gives the input dist its own comm group, the predicted step of
    it (from its own profile after a second round; ``first_predicted_s``: from the starting plan's)
    and of the starting plan, the starting plan's measured step, the lines saying why, and (once
    verified) the measured step with the chosen plan. ``processes``: the worker processes the
    chosen plan's draws are fetched in (``MapSource.use_processes``; 0: on its threads).

    ``tried``: the plans of the last trial, each with its predicted and measured step
    (``trial.Tried``), the running plan first; ``visits``: the order they ran in (indices into
    ``tried``). ``trial_steps``: the calls every trial took (switches, settling, measuring);
    ``switches``: the plan switches the tuner made; ``tuning_steps``: the calls before the last
    decision (what tuning cost before the final plan ran alone); ``retunes``: re-tunes after a
    drift; ``lost_s``: the net time the tuning's searches and trials lost, up to the last decision,
    against the plans they started from (``autotune.budget``; rank-local: each rank's own steps;
    negative where the candidates tried won more than the others lost).

    ``decided`` False: no decision was taken, the data ended first (``why``: ``not decided: the
    data ended after N steps, having profiled P of the S steps it needs ...``; ``plan``: the plan
    running then, None for the starting plan). Such a record is not checkpointed: a resume tunes
    again."""

    plan: str | None
    own_group: bool = False
    predicted_s: float | None = None
    baseline_s: float | None = None
    measured_start_s: float | None = None
    why: tuple[str, ...] = ()
    measured_s: float | None = None
    first_predicted_s: float | None = None
    decided: bool = True
    tried: tuple[Tried, ...] = ()
    visits: tuple[int, ...] = ()
    trial_steps: int = 0
    switches: int = 0
    tuning_steps: int | None = None
    retunes: int = 0
    processes: int = 0
    lost_s: float = 0.0

    @property
    def switched(self) -> bool:
        return self.plan is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Decision:
        return cls(
            **{
                **data,
                "why": tuple(data.get("why", ())),
                "tried": tuple(Tried.from_dict(t) for t in data.get("tried", ())),
                "visits": tuple(data.get("visits", ())),
            }
        )
