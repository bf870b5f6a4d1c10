"""Data parallelism: d replicas behind one ``LLM``, requests assigned by a policy.

``LLM(..., data_parallel_size=d)`` (or a mesh whose "data" axis has size d) returns a
``DataParallelLLM``: one ``LLM`` per row of the mesh (t devices each), each with its own
pool, block manager and scheduler; nothing is shared between replicas and no collective
crosses them. Each request goes to the replica a policy names:

    policy(request: Assignment, loads: list[ReplicaLoad]) -> replica index

``"round_robin"`` (default: request number mod d) and ``"least_loaded"`` (fewest
outstanding tokens, prompt + members x max_tokens, ties to the lowest index), or any
such function. Request ids (hence default sampling seeds) are numbered across the front
end exactly as one engine numbers them, so a request's outputs do not depend on which
replica ran it. ``generate`` steps the busy replicas concurrently (one thread each: a
replica's step waits on its own devices only) and returns outputs in prompt order.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import NamedTuple

from paged_jax.engine.beam import BeamSearchParams
from paged_jax.engine.llm import LLM, _done
from paged_jax.engine.prompts import normalise_prompts
from paged_jax.engine.sampling import SamplingParams
from paged_jax.engine.sequence import SequenceGroup
from paged_jax.parallel.backend import resolve_mesh
from paged_jax.parallel.mesh import mesh_sizes, replica_meshes


class Assignment(NamedTuple):
    """What a policy knows of a request: its number (0, 1, ... across the front end's
    life) and its cost, ``len(prompt) + members x max_tokens`` tokens at most."""

    number: int
    tokens: int


class ReplicaLoad(NamedTuple):
    """A replica's unfinished work: requests and their tokens (as ``Assignment.tokens``)."""

    requests: int
    tokens: int


Policy = Callable[[Assignment, list[ReplicaLoad]], int]


def round_robin(request: Assignment, loads: list[ReplicaLoad]) -> int:
    """Request n goes to replica n mod d."""
    return request.number % len(loads)


def least_loaded(request: Assignment, loads: list[ReplicaLoad]) -> int:
    """The replica with the fewest outstanding tokens (then requests; then the lowest index)."""
    return min(range(len(loads)), key=lambda i: (loads[i].tokens, loads[i].requests, i))


POLICIES: dict[str, Policy] = {"round_robin": round_robin, "least_loaded": least_loaded}


def get_policy(policy) -> Policy:
    """A policy by name (``POLICIES``) or a function itself; ValueError otherwise."""
    if callable(policy):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"data_parallel_policy={policy!r}: choose one of {sorted(POLICIES)} or pass a function")
    return POLICIES[policy]


def _cost(prompt: list[int], params) -> int:
    members = params.beam_width if isinstance(params, BeamSearchParams) else params.n
    return len(prompt) + members * params.max_tokens


# Counters that add up over replicas in ``stats``.
_ADDITIVE = ("steps", "generated_tokens", "prefill_tokens", "num_preemptions", "swap_outs", "swap_ins", "compiles",
             "prefix_cache_query_tokens", "prefix_cache_hit_tokens", "prefix_cache_evictions")


class DataParallelLLM(LLM):
    """d ``LLM`` replicas behind ``LLM``'s API (module docstring). Built by ``LLM(...)``
    when ``data_parallel_size`` (or the mesh's "data" axis) exceeds 1; every other
    argument goes to each replica. ``replicas`` are the engines; ``num_gpu_blocks`` is a
    replica's pool."""

    def __init__(self, model, *, tensor_parallel_size: int = 1, data_parallel_size: int = 1, mesh=None,
                 data_parallel_policy="round_robin", **kwargs):
        self.policy = get_policy(data_parallel_policy)
        self.mesh = resolve_mesh(tensor_parallel_size, data_parallel_size, mesh)
        self.tensor_parallel_size, self.data_parallel_size = mesh_sizes(self.mesh)
        self.replicas = [LLM(model, mesh=m, **kwargs) for m in replica_meshes(self.mesh)]
        first = self.replicas[0]
        for name in ("tokenizer", "generation_defaults", "eos_token_ids", "max_model_len", "block_size",
                     "num_gpu_blocks", "seed", "backend", "kv_cache", "kv_cache_dtype", "speculative"):
            setattr(self, name, getattr(first, name))
        self._next_request = 0
        self._owner: dict[str, int] = {}  # request id -> replica, while it may still be reported
        self._costs: dict[str, int] = {}  # request id -> Assignment.tokens
        self._streamed: dict[str, SequenceGroup] = {}  # add_request's, until step() reports them finished

    # ------------------------------------------------------------------ requests

    def loads(self) -> list[ReplicaLoad]:
        """Each replica's unfinished requests and their tokens (``Assignment.tokens``)."""
        loads = [[0, 0] for _ in self.replicas]
        for i, rep in enumerate(self.replicas):
            sched = rep.engine.scheduler
            for g in [*sched.waiting, *sched.running, *sched.swapped]:
                loads[i][0] += 1
                loads[i][1] += self._costs.get(g.request_id, 0)
        return [ReplicaLoad(*x) for x in loads]

    def add_requests(self, prompts, sampling_params=None) -> list[SequenceGroup]:
        """``LLM.add_requests`` over the replicas: every request is validated first (the
        replicas are identical), then each is queued on the replica the policy names."""
        given = normalise_prompts(prompts, self.tokenizer)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams | BeamSearchParams):
            params = [sampling_params] * len(given)
        else:
            params = list(sampling_params)
            if len(params) != len(given):
                raise ValueError(f"{len(params)} sampling_params for {len(given)} prompts")
        first = self.replicas[0]
        for i, (prompt, p) in enumerate(zip(given, params, strict=True)):
            if not isinstance(p, SamplingParams | BeamSearchParams):
                raise ValueError(f"sampling_params[{i}]={p!r}: expected SamplingParams or BeamSearchParams")
            if isinstance(p, BeamSearchParams) and self.speculative is not None:
                raise ValueError(f"request {i}: beam search with speculative decoding is not supported "
                                 f"(speculative method {self.speculative.method!r})")
            first._validate_prompt(i, prompt.token_ids)
            first._validate_fit(i, prompt.token_ids, p)  # raises for impossible fields; rejections come below
        loads = self.loads()
        groups = []
        for prompt, p in zip(given, params, strict=True):
            cost = _cost(prompt.token_ids, p)
            r = self.policy(Assignment(self._next_request, cost), loads)
            if not (isinstance(r, int) and 0 <= r < len(self.replicas)):
                raise ValueError(f"data_parallel_policy returned {r!r}: expected a replica index in "
                                 f"[0, {len(self.replicas)})")
            rep = self.replicas[r]
            rep._next_request = self._next_request  # one numbering across replicas: ids and seeds as one engine's
            (group,) = rep.add_requests([{"prompt_token_ids": prompt.token_ids, "cache_salt": prompt.cache_salt}], [p])
            self._next_request += 1
            group.prompt_text = prompt.text
            self._owner[group.request_id] = r
            self._costs[group.request_id] = cost
            loads[r] = ReplicaLoad(loads[r].requests + 1, loads[r].tokens + cost)
            groups.append(group)
        return groups

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list:
        """``LLM.generate`` over the replicas: outputs in prompt order."""
        groups = self.add_requests(prompts, sampling_params)
        try:
            self._run(groups, use_tqdm)
            return self.outputs(groups)
        finally:
            self._forget(groups)

    def _forget(self, groups: list[SequenceGroup]) -> None:
        """Drop the bookkeeping of requests that will not be reported again."""
        for g in groups:
            self._owner.pop(g.request_id, None)
            self._costs.pop(g.request_id, None)

    def _run(self, groups: list[SequenceGroup], use_tqdm: bool) -> None:
        """Step every busy replica to completion, one thread each; on any exception
        (Ctrl-C included) every replica is reset (``LLM._reset``) and it is re-raised."""
        busy = [rep for rep in self.replicas if rep.engine.has_unfinished()]
        stop = threading.Event()

        def drive(rep: LLM) -> None:
            while rep.engine.has_unfinished() and not stop.is_set():
                rep._times(rep.engine.step())
            rep.engine.flush()

        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(groups), desc="generating", unit="req", dynamic_ncols=True)
        pool = concurrent.futures.ThreadPoolExecutor(max(len(busy), 1), thread_name_prefix="replica")
        futures = [pool.submit(drive, rep) for rep in busy]
        try:
            pending = set(futures)
            while pending:
                done, pending = concurrent.futures.wait(pending, timeout=0.2,
                                                        return_when=concurrent.futures.FIRST_EXCEPTION)
                for f in done:
                    f.result()  # re-raises a replica's exception here
                if bar is not None:
                    bar.update(sum(_done(g) for g in groups) - bar.n)
        except BaseException:
            stop.set()
            pool.shutdown(wait=True)
            for rep in self.replicas:
                rep._reset()
            raise
        finally:
            pool.shutdown(wait=True)
            if bar is not None:
                bar.close()

    def outputs(self, groups: list[SequenceGroup]) -> list:
        """Each request's output from the replica that ran it, in the given order."""
        return [self.replicas[self._owner[g.request_id]].outputs([g])[0] for g in groups]

    # ------------------------------------------------------------------ streaming

    def add_request(self, prompt, params=None, request_id: str | None = None) -> str:
        (group,) = self.add_requests([prompt], None if params is None else [params])
        if request_id is not None:
            if not isinstance(request_id, str) or request_id in self._streamed:
                raise ValueError(f"request_id={request_id!r}: must be a new string")
            self._owner[request_id] = self._owner.pop(group.request_id)
            self._costs[request_id] = self._costs.pop(group.request_id)
            group.request_id = request_id
            for s in group.seqs:
                s.request_id = request_id
        self._streamed[group.request_id] = group
        return group.request_id

    def step(self) -> list:
        """One step of every replica with work; outputs as ``LLM.step``."""
        for rep in self.replicas:
            if rep.engine.has_unfinished():
                try:
                    rep._times(rep.engine.step())
                    if not rep.engine.has_unfinished():
                        rep.engine.flush()
                except BaseException:
                    rep._reset()
                    raise
        groups = list(self._streamed.values())
        self._streamed = {rid: g for rid, g in self._streamed.items() if not _done(g)}
        outs = self.outputs(groups)
        self._forget([g for g in groups if _done(g)])
        return outs

    def has_unfinished_requests(self) -> bool:
        return any(rep.engine.has_unfinished() for rep in self.replicas)

    def abort(self, request_ids) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        unknown = [r for r in ids if r not in self._owner]
        if unknown:
            raise ValueError(f"unknown request ids (never added, or already finished): {unknown}")
        by_replica: dict[int, list[str]] = {}
        for rid in dict.fromkeys(ids):
            by_replica.setdefault(self._owner[rid], []).append(rid)
        for r, rids in by_replica.items():
            self.replicas[r].abort(rids)

    # ------------------------------------------------------------------ the rest

    def warmup(self, use_tqdm: bool = True) -> int:
        return sum(rep.warmup(use_tqdm=use_tqdm) for rep in self.replicas)

    def stats(self) -> dict:
        """Every replica's ``LLM.stats()`` under "replicas", the additive counters summed."""
        per = [rep.stats() for rep in self.replicas]
        out = {k: sum(s[k] for s in per) for k in _ADDITIVE}
        out.update(data_parallel_size=self.data_parallel_size, tensor_parallel_size=self.tensor_parallel_size,
                   replicas=per)
        return out

    def reset_stats(self) -> None:
        for rep in self.replicas:
            rep.reset_stats()

    def _reset(self) -> None:
        for rep in self.replicas:
            rep._reset()
