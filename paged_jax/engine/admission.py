"""Admission policies: the order in which waiting requests are offered the pool.

An admission policy is a pure function ``key(request: WaitingInfo) -> sortable``. Each step
the scheduler sorts the waiting queue by it (stably, so ties keep queue order: arrival, with
recompute-preempted requests at the front) and admits from the head while requests fit;
the first that does not fit blocks the rest (head-of-line, as vLLM's FCFS and priority
schedulers do), so no request is starved by smaller ones behind it unless the policy's
order says so.

Built in: ``"fcfs"`` (queue order: vLLM's default), ``"priority"`` (lower
``priority`` first, vLLM's ``--scheduling-policy priority``; ``LLM.generate(...,
priority=[...])``), ``"shortest_prompt_first"`` (fewest tokens to prefill first: an example
of a throughput-minded policy that can starve long prompts). Register your own with
``register_admission_policy`` or pass the function as ``LLM(admission_policy=...)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple


class WaitingInfo(NamedTuple):
    """What an admission policy may look at, for one waiting request."""

    request_id: str
    arrival: int  # position in the waiting queue now (0 = head)
    priority: int  # the caller's (LLM.generate(priority=...)); lower = sooner
    num_prompt_tokens: int
    num_tokens: int  # prompt + output so far (a recompute-preempted request has output)
    num_preemptions: int
    num_seqs: int  # members (n completions or beam_width beams) still running


AdmissionPolicy = Callable[[WaitingInfo], Any]


def fcfs(request: WaitingInfo) -> int:
    """Queue order (arrival; recompute-preempted requests first)."""
    del request
    return 0


def priority(request: WaitingInfo) -> int:
    """Lower ``priority`` first; ties in queue order."""
    return request.priority


def shortest_prompt_first(request: WaitingInfo) -> int:
    """Fewest tokens to (re)compute first; ties in queue order."""
    return request.num_tokens


ADMISSION_POLICIES: dict[str, AdmissionPolicy] = {
    "fcfs": fcfs,
    "priority": priority,
    "shortest_prompt_first": shortest_prompt_first,
}


def register_admission_policy(name: str, policy: AdmissionPolicy) -> AdmissionPolicy:
    """Make ``policy`` available as ``LLM(admission_policy=name)``."""
    ADMISSION_POLICIES[name] = policy
    return policy


def get_admission_policy(policy: str | AdmissionPolicy) -> AdmissionPolicy:
    """A policy by name (``ADMISSION_POLICIES``) or a function itself; ValueError otherwise."""
    if callable(policy):
        return policy
    if policy not in ADMISSION_POLICIES:
        raise ValueError(f"admission_policy={policy!r}: unknown; choose one of {sorted(ADMISSION_POLICIES)} "
                         "or pass a function")
    return ADMISSION_POLICIES[policy]
