"""The continuous-batching scheduler, its policies (fcfs, priority, vtc) and admission."""

from engine.sched.admission import AddResult, AdmissionStatus
from engine.sched.config import SchedulerConfig
from engine.sched.output import ScheduledSeq, SchedulerOutput, StepResult
from engine.sched.policy import SCHEDULING_POLICIES, Policy, TokenCost, make_policy
from engine.sched.scheduler import Scheduler
from engine.sched.stats import SchedulerStats, TenantStats

__all__ = [
    "SCHEDULING_POLICIES",
    "AddResult",
    "AdmissionStatus",
    "Policy",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "StepResult",
    "TenantStats",
    "TokenCost",
    "make_policy",
]
