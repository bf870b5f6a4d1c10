"""Data parallelism by composition: ``LLM`` owns d engines and a ``Router`` that assigns
each request to one of them.

Each engine (a replica) has its own pool, block manager, scheduler and devices; nothing is
shared and no collective crosses them. A routing policy is a pure function

    policy(request: Assignment, loads: list[ReplicaLoad]) -> replica index

``"round_robin"`` (default: request number mod d) and ``"least_loaded"`` (fewest
outstanding tokens, prompt + members x max_tokens, ties to the lowest index), or any such
function (``register_router``). Request ids (hence default sampling seeds) are numbered by
the front end, so a request's outputs do not depend on which replica ran it.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import NamedTuple


class Assignment(NamedTuple):
    """What a policy knows of a request: its number (0, 1, ... across the front end's
    life) and its cost, ``len(prompt) + members x max_tokens`` tokens at most."""

    number: int
    tokens: int


class ReplicaLoad(NamedTuple):
    """A replica's unfinished work: requests and their tokens (as ``Assignment.tokens``)."""

    requests: int
    tokens: int


RoutingPolicy = Callable[[Assignment, list[ReplicaLoad]], int]


def round_robin(request: Assignment, loads: list[ReplicaLoad]) -> int:
    """Request n goes to replica n mod d."""
    return request.number % len(loads)


def least_loaded(request: Assignment, loads: list[ReplicaLoad]) -> int:
    """The replica with the fewest outstanding tokens (then requests; then the lowest index)."""
    del request
    return min(range(len(loads)), key=lambda i: (loads[i].tokens, loads[i].requests, i))


ROUTERS: dict[str, RoutingPolicy] = {"round_robin": round_robin, "least_loaded": least_loaded}


def register_router(name: str, policy: RoutingPolicy) -> RoutingPolicy:
    """Make ``policy`` available as ``LLM(data_parallel_policy=name)``."""
    ROUTERS[name] = policy
    return policy


def get_router(policy) -> RoutingPolicy:
    """A policy by name (``ROUTERS``) or a function itself; ValueError otherwise."""
    if callable(policy):
        return policy
    if policy not in ROUTERS:
        raise ValueError(f"data_parallel_policy={policy!r}: choose one of {sorted(ROUTERS)} or pass a function")
    return ROUTERS[policy]


class Router:
    """Assigns requests to ``num_replicas`` engines and remembers each one's owner and
    cost until it is forgotten (the front end forgets a request once it is reported done)."""

    def __init__(self, policy, num_replicas: int):
        self.policy = get_router(policy)
        self.num_replicas = num_replicas
        self.owner: dict[str, int] = {}
        self.cost: dict[str, int] = {}

    def loads(self, unfinished: list[list[str]]) -> list[ReplicaLoad]:
        """Each replica's load, from the ids of its unfinished requests."""
        return [ReplicaLoad(len(ids), sum(self.cost.get(r, 0) for r in ids)) for ids in unfinished]

    def assign(self, number: int, tokens: int, loads: list[ReplicaLoad]) -> int:
        if self.num_replicas == 1:
            return 0
        r = self.policy(Assignment(number, tokens), loads)
        if not (isinstance(r, int) and 0 <= r < self.num_replicas):
            raise ValueError(f"data_parallel_policy returned {r!r}: expected a replica index in "
                             f"[0, {self.num_replicas})")
        return r

    def record(self, request_id: str, replica: int, tokens: int) -> None:
        self.owner[request_id] = replica
        self.cost[request_id] = tokens

    def forget(self, request_id: str) -> None:
        self.owner.pop(request_id, None)
        self.cost.pop(request_id, None)


def run_engines(engines: list, on_progress: Callable[[], None] | None = None) -> None:
    """Step ``engines`` until none has unfinished work, then release their last rows. One
    engine steps on the caller's thread; several step concurrently, one thread each (a
    replica's step waits on its own devices only). The first exception is re-raised after
    the others stop at their next step."""
    if len(engines) == 1:
        engine = engines[0]
        while engine.has_unfinished():
            engine.step()
            if on_progress is not None:
                on_progress()
        engine.flush()
        return
    stop = threading.Event()

    def drive(engine) -> None:
        while engine.has_unfinished() and not stop.is_set():
            engine.step()
        engine.flush()

    with concurrent.futures.ThreadPoolExecutor(max(len(engines), 1), thread_name_prefix="replica") as pool:
        pending = {pool.submit(drive, e) for e in engines}
        try:
            while pending:
                done, pending = concurrent.futures.wait(pending, timeout=0.2,
                                                        return_when=concurrent.futures.FIRST_EXCEPTION)
                for f in done:
                    f.result()  # re-raises a replica's exception here
                if on_progress is not None:
                    on_progress()
        except BaseException:
            stop.set()
            raise
