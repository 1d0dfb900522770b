"""Fault injection for tests: engine steps that fail on purpose, through the real server.

FAULT_INJECTION="<where>:<marker>[,<where>:<marker>...]": every step that schedules a sequence
whose prompt contains <marker> raises InjectedFault at <where>:
- "forward": as the model forward runs, before anything of the step is sampled;
- "step": at the end of the step, after sampling and detokenizing, before the scheduler's update.

Tests only: with it set, anyone who can send a prompt can fail the requests batched with theirs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from engine.sched.output import ScheduledSeq

# What FAULT_INJECTION accepts: empty (off), or comma-separated <where>:<marker> rules.
FAULT_SPEC_PATTERN = r"^((forward|step):[^,]+(,(forward|step):[^,]+)*)?$"


class InjectedFault(RuntimeError):
    """The failure FAULT_INJECTION asked for."""


@dataclass(frozen=True)
class FaultRule:
    where: str  # "forward" or "step"
    marker: str  # fail steps that schedule a prompt containing this text


def parse_fault_rules(spec: str) -> tuple[FaultRule, ...]:
    """The rules of a FAULT_INJECTION value; () when it is empty."""
    if not re.fullmatch(FAULT_SPEC_PATTERN, spec):
        raise ValueError(f"FAULT_INJECTION must be <where>:<marker>[,...], got {spec!r}")
    rules = (part.partition(":") for part in spec.split(",") if part)
    return tuple(FaultRule(where, marker) for where, _, marker in rules)


class FaultInjector:
    """Raises InjectedFault where a rule says; the engine holds one only when rules are set."""

    def __init__(self, rules: Iterable[FaultRule], tokenizer: PreTrainedTokenizerBase) -> None:
        self.rules = tuple(rules)
        self._tokenizer = tokenizer

    def check(self, where: str, scheduled: list[ScheduledSeq]) -> None:
        """Raise if a rule for `where` matches the prompt of a sequence in the step."""
        for rule in self.rules:
            if rule.where == where and any(self._has(item, rule.marker) for item in scheduled):
                raise InjectedFault(f"injected {where} fault: a prompt contains {rule.marker!r}")

    def _has(self, item: ScheduledSeq, marker: str) -> bool:
        return marker in str(self._tokenizer.decode(item.seq.prompt_token_ids))
