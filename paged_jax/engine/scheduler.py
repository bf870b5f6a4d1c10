"""The scheduler: who runs this step, with how many tokens, and who must make room.

Host side only: it holds the queues and decides; every device action goes through the
``ModelRunner`` (which calls the jitted block-manager ops), every admission decision
through the cache accounting (paged or static, ``accounting.py``). Checks come paired
with actions: ``_can_swap_in`` / ``_swap_in``, ``can_admit`` / ``_admit``,
``_fits`` / ``_preempt``.

One step (``schedule``), under a token budget of ``max_num_batched_tokens``:

1. Running sequences: every decoding one (one pending token) gets 1 token; then those
   in the middle of a chunked prefill get the next chunk, in admission order, while
   the budget lasts. Before anything runs, the blocks all these appends need
   (``blocks_needed``: new blocks plus copy-on-write targets) must fit in the free pool;
   while they do not, the victim policy picks a running sequence to preempt and the
   plan is redone without it.
2. If nothing was preempted this step: swapped sequences come back (oldest first) while
   their blocks plus one more token fit above the watermark.
3. If nothing was preempted and nothing is still swapped out: waiting requests are
   admitted (FIFO; recompute-preempted ones sit at the front) while a table row is free,
   the budget lasts, and the accounting admits them. Their first chunk runs this step.

Preemption (seed M5), ``preemption_mode``:

- ``"recompute"``: release the victim's blocks; it goes to the front of the waiting
  queue with nothing computed, and is later prefilled again from prompt + output so far.
- ``"swap"``: copy its blocks to the host swap pool, release the device blocks; it
  comes back through step 2 into fresh device blocks. When the host pool cannot take
  it, the victim is recomputed instead (counted as a swap fallback).
"""

from __future__ import annotations

import collections
import dataclasses

from paged_jax.engine.accounting import blocks_for
from paged_jax.engine.runner import ModelRunner
from paged_jax.engine.sequence import SeqStatus, Sequence
from paged_jax.engine.swap import HostSwapPool
from paged_jax.engine.victim import VictimPolicy, get_victim_policy

PREEMPTION_MODES = ("recompute", "swap")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    preemption_mode: str = "recompute"
    victim_policy: VictimPolicy | str = "most_recently_admitted"
    admission_lookahead: int = 0  # steps of running sequences' growth kept free at admission

    def __post_init__(self):
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode={self.preemption_mode!r}: unknown; choose one of {list(PREEMPTION_MODES)}"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_num_seqs={self.max_num_seqs} (every running sequence decodes each step)"
            )
        if not isinstance(self.admission_lookahead, int) or self.admission_lookahead < 0:
            raise ValueError(f"admission_lookahead={self.admission_lookahead!r}: must be an int >= 0")
        object.__setattr__(self, "victim_policy", get_victim_policy(self.victim_policy))


@dataclasses.dataclass
class StepPlan:
    """What one step runs: ``(sequence, tokens to feed)`` pairs, each sequence once."""

    work: list[tuple[Sequence, int]]

    @property
    def decode(self) -> list[Sequence]:
        """Single-token appends: they go through the decode step."""
        return [s for s, n in self.work if n == 1]

    @property
    def prefill(self) -> list[tuple[Sequence, int]]:
        """Multi-token chunks: they go through the prefill step."""
        return [(s, n) for s, n in self.work if n > 1]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.work)


@dataclasses.dataclass
class SchedulerCounters:
    preemptions: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # by mode
    swap_outs: int = 0
    swap_ins: int = 0
    swap_fallbacks: int = 0  # swap wanted, host pool full: recomputed instead
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0


class Scheduler:
    """Queues and decisions. ``accounting`` is a ``PagedAccounting`` or ``StaticAccounting``."""

    def __init__(self, config: SchedulerConfig, runner: ModelRunner, accounting, swap_pool: HostSwapPool | None):
        self.config = config
        self.runner = runner
        self.accounting = accounting
        self.swap_pool = swap_pool
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # admission order
        self.swapped: collections.deque[Sequence] = collections.deque()
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))  # stack, row 0 first
        self._clock = 0  # admissions so far: the victim policy's notion of "recent"
        self.counters = SchedulerCounters()
        # Host mirror of the pool's free count. The engine never shares a block (one
        # completion per request, no prefix cache), so every running sequence holds
        # exactly ceil(num_computed / block_size) blocks of its own, and the scheduler
        # can count on the host instead of syncing the device before each step. The
        # engine resets it from the device after every step (the count comes back with
        # the sampled tokens) and, with debug checks, compares it with the device.
        self.num_free = runner.num_free_blocks()
        self.debug = False  # cross-check host block arithmetic against the device

    # ------------------------------------------------------------------ queues

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> StepPlan:
        """Decide this step's work, doing the preemptions, swap-ins and admissions it needs."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        preempted = False
        while True:
            work = self._plan_running(budget)
            need = self._blocks_needed(work)
            if need <= self.num_free:
                break
            self._preempt(self._pick_victim())
            preempted = True
        free = self.num_free - need
        budget -= sum(n for _, n in work)
        # Kept free for the running sequences' growth over the next steps (paged only:
        # static reservations already cover growth).
        reserve = self._growth_reserve(work) if self.accounting.may_preempt else 0

        if not preempted:
            while self.swapped and budget >= 1 and len(self.running) < cfg.max_num_seqs:
                seq = self.swapped[0]
                n = min(seq.num_pending, budget)  # 1 unless swapped mid-prefill
                if not self._can_swap_in(seq, n, free - reserve):
                    break
                self.swapped.popleft()
                self._swap_in(seq)
                work.append((seq, n))
                free -= blocks_for(seq.num_tokens, cfg.block_size)
                budget -= n

        if not preempted and not self.swapped:
            while self.waiting and budget >= 1 and len(self.running) < cfg.max_num_seqs:
                seq = self.waiting[0]
                if not self.accounting.can_admit(seq.num_tokens, free - reserve, bool(self.running)):
                    break
                self.waiting.popleft()
                self._admit(seq)
                n = min(seq.num_pending, budget)
                work.append((seq, n))
                # Charge the whole prompt now: its later chunks must not be promised away.
                free -= blocks_for(seq.num_tokens, cfg.block_size)
                budget -= n
        return StepPlan(work)

    def _blocks_needed(self, work: list[tuple[Sequence, int]]) -> int:
        """New blocks the appends of ``work`` take (host arithmetic: nothing is shared,
        so there are no copy-on-write targets). Checked against the block manager's own
        ``blocks_needed`` when ``debug`` is on."""
        bs = self.config.block_size
        need = [blocks_for(s.num_computed + n, bs) - blocks_for(s.num_computed, bs) for s, n in work]
        if self.debug:
            device, free = self.runner.blocks_needed([s.slot for s, _ in work], [n for _, n in work])
            assert device.tolist() == need and free == self.num_free, (device.tolist(), need, free, self.num_free)
        return sum(need)

    def _growth_reserve(self, work: list[tuple[Sequence, int]]) -> int:
        """Blocks the running sequences will take over the next ``admission_lookahead``
        steps beyond this one's appends: the rest of a chunked prompt, plus one token per
        step, capped at each request's ``max_tokens`` (a bound the request states, not an
        oracle: generation may stop earlier). Admitting only above it avoids admitting a
        request that the next few steps' growth would preempt again (recompute churn)."""
        k = self.config.admission_lookahead
        if not k:
            return 0
        bs = self.config.block_size
        after = {id(s): s.num_computed + n for s, n in work}
        total = 0
        for s in self.running:
            held = after.get(id(s), s.num_computed)
            final = len(s.prompt_token_ids) + s.max_tokens
            total += blocks_for(min(s.num_tokens + k, final), bs) - blocks_for(held, bs)
        return total

    def _plan_running(self, budget: int) -> list[tuple[Sequence, int]]:
        """Decodes first (1 token each), then prefill chunks in admission order."""
        work = [(s, 1) for s in self.running if s.num_pending == 1]
        budget -= len(work)
        for s in self.running:
            if s.num_pending > 1 and budget > 0:
                n = min(s.num_pending, budget)
                work.append((s, n))
                budget -= n
        return work

    # ------------------------------------------------------------------ after the step

    def finish(self, seqs: list[Sequence]) -> None:
        """Free what finished sequences hold (their rows and blocks, last partial one included)."""
        if not seqs:
            return
        self.runner.release([s.slot for s in seqs])
        for s in seqs:
            self.num_free += blocks_for(s.num_computed, self.config.block_size)
            self.running.remove(s)
            self._return_slot(s)
            s.status = SeqStatus.FINISHED

    # ------------------------------------------------------------------ admission

    def _admit(self, seq: Sequence) -> None:
        seq.slot = self._free_slots.pop()
        self.runner.open([seq.slot])
        self.accounting.on_admit(seq)
        self._clock += 1
        seq.admitted_at = self._clock
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def _return_slot(self, seq: Sequence) -> None:
        self.accounting.on_release(seq)
        self._free_slots.append(seq.slot)
        seq.slot = None

    # ------------------------------------------------------------------ preemption

    def _pick_victim(self) -> Sequence:
        if not self.accounting.may_preempt:
            raise AssertionError("static reservations ran out of blocks: accounting bug")
        infos = [s.info(blocks_for(s.num_computed, self.config.block_size)) for s in self.running]
        return self.running[self.config.victim_policy(infos)]

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.num_preemptions += 1
        if self.config.preemption_mode == "swap":
            num_blocks = blocks_for(seq.num_computed, self.config.block_size)
            if num_blocks and self.swap_pool is not None and self.swap_pool.can_store(num_blocks):
                self._swap_out(seq, num_blocks)
                return
            self.counters.swap_fallbacks += 1
        self.runner.release([seq.slot])
        self.num_free += blocks_for(seq.num_computed, self.config.block_size)
        self._return_slot(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        # appendleft: victims are taken newest first, so older ones end up in front.
        self.waiting.appendleft(seq)
        self.counters.preemptions["recompute"] += 1

    # ------------------------------------------------------------------ swap

    def _swap_out(self, seq: Sequence, num_blocks: int) -> None:
        data = self.runner.swap_out(seq.slot, num_blocks)
        seq.host_blocks = self.swap_pool.store(data)
        self.runner.release([seq.slot])
        self.num_free += num_blocks
        self._return_slot(seq)
        seq.status = SeqStatus.SWAPPED
        self.swapped.appendleft(seq)
        self.counters.preemptions["swap"] += 1
        self.counters.swap_outs += 1
        self.counters.blocks_swapped_out += num_blocks

    def _can_swap_in(self, seq: Sequence, num_new: int, free: int) -> bool:
        # Its blocks plus room for the tokens it runs right after.
        return self.accounting.can_admit(seq.num_computed + num_new, free, bool(self.running))

    def _swap_in(self, seq: Sequence) -> None:
        slot = self._free_slots.pop()
        self.runner.swap_in(slot, seq.num_computed, self.swap_pool.load(seq.host_blocks))
        self.num_free -= len(seq.host_blocks)
        self.swap_pool.free(seq.host_blocks)
        self.counters.swap_ins += 1
        self.counters.blocks_swapped_in += len(seq.host_blocks)
        seq.host_blocks = None
        seq.slot = slot
        self.accounting.on_admit(seq)
        self._clock += 1
        seq.admitted_at = self._clock
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
