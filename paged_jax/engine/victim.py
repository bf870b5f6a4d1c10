"""Victim policies: which running sequence to preempt when the pool runs dry (M5 in docs/SEED.md).

A victim policy is a pure function ``(running: Sequence[SeqInfo]) -> index`` into
``running`` (which is never empty). The block manager offers the mechanism (release,
swap); the scheduler asks one of these for the policy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from paged_jax.engine.sequence import SeqInfo

VictimPolicy = Callable[[Sequence[SeqInfo]], int]


def most_recently_admitted(running: Sequence[SeqInfo]) -> int:
    """The latest admission (vLLM's choice: it has done the least work, and the oldest
    requests keep making progress, so the engine always drains)."""
    return max(range(len(running)), key=lambda i: running[i].admitted_at)


def fewest_blocks(running: Sequence[SeqInfo]) -> int:
    """The one holding the fewest blocks (cheapest to recompute or swap); ties: latest."""
    return min(range(len(running)), key=lambda i: (running[i].num_blocks, -running[i].admitted_at))


def most_blocks(running: Sequence[SeqInfo]) -> int:
    """The one holding the most blocks (frees the most memory at once); ties: latest."""
    return max(range(len(running)), key=lambda i: (running[i].num_blocks, running[i].admitted_at))


VICTIM_POLICIES: dict[str, VictimPolicy] = {
    "most_recently_admitted": most_recently_admitted,
    "fewest_blocks": fewest_blocks,
    "most_blocks": most_blocks,
}


def register_victim_policy(name: str, policy: VictimPolicy) -> VictimPolicy:
    """Make ``policy`` available as ``victim_policy=name`` (``docs/EXTENDING.md``)."""
    VICTIM_POLICIES[name] = policy
    return policy


def get_victim_policy(policy: str | VictimPolicy) -> VictimPolicy:
    if callable(policy):
        return policy
    if policy not in VICTIM_POLICIES:
        raise ValueError(f"victim_policy={policy!r}: unknown; choose one of {sorted(VICTIM_POLICIES)} or pass a function")
    return VICTIM_POLICIES[policy]
