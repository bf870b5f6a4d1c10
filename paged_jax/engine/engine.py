"""The engine loop: schedule, run, sample, update, release — one ``step`` at a time.

``LLMEngine`` wires the scheduler (decisions), the runner (device) and the stats
together; ``LLM`` (``llm.py``) is the offline front end over it. A step:

1. ``Scheduler.schedule`` returns the step's work (and has already done its
   preemptions, swap-ins and admissions through the runner).
2. Single-token appends go through decode calls (one, or a few split by table width
   when the runner's cost model says it pays: ``ModelRunner.plan_decode``), chunks
   through prefill calls (usually one: ``ModelRunner.plan_prefill``).
3. Rows that consumed all their pending tokens get a sampled token; sampled tokens, their
   log-probabilities and the pool's free count come back in one device sync (the free
   count also resyncs the scheduler's host-side mirror of it).
4. Finished sequences release their rows and blocks.
"""

from __future__ import annotations

import time

from paged_jax.engine.runner import ModelRunner, SampleRow
from paged_jax.engine.scheduler import Scheduler
from paged_jax.engine.sequence import FinishReason, Sequence
from paged_jax.engine.stats import EngineStats


class LLMEngine:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, *, eos_token_id: int | None, debug_checks: bool):
        self.scheduler = scheduler
        self.runner = runner
        self.eos_token_id = eos_token_id
        self.debug_checks = debug_checks
        scheduler.debug = debug_checks
        cfg = runner.config
        self.stats = EngineStats(block_size=cfg.block_size, num_blocks=cfg.num_blocks)

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Sequence]:
        """Run one step; returns the sequences that finished in it."""
        start = time.perf_counter()
        compiled_before = self.runner.compile_seconds
        plan = self.scheduler.schedule()
        t_sched = time.perf_counter()
        if not plan.work:
            raise RuntimeError(
                "scheduler made no progress: nothing runs although requests remain "
                f"(waiting={len(self.scheduler.waiting)}, swapped={len(self.scheduler.swapped)})"
            )
        runner = self.runner
        bs = runner.config.block_size
        # The most blocks any live row holds after this step: the table view's width.
        after = {id(s): s.num_computed + n for s, n in plan.work}
        max_blocks = max(-(-after.get(id(s), s.num_computed) // bs) for s in self.scheduler.running)
        groups = []  # (sequences, tokens each feeds)
        outs = []  # their StepOuts, fetched together below
        if decode := plan.decode:
            # Split by table width where the runner's cost model says it pays.
            for members, group_blocks in runner.plan_decode([-(-after[id(s)] // bs) for s in decode]):
                seqs = [decode[i] for i in members]
                groups.append((seqs, [1] * len(seqs)))
                outs.append(runner.decode(
                    [s.slot for s in seqs], [s.pending_token_ids(1)[0] for s in seqs], self._sample_rows(seqs),
                    group_blocks,
                ))
        if prefill := plan.prefill:
            # Ragged chunks go in as few calls as fit the area bound (padding < 2x a side).
            for rows, width, members in runner.plan_prefill([n for _, n in prefill]):
                group = [prefill[i] for i in members]
                seqs = [s for s, _ in group]
                groups.append((seqs, [n for _, n in group]))
                outs.append(runner.prefill(
                    [s.slot for s in seqs], [s.pending_token_ids(n) for s, n in group], self._sample_rows(seqs),
                    max_blocks, (rows, width),
                ))
        t_dispatch = time.perf_counter()
        outs = runner.fetch(outs)  # the step's one device sync
        t_sync = time.perf_counter()

        finished, generated = [], 0
        for (seqs, counts), out in zip(groups, outs, strict=True):
            for i, (s, n) in enumerate(zip(seqs, counts, strict=True)):
                s.num_computed += n
                if s.num_pending:  # mid-prefill: its sample is not a prediction we need
                    continue
                generated += 1
                if self._append_token(s, int(out.tokens[i]), float(out.logprobs[i])):
                    finished.append(s)
        free = int(outs[-1].num_free)
        self.scheduler.num_free = free  # the device's count resyncs the host mirror

        # Measured after the appends, before the finished release their blocks.
        allocated = runner.config.num_blocks - free
        charged = self.scheduler.accounting.charged_blocks(allocated)
        tokens_held = sum(s.num_computed for s in self.scheduler.running)
        self.scheduler.finish(finished)
        if self.debug_checks:
            self.check()
        end = time.perf_counter()
        self.stats.record_step(
            batch=len(plan.work),
            generated=generated,
            prefilled=sum(n for _, n in plan.prefill),
            tokens_held=tokens_held,
            allocated_blocks=allocated,
            charged_blocks=charged,
            seconds=end - start,
            waiting=len(self.scheduler.waiting) + len(self.scheduler.swapped),
            compile_seconds=self.runner.compile_seconds - compiled_before,
            phases={"schedule": t_sched - start, "dispatch": t_dispatch - t_sched, "sync": t_sync - t_dispatch,
                    "update": end - t_sync},
        )
        return finished

    @staticmethod
    def _sample_rows(seqs: list[Sequence]) -> list[SampleRow]:
        # The token index is the output length: the same whenever this token is sampled.
        return [
            SampleRow(s.params.temperature, s.params.top_k, s.params.top_p, s.seed, len(s.output_token_ids))
            for s in seqs
        ]

    def _append_token(self, seq: Sequence, token: int, logprob: float) -> bool:
        """Record a sampled token; True if the sequence is now finished."""
        seq.output_token_ids.append(token)
        seq.cumulative_logprob += logprob
        params = seq.params
        if token in params.stop_token_ids or (
            not params.ignore_eos and self.eos_token_id is not None and token == self.eos_token_id
        ):
            seq.finish_reason = FinishReason.STOP
        elif len(seq.output_token_ids) >= seq.max_tokens:
            seq.finish_reason = FinishReason.LENGTH
        return seq.finish_reason is not None

    def check(self) -> None:
        """Invariants after a step: the block manager's (seed M9), the device agreeing
        with the scheduler about every live row, and the host swap pool's accounting."""
        sched = self.scheduler
        self.runner.check({s.slot: s.num_computed for s in sched.running})
        device_free = self.runner.num_free_blocks()
        if sched.num_free != device_free:
            raise AssertionError(f"scheduler counts {sched.num_free} free blocks, the device {device_free}")
        if sched.swap_pool is not None:
            sched.swap_pool.check([s.host_blocks for s in sched.swapped])
