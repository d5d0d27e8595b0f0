"""The plan language (pure Python, no torch): tasks, schedules, dependencies, plans, phases."""

from torchrec_swp.plan.errors import PlanError
from torchrec_swp.plan.names import Vocabulary
from torchrec_swp.plan.phases import PhasedPlan, load_plan
from torchrec_swp.plan.plan import Dep, PipelinePlan, ThreadMap
from torchrec_swp.plan.task import (
    DEFAULT_COMM_GROUP,
    DEFAULT_STREAM,
    MAIN_THREAD,
    PipelineTask,
    ScheduledTask,
    TaskSchedule,
    When,
)

__all__ = [
    "DEFAULT_COMM_GROUP",
    "DEFAULT_STREAM",
    "MAIN_THREAD",
    "Dep",
    "PhasedPlan",
    "PipelinePlan",
    "PipelineTask",
    "PlanError",
    "ScheduledTask",
    "TaskSchedule",
    "ThreadMap",
    "Vocabulary",
    "When",
    "load_plan",
]
