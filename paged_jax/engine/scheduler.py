"""The scheduler: who runs this step, with how many tokens, and who must make room.

Host side only: it holds the queues of requests (``SequenceGroup``s) and decides; it
plans every device action into a ``SchedulerOutput`` (``interface.py``) that the
``ModelRunner`` executes. It talks to one ``KVCacheManager`` and to nothing else: it counts
blocks on the manager's host model of the block manager (equal to the device's after every
step; its what-ifs are the ops themselves on a copy: the releases, forks, beam selections
and restores the plan makes), so counting is exact when completions share blocks, and no
decision syncs the device; prefix-cache hits and the swap pool's room come from the same
manager. Every admission decision goes through the cache accounting (paged or static,
``accounting.py``); the order waiting requests are offered the pool is the admission
policy's (``admission.py``).

One step (``schedule``), under a token budget of ``max_num_batched_tokens``:

1. Rows of sequences that finished last step are released.
2. Running requests: members get their rows (a beam step's ``select_parents``; forks
   from the leader once it holds the shared prefix, see ``sequence.py``); every decoding
   sequence (one pending token) gets 1 token; then those in the middle of a chunked
   prefill get the next chunk, in admission order, while the budget lasts. The blocks
   all these appends need (``HostBlockManager.blocks_needed``: new blocks plus copy-on-write
   targets) must fit in the free pool; while they do not, the victim policy picks a
   running request to preempt (the whole group) and the plan is redone without it.
3. If nothing was preempted this step: swapped requests come back (oldest first) while
   their blocks plus their next appends fit above the watermark.
4. If nothing was preempted and nothing is still swapped out: waiting requests are
   admitted in the admission policy's order (FCFS by default; recompute-preempted ones
   sit at the front of the queue) while table rows are free, the budget lasts, and the
   accounting admits them (the first that does not fit blocks those behind it). Their first chunk runs this step.
   With prefix caching the leader starts on its cached blocks (``prefix_cache.py``) and
   is charged only for blocks no row holds yet.
5. Speculative decoding (``engine/speculative.py``): a decoding sequence of a sampling request
   may feed its pending token plus ``m <= k`` proposals (n-gram proposals made here from
   its tokens; a draft model's on the device), ``m`` capped by its remaining
   ``max_tokens`` and the budget. Their blocks are counted like any append; when they
   do not fit, the step is planned again without proposals before anyone is preempted,
   so speculation never costs a preemption. The verification rolls back what it rejects.
   Rows whose sampling verification does not reproduce (penalties, logit bias, min-p, min_tokens
   not yet reached, logprobs, missing prompt logprobs: ``_speculates``) get no proposals.
6. Prefix caching: "free" means the pool plus the cached-free blocks
   (``HostBlockManager.num_available``); when the step's allocations exceed the pool, that many
   cached-free blocks are evicted, in the eviction policy's order, at the end of the
   step's housekeeping. A request whose prompt logprobs are incomplete is not looked
   up (a hit would compute no logits for its positions; vLLM skips the cache likewise);
   once they are complete (e.g. after a recompute preemption) it may hit again.

The output names, per running row, the sequence and how many tokens it feeds
(``ScheduledRow``); how it samples is the runner's business (``inputs.py``).

Preemption, ``preemption_mode``:

- ``"recompute"``: release the victim's rows; it goes to the front of the waiting queue
  with nothing computed, and is later prefilled again from prompt + output so far (its
  members forked from a leader again, sharing the prompt).
- ``"swap"``: copy its blocks to the host swap pool (a block its members share goes
  once), release the device rows; it comes back through step 3 into fresh device blocks
  with the same sharing. When the host pool cannot take it, it is recomputed instead
  (counted as a swap fallback).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from paged_jax.cache import NO_BLOCK, HostBlockManager
from paged_jax.config import blocks_for
from paged_jax.engine.admission import WaitingInfo, fcfs
from paged_jax.engine.config import SchedulerConfig
from paged_jax.engine.interface import ScheduledRow, SchedulerOutput, SwapIn
from paged_jax.engine.sequence import FinishReason, SeqStatus, Sequence, SequenceGroup
from paged_jax.engine.speculative import propose


@dataclasses.dataclass
class SchedulerCounters:
    preemptions: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # by mode
    swap_outs: int = 0
    swap_ins: int = 0
    swap_fallbacks: int = 0  # swap wanted, host pool full: recomputed instead
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0


@dataclasses.dataclass
class _Prep:
    """The running groups' row-making ops of a step, before they are committed."""

    select: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (row, parent row)
    fork: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (parent row, child row)
    unshare: list[int] = dataclasses.field(default_factory=list)  # rows made private (no sharing)
    computed: dict = dataclasses.field(default_factory=dict)  # id(seq) -> num_computed once made
    groups: list[SequenceGroup] = dataclasses.field(default_factory=list)  # with a pending select made


def _padded(rows: list[list[int]], n: int) -> np.ndarray:
    """int32[n, K]: ``rows`` (block ids, or none at all) padded with NO_BLOCK."""
    width = max((len(r) for r in rows), default=0)
    out = np.full((n, width), NO_BLOCK, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def group_blocks(group: SequenceGroup, block_size: int, share_blocks: bool = True) -> int:
    """Blocks a (re)admitted group holds once its members are rebuilt: the leader's full
    blocks of the shared prefix once (unless nothing is shared), each member's other
    blocks privately."""
    members = group.live
    if len(members) == 1:
        return blocks_for(members[0].num_tokens, block_size)
    shared = group.shared_prefix // block_size if share_blocks else 0
    return shared + sum(blocks_for(s.num_tokens, block_size) - shared for s in members)


class Scheduler:
    """Queues and decisions over one ``KVCacheManager`` (``kv``). ``accounting`` is a
    ``PagedAccounting`` or ``StaticAccounting``."""

    def __init__(self, config: SchedulerConfig, kv, accounting, *, swapping: bool):
        self.config = config
        self.kv = kv
        self.prefix_cache = kv.prefix_cache
        self.accounting = accounting
        self.swapping = swapping
        self.waiting: collections.deque[SequenceGroup] = collections.deque()
        self.running: list[SequenceGroup] = []  # admission order
        self.swapped: collections.deque[SequenceGroup] = collections.deque()
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))  # stack, row 0 first
        self._to_release: list[int] = []  # rows of sequences that finished last step
        self._clock = 0  # admissions so far: the victim policy's notion of "recent"
        # This step's speculative rows: id(seq) -> n-gram proposals (a draft model's
        # count as [None] * m: they are made on the device).
        self._proposals: dict[int, list] = {}
        self.counters = SchedulerCounters()

    # ------------------------------------------------------------------ queues

    def add(self, group: SequenceGroup) -> None:
        group.status = SeqStatus.WAITING
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        """Decide this step's work and plan the releases, preemptions, swaps and admissions
        it needs."""
        cfg = self.config
        plan = SchedulerOutput(release=self._to_release)
        self._to_release = []
        base = self.kv.blocks
        if self.prefix_cache is not None:
            plan.mark = self.prefix_cache.take_marks()
            base = base.marked(plan.mark)
            self.prefix_cache.released(base, plan.release)
        base = base.released(plan.release)
        swapped_out: list[SequenceGroup] = []
        budget = cfg.max_num_batched_tokens
        preempted = False
        attempts = (True, False) if cfg.speculative is not None else (False,)
        while True:
            for speculate in attempts:  # with proposals if they fit, else without
                view, prep, work = self._plan_running(base, budget, speculate)
                need = int(view.blocks_needed([s.slot for s, _ in work], [n for _, n in work]).sum())
                if need <= view.num_available:
                    break
            if need <= view.num_available:
                break
            base = self._preempt(self._pick_victim(base), plan, base, swapped_out)
            preempted = True
        self._commit(prep, plan)
        free = view.num_available - need
        allocations = need  # blocks this step's swap-ins and appends take from the pool
        budget -= sum(n for _, n in work)
        # Kept free for the running sequences' growth over the next steps (paged only:
        # static reservations already cover growth).
        reserve = self._growth_reserve(work) if self.accounting.may_preempt else 0

        if not preempted:
            while self.swapped and budget >= len(self.swapped[0].live) and self._rows_for(self.swapped[0]):
                group = self.swapped[0]
                slots = self._free_slots[-len(group.live):][::-1]
                rows = [slot for seq, slot in zip(group.live, slots, strict=True) if seq.row_live]
                returning = view.restored(rows, group.swapped.lens, group.swapped.local_tables,
                                          len(group.swapped.host_ids))
                # A beam step chosen before the swap-out is made next step, before any feed.
                items = [] if group.pending_select is not None else [
                    (s, min(s.num_pending, max(budget // len(slots), 1)))
                    for s, slot in zip(group.live, slots, strict=True) if s.row_live and s.num_pending
                ]
                item_slots = [slots[group.live.index(s)] for s, _ in items]
                grow = int(returning.blocks_needed(item_slots, [n for _, n in items]).sum())
                held = len(group.swapped.host_ids)
                if not self.accounting.can_admit(held + grow, free - reserve, bool(self.running), len(slots)):
                    break
                self.swapped.popleft()
                self._swap_in(group, slots, plan)
                view = returning
                work += items
                free -= held + grow
                allocations += grow
                budget -= sum(n for _, n in items)

        if not preempted and not self.swapped:
            cache = self.prefix_cache
            if cache is not None:
                cache.begin_step()
            for group in self._admission_order():
                if budget < 1 or not self._rows_for(group):
                    break
                blocks = group_blocks(group, cfg.block_size, cfg.share_blocks)
                # A prompt-logprobs request computes its whole prompt (a hit computes no
                # logits), as vLLM does, until its prompt logprobs are complete.
                lookup = cache is not None and not group.needs_prompt_logprobs
                hits = cache.lookup(group, group.live[0]) if lookup else []
                if lookup and cache.should_wait(group, group.live[0], hits):
                    break
                # A hit on a block some row holds costs nothing; one on a cached-free
                # block takes it out of the free count like a new block.
                charge = blocks - int(np.isin(hits, view.named_blocks()).sum()) if hits else blocks
                if not self.accounting.can_admit(charge, free - reserve, bool(self.running), len(group.live)):
                    break
                self.waiting.remove(group)
                if cache is not None:
                    cache.use(hits, group.live[0].num_tokens)
                opened = len(plan.open)
                admitted = self._admit(group, plan, budget, hits)
                if cache is not None:  # the view must know every hit and this step's allocations
                    if admitted:
                        cache.will_compute(group, admitted[0][0], hits, admitted[0][0].num_computed + admitted[0][1])
                    view = view.opened(plan.open[opened:], _padded(plan.prefix[opened:], len(plan.open) - opened))
                    allocations += int(view.blocks_needed([s.slot for s, _ in admitted],
                                                          [n for _, n in admitted]).sum())
                for seq, n in admitted:
                    work.append((seq, n))
                    budget -= n
                # Charge the whole request now: its later chunks must not be promised away.
                free -= charge
        if self.prefix_cache is not None:
            plan.evict = self.prefix_cache.evict(view, allocations - view.num_free)
        plan.rows = [ScheduledRow(s, n, self._proposals.get(id(s))) for s, n in work]
        plan.swapped_out = swapped_out
        return plan

    def _admission_order(self) -> list[SequenceGroup]:
        """The waiting queue in the admission policy's order (stable: ties keep queue order)."""
        queue = list(self.waiting)
        key = self.config.admission_policy
        if key is fcfs or len(queue) < 2:
            return queue
        infos = [WaitingInfo(g.request_id, i, g.priority, len(g.prompt_token_ids), g.num_tokens, g.num_preemptions,
                             len(g.live)) for i, g in enumerate(queue)]
        return [queue[i] for i in sorted(range(len(queue)), key=lambda i: key(infos[i]))]

    def _rows_for(self, group: SequenceGroup) -> bool:
        return len(self._free_slots) >= len(group.live)

    @staticmethod
    def _speculates(seq: Sequence) -> bool:
        """Whether the row may speculate: verification applies only temperature, top-k and
        top-p, so rows with penalties, a logit bias, min-p, an active min_tokens, logprobs or
        missing prompt logprobs decode one token at a time."""
        p = seq.params
        return not (p.uses_penalties or p.logit_bias or p.min_p > 0 or len(seq.output_token_ids) < p.min_tokens
                    or p.logprobs is not None or seq.group.needs_prompt_logprobs)

    def _propose(self, seq: Sequence, budget: int) -> list:
        """This round's proposals for a decoding ``seq`` (at most ``budget``; none for a
        beam member, a sequence one token from its end, or one whose sampling options
        verification does not apply, ``_speculates``)."""
        spec = self.config.speculative
        if seq.group.beam is not None or not seq.output_token_ids or not self._speculates(seq):
            return []
        m = min(spec.num_speculative_tokens, seq.max_tokens - len(seq.output_token_ids) - 1, budget)
        if m <= 0:
            return []
        return propose(spec, seq.token_ids(), m)

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
        for group in self.running:
            for s in group.live:
                held = after.get(id(s), s.num_computed)
                final = len(s.prompt_token_ids) + s.max_tokens
                total += blocks_for(min(s.num_tokens + k, final), bs) - blocks_for(held, bs)
        return total

    def _plan_running(self, view: HostBlockManager, budget: int, speculate: bool = False
                      ) -> tuple[HostBlockManager, _Prep, list[tuple[Sequence, int]]]:
        """The running groups' row-making ops and work, without committing anything:
        decodes first (1 token each), then their proposals (``speculate``), then prefill
        chunks in admission order. Returns the view after the ops."""
        prep = _Prep()
        pending = []  # (seq, tokens it may feed now) in admission order
        for group in self.running:
            members = group.live
            if group.pending_select is not None:
                prep.select += [(s.slot, members[i].slot) for s, i in zip(members, group.pending_select, strict=True)]
                prep.groups.append(group)
                for s, i in zip(members, group.pending_select, strict=True):
                    prep.computed[id(s)] = members[i].num_computed
            unborn = [s for s in members if not s.row_live and group.pending_select is None]
            leader = next((s for s in members if s.row_live), None)
            if unborn and group.forks_members() and leader is not None and leader.num_computed == group.shared_prefix:
                prep.fork += [(leader.slot, s.slot) for s in unborn]
                for s in unborn:
                    prep.computed[id(s)] = leader.num_computed
                unborn = []
            for s in members:
                if not (s.row_live or id(s) in prep.computed):
                    continue
                todo = s.num_tokens - prep.computed.get(id(s), s.num_computed)
                if s is leader and unborn and group.forks_members():
                    todo = min(todo, group.shared_prefix - s.num_computed)  # stop at the fork point
                if todo > 0:
                    pending.append((s, todo))
        # Groups touch disjoint rows: one transition each for all selects and all forks,
        # in the runner's order (select, then fork, then unshare).
        if prep.select:
            view = view.selected(*zip(*prep.select, strict=True))
        if prep.fork:
            parents, children = zip(*prep.fork, strict=True)
            view = view.forked(parents, children)
        if not self.config.share_blocks:
            prep.unshare = [r for r, _ in prep.select] + [c for _, c in prep.fork]
            if prep.unshare:
                view = view.unshared(prep.unshare)
        work = [(s, 1) for s, todo in pending if todo == 1]
        budget -= len(work)
        self._proposals = {}
        if speculate:
            for i, (s, _) in enumerate(work):
                if proposals := self._propose(s, budget):
                    self._proposals[id(s)] = proposals
                    work[i] = (s, 1 + len(proposals))
                    budget -= len(proposals)
        for s, todo in pending:
            if todo > 1 and budget > 0:
                n = min(todo, budget)
                work.append((s, n))
                budget -= n
        return view, prep, work

    def _commit(self, prep: _Prep, plan: SchedulerOutput) -> None:
        """Make the planned row-making ops real: in the plan, and on the members."""
        plan.select, plan.fork, plan.unshare = prep.select, prep.fork, prep.unshare
        for group in self.running:
            for s in group.live:
                if id(s) in prep.computed:
                    s.num_computed = prep.computed[id(s)]
                    s.row_live = True
        for group in prep.groups:
            group.pending_select = None

    # ------------------------------------------------------------------ after the step

    def finish(self, seqs: list[Sequence], groups: list[SequenceGroup] = ()) -> None:
        """Sequences that finished this step, and beam searches that ended (all their
        members): their rows are released at the start of the next step (or by
        ``LLMEngine.flush``); a group whose members are all done leaves."""
        ended = list(seqs) + [s for g in groups for s in g.live]
        for s in ended:
            if s.row_live:
                self._to_release.append(s.slot)
            self._free_slots.append(s.slot)
            s.slot, s.row_live = None, False
            self.accounting.on_release(1)
        for group in {id(s.group): s.group for s in ended}.values():
            if group.finished:
                self.running.remove(group)
                group.status = SeqStatus.FINISHED

    @property
    def pending_rows(self) -> list[int]:
        """Rows of sequences finished last step, not yet released."""
        return list(self._to_release)

    def pending_release(self) -> SchedulerOutput | None:
        """A plan that only releases the rows finished in the last step, after marking the
        blocks it filled cached (None if there is neither)."""
        marks = [] if self.prefix_cache is None else self.prefix_cache.take_marks()
        if not (self._to_release or marks):
            return None
        if self.prefix_cache is not None:
            self.prefix_cache.released(self.kv.blocks, self._to_release)
        plan = SchedulerOutput(release=self._to_release, mark=marks)
        self._to_release = []
        return plan

    def swapped_out(self, groups: list[SequenceGroup], blocks) -> None:
        """The runner copied ``groups``' blocks to the host: remember where."""
        for group, b in zip(groups, blocks, strict=True):
            group.swapped = b

    # ------------------------------------------------------------------ admission

    def _admit(self, group: SequenceGroup, plan: SchedulerOutput, budget: int, hits: list[int] = ()) -> list[tuple[Sequence, int]]:
        """Reserve a row per member and open the leader's (every member's, when there is no
        shared prefix to wait for), the leader's on the cached blocks ``hits``; returns
        the leader's first chunk."""
        members = group.live
        for seq in members:
            seq.slot = self._free_slots.pop()
        opened = members if (group.forks_members() and group.shared_prefix == 0) else members[:1]
        for i, seq in enumerate(opened):
            plan.open.append(seq.slot)
            if self.prefix_cache is not None:
                plan.prefix.append(list(hits) if i == 0 else [])
            seq.row_live = True
        opened[0].num_computed = len(hits) * self.config.block_size
        self._start(group)
        work = []
        for seq in opened:
            todo = seq.num_pending
            if len(opened) < len(members) and group.forks_members():
                todo = min(todo, group.shared_prefix - seq.num_computed)
            n = min(todo, budget)
            if n >= 1:
                work.append((seq, n))
                budget -= n
        return work

    def _start(self, group: SequenceGroup) -> None:
        self.accounting.on_admit(len(group.live))
        self._clock += 1
        group.admitted_at = self._clock
        group.status = SeqStatus.RUNNING
        self.running.append(group)

    # ------------------------------------------------------------------ preemption

    def _pick_victim(self, view: HostBlockManager) -> SequenceGroup:
        if not self.accounting.may_preempt:
            raise AssertionError("static reservations ran out of blocks: accounting bug")
        infos = [g.info(view.blocks_held([s.slot for s in g.live if s.row_live])) for g in self.running]
        return self.running[self.config.victim_policy(infos)]

    def _preempt(self, group: SequenceGroup, plan: SchedulerOutput, view: HostBlockManager,
                 swapped_out: list) -> HostBlockManager:
        """Plan the victim's preemption; returns the view without its rows."""
        self.running.remove(group)
        group.num_preemptions += 1
        members = group.live
        rows = [s.slot for s in members if s.row_live]
        self.accounting.on_release(len(members))
        if self.prefix_cache is not None:
            self.prefix_cache.released(view, rows)
        if self.config.preemption_mode == "swap":
            blocks = view.blocks_held(rows)
            planned = sum(view.blocks_held(r) for r in plan.swap_out)
            if blocks and self.swapping and self.kv.swap_pool.can_store(planned + blocks):
                for s in members:
                    self._free_slots.append(s.slot)
                    s.slot = None
                plan.swap_out.append(rows)
                swapped_out.append(group)
                group.status = SeqStatus.SWAPPED
                self.swapped.appendleft(group)
                self.counters.preemptions["swap"] += 1
                self.counters.swap_outs += 1
                self.counters.blocks_swapped_out += blocks
                return view.released(rows)
            self.counters.swap_fallbacks += 1
        plan.release += rows
        for s in members:
            self._free_slots.append(s.slot)
            s.slot, s.row_live, s.num_computed, s.candidates = None, False, 0, None
        group.pending_select = None  # the members' histories already hold the beam step
        group.status = SeqStatus.WAITING
        # appendleft: victims are taken newest first, so older ones end up in front.
        self.waiting.appendleft(group)
        self.counters.preemptions["recompute"] += 1
        return view.released(rows)

    # ------------------------------------------------------------------ swap

    def _swap_in(self, group: SequenceGroup, slots: list[int], plan: SchedulerOutput) -> None:
        rows = []
        for seq, slot in zip(group.live, slots, strict=True):
            self._free_slots.remove(slot)
            seq.slot = slot
            if seq.row_live:
                rows.append(slot)
        plan.swap_in.append(SwapIn(rows, group.swapped))
        self.counters.swap_ins += 1
        self.counters.blocks_swapped_in += len(group.swapped.host_ids)
        group.swapped = None
        self._start(group)

    # ------------------------------------------------------------------ abort

    def abort(self, group: SequenceGroup) -> None:
        """End an unfinished request between steps (``LLM.abort``): its unfinished members
        finish with reason "abort", keeping their tokens. A running group's rows are
        released at the next step like finished ones (or by ``LLMEngine.flush``); a
        swapped group's host blocks go back to the swap pool; a waiting one leaves its
        queue (it holds nothing)."""
        holding = [s for s in group.seqs if s.slot is not None]
        for s in group.seqs:
            if s.finish_reason is None:
                s.finish_reason = FinishReason.ABORT
        if group in self.waiting:
            self.waiting.remove(group)
        elif group in self.swapped:
            self.swapped.remove(group)
            if group.swapped is not None:
                self.kv.swap_pool.free(list(group.swapped.host_ids))
                group.swapped = None
        elif group in self.running:
            self.finish(holding)
            if group in self.running:
                self.running.remove(group)
        group.pending_select = None
        group.status = SeqStatus.FINISHED
