"""The model runner: the only part of the engine that touches the device.

It owns the device state (the block manager's ``CacheState``, the KV pages, the model
parameters) and executes one ``StepPlan`` per engine step with ``run``:

1. copy the blocks of requests being swapped out (a gather, on the device);
2. one housekeeping program: mark blocks cached (prefix caching), release rows (finished
   last step, preempted now), rebuild beam rows, open the rows of admitted requests
   (on cached blocks, for a prefix-cache hit), fork children from their parents, evict
   cached-free blocks the step's allocations need;
3. swap-ins: rebuild the rows of returning requests in fresh blocks (shared blocks
   shared again, ``cache.restore_rows``) and write their data back;
4. the model steps: one decode call for every single-token append, one verification
   call for the rows that speculate (``engine/speculative.py``: proposals fed, accepted
   ones kept, the rest rolled back by ``truncate`` in the same program), prefill calls
   for the chunks (``buckets.plan_prefill``), each fused with the sampler; chunks that
   want prompt logprobs (``Work.prompt_targets``) go to prefill calls of their own that
   keep the logits at every position (f32[rows, width, V]: only those rows pay for it);
5. a snapshot of the block manager (``cache.snapshot``);

and then brings everything the host needs back in **one** device fetch: sampled tokens,
their log-probabilities, every op's status, the swapped-out data and the snapshot, from
which it rebuilds ``view`` (a ``cache.HostView``). The scheduler plans the next step
against ``view`` on the host, so no decision waits for the device.

Every batch is padded to a bucket (``paged_jax.buckets``) so the number of compiled
programs stays bounded; the housekeeping program has one fixed shape. ``traces`` counts
the model-step traces (compiles) this runner's calls caused; the jitted functions are
shared process-wide, so a second engine with the same shapes compiles nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import buckets
from paged_jax.backend import ModelBackend
from paged_jax.cache import (
    NO_BLOCK,
    HostView,
    check_invariants,
    evict_cached,
    fork,
    init_state,
    mark_cached,
    open_sequences,
    raise_for_status,
    release,
    restore_rows,
    select_parents,
    snapshot,
    truncate,
    unshare,
)
from paged_jax.cache.sentinels import NO_SEQ
from paged_jax.engine import speculative
from paged_jax.engine.config import EngineConfig
from paged_jax.engine.sampling import History, empty_history, sample, token_logprobs, top_logprobs
from paged_jax.engine.swap import HostSwapPool, SwappedBlocks
from paged_jax.kv.pages import block_axis, bytes_per_block, copy_blocks, read_blocks, write_blocks

# The token a row gets when its logits hold a NaN (NaN weights, an overflow): the engine
# ends that request with finish reason "error" instead of emitting argmax-of-NaN forever.
NAN_TOKEN = -1
MIN_TOP = 16  # narrowest top-K call (see _call)
MIN_HISTORY = 64  # narrowest penalty/min-tokens history (sampling.History): most batches fit it


class SampleRow(NamedTuple):
    """How one row samples (host values; ``ModelRunner._sampling`` stacks them).

    ``history`` is the row's ``sampling.History`` entries as ``(ids, counts, flags)``
    int arrays of one length (the distinct tokens its penalties and min-tokens ban
    touch), or None when it uses neither. ``num_logprobs`` >= 0 asks for the sampled
    token's rank (and, with ``Work.top``, the top tokens); -1: none.
    """

    temperature: float
    top_k: int
    top_p: float
    seed: int
    step: int  # index of the token being sampled in the completion's output
    min_p: float = 0.0
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    history: tuple | None = None
    num_logprobs: int = -1


_PAD_SAMPLE = SampleRow(0.0, -1, 1.0, 0, 0)


class SamplingBatch(NamedTuple):
    """The per-row sampling inputs of one fused call (device side, rows padded to B).

    temperature f32[B], top_k int32[B], top_p f32[B], min_p f32[B], seeds uint32[B],
    steps int32[B], top_temperature f32[B] (the top-K's distribution: 0 = raw), history
    ``sampling.History`` of width K (a power of two >= ``MIN_HISTORY``).
    """

    temperature: Any
    top_k: Any
    top_p: Any
    min_p: Any
    seeds: Any
    steps: Any
    top_temperature: Any
    history: History


class Work(NamedTuple):
    """One row's part of a step: feed ``tokens`` (its next pending ones) to row ``slot``.

    ``top`` > 0 also asks for the ``top`` most likely next tokens and their
    log-probabilities, of ``log_softmax(logits / top_temperature)`` (0: the model's own).

    ``spec`` > 0 makes it a speculative round of ``spec`` proposals: ``tokens`` is the
    pending token followed by the n-gram proposals, or the pending token alone when the
    backend's draft model proposes on the device.

    ``prompt_targets`` (prompt logprobs): aligned with ``tokens``, the prompt token each
    fed position predicts (-1 where none is wanted); the row then runs in a call that
    keeps the logits at every position, and ``StepResult.prompt_logprobs`` brings back
    their raw log-probabilities, ranks and the top ``prompt_top``.
    """

    slot: int
    tokens: list[int]
    sample: SampleRow
    top: int = 0
    top_temperature: float = 0.0
    spec: int = 0
    prompt_targets: tuple[int, ...] | None = None
    prompt_top: int = 0


class SwapIn(NamedTuple):
    """A request coming back from the host pool into the rows ``slots`` (one per member)."""

    slots: list[int]
    blocks: SwappedBlocks


@dataclasses.dataclass
class StepPlan:
    """What the runner does in one step, in this order (see the module docstring).

    ``mark`` blocks become cached (prefix caching); ``swap_out`` rows are copied to the
    host and released; ``release`` rows are released; ``select`` rebuilds rows from
    parent rows (``select_parents``: beam search); ``open`` rows become live, empty or,
    where ``prefix`` (aligned with ``open``, or empty) names blocks, starting on those
    cached blocks; ``fork`` makes each child a copy of its parent; ``evict`` cached-free
    blocks return to the pool; ``unshare`` rows get private copies of the blocks they
    share (the no-sharing baseline); ``swap_in`` rebuilds requests from the host pool;
    ``work`` runs the model.
    """

    work: list[Work] = dataclasses.field(default_factory=list)
    release: list[int] = dataclasses.field(default_factory=list)
    swap_out: list[list[int]] = dataclasses.field(default_factory=list)  # member rows per request
    select: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (row, parent row)
    open: list[int] = dataclasses.field(default_factory=list)
    fork: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (parent, child) rows
    unshare: list[int] = dataclasses.field(default_factory=list)  # rows, after select and fork
    swap_in: list[SwapIn] = dataclasses.field(default_factory=list)
    mark: list[int] = dataclasses.field(default_factory=list)  # blocks to mark cached, first
    prefix: list[list[int]] = dataclasses.field(default_factory=list)  # per open row: cached blocks
    evict: list[int] = dataclasses.field(default_factory=list)  # cached-free blocks, after fork

    @property
    def empty(self) -> bool:
        return not (self.work or self.release or self.swap_out or self.select or self.open or self.fork
                    or self.unshare or self.swap_in or self.mark or self.evict)


class StepResult(NamedTuple):
    """What comes back from ``run``, host side (aligned with the plan's lists)."""

    tokens: np.ndarray  # int32[len(work)]: sampled at each row's last fed token
    logprobs: np.ndarray  # f32[len(work)]: its log-probability under the model
    top_logprobs: np.ndarray  # f32[len(work), max top]: Work.top most likely, best first
    top_ids: np.ndarray  # int32[len(work), max top]
    swapped: list[SwappedBlocks]  # one per plan.swap_out entry
    view: HostView  # the block manager after the step
    accepted: np.ndarray | None = None  # int32[len(work)]: proposals kept (speculative rows)
    spec_tokens: np.ndarray | None = None  # int32[len(work), k + 1]: kept proposals, then the new token
    spec_logprobs: np.ndarray | None = None  # f32[len(work), k + 1]
    proposed: np.ndarray | None = None  # int32[len(work), k]: the proposals (draft or n-gram)
    ranks: np.ndarray | None = None  # int32[len(work)]: the sampled token's raw rank (rows wanting it)
    # work position -> (logprob f32[n], rank int32[n], top_logprobs f32[n, K], top_ids
    # int32[n, K]) at its n fed positions, for rows with Work.prompt_targets.
    prompt_logprobs: dict | None = None


class _StepOut(NamedTuple):
    tokens: Any  # int32[B_pad]
    logprobs: Any  # f32[B_pad]
    status: Any  # int32[B_pad]
    top_logprobs: Any  # f32[B_pad, num_top]
    top_ids: Any  # int32[B_pad, num_top]
    ranks: Any  # int32[B_pad]: the sampled token's raw rank (0 when num_top is 0)
    prompt: Any = None  # prompt-logprobs calls: sampling.token_logprobs at [B_pad, T]


class _VerifyOut(NamedTuple):
    accepted: Any  # int32[B_pad]
    tokens: Any  # int32[B_pad, k + 1]
    logprobs: Any  # f32[B_pad, k + 1]
    status: Any  # int32[B_pad]
    proposals: Any  # int32[B_pad, k]


# Jitted functions are shared by every runner (module-level caches), so engines with the
# same shapes compile once per process; a runner counts only the traces its calls cause.
_TRACES: collections.Counter = collections.Counter()


@functools.cache
def _fused(step: Callable) -> Callable:
    """jit(step, then sample): one program and one dispatch per model call. Its Python
    body runs only when it traces, which ``_TRACES`` counts. State and pages are donated.

    One program per (rows, width, num_top, history width) whatever the rows' sampling
    options: the greedy shortcut and the penalties/min-tokens scatter are ``lax.cond``s
    on the batch's values (``sampling.sample``), skipped at run time when no row needs
    them. ``num_top`` (static) > 0 adds the top-K and the sampled tokens' ranks (beam
    search, logprobs): 0 keeps them out of the common program, whose compile they would
    lengthen. ``prompt_top`` > 0 (static) is the prompt-logprobs variant: the step keeps
    the logits at every fed position, samples at each row's last, and also returns
    ``token_logprobs`` of ``prompt_targets`` int32[B, T] at every position."""

    def traced(params, state, pages, tokens, seq_ids, num_tokens, rows: SamplingBatch, prompt_targets, *,
               num_top, prompt_top):
        _TRACES[fused] += 1
        prompt = None
        if prompt_top:
            every, state, pages, status = step(params, state, pages, tokens, seq_ids, num_tokens, all_logits=True)
            b, t = tokens.shape
            logits = every[jnp.arange(b), jnp.clip(num_tokens.astype(jnp.int32) - 1, 0, t - 1)]
            prompt = token_logprobs(every, prompt_targets, prompt_top)
        else:
            logits, state, pages, status = step(params, state, pages, tokens, seq_ids, num_tokens)
        toks, logprobs = sample(logits, rows.temperature, rows.top_k, rows.top_p, rows.seeds, rows.steps,
                                min_p=rows.min_p, history=rows.history)
        toks = jnp.where(jnp.isnan(logits).any(axis=-1), NAN_TOKEN, toks)
        b = toks.shape[0]
        if num_top:
            raw = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
            own = jnp.take_along_axis(raw, toks[:, None], axis=-1)
            top_lp, top_ids = top_logprobs(logits, rows.top_temperature, num_top)
            ranks = (raw >= own).sum(axis=-1).astype(jnp.int32)
        else:
            top_lp, top_ids = jnp.zeros((b, 0), jnp.float32), jnp.zeros((b, 0), jnp.int32)
            ranks = jnp.zeros((b,), jnp.int32)
        return _StepOut(toks, logprobs, status, top_lp, top_ids, ranks, prompt), state, pages

    fused = jax.jit(traced, donate_argnums=(1, 2), static_argnames=("num_top", "prompt_top"))
    return fused


@functools.cache
def _fused_verify(step: Callable, propose: Callable | None) -> Callable:
    """jit(one speculative round): the target over the proposals (n-gram: given; draft:
    ``propose`` makes them in the same program), the acceptance rule, and ``truncate``
    back to the accepted tokens: one program, state and pages donated. ``greedy_only``
    None (the runner's): whether every row is greedy (no sort, no draws) is decided at
    run time inside the one program; True/False force it (a program of its own)."""

    def traced(params, state, pages, tokens, seq_ids, num_tokens, temperature, top_k, top_p, seeds, steps, *,
               greedy_only=None):
        _TRACES[fused] += 1
        seq_ids = seq_ids.astype(jnp.int32)
        real = seq_ids != NO_SEQ
        start = state.seq_lens[jnp.clip(seq_ids, 0, state.max_seqs - 1)]
        if propose is None:
            logits, state, pages, status = step(params, state, pages, tokens, seq_ids, num_tokens, all_logits=True)
            proposals, draft_probs = tokens[:, 1:], None
        else:
            proposals, draft_probs, logits, state, pages, status = propose(
                params, state, pages, tokens[:, 0], seq_ids, num_tokens, temperature, top_k, top_p, seeds, steps)

        def run(greedy: bool):
            # Greedy acceptance compares argmaxes: no draft distribution needed.
            return speculative.verify(logits, proposals, jnp.maximum(num_tokens - 1, 0),
                                      None if greedy else draft_probs, temperature, top_k, top_p, seeds, steps,
                                      greedy_only=greedy)

        if greedy_only is None:
            out = jax.lax.cond(jnp.all(temperature == 0), lambda: run(True), lambda: run(False))
        else:
            out = run(greedy_only)
        fed = jnp.arange(logits.shape[1])[None, :] < num_tokens[:, None]  # padding positions are not read
        nan = (jnp.isnan(logits).any(axis=2) & fed).any(axis=1)  # void round: keep only the pending token
        out = out._replace(accepted=jnp.where(nan, 0, out.accepted),
                           tokens=jnp.where(nan[:, None], NAN_TOKEN, out.tokens))
        # Keep the pending token and the accepted proposals; the new token is fed next round.
        state, cut = truncate(state, jnp.where(real, seq_ids, NO_SEQ), jnp.where(real, start + 1 + out.accepted, 0))
        status = jnp.where(status == 0, cut, status)
        return _VerifyOut(out.accepted, out.tokens, out.logprobs, status, proposals), state, pages

    fused = jax.jit(traced, donate_argnums=(1, 2), static_argnames=("greedy_only",))
    return fused


def _housekeeping(state, release_ids, select_ids, select_parents_ids, open_ids, fork_parents, fork_children,
                  open_prefix=None):
    """Release, select parents, open (on cached blocks where ``open_prefix`` int32[S, P]
    names them), fork (int32[S] each, NO_SEQ-padded), in that order: one program."""
    state, released = release(state, release_ids)
    state, selected = select_parents(state, select_ids, select_parents_ids)
    state, opened = open_sequences(state, open_ids, open_prefix)
    state, forked = fork(state, fork_parents, fork_children)
    return state, (released, selected, opened, forked)


def _housekeeping_cached(state, mark_ids, release_ids, select_ids, select_parents_ids, open_ids, open_prefix,
                         fork_parents, fork_children, evict_ids):
    """With prefix caching: mark cached, then ``_housekeeping`` (opening rows on cached
    blocks), then evict: one program. Block ids int32[M] padded with NO_BLOCK. Nothing
    in between allocates, so evicting last serves every allocation of the step
    (swap-ins, appends). A program of its own, so that the plain one compiles as cheaply
    as before for engines without the cache."""
    state, marked = mark_cached(state, mark_ids)
    state, (released, selected, opened, forked) = _housekeeping(
        state, release_ids, select_ids, select_parents_ids, open_ids, fork_parents, fork_children, open_prefix)
    state, evicted = evict_cached(state, evict_ids)
    return state, (marked, released, selected, opened, forked, evicted)


def _unshare(state, pages, seq_ids):
    """unshare, then the copies in the KV store, in one program."""
    state, out = unshare(state, seq_ids)
    return state, copy_blocks(pages, out.copy_src, out.copy_dst), out.status


def _swap_in(state, pages, seq_ids, lens, local_tables, num_local, data, *, max_local):
    """restore_rows, then the host data into the fresh blocks, in one program."""
    state, ids, status = restore_rows(state, seq_ids, lens, local_tables, num_local, max_local=max_local)
    return state, write_blocks(pages, ids, data), status


_housekeeping_jit = jax.jit(_housekeeping, donate_argnums=0)
_housekeeping_cached_jit = jax.jit(_housekeeping_cached, donate_argnums=0)
_swap_in_jit = jax.jit(_swap_in, donate_argnums=(0, 1), static_argnames="max_local")
_unshare_jit = jax.jit(_unshare, donate_argnums=(0, 1))
_read_blocks = jax.jit(read_blocks)
_snapshot = jax.jit(snapshot)


class ModelRunner:
    """Device state and the jitted calls on it. Not thread-safe; one engine owns it."""

    def __init__(self, backend: ModelBackend, config: EngineConfig):
        self.backend = backend
        self.config = config
        cache, sched = config.cache, config.scheduler
        self.num_blocks, self.block_size = cache.num_blocks, cache.block_size
        self.max_num_seqs, self.max_blocks_per_seq = sched.max_num_seqs, cache.max_blocks_per_seq
        self.max_num_batched_tokens, self.decode_buckets = sched.max_num_batched_tokens, sched.decode_buckets
        self.num_speculative_tokens = config.speculative.num_speculative_tokens if config.speculative else 0
        self.prefix_caching = cache.prefix_caching
        self.cache_config = config.device_shape()
        self.cache_state = self.empty_state()
        self.pages = backend.init_pages(self.num_blocks)
        self.params = backend.params
        self.bytes_per_block = bytes_per_block(self.pages)
        self.swap_pool = HostSwapPool.for_pages(cache.swap_space_blocks, self.pages)
        self.traces: collections.Counter[str] = collections.Counter()
        self.compile_seconds = 0.0  # wall time of model calls that traced
        self._step = _fused(backend.step)
        self._verify = _fused_verify(backend.step, backend.propose) if self.num_speculative_tokens else None
        # Blocks one step can fill (marks) or take (evictions, swap-ins aside): a row fed
        # n tokens fills at most n // block_size + 1 blocks.
        self._block_batch = self.max_num_batched_tokens // self.block_size + self.max_num_seqs
        self.view = self._fresh_view()

    def empty_state(self):
        """A block manager with no sequence, replicated over the backend's mesh if it has one."""
        state = init_state(self.cache_config, self.config.cache.allocation_policy, debug=self.config.debug_checks)
        if self.backend.mesh is None:
            return state
        from paged_jax.parallel.sharding import replicate

        return replicate(state, self.backend.mesh)

    # ------------------------------------------------------------------ the step

    def run(self, plan: StepPlan) -> StepResult:
        """Execute ``plan`` (module docstring) with one device fetch; returns the sampled
        tokens and the new view. Raises ``CacheOpError`` if the device rejected an op:
        the scheduler planned against ``view``, so a rejection is an engine bug."""
        statuses: list[tuple[str, Any, Any]] = []  # (op, ids, device status)
        swap_reads = [self._read_swap_out(rows) for rows in plan.swap_out]
        self._run_housekeeping(plan, statuses)
        if plan.swap_in:
            self._run_swap_in(plan.swap_in, statuses)
        outs, order = self._run_model(plan.work, statuses)
        host_outs, host_statuses, host_reads, snap = jax.device_get(
            (outs, [s for _, _, s in statuses], [data for _, data in swap_reads], _snapshot(self.cache_state))
        )
        for (op, ids, _), status in zip(statuses, host_statuses, strict=True):
            raise_for_status(op, ids, status)
        swapped = []
        for (blocks, _), data in zip(swap_reads, host_reads, strict=True):
            leaves = [np.moveaxis(np.asarray(x), block_axis(data), 0) for x in jax.tree.leaves(data)]
            self.swap_pool.write(blocks.host_ids, leaves)
            swapped.append(blocks)
        self.view = HostView.from_snapshot(snap, self.block_size)
        tokens = np.zeros(len(plan.work), np.int32)
        logprobs = np.zeros(len(plan.work), np.float32)
        width = max((out.top_ids.shape[1] for out in host_outs if isinstance(out, _StepOut)), default=0)
        top_lp = np.zeros((len(plan.work), width), np.float32)
        top_ids = np.zeros((len(plan.work), width), np.int32)
        ranks = np.zeros(len(plan.work), np.int32)
        prompt = {}
        spec = {}
        for out, positions in zip(host_outs, order, strict=True):
            n = len(positions)
            if isinstance(out, _VerifyOut):
                spec = self._spec_result(out, positions, len(plan.work))
                tokens[positions] = out.tokens[np.arange(n), out.accepted[:n]]
                continue
            k = out.top_ids.shape[1]
            tokens[positions] = out.tokens[:n]
            logprobs[positions] = out.logprobs[:n]
            top_lp[positions, :k] = out.top_logprobs[:n]
            top_ids[positions, :k] = out.top_ids[:n]
            ranks[positions] = out.ranks[:n]
            if out.prompt is not None:
                for r, i in enumerate(positions):
                    fed = len(plan.work[i].tokens)
                    prompt[i] = tuple(np.asarray(x[r, :fed]) for x in out.prompt)
        return StepResult(tokens, logprobs, top_lp, top_ids, swapped, self.view, **spec, ranks=ranks,
                          prompt_logprobs=prompt)

    def _spec_result(self, out: _VerifyOut, positions: list[int], num_work: int) -> dict:
        """The verification call's outputs scattered to the plan's work positions."""
        n, k = len(positions), self.num_speculative_tokens
        accepted = np.zeros(num_work, np.int32)
        spec_tokens = np.zeros((num_work, k + 1), np.int32)
        spec_logprobs = np.zeros((num_work, k + 1), np.float32)
        proposed = np.zeros((num_work, k), np.int32)
        accepted[positions] = out.accepted[:n]
        spec_tokens[positions] = out.tokens[:n]
        spec_logprobs[positions] = out.logprobs[:n]
        proposed[positions] = out.proposals[:n]
        return dict(accepted=accepted, spec_tokens=spec_tokens, spec_logprobs=spec_logprobs, proposed=proposed)

    def _read_swap_out(self, rows: list[int]) -> tuple[SwappedBlocks, Any]:
        """Host blocks for the distinct blocks ``rows`` name (shared ones once), and the
        device gather of their data (fetched with the step)."""
        tables = self.view.block_tables[rows]
        held = tables[tables != NO_BLOCK]
        distinct, first = np.unique(held, return_index=True)
        distinct = distinct[np.argsort(first)]  # in order of first appearance
        local = np.full(tables.shape, NO_BLOCK, np.int32)
        lookup = {int(b): i for i, b in enumerate(distinct)}
        for (r, c), b in np.ndenumerate(tables):
            if b != NO_BLOCK:
                local[r, c] = lookup[int(b)]
        blocks = SwappedBlocks(self.swap_pool.reserve(len(distinct)), local,
                               [int(self.view.seq_lens[r]) for r in rows])
        size = buckets.bucket(len(distinct), cap=self.num_blocks)
        ids = np.concatenate([distinct, np.full(size - len(distinct), distinct[-1])]).astype(np.int32)
        return blocks, _read_blocks(self.pages, ids)

    def _run_housekeeping(self, plan: StepPlan, statuses: list) -> None:
        released = plan.release + [r for rows in plan.swap_out for r in rows]
        if not (released or plan.select or plan.open or plan.fork or plan.unshare or plan.mark or plan.evict):
            return
        size = self.max_num_seqs

        def pad(ids):
            return buckets.pad_ids(ids, size)

        def pad_blocks(ids):
            # One size covers every step's marks and its evictions but for a large swap-in
            # (a bigger bucket then): the housekeeping program compiles once. NO_BLOCK is
            # NO_SEQ, so pad_ids pads blocks too.
            size = self._block_batch if len(ids) <= self._block_batch else buckets.bucket(len(ids))
            return buckets.pad_ids(ids, size)

        rows = [pad(released), pad([r for r, _ in plan.select]), pad([p for _, p in plan.select]), pad(plan.open)]
        forks = [pad([p for p, _ in plan.fork]), pad([c for _, c in plan.fork])]
        if not self.prefix_caching:
            self.cache_state, (s_rel, s_sel, s_open, s_fork) = _housekeeping_jit(self.cache_state, *rows, *forks)
            statuses += [("release", rows[0], s_rel), ("select_parents", rows[1], s_sel),
                         ("open_sequences", rows[3], s_open), ("fork", forks[1], s_fork)]
        else:
            prefix = np.full((size, self.max_blocks_per_seq), NO_BLOCK, np.int32)
            for i, blocks in enumerate(plan.prefix):
                prefix[i, : len(blocks)] = blocks
            marks, evicts = pad_blocks(plan.mark), pad_blocks(plan.evict)
            self.cache_state, (s_mark, s_rel, s_sel, s_open, s_fork, s_evict) = _housekeeping_cached_jit(
                self.cache_state, marks, *rows, prefix, *forks, evicts)
            statuses += [("mark_cached", marks, s_mark), ("release", rows[0], s_rel),
                         ("select_parents", rows[1], s_sel), ("open_sequences", rows[3], s_open),
                         ("fork", forks[1], s_fork), ("evict_cached", evicts, s_evict)]
        if plan.unshare:
            rows = pad(plan.unshare)
            self.cache_state, self.pages, s_unshare = _unshare_jit(self.cache_state, self.pages, rows)
            statuses.append(("unshare", rows, s_unshare))

    def _run_swap_in(self, swap_ins: list[SwapIn], statuses: list) -> None:
        """Every returning request in one restore: local block ids offset per request."""
        slots, lens, tables, host_ids = [], [], [], []
        for item in swap_ins:
            local = np.where(item.blocks.local_tables >= 0, item.blocks.local_tables + len(host_ids), NO_BLOCK)
            slots += item.slots
            lens += item.blocks.lens
            tables.append(local)
            host_ids += item.blocks.host_ids
        rows = buckets.bucket(len(slots), cap=self.max_num_seqs)
        max_local = buckets.bucket(len(host_ids), cap=self.num_blocks)
        width = self.max_blocks_per_seq
        local_tables = np.full((rows, width), NO_BLOCK, np.int32)
        local_tables[: len(slots)] = np.concatenate(tables)
        data = []
        for leaf in self.swap_pool.load(host_ids):
            padded = np.concatenate([leaf, np.repeat(leaf[-1:], max_local - len(host_ids), axis=0)])
            data.append(jnp.asarray(np.moveaxis(padded, 0, block_axis(self.pages))))
        ids = buckets.pad_ids(slots, rows)
        padded_lens = np.zeros(rows, np.int32)
        padded_lens[: len(lens)] = lens
        self.cache_state, self.pages, status = _swap_in_jit(
            self.cache_state, self.pages, ids, padded_lens, local_tables, np.int32(len(host_ids)),
            jax.tree.unflatten(self.swap_pool.treedef, data), max_local=max_local,
        )
        statuses.append(("restore_rows (swap-in)", ids, status))
        for item in swap_ins:
            self.swap_pool.free(item.blocks.host_ids)

    def _run_model(self, work: list[Work], statuses: list) -> tuple[list[_StepOut], list[list[int]]]:
        """Decode rows in one call, chunks in as few prefill calls as fit the area bound."""
        outs, order = [], []
        # Rows wanting prompt logprobs need every position's logits: calls of their own.
        prompt = [i for i, w in enumerate(work) if w.prompt_targets is not None and not w.spec]
        plain = [w.prompt_targets is None for w in work]
        decode = [i for i, w in enumerate(work) if len(w.tokens) == 1 and not w.spec and plain[i]]
        verify = [i for i, w in enumerate(work) if w.spec]
        chunks = [i for i, w in enumerate(work) if len(w.tokens) > 1 and not w.spec and plain[i]]
        if decode:
            size = buckets.decode_rows(len(decode), self.decode_buckets)
            outs.append(self._call("decode", [work[i] for i in decode], (size, 1), statuses))
            order.append(decode)
        if verify:
            outs.append(self._call_verify([work[i] for i in verify], statuses))
            order.append(verify)
        area = buckets.prefill_area(self.max_num_batched_tokens)
        for rows, width, members in buckets.plan_prefill([len(work[i].tokens) for i in chunks], area,
                                                          self.max_num_seqs):
            group = [chunks[m] for m in members]
            outs.append(self._call("prefill", [work[i] for i in group], (rows, width), statuses))
            order.append(group)
        for rows, width, members in buckets.plan_prefill([len(work[i].tokens) for i in prompt], area,
                                                          self.max_num_seqs):
            group = [prompt[m] for m in members]
            outs.append(self._call("prefill", [work[i] for i in group], (rows, width), statuses, prompt=True))
            order.append(group)
        return outs, order

    @staticmethod
    def _sampling(items: list[Work], size: int) -> SamplingBatch:
        """The sampling inputs of ``items`` padded to ``size`` rows (host arrays).

        The history's width is the longest row's entries bucketed to a power of two, at
        least ``MIN_HISTORY``: a batch whose rows need no penalties (all padding) has the
        narrowest, so it shares its program with small-history batches."""
        rows = [w.sample for w in items] + [_PAD_SAMPLE] * (size - len(items))
        cols = list(zip(*rows, strict=True))
        longest = max((len(r.history[0]) for r in rows if r.history is not None), default=0)
        history = empty_history(size, buckets.bucket(longest, lo=MIN_HISTORY))
        for i, r in enumerate(rows):
            if r.history is not None:
                n = len(r.history[0])
                history.ids[i, :n], history.counts[i, :n], history.flags[i, :n] = r.history
        history = history._replace(presence=np.asarray(cols[6], np.float32), frequency=np.asarray(cols[7], np.float32),
                                   repetition=np.asarray(cols[8], np.float32))
        top_temperature = np.zeros(size, np.float32)
        top_temperature[: len(items)] = [w.top_temperature for w in items]
        return SamplingBatch(
            temperature=np.asarray(cols[0], np.float32), top_k=np.asarray(cols[1], np.int32),
            top_p=np.asarray(cols[2], np.float32), min_p=np.asarray(cols[5], np.float32),
            seeds=np.asarray(cols[3], np.uint32), steps=np.asarray(cols[4], np.int32),
            top_temperature=top_temperature, history=history,
        )

    def _call_verify(self, items: list[Work], statuses: list) -> _VerifyOut:
        """One speculative round for ``items`` (``Work.spec`` proposals each): rows padded
        to a power of two, width k + 1."""
        k = self.num_speculative_tokens
        # Powers of two from 1, not decode's buckets from 8: a padding row costs k + 1
        # tokens here, so a lone row padded to 8 would compute 8x its tokens.
        size = buckets.bucket(len(items), cap=self.max_num_seqs)
        tokens = np.zeros((size, k + 1), np.int32)
        num = np.zeros(size, np.int32)
        for i, w in enumerate(items):
            tokens[i, : len(w.tokens)] = w.tokens
            num[i] = w.spec + 1
        seq_ids = buckets.pad_ids([w.slot for w in items], size)
        rows = self._sampling(items, size)
        before = _TRACES[self._verify]
        start = time.perf_counter()
        # Rows that speculate use none of the history/min-p machinery (the scheduler's
        # ``_propose`` gives such rows no proposals), so verification takes the basics.
        out, self.cache_state, self.pages = self._verify(
            self.params, self.cache_state, self.pages, tokens, seq_ids, num, rows.temperature, rows.top_k,
            rows.top_p, rows.seeds, rows.steps,
        )
        if traced := _TRACES[self._verify] - before:
            self.traces["verify"] += traced
            self.compile_seconds += time.perf_counter() - start
        statuses.append(("verify", seq_ids, out.status))
        return out

    def _call(self, name: str, items: list[Work], shape: tuple[int, int], statuses: list,
              prompt: bool = False) -> _StepOut:
        """One fused model call over ``items`` padded to ``shape``, counting any trace;
        ``prompt``: the prompt-logprobs variant (every item has ``prompt_targets``)."""
        batch = buckets.pad_batch([w.slot for w in items], [w.tokens for w in items], shape=shape)
        sampling = self._sampling(items, shape[0])
        vocab = self.backend.vocab_size
        top = max((max(w.top, w.sample.num_logprobs) for w in items), default=0)
        wants = any(w.top > 0 or w.sample.num_logprobs >= 0 for w in items)
        # One compiled width for every beam up to 8 (2W candidates) and for logprobs<=16:
        # a top-k of 16 costs no more than one of 4 next to the log-softmax it follows.
        num_top = buckets.bucket(min(max(top, 1), vocab), lo=MIN_TOP, cap=vocab) if wants else 0
        targets, prompt_top = None, 0
        if prompt:
            targets = np.full(shape, -1, np.int32)
            for i, w in enumerate(items):
                targets[i, : len(w.prompt_targets)] = w.prompt_targets
            want = max(w.prompt_top for w in items)
            prompt_top = buckets.bucket(min(max(want, 1), vocab), lo=MIN_TOP, cap=vocab)
        before = _TRACES[self._step]
        start = time.perf_counter()
        out, self.cache_state, self.pages = self._step(
            self.params, self.cache_state, self.pages, batch.tokens, batch.seq_ids, batch.num_tokens, sampling,
            targets, num_top=num_top, prompt_top=prompt_top,
        )
        if traced := _TRACES[self._step] - before:
            # Tracing and compiling happen inside the call, before it returns (execution
            # is asynchronous): the call's time is the compile time.
            self.traces[name] += traced
            self.compile_seconds += time.perf_counter() - start
        statuses.append((name, batch.seq_ids, out.status))
        return out

    def warmup_shapes(self) -> list[tuple[str, tuple[int, int]]]:
        """Every (program, shape) a plain step may call: the decode buckets, and
        ``buckets.prefill_shapes`` of the token budget."""
        decode = self.decode_buckets
        prefill = buckets.prefill_shapes(buckets.prefill_area(self.max_num_batched_tokens), self.max_num_seqs,
                                         max_width=self.max_blocks_per_seq * self.block_size)
        return [("decode", (rows, 1)) for rows in decode] + [("prefill", shape) for shape in prefill]

    def warmup(self, shapes: list[tuple[str, tuple[int, int]]], on_shape: Callable | None = None) -> None:
        """Compile ``shapes`` (``warmup_shapes``) by calling each program on padding rows
        only (every op and write ignores ``NO_SEQ``: the state is unchanged), and the
        bookkeeping program, so later steps compile nothing of these."""
        statuses: list = []
        self._run_housekeeping(StepPlan(), statuses)
        for name, shape in shapes:
            self._call(name, [], shape, statuses)
            if on_shape is not None:
                on_shape(name, shape)
        for (op, ids, _), status in zip(statuses, jax.device_get([s for _, _, s in statuses]), strict=True):
            raise_for_status(op, ids, status)

    # ------------------------------------------------------------------ debug

    def check(self, held: dict[int, int], pending_release: list[int] = ()) -> None:
        """Block-manager invariants, and that the device agrees with the host: exactly
        the rows in ``held`` (slot -> tokens) and ``pending_release`` (finished, released
        next step) are live, ``held`` with those lengths, and ``view`` equals a fresh
        snapshot. A debug aid: it syncs the device."""
        check_invariants(self.cache_state, op="engine step")
        fresh = self._fresh_view()
        live = set(np.flatnonzero(fresh.active).tolist())
        if live != set(held) | set(pending_release):
            raise AssertionError(f"device live rows {sorted(live)} != the host's {sorted(held)} + {pending_release}")
        for slot, n in held.items():
            if fresh.seq_lens[slot] != n:
                raise AssertionError(f"row {slot}: device holds {fresh.seq_lens[slot]} tokens, the host says {n}")
        if not self.view.same_as(fresh):
            raise AssertionError("the runner's host view differs from the device's block manager")

    def _fresh_view(self) -> HostView:
        """A view of the device state now (a sync: construction and debug checks only)."""
        return HostView.from_snapshot(_snapshot(self.cache_state), self.block_size)

    def num_free_blocks(self) -> int:
        """Free blocks on the device now (a sync; for tests and reports)."""
        return self._fresh_view().num_free

