"""The engine loop: schedule, run, postprocess — one ``step`` at a time.

``LLMEngine`` is built from an ``EngineConfig`` (``from_config``: the backend's weights are
loaded there) and wires the scheduler (decisions, host only), the runner (the device) and
the stats together; ``LLM`` (``llm.py``) is the offline front end over one or more engines
(data-parallel replicas), and a server drives one the same way. A step:

1. ``Scheduler.schedule`` plans the step: releases, preemptions, swaps, admissions and
   the tokens each running sequence feeds (``interface.SchedulerOutput``).
2. ``ModelRunner.run`` executes the plan and brings back the sampled tokens, their
   log-probabilities in one device fetch, and advances the engine's host model of the
   block manager (``KVCacheManager``) through the same ops.
3. ``postprocess`` appends the tokens, decides who finished; the scheduler releases their
   rows at the start of the next step (``flush`` does it when no step follows).
"""

from __future__ import annotations

import time
import warnings

import jax
import numpy as np

from paged_jax.backend import ModelBackend, build_backend
from paged_jax.cache.sentinels import NO_BLOCK
from paged_jax.config import blocks_for
from paged_jax.engine import beam as beam_lib
from paged_jax.engine.accounting import make_accounting
from paged_jax.engine.config import EngineConfig
from paged_jax.engine.interface import SchedulerOutput, StepResult
from paged_jax.engine.kv_cache_manager import KVCacheManager
from paged_jax.engine.outputs import request_output
from paged_jax.engine.prefix_cache import PrefixCacheCounters
from paged_jax.engine.programs import NAN_TOKEN
from paged_jax.engine.runner import ModelRunner
from paged_jax.engine.sampling import Logprob
from paged_jax.engine.scheduler import Scheduler, SchedulerCounters
from paged_jax.engine.sequence import FinishReason, SeqStatus, Sequence, SequenceGroup
from paged_jax.engine.stats import EngineStats
from paged_jax.engine.text_output import TextOutputs


def _prefill_tokens(output: SchedulerOutput) -> int:
    """Tokens a step feeds that are not decodes: prompt tokens and recomputed outputs.
    A row's fed token is a decode when it is the newest sampled token."""
    total = 0
    for row in output.rows:
        if row.spec:  # a speculative round feeds the newest token and proposals
            continue
        seq, n = row.seq, row.num_tokens
        decode = seq.num_computed + n == seq.num_tokens and seq.output_token_ids
        total += n - bool(decode)
    return total


def _logprob_dict(token: int, logprob: float, rank: int, top_lp, top_ids, k: int) -> dict[int, Logprob]:
    """vLLM's logprobs entry for one position: the token first, then the ``k`` most likely
    (ranks 1..k; the token's own rank becomes its top position when it is among them,
    as vLLM's merge does). top_lp f32[>= k], top_ids int32[>= k]: most likely first."""
    entry = {int(token): Logprob(float(logprob), int(rank))}
    for j in range(min(k, len(top_ids))):
        tid = int(top_ids[j])
        # The token keeps the log-probability reported with it (cumulative_logprob's).
        entry[tid] = Logprob(entry[tid].logprob if tid == token else float(top_lp[j]), j + 1)
    return entry


class LLMEngine:
    """One engine: a runner (one device, or one replica's mesh), a scheduler, the stats.

    Not thread-safe: one caller steps it (``LLM`` gives each replica a thread of its own)."""

    def __init__(self, config: EngineConfig, backend: ModelBackend):
        self.config = config
        self.kv = KVCacheManager(config, jax.eval_shape(lambda: backend.init_pages(config.cache.num_blocks)))
        self.runner = ModelRunner(backend, config, self.kv)
        self.scheduler = self._new_scheduler()
        self.tokenizer = config.model.tokenizer
        self.text = None if self.tokenizer is None else TextOutputs(self.tokenizer)
        self.debug_checks = config.debug_checks
        self.stats = EngineStats(block_size=config.cache.block_size, num_blocks=config.cache.num_blocks)

    @classmethod
    def from_config(cls, config: EngineConfig, mesh=None) -> LLMEngine:
        """An engine over a freshly built backend (weights loaded here) on ``mesh`` (one
        replica's, or None: one device)."""
        backend = build_backend(config.model, block_size=config.cache.block_size,
                                kv_cache_dtype=config.cache.kv_cache_dtype, attention_impl=config.model.attention_impl,
                                speculative=config.speculative, mesh=mesh)
        return cls(config, backend)

    def _new_scheduler(self) -> Scheduler:
        """A scheduler with empty queues over the KV-cache manager (construction, ``reset``)."""
        cfg = self.config
        swapping = cfg.scheduler.preemption_mode == "swap" and cfg.cache.mode == "paged"
        return Scheduler(cfg.scheduler, self.kv, make_accounting(cfg), swapping=swapping)

    def add(self, group: SequenceGroup) -> None:
        self.scheduler.add(group)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def unfinished(self) -> list[SequenceGroup]:
        """Requests not finished: waiting, running or swapped out."""
        sched = self.scheduler
        return [*sched.waiting, *sched.running, *sched.swapped]

    def outputs(self, groups: list[SequenceGroup]) -> list:
        """The outputs of ``groups`` as they stand (``outputs.request_output``)."""
        return [request_output(g, self.text, self.tokenizer) for g in groups]

    def step(self) -> list[Sequence]:
        """Run one step; returns the sequences that finished in it. Any exception inside
        (Ctrl-C included) resets the engine (``reset``) before it propagates."""
        try:
            finished = self._step()
        except BaseException:
            self.reset()
            raise
        self._times(finished)
        return finished

    def run_until_done(self) -> None:
        """Step until nothing is unfinished, then release the last rows (``flush``)."""
        try:
            while self.has_unfinished():
                self._times(self._step())
            self.flush()
        except BaseException:  # never leave half a step behind
            self.reset()
            raise

    def _times(self, finished: list[Sequence]) -> None:
        """Record first-token and finish times (``RequestMetrics``) after a step."""
        now = time.time()
        for g in self.scheduler.running:
            if g.metrics is not None and "first_token_time" not in g.metrics and any(s.output_token_ids for s in g.seqs):
                g.metrics["first_token_time"] = now
        for s in finished:
            m = s.group.metrics
            if m is not None:
                m.setdefault("first_token_time", now)
                if s.group.finished:
                    m["finished_time"] = now

    def _step(self) -> list[Sequence]:
        start = time.perf_counter()
        compiled_before = self.runner.compile_seconds
        output = self.scheduler.schedule()
        if not output.rows:
            raise RuntimeError(
                "scheduler made no progress: nothing runs although requests remain "
                f"(waiting={len(self.scheduler.waiting)}, swapped={len(self.scheduler.swapped)})"
            )
        t_sched = time.perf_counter()
        prefilled = _prefill_tokens(output)
        result = self.runner.run(output)
        t_run = time.perf_counter()
        finished, ended, generated = self.postprocess(output, result)
        # Measured after the appends, before the finished release their blocks; cached-free
        # blocks (prefix caching) are reclaimable, so not allocated.
        blocks = self.kv.blocks
        allocated = self.runner.num_blocks - blocks.num_available
        charged = self.scheduler.accounting.charged_blocks(allocated)
        tokens_held = sum(s.num_computed for g in self.scheduler.running for s in g.seqs if s.row_live)
        unshared, per_request = self._sharing(blocks)
        self.scheduler.finish(finished, ended)
        if self.debug_checks:
            self.check()
        end = time.perf_counter()
        self.stats.record_step(
            batch=len(output.rows),
            generated=generated,
            prefilled=prefilled,
            tokens_held=tokens_held,
            allocated_blocks=allocated,
            charged_blocks=charged,
            seconds=end - start,
            waiting=len(self.scheduler.waiting) + len(self.scheduler.swapped),
            compile_seconds=self.runner.compile_seconds - compiled_before,
            unshared_blocks=unshared,
            request_blocks=per_request,
            speculated=sum(1 for r in output.rows if r.spec),
            phases={"schedule": t_sched - start, "run": t_run - t_sched, "update": end - t_run},
        )
        return finished

    def postprocess(
        self, output: SchedulerOutput, result: StepResult
    ) -> tuple[list[Sequence], list[SequenceGroup], int]:
        """Record the step's tokens; returns (sampled sequences that finished, beam searches
        that ended, tokens generated)."""
        self.scheduler.swapped_out(output.swapped_out, result.swapped)
        cache = self.scheduler.prefix_cache
        blocks = self.kv.blocks
        prompt_lps = result.prompt_logprobs or {}
        finished, generated, beams = [], 0, {}
        for i, row in enumerate(output.rows):
            seq, fed = row.seq, row.num_tokens
            if row.spec:
                generated += self._speculated(seq, row.spec, i, result)
                if seq.finished:
                    finished.append(seq)
                continue
            seq.num_computed += fed
            if cache is not None:  # before a beam step rewrites the histories
                cache.record(seq, seq.num_computed - fed, blocks)
            if i in prompt_lps:
                # Positions in order, each once: a recompute's re-fed positions were
                # planned without targets, and ``len`` only grows.
                targets, lp, rank, top_lp, top_ids = prompt_lps[i]
                recorded = seq.group.prompt_logprobs
                start = seq.num_computed - fed
                for t, target in enumerate(targets):
                    if target >= 0 and start + t + 1 == len(recorded):
                        recorded.append(_logprob_dict(target, lp[t], rank[t], top_lp[t], top_ids[t],
                                                      seq.params.prompt_logprobs))
            if seq.num_pending:  # mid-prefill: its sample is not a prediction we need
                continue
            if seq.group.beam is not None:
                top = seq.group.beam.num_candidates
                seq.candidates = (result.top_logprobs[i, :top], result.top_ids[i, :top])
                beams[id(seq.group)] = seq.group
                continue
            generated += 1
            token, logprob = int(result.tokens[i]), float(result.logprobs[i])
            entry = None
            if seq.output_logprobs is not None:
                entry = _logprob_dict(token, logprob, int(result.ranks[i]), result.top_logprobs[i],
                                      result.top_ids[i], seq.params.logprobs)
            if self._append_token(seq, token, logprob, entry):
                finished.append(seq)
        ended = []
        for group in beams.values():
            advanced = self._beam_step(group)
            if advanced is None:
                ended.append(group)
            else:
                generated += advanced
        return finished, ended, generated

    def _speculated(self, seq: Sequence, proposed: int, i: int, result: StepResult) -> int:
        """Record one speculative round: the pending token and the ``a`` accepted
        proposals are now computed (the device truncated the row to them), and ``a + 1``
        tokens join the output, cut at a stop. Returns the tokens appended."""
        accepted = int(result.accepted[i])
        before = seq.num_computed
        emitted = 0
        for token, logprob in zip(result.spec_tokens[i, : accepted + 1], result.spec_logprobs[i, : accepted + 1],
                                  strict=True):
            emitted += 1
            if self._append_token(seq, int(token), float(logprob)):
                break
        # The row holds the pending token and the accepted proposals (the device truncated
        # it to them); a stop among them ends the sequence there.
        seq.num_computed = min(before + 1 + accepted, seq.num_tokens)
        if (cache := self.scheduler.prefix_cache) is not None:
            cache.record(seq, before, self.kv.blocks)
        self.stats.spec.record(proposed, accepted, emitted)
        return emitted

    def _beam_step(self, group: SequenceGroup) -> int | None:
        """One beam step once every beam has its candidates: the next beams (a parent and a
        token each, made on the device next step by ``select_parents``), or None when the
        search is over. Returns the tokens the step generated."""
        started = [s for s in group.live if s.row_live]
        if any(s.candidates is None for s in started):
            return 0  # a sibling is still catching up (a chunked recompute)
        bp = group.params
        width, k = group.beam.width, group.beam.num_candidates
        logprobs = np.full((width, k), -np.inf, np.float32)
        ids = np.zeros((width, k), np.int32)
        for b, s in enumerate(group.live):
            if s.candidates is not None:
                logprobs[b], ids[b] = s.candidates
            s.candidates = None
        group.beam, choice = beam_lib.beam_step(
            group.beam, logprobs, ids, eos=group.eos, max_tokens=group.seqs[0].max_tokens,
            length_penalty=bp.length_penalty, early_stopping=bp.early_stopping,
        )
        if choice is None:
            return None
        histories = [(list(s.output_token_ids), s.cumulative_logprob) for s in group.live]
        for s, parent, token, logprob in zip(group.live, choice.parents, choice.tokens, choice.logprobs, strict=True):
            outputs, cum = histories[parent]
            s.output_token_ids = [*outputs, token]
            s.cumulative_logprob = cum + logprob
        group.pending_select = list(choice.parents)
        return len(choice.tokens)

    def _sharing(self, view) -> tuple[int, dict]:
        """Blocks the live rows would hold unshared, and per request with several members
        (physical, unshared); a one-member request holds exactly its own blocks."""
        bs = self.runner.block_size
        lens = view.seq_lens[view.active]
        unshared = int(blocks_for(lens, bs).sum())
        groups = [(g.request_id, [s.slot for s in g.seqs if s.row_live]) for g in self.scheduler.running]
        groups = [(rid, rows) for rid, rows in groups if len(rows) > 1]
        if not groups:
            return unshared, {}
        # Every multi-member request at once: its distinct (request, block) pairs.
        rows = np.concatenate([rows for _, rows in groups])
        owner = np.repeat(np.arange(len(groups)), [len(r) for _, r in groups])
        tables = view.block_tables[rows]
        named = tables != NO_BLOCK
        pairs = np.unique(np.stack([np.broadcast_to(owner[:, None], tables.shape)[named], tables[named]]), axis=1)
        physical = np.bincount(pairs[0], minlength=len(groups))
        private = np.bincount(owner, weights=blocks_for(view.seq_lens[rows], bs), minlength=len(groups))
        return unshared, {rid: (int(physical[i]), int(private[i])) for i, (rid, _) in enumerate(groups)}

    def flush(self) -> None:
        """Release the rows of the last step's finished sequences now (one device call and
        fetch); ``generate`` calls it when no step follows."""
        plan = self.scheduler.pending_release()
        if plan is not None:
            self.runner.run(plan)
            if self.debug_checks:
                self.check()

    def _append_token(self, seq: Sequence, token: int, logprob: float,
                      entry: dict[int, Logprob] | None = None) -> bool:
        """Record a sampled token (and its logprobs ``entry``, for a sequence that keeps
        ``output_logprobs``; without one, the token alone, rank unknown); True if the
        sequence is now finished. Stops count only once the output holds ``min_tokens``
        (vLLM's check; the sampler bans them before). EOS is a stop with ``stop_reason``
        None; a stop token id sets ``stop_reason`` to it (EOS wins if it is both)."""
        if token == NAN_TOKEN:  # the model's logits held a NaN: this request cannot go on
            seq.finish_reason = FinishReason.ERROR
            warnings.warn(f"request {seq.request_id}: the model's logits are NaN after {len(seq.output_token_ids)} "
                          "output tokens (NaN weights or an overflow); it ends with finish reason 'error'",
                          stacklevel=2)
            return True
        seq.output_token_ids.append(token)
        seq.cumulative_logprob += logprob
        if seq.output_logprobs is not None:
            seq.output_logprobs.append(entry if entry is not None else {token: Logprob(logprob)})
        params = seq.params
        may_stop = len(seq.output_token_ids) >= getattr(params, "min_tokens", 0)
        if may_stop and not params.ignore_eos and token in self.config.model.eos_token_ids:
            seq.finish_reason = FinishReason.STOP
        elif may_stop and token in params.stop_token_ids:
            seq.finish_reason = FinishReason.STOP
            seq.stop_reason = token
        elif len(seq.output_token_ids) >= seq.max_tokens:
            seq.finish_reason = FinishReason.LENGTH
        if self.text is not None and seq.group is not None and seq.group.beam is None:
            # Every token feeds the text; a stop string it completes ends the sequence.
            matched = self.text.on_token(seq)
            if matched is not None and seq.finish_reason in (None, FinishReason.LENGTH):
                seq.finish_reason, seq.stop_reason = FinishReason.STOP, matched
        return seq.finish_reason is not None

    def check(self) -> None:
        """Invariants after a step: the block manager's, the device agreeing with the host
        about every live row and with the host model (``KVCacheManager``), the prefix
        index, and the host swap pool's accounting. A debug aid: it syncs the device."""
        sched = self.scheduler
        live = {s.slot: s.num_computed for g in sched.running for s in g.live if s.row_live}
        self.runner.check(live, pending_release=sched.pending_rows)
        if sched.prefix_cache is not None:
            # A beam step already rewrote its members' histories; their rows follow next step.
            rows = {s.slot: s.token_ids()[: s.num_computed] for g in sched.running if g.pending_select is None
                    for s in g.live if s.row_live}
            sched.prefix_cache.check(np.asarray(self.runner.cache_state.cached), rows, self.kv.blocks)
        if sched.swapping:
            self.kv.swap_pool.check([g.swapped.host_ids for g in sched.swapped if g.swapped is not None])

    def warmup(self, use_tqdm: bool = True) -> int:
        """Compile every program a plain (non-speculative, no logprobs) step can call, up
        front: the decode and prefill buckets (``ModelRunner.warmup_shapes``). Returns how
        many shapes were run; with the persistent cache warm this is mostly reading back."""
        shapes = self.runner.warmup_shapes()
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(shapes), desc="compiling", unit="program")
        try:
            self.runner.warmup(shapes, on_shape=None if bar is None else (lambda name, shape: bar.update()))
        finally:
            if bar is not None:
                bar.close()
        return len(shapes)

    # ------------------------------------------------------------------ recovery

    def reset(self) -> None:
        """Back to an empty, consistent engine after a call was interrupted anywhere (in the
        scheduler's planning, between a device call and its host bookkeeping, or with the
        donated KV arrays lost): every unfinished request is aborted (finish reason
        "abort"), the block manager starts from an empty pool (the prefix cache with it),
        the host swap pool is emptied. Compiled programs, the pages' memory (unless lost)
        and the statistics are kept."""
        old = self.scheduler
        for group in self.unfinished():
            for s in group.seqs:
                if s.finish_reason is None:
                    s.finish_reason = FinishReason.ABORT
                s.slot, s.row_live = None, False
            group.status = SeqStatus.FINISHED
        self.runner.reset()
        self.kv = self.runner.kv = KVCacheManager(self.config, jax.eval_shape(lambda: self.runner.pages))
        self.scheduler = self._new_scheduler()
        self.scheduler.counters = old.counters

    def abort(self, request_ids: list[str]) -> None:
        """Abort unfinished requests by id (``Scheduler.abort``); ValueError, before anything
        changes, for an id that is not unfinished here."""
        live = {g.request_id: g for g in self.unfinished()}
        unknown = [r for r in request_ids if r not in live]
        if unknown:
            raise ValueError(f"unknown request ids (never added, or already finished): {unknown}")
        for rid in dict.fromkeys(request_ids):
            self.scheduler.abort(live[rid])

    # ------------------------------------------------------------------ stats

    def summary(self) -> dict:
        """Counters since construction (or ``reset_stats``); see ``stats.py``."""
        cfg, sched, runner = self.config, self.scheduler, self.runner
        c = sched.counters
        out = self.stats.summary()
        traces = runner.traces
        out.update(
            kv_cache=cfg.cache.mode,
            kv_cache_dtype=cfg.cache.kv_cache_dtype,
            block_size=cfg.cache.block_size,
            bytes_per_block=runner.bytes_per_block,
            preemption_mode=cfg.scheduler.preemption_mode,
            preemptions={"recompute": c.preemptions["recompute"], "swap": c.preemptions["swap"]},
            num_preemptions=sum(c.preemptions.values()),
            swap_outs=c.swap_outs,
            swap_ins=c.swap_ins,
            blocks_swapped_out=c.blocks_swapped_out,
            blocks_swapped_in=c.blocks_swapped_in,
            swap_fallbacks=c.swap_fallbacks,
            compiles=sum(traces.values()),
            speculative=None if cfg.speculative is None else cfg.speculative.method,
            compile_seconds=runner.compile_seconds,
            tokens_per_s_excl_compile=(
                out["generated_tokens"] / max(out["seconds"] - runner.compile_seconds, 1e-9) if out["seconds"] else 0.0
            ),
            traces=dict(traces),
        )
        cache = self.kv.prefix_cache
        pc = cache.counters if cache is not None else None
        out.update(
            prefix_caching=cache is not None,
            prefix_cache_query_tokens=pc.query_tokens if pc else 0,
            prefix_cache_hit_tokens=pc.hit_tokens if pc else 0,
            prefix_cache_hit_rate=pc.hit_tokens / pc.query_tokens if pc and pc.query_tokens else 0.0,
            prefix_cache_evictions=pc.evictions if pc else 0,
            cached_blocks=cache.num_cached if cache is not None else 0,
            peak_cached_blocks=pc.peak_cached_blocks if pc else 0,
        )
        return out

    def reset_stats(self) -> None:
        """Start counting afresh (e.g. after a warm-up run); the trace counts are kept."""
        self.scheduler.counters = SchedulerCounters()
        if (cache := self.scheduler.prefix_cache) is not None:
            cache.counters = PrefixCacheCounters(peak_cached_blocks=cache.num_cached)
        self.runner.compile_seconds = 0.0
        self.stats = EngineStats(block_size=self.config.cache.block_size, num_blocks=self.config.cache.num_blocks)

    def usage(self):
        """Request and block counts now, host side, no device sync (``inspection.EngineUsage``)."""
        from paged_jax.engine.inspection import usage_of

        return usage_of(self)

    def inspect(self):
        """The block manager as the device holds it now (a ``inspection.CacheInspection``;
        a device sync: for tests, notebooks and debugging)."""
        from paged_jax.engine.inspection import inspect_engine

        return inspect_engine(self)
