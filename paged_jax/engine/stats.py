"""Per-step measurements and the summary ``LLM.stats()`` returns.

KV utilisation of a step = tokens whose K/V are held / token slots the cache is charged
for (paged: slots of allocated blocks; static: slots of reserved blocks), measured after
the step's appends and before finished sequences are released. The summary averages it
over steps (each step weighs the same: a time average in units of steps).

Sharing: each step also records the blocks the live sequences would hold if nothing were
shared (ceil(length / block_size) per sequence), beside the blocks actually allocated (a
block several sequences share counted once); ``blocks_unshared`` and the per-request
peaks in ``request_blocks`` (physical, unshared) measure what copy-on-write saves.

Each step's wall time is also split into phases (``phase_seconds``): ``schedule`` (host
decisions: the plan), ``run`` (the runner executing it: building the padded arrays,
enqueueing the jitted calls and waiting for the step's one device fetch, i.e. the
compute) and ``update`` (appending tokens, finishing sequences). ``timeline`` keeps one
``StepRecord`` per step for plots: the last ``timeline_limit`` steps (a ring buffer, so a
long-running server's memory stays bounded; the summary's figures are running aggregates
and stay exact over every step). ``request_blocks`` likewise keeps the last
``request_limit`` requests.

Saturation: an offline run has two phases. While requests still wait for admission
(waiting or swapped out), the engine runs at its capacity, which is what a serving
system at load sees; after the last admission it drains, running ever fewer, mostly long
sequences until the last finishes. The summary splits the run at the last step that
ended with a request waiting: ``saturated_*`` covers that step and those before it,
``drain_*`` the rest. Their tokens per second exclude compile time, as
``tokens_per_s_excl_compile`` does.

Speculative decoding (``SpecCounters``): proposed and accepted tokens over every
verification round, the acceptance rate, the tokens a round emits on average
(accepted + 1) and the target steps saved (accepted tokens: each would have cost a
decode step of its own).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

TIMELINE_LIMIT = 100_000  # steps kept in EngineStats.timeline (~10 MB of rows)
REQUEST_LIMIT = 100_000  # requests kept in EngineStats.request_blocks


class StepRecord(NamedTuple):
    """One row of ``EngineStats.timeline`` (one engine step)."""

    end_seconds: float  # step-seconds since the start, this step included
    batch: int
    tokens_held: int
    charged_blocks: int
    generated: int
    waiting: int  # requests still not running after it (waiting or swapped out)
    compile_seconds: float  # of this step's time
    unshared_blocks: int = 0  # blocks the live sequences would hold with nothing shared
    prefilled: int = 0  # prompt (or recomputed) tokens this step fed in chunks
    speculated: int = 0  # rows that ran a speculative round this step


@dataclasses.dataclass
class SpecCounters:
    rounds: int = 0  # verification rows (one per speculating sequence per step)
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens the rounds appended (accepted + the new one, cut at a stop)

    def record(self, proposed: int, accepted: int, emitted: int) -> None:
        self.rounds += 1
        self.proposed += proposed
        self.accepted += accepted
        self.emitted += emitted

    def summary(self) -> dict:
        return {
            "spec_rounds": self.rounds,
            "spec_proposed_tokens": self.proposed,
            "spec_accepted_tokens": self.accepted,
            "spec_acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "spec_mean_accepted_per_round": self.accepted / self.rounds if self.rounds else 0.0,
            "spec_mean_tokens_per_round": self.emitted / self.rounds if self.rounds else 0.0,
            "spec_target_steps_saved": self.accepted,
        }


@dataclasses.dataclass
class EngineStats:
    block_size: int
    num_blocks: int
    steps: int = 0
    generated_tokens: int = 0
    prompt_tokens_computed: int = 0  # tokens fed through prefill (recompute included)
    step_seconds: float = 0.0
    batch_sum: int = 0
    peak_batch: int = 0
    util_sum: float = 0.0
    util_steps: int = 0
    peak_charged_blocks: int = 0
    peak_allocated_blocks: int = 0
    charged_blocks_sum: int = 0
    peak_unshared_blocks: int = 0
    unshared_blocks_sum: int = 0
    allocated_blocks_sum: int = 0
    request_blocks: dict = dataclasses.field(default_factory=dict)  # request id -> (peak physical, peak unshared)
    phase_seconds: dict = dataclasses.field(default_factory=dict)
    timeline_limit: int = TIMELINE_LIMIT
    request_limit: int = REQUEST_LIMIT
    timeline: collections.deque = dataclasses.field(default=None)  # of StepRecord, the last timeline_limit
    spec: SpecCounters = dataclasses.field(default_factory=SpecCounters)
    # Running totals for the saturated/drain split: the totals as of the last step that
    # ended with a request waiting (steps, seconds, compile seconds, generated, batch sum).
    compile_seconds: float = 0.0
    _saturated: tuple = (0, 0.0, 0.0, 0, 0)

    def __post_init__(self):
        for name in ("timeline_limit", "request_limit"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: must be an int >= 1")
        self.timeline = collections.deque(self.timeline or (), maxlen=self.timeline_limit)

    def record_step(
        self,
        *,
        batch: int,
        generated: int,
        prefilled: int,
        tokens_held: int,
        allocated_blocks: int,
        charged_blocks: int,
        seconds: float,
        waiting: int = 0,
        compile_seconds: float = 0.0,
        phases: dict | None = None,
        unshared_blocks: int | None = None,
        request_blocks: dict | None = None,
        speculated: int = 0,
    ) -> None:
        """One engine step: ``batch`` sequences ran, ``generated`` tokens were sampled;
        ``waiting`` requests were still not running after it (waiting or swapped out);
        ``compile_seconds`` of its ``seconds`` went to compiling."""
        self.steps += 1
        self.generated_tokens += generated
        self.prompt_tokens_computed += prefilled
        self.step_seconds += seconds
        self.batch_sum += batch
        self.peak_batch = max(self.peak_batch, batch)
        self.peak_allocated_blocks = max(self.peak_allocated_blocks, allocated_blocks)
        self.peak_charged_blocks = max(self.peak_charged_blocks, charged_blocks)
        self.charged_blocks_sum += charged_blocks
        unshared = allocated_blocks if unshared_blocks is None else unshared_blocks
        self.peak_unshared_blocks = max(self.peak_unshared_blocks, unshared)
        self.unshared_blocks_sum += unshared
        self.allocated_blocks_sum += allocated_blocks
        for rid, (physical, private) in (request_blocks or {}).items():
            peak = self.request_blocks.get(rid)
            if peak is None:
                if len(self.request_blocks) >= self.request_limit:  # forget the oldest request
                    del self.request_blocks[next(iter(self.request_blocks))]
                peak = (0, 0)
            self.request_blocks[rid] = (max(peak[0], physical), max(peak[1], private))
        for name, sec in (phases or {}).items():
            self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + sec
        self.timeline.append(
            StepRecord(self.step_seconds, batch, tokens_held, charged_blocks, generated, waiting, compile_seconds,
                       unshared, prefilled, speculated)
        )
        self.compile_seconds += compile_seconds
        if waiting > 0:
            self._saturated = (self.steps, self.step_seconds, self.compile_seconds, self.generated_tokens,
                               self.batch_sum)
        if charged_blocks:
            self.util_sum += tokens_held / (charged_blocks * self.block_size)
            self.util_steps += 1

    def summary(self) -> dict:
        steps = max(self.steps, 1)
        return {
            "steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "prefill_tokens": self.prompt_tokens_computed,
            "seconds": self.step_seconds,
            "tokens_per_s": self.generated_tokens / self.step_seconds if self.step_seconds else 0.0,
            "mean_running_batch": self.batch_sum / steps,
            "peak_running_batch": self.peak_batch,
            "kv_utilization": self.util_sum / self.util_steps if self.util_steps else 0.0,
            "peak_blocks_used": self.peak_charged_blocks,
            "peak_blocks_allocated": self.peak_allocated_blocks,
            "mean_blocks_used": self.charged_blocks_sum / steps,
            "mean_blocks_allocated": self.allocated_blocks_sum / steps,
            "peak_blocks_unshared": self.peak_unshared_blocks,
            "mean_blocks_unshared": self.unshared_blocks_sum / steps,
            "request_peak_blocks": {rid: {"physical": a, "unshared": b} for rid, (a, b) in self.request_blocks.items()},
            "num_blocks": self.num_blocks,
            "phase_seconds": dict(self.phase_seconds),
            **self._phases(),
            **self.spec.summary(),
        }

    def _phases(self) -> dict:
        """Saturated vs drain split (module docstring), from the running totals."""
        sat = self._saturated
        total = (self.steps, self.step_seconds, self.compile_seconds, self.generated_tokens, self.batch_sum)
        out = {}
        for name, (steps, wall, compiled, generated, batch) in (
            ("saturated", sat), ("drain", tuple(t - s for t, s in zip(total, sat))),
        ):
            steady = wall - compiled
            out[f"{name}_steps"] = steps
            out[f"{name}_seconds"] = wall
            out[f"{name}_generated_tokens"] = generated
            out[f"{name}_tokens_per_s"] = generated / steady if steady > 0 else 0.0
            out[f"{name}_mean_running_batch"] = batch / steps if steps else 0.0
        return out


# Counters that add up over data-parallel replicas.
ADDITIVE = ("steps", "generated_tokens", "prefill_tokens", "num_preemptions", "swap_outs", "swap_ins", "compiles",
            "prefix_cache_query_tokens", "prefix_cache_hit_tokens", "prefix_cache_evictions")


def merged_summary(per_replica: list[dict], tensor_parallel_size: int) -> dict:
    """One summary over replicas: the additive counters summed, each replica's summary under
    "replicas"."""
    out = {k: sum(s[k] for s in per_replica) for k in ADDITIVE}
    out.update(data_parallel_size=len(per_replica), tensor_parallel_size=tensor_parallel_size, replicas=per_replica)
    return out
