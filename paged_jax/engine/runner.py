"""The model runner: the only part of the engine that touches the device.

It owns the device state (the block manager's ``CacheState``, the KV pages, the model
parameters) and executes one ``SchedulerOutput`` per engine step with ``run``:

1. copy the blocks of requests being swapped out (a gather, on the device);
2. one housekeeping program: mark blocks cached (prefix caching), release rows (finished
   last step, preempted now), rebuild beam rows, open the rows of admitted requests
   (on cached blocks, for a prefix-cache hit), fork children from their parents, evict
   cached-free blocks the step's allocations need; then ``unshare`` (the no-sharing
   baseline);
3. swap-ins: rebuild the rows of returning requests in fresh blocks (shared blocks
   shared again, ``cache.restore_rows``) and write their data back;
4. the model, fused with the sampler: with the packed layout (the default) **one** call for
   every row, decodes and prefill chunks alike, their tokens one after another
   (``buckets.pack_batch``: rows padded to a decode bucket, tokens to ``packed_width``);
   with the padded layout one decode call for every single-token append and the prefill
   calls for the chunks (``buckets.plan_prefill``). Rows that want prompt logprobs go to
   a call of their own that keeps the logits at every position; last, the verification
   call for the rows that speculate (``engine/speculative.py``: proposals fed, accepted
   ones kept, the rest rolled back by ``truncate`` in the same program);

and then brings everything the host needs back in **one** device fetch: sampled tokens,
their log-probabilities, every op's status and the swapped-out data. Every block op it
runs on the device it also applies, with the same arguments in the same order, to the
engine's host model of the block manager (``KVCacheManager.apply``; the verification's
``truncate`` once the fetch says how many proposals were kept, which is why that call
runs last), so the host model stays equal to the device's state without a snapshot.

Every batch is padded to a bucket (``paged_jax.buckets``) so the number of compiled
programs stays bounded; the housekeeping program has one fixed shape. ``traces`` counts
the model-step traces (compiles) this runner's calls caused; the jitted programs
(``programs.py``) are shared process-wide, so a second engine with the same shapes
compiles nothing.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import buckets
from paged_jax.backend import ModelBackend
from paged_jax.cache import NO_BLOCK, check_invariants, init_state, raise_for_status
from paged_jax.cache.sentinels import NO_SEQ
from paged_jax.engine import programs
from paged_jax.engine.config import EngineConfig
from paged_jax.engine.inputs import MIN_TOP, InputBatch, Work, prepare
from paged_jax.engine.interface import SchedulerOutput, StepResult, SwapIn
from paged_jax.engine.programs import StepOut, VerifyOut
from paged_jax.engine.swap import SwappedBlocks
from paged_jax.kv.pages import block_axis, bytes_per_block


class ModelRunner:
    """Device state and the jitted calls on it. Not thread-safe; one engine owns it.

    Args:
      backend: the model (``backend.ModelBackend``).
      config: the ``EngineConfig``.
      kv: the engine's ``KVCacheManager``: its host model is advanced with every block op
        run here, and its swap pool holds swapped-out data.
    """

    def __init__(self, backend: ModelBackend, config: EngineConfig, kv):
        self.backend, self.config, self.kv = backend, config, kv
        cache, sched = config.cache, config.scheduler
        self.num_blocks, self.block_size = cache.num_blocks, cache.block_size
        self.max_num_seqs, self.max_blocks_per_seq = sched.max_num_seqs, cache.max_blocks_per_seq
        self.max_num_batched_tokens, self.decode_buckets = sched.max_num_batched_tokens, sched.decode_buckets
        self.packed = sched.batch_layout == "packed"
        self.num_speculative_tokens = config.speculative.num_speculative_tokens if config.speculative else 0
        self.prefix_caching = cache.prefix_caching
        self.cache_state = self.empty_state()
        self.pages = backend.init_pages(self.num_blocks)
        self.params = backend.params
        self.bytes_per_block = bytes_per_block(self.pages)
        self.inputs = InputBatch(self.max_num_seqs)
        self.traces: collections.Counter[str] = collections.Counter()
        self.compile_seconds = 0.0  # wall time of model calls that traced
        self._step = programs.fused(backend.step)
        self._verify = programs.fused_verify(backend.step, backend.propose) if self.num_speculative_tokens else None
        # Blocks one step can fill (marks) or take (evictions, swap-ins aside): a row fed
        # n tokens fills at most n // block_size + 1 blocks.
        self._block_batch = self.max_num_batched_tokens // self.block_size + self.max_num_seqs

    def empty_state(self):
        """A block manager with no sequence, replicated over the backend's mesh if it has one."""
        state = init_state(self.config.device_shape(), self.config.cache.allocation_policy,
                           debug=self.config.debug_checks)
        if self.backend.mesh is None:
            return state
        from paged_jax.parallel.sharding import replicate

        return replicate(state, self.backend.mesh)

    def reset(self) -> None:
        """An empty block manager (and fresh pages if donation lost them); the compiled
        programs are kept. The engine resets its host model with it."""
        self.cache_state = self.empty_state()
        if any(leaf.is_deleted() for leaf in jax.tree.leaves(self.pages)):
            self.pages = self.backend.init_pages(self.num_blocks)
        self.inputs.clear()

    # ------------------------------------------------------------------ the step

    def run(self, output: SchedulerOutput) -> StepResult:
        """Execute ``output`` (module docstring) with one device fetch; returns the sampled
        tokens. Raises ``CacheOpError`` if the device rejected an op (or ``PlanningError``
        if the host model did): the scheduler planned against the host model, so a
        rejection is an engine bug."""
        statuses: list[tuple[str, Any, Any]] = []  # (op, ids, device status)
        swap_reads = [self._read_swap_out(rows) for rows in output.swap_out]
        self._run_housekeeping(output, statuses)
        if output.swap_in:
            self._run_swap_in(output.swap_in, statuses)
        for row in output.rows:
            self.inputs.bind(row.seq.slot, row.seq)
        work = [prepare(row, self.config.model.eos_token_ids) for row in output.rows]
        outs, order = self._run_model(work, statuses)
        host_outs, host_statuses, host_reads = jax.device_get(
            (outs, [s for _, _, s in statuses], [data for _, data in swap_reads]))
        for (op, ids, _), status in zip(statuses, host_statuses, strict=True):
            raise_for_status(op, ids, status)
        swapped = []
        for (blocks, _), data in zip(swap_reads, host_reads, strict=True):
            leaves = [np.moveaxis(np.asarray(x), block_axis(data), 0) for x in jax.tree.leaves(data)]
            self.kv.swap_pool.write(blocks.host_ids, leaves)
            swapped.append(blocks)
        return self._result(work, host_outs, order, swapped)

    def _result(self, work: list[Work], host_outs: list, order: list[list[int]], swapped: list) -> StepResult:
        """The fetched outputs scattered back to the rows' positions."""
        n_rows = len(work)
        tokens = np.zeros(n_rows, np.int32)
        logprobs = np.zeros(n_rows, np.float32)
        width = max((out.top_ids.shape[1] for out in host_outs if isinstance(out, StepOut)), default=0)
        top_lp = np.zeros((n_rows, width), np.float32)
        top_ids = np.zeros((n_rows, width), np.int32)
        ranks = np.zeros(n_rows, np.int32)
        prompt, spec = {}, {}
        for out, positions in zip(host_outs, order, strict=True):
            n = len(positions)
            if isinstance(out, VerifyOut):
                spec = self._verified(out, positions, work)
                tokens[positions] = out.tokens[np.arange(n), out.accepted[:n]]
                continue
            k = out.top_ids.shape[1]
            tokens[positions] = out.tokens[:n]
            logprobs[positions] = out.logprobs[:n]
            top_lp[positions, :k] = out.top_logprobs[:n]
            top_ids[positions, :k] = out.top_ids[:n]
            ranks[positions] = out.ranks[:n]
            if out.prompt is not None:
                at = 0  # packed: the rows' tokens one after another, in ``positions`` order
                for r, i in enumerate(positions):
                    fed = len(work[i].tokens)
                    if out.prompt[0].ndim == 1:
                        prompt[i] = (work[i].prompt_targets, *(np.asarray(x[at: at + fed]) for x in out.prompt))
                    else:
                        prompt[i] = (work[i].prompt_targets, *(np.asarray(x[r, :fed]) for x in out.prompt))
                    at += fed
        return StepResult(tokens, logprobs, top_lp, top_ids, swapped, ranks, **spec, prompt_logprobs=prompt)

    def _verified(self, out: VerifyOut, positions: list[int], work: list[Work]) -> dict:
        """The verification call's outputs at the rows' positions; the host model learns
        the rollback (``truncate`` to the pending token plus the accepted proposals)."""
        n, k, num_rows = len(positions), self.num_speculative_tokens, len(work)
        accepted = np.zeros(num_rows, np.int32)
        spec_tokens = np.zeros((num_rows, k + 1), np.int32)
        spec_logprobs = np.zeros((num_rows, k + 1), np.float32)
        proposed = np.zeros((num_rows, k), np.int32)
        accepted[positions] = out.accepted[:n]
        spec_tokens[positions] = out.tokens[:n]
        spec_logprobs[positions] = out.logprobs[:n]
        proposed[positions] = out.proposals[:n]
        ids, start = self._verify_rows
        size = len(ids)
        cut = np.zeros(size, np.int32)
        cut[:n] = start[:n] + 1 + out.accepted[:n]
        self.kv.apply("truncate", ids, cut)
        return dict(accepted=accepted, spec_tokens=spec_tokens, spec_logprobs=spec_logprobs, proposed=proposed)

    def _read_swap_out(self, rows: list[int]) -> tuple[SwappedBlocks, Any]:
        """Host blocks for the distinct blocks ``rows`` name (shared ones once), and the
        device gather of their data (fetched with the step)."""
        tables, lens = self.kv.rows_held(rows)
        held = tables[tables != NO_BLOCK]
        distinct, first = np.unique(held, return_index=True)
        distinct = distinct[np.argsort(first)]  # in order of first appearance
        local = np.full(tables.shape, NO_BLOCK, np.int32)
        lookup = {int(b): i for i, b in enumerate(distinct)}
        for (r, c), b in np.ndenumerate(tables):
            if b != NO_BLOCK:
                local[r, c] = lookup[int(b)]
        blocks = SwappedBlocks(self.kv.swap_pool.reserve(len(distinct)), local, [int(x) for x in lens])
        size = buckets.bucket(len(distinct), cap=self.num_blocks)
        ids = np.concatenate([distinct, np.full(size - len(distinct), distinct[-1])]).astype(np.int32)
        return blocks, programs.read_blocks_program(self.pages, ids)

    def _run_housekeeping(self, output: SchedulerOutput, statuses: list) -> None:
        released = output.release + [r for rows in output.swap_out for r in rows]
        if not (released or output.select or output.open or output.fork or output.unshare or output.mark
                or output.evict):
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

        rel, sel, parents, opened = (pad(released), pad([r for r, _ in output.select]),
                                     pad([p for _, p in output.select]), pad(output.open))
        fork_parents, fork_children = pad([p for p, _ in output.fork]), pad([c for _, c in output.fork])
        kv = self.kv
        if not self.prefix_caching:
            self.cache_state, (s_rel, s_sel, s_open, s_fork) = programs.housekeeping(
                self.cache_state, rel, sel, parents, opened, fork_parents, fork_children)
            prefix = None
        else:
            prefix = np.full((size, self.max_blocks_per_seq), NO_BLOCK, np.int32)
            for i, blocks in enumerate(output.prefix):
                prefix[i, : len(blocks)] = blocks
            marks, evicts = pad_blocks(output.mark), pad_blocks(output.evict)
            self.cache_state, (s_mark, s_rel, s_sel, s_open, s_fork, s_evict) = programs.housekeeping_cached(
                self.cache_state, marks, rel, sel, parents, opened, prefix, fork_parents, fork_children, evicts)
            statuses.append(("mark_cached", marks, s_mark))
            kv.apply("mark_cached", marks)
        statuses += [("release", rel, s_rel), ("select_parents", sel, s_sel), ("open_sequences", opened, s_open),
                     ("fork", fork_children, s_fork)]
        kv.apply("release", rel)
        kv.apply("select_parents", sel, parents)
        kv.apply("open_sequences", opened, prefix)
        kv.apply("fork", fork_parents, fork_children)
        if self.prefix_caching:
            statuses.append(("evict_cached", evicts, s_evict))
            kv.apply("evict_cached", evicts)
        if output.unshare:
            rows = pad(output.unshare)
            self.cache_state, self.pages, s_unshare = programs.unshare_program(self.cache_state, self.pages, rows)
            statuses.append(("unshare", rows, s_unshare))
            kv.apply("unshare", rows)

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
        pool = self.kv.swap_pool
        data = []
        for leaf in pool.load(host_ids):
            padded = np.concatenate([leaf, np.repeat(leaf[-1:], max_local - len(host_ids), axis=0)])
            data.append(jnp.asarray(np.moveaxis(padded, 0, block_axis(self.pages))))
        ids = buckets.pad_ids(slots, rows)
        padded_lens = np.zeros(rows, np.int32)
        padded_lens[: len(lens)] = lens
        self.cache_state, self.pages, status = programs.swap_in_program(
            self.cache_state, self.pages, ids, padded_lens, local_tables, np.int32(len(host_ids)),
            jax.tree.unflatten(pool.treedef, data), max_local=max_local,
        )
        statuses.append(("restore_rows (swap-in)", ids, status))
        self.kv.apply("restore_rows", ids, padded_lens, local_tables, np.int32(len(host_ids)), max_local=max_local)
        for item in swap_ins:
            pool.free(item.blocks.host_ids)

    def _run_model(self, work: list[Work], statuses: list) -> tuple[list, list[list[int]]]:
        """The model calls of a step: packed, every plain row (decodes and chunks) in one call
        and the rows wanting prompt logprobs in another; padded, decode rows in one call and
        chunks in as few prefill calls as fit the area bound. Speculative rows last (their
        rollback is applied to the host model after the fetch)."""
        outs, order = [], []
        # Rows wanting prompt logprobs need every position's logits: calls of their own.
        prompt = [i for i, w in enumerate(work) if w.prompt_targets is not None and not w.spec]
        plain = [i for i, w in enumerate(work) if w.prompt_targets is None and not w.spec]
        verify = [i for i, w in enumerate(work) if w.spec]
        if self.packed:
            for group, wants_prompt in ((plain, False), (prompt, True)):
                if group:
                    items = [work[i] for i in group]
                    rows = buckets.decode_rows(len(items), self.decode_buckets)
                    width = buckets.packed_width(sum(len(w.tokens) for w in items), rows)
                    outs.append(self._call("step", items, (rows, width), statuses, prompt=wants_prompt))
                    order.append(group)
        else:
            decode = [i for i in plain if len(work[i].tokens) == 1]
            chunks = [i for i in plain if len(work[i].tokens) > 1]
            if decode:
                size = buckets.decode_rows(len(decode), self.decode_buckets)
                outs.append(self._call("decode", [work[i] for i in decode], (size, 1), statuses))
                order.append(decode)
            area = buckets.prefill_area(self.max_num_batched_tokens)
            for group, wants_prompt in ((chunks, False), (prompt, True)):
                for rows, width, members in buckets.plan_prefill([len(work[i].tokens) for i in group], area,
                                                                  self.max_num_seqs):
                    outs.append(self._call("prefill", [work[group[m]] for m in members], (rows, width), statuses,
                                           prompt=wants_prompt))
                    order.append([group[m] for m in members])
        if verify:
            outs.append(self._call_verify([work[i] for i in verify], statuses))
            order.append(verify)
        return outs, order

    def _call_verify(self, items: list[Work], statuses: list) -> VerifyOut:
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
        rows = self.inputs.sampling(items, size)
        before = programs.TRACES[self._verify]
        start = time.perf_counter()
        # The rollback's starting lengths, for the host model (read before the append).
        real = seq_ids != NO_SEQ
        self._verify_rows = (seq_ids, np.where(real, self.kv.blocks.seq_lens[np.where(real, seq_ids, 0)], 0))
        # Rows that speculate use none of the history/min-p machinery (the scheduler gives
        # such rows no proposals), so verification takes the basics.
        out, self.cache_state, self.pages = self._verify(
            self.params, self.cache_state, self.pages, tokens, seq_ids, num, rows.temperature, rows.top_k,
            rows.top_p, rows.seeds, rows.steps,
        )
        self.kv.apply("append_slots", seq_ids, num, max_tokens=k + 1, slots=False)
        if traced := programs.TRACES[self._verify] - before:
            self.traces["verify"] += traced
            self.compile_seconds += time.perf_counter() - start
        statuses.append(("verify", seq_ids, out.status))
        return out

    def _call(self, name: str, items: list[Work], shape: tuple[int, int], statuses: list,
              prompt: bool = False) -> StepOut:
        """One fused model call over ``items`` padded to ``shape`` (rows, width), counting any
        trace; packed (``name == "step"``: tokens int32[width]) or padded ([rows, width]).
        ``prompt``: the prompt-logprobs variant (every item has ``prompt_targets``)."""
        rows, width = shape
        if name == "step":
            batch = buckets.pack_batch([w.slot for w in items], [w.tokens for w in items], rows=rows, width=width)
        else:
            batch = buckets.pad_batch([w.slot for w in items], [w.tokens for w in items], shape=shape)
        sampling = self.inputs.sampling(items, rows)
        vocab = self.backend.vocab_size
        top = max((max(w.top, w.num_logprobs) for w in items), default=0)
        wants = any(w.top > 0 or w.num_logprobs >= 0 for w in items)
        # One compiled width for every beam up to 8 (2W candidates) and for logprobs<=16:
        # a top-k of 16 costs no more than one of 4 next to the log-softmax it follows.
        num_top = buckets.bucket(min(max(top, 1), vocab), lo=MIN_TOP, cap=vocab) if wants else 0
        targets, prompt_top = None, 0
        if prompt:
            targets = np.full(batch.tokens.shape, -1, np.int32)
            for i, w in enumerate(items):
                if name == "step":
                    targets[batch.starts[i]: batch.starts[i] + len(w.prompt_targets)] = w.prompt_targets
                else:
                    targets[i, : len(w.prompt_targets)] = w.prompt_targets
            want = max(w.prompt_top for w in items)
            prompt_top = buckets.bucket(min(max(want, 1), vocab), lo=MIN_TOP, cap=vocab)
        before = programs.TRACES[self._step]
        start = time.perf_counter()
        out, self.cache_state, self.pages = self._step(
            self.params, self.cache_state, self.pages, batch.tokens, batch.seq_ids, batch.num_tokens, sampling,
            targets, num_top=num_top, prompt_top=prompt_top,
        )
        self.kv.apply("append_slots", batch.seq_ids, batch.num_tokens, max_tokens=width, slots=False)
        if traced := programs.TRACES[self._step] - before:
            # Tracing and compiling happen inside the call, before it returns (execution
            # is asynchronous): the call's time is the compile time.
            self.traces[name] += traced
            self.compile_seconds += time.perf_counter() - start
        statuses.append((name, batch.seq_ids, out.status))
        return out

    def warmup_shapes(self) -> list[tuple[str, tuple[int, int]]]:
        """Every (program, shape) a plain step may call: packed, each decode bucket's rows at
        each width (``buckets.packed_shapes``); padded, the decode buckets and
        ``buckets.prefill_shapes`` of the token budget."""
        if self.packed:
            return [("step", shape) for shape in buckets.packed_shapes(self.decode_buckets,
                                                                       self.max_num_batched_tokens)]
        prefill = buckets.prefill_shapes(buckets.prefill_area(self.max_num_batched_tokens), self.max_num_seqs,
                                         max_width=self.max_blocks_per_seq * self.block_size)
        return [("decode", (rows, 1)) for rows in self.decode_buckets] + [("prefill", shape) for shape in prefill]

    def warmup(self, shapes: list[tuple[str, tuple[int, int]]], on_shape: Callable | None = None) -> None:
        """Compile ``shapes`` (``warmup_shapes``) by calling each program on padding rows
        only (every op and write ignores ``NO_SEQ``: the state is unchanged), and the
        bookkeeping program, so later steps compile nothing of these."""
        statuses: list = []
        self._run_housekeeping(SchedulerOutput(), statuses)
        for name, shape in shapes:
            self._call(name, [], shape, statuses)
            if on_shape is not None:
                on_shape(name, shape)
        for (op, ids, _), status in zip(statuses, jax.device_get([s for _, _, s in statuses]), strict=True):
            raise_for_status(op, ids, status)

    # ------------------------------------------------------------------ debug

    def check(self, held: dict[int, int], pending_release: list[int] = ()) -> None:
        """Block-manager invariants, and that the device agrees with the host: exactly the
        rows in ``held`` (slot -> tokens) and ``pending_release`` (finished, released next
        step) are live, ``held`` with those lengths, and the host model equals the device
        state. A debug aid: it syncs the device."""
        check_invariants(self.cache_state, op="engine step")
        lens, active = jax.device_get((self.cache_state.seq_lens, self.cache_state.active))
        live = set(np.flatnonzero(active).tolist())
        if live != set(held) | set(pending_release):
            raise AssertionError(f"device live rows {sorted(live)} != the host's {sorted(held)} + {pending_release}")
        for slot, n in held.items():
            if lens[slot] != n:
                raise AssertionError(f"row {slot}: device holds {lens[slot]} tokens, the host says {n}")
        self.kv.check(self.cache_state)
