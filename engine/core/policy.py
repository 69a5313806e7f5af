"""The scheduling policy: the order waiting requests are admitted in, and which running request is
preempted first when blocks run out (the one that would be admitted last)."""

from __future__ import annotations

import bisect
import enum

from xlaserve.core.request import Request


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"  # lower `priority` first, then earlier arrival


def enqueue_waiting(
    waiting: list[Request], request: Request, policy: SchedulingPolicy, *, is_preempted: bool
) -> None:
    """Put `request` where the policy admits it among `waiting` (kept in admission order)."""
    if policy == SchedulingPolicy.PRIORITY:
        bisect.insort(waiting, request, key=lambda r: (r.priority, r.arrival_time))
    elif is_preempted:
        waiting.insert(0, request)  # it was admitted before everything still waiting
    else:
        waiting.append(request)


def pick_victim(running: list[Request], policy: SchedulingPolicy) -> int:
    """The index in `running` of the request to preempt: the last admitted (FCFS), or the lowest
    priority, latest arrival (PRIORITY)."""
    if policy == SchedulingPolicy.FCFS:
        return len(running) - 1
    return max(range(len(running)), key=lambda i: (running[i].priority, running[i].arrival_time, i))
