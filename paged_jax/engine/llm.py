"""The public offline API, with vLLM's names: ``LLM``, ``SamplingParams``, ``RequestOutput``.

    llm = LLM(model="tests/fixtures/llama", num_gpu_blocks=64, max_num_seqs=8)
    outs = llm.generate([[1, 2, 3], {"prompt_token_ids": [4, 5]}],
                        SamplingParams(temperature=0, max_tokens=8))
    outs[0].outputs[0].token_ids, llm.stats()

``model`` is a local Hugging Face checkpoint directory, a ``ModelConfig`` (random weights
from ``seed``), or a ``ModelBackend`` (any step functions obeying the contract in
``paged_jax/steps.py``; tests use a small fake).

Differences from vLLM worth knowing: prompts are token ids (there is no tokenizer);
prompts longer than ``max_model_len - 1`` are rejected up front, before anything is
generated (vLLM raises too); generation stops at ``max_model_len`` total tokens with
finish reason "length"; the KV pool size is given (``num_gpu_blocks`` or
``kv_cache_memory_bytes``), not profiled; ``kv_cache="static"`` runs the
pre-PagedAttention baseline (see ``accounting.py``).
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
import warnings
from collections.abc import Sequence as Seq

import jax

from paged_jax.config import blocks_for
from paged_jax.engine import beam as beam_lib
from paged_jax.engine.accounting import PagedAccounting, StaticAccounting
from paged_jax.engine.beam import BeamSearchOutput, BeamSearchParams
from paged_jax.engine.engine import LLMEngine
from paged_jax.engine.prefix_cache import PrefixCache
from paged_jax.engine.runner import ModelBackend, ModelRunner, RunnerConfig
from paged_jax.engine.sampling import SamplingParams, completion_seed, seed_for
from paged_jax.engine.scheduler import Scheduler, SchedulerConfig
from paged_jax.engine.sequence import FinishReason, Sequence, SequenceGroup
from paged_jax.kv.pages import bytes_per_block as kv_bytes_per_block

KV_CACHE_MODES = ("paged", "static")


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
    """One completion of a request."""

    index: int
    token_ids: list[int]
    cumulative_logprob: float  # sum of log p(token) under the unmodified model distribution
    finish_reason: str  # "length" or "stop"


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    rejected: str | None = None  # why the request never ran (its completions are empty)


def _load(model, *, dtype: str, seed: int):
    """(ModelConfig, params, eos id or None, name) of a checkpoint directory or a
    ``ModelConfig`` (random weights from ``seed``)."""
    from paged_jax.model import ModelConfig, init_params, load_model

    eos = None
    if isinstance(model, ModelConfig):
        config = model.replace(dtype=dtype)
        _, params = init_params(config, seed)
        name = f"random {config.architecture} ({config.num_params / 1e6:.1f}M params, seed {seed})"
    elif isinstance(model, (str, os.PathLike)):
        if not os.path.isdir(model):
            raise ValueError(f"model={model!r}: not a local checkpoint directory (no downloads)")
        config, _, params = load_model(model, dtype=dtype)
        with open(os.path.join(model, "config.json")) as f:
            eos = json.load(f).get("eos_token_id")
        if isinstance(eos, list):  # some checkpoints list several; the first is the EOS
            eos = eos[0] if eos else None
        name = f"{config.architecture} from {model}"
    else:
        raise ValueError(
            f"model={model!r}: expected a local HF checkpoint directory, a ModelConfig or a ModelBackend"
        )
    return config, params, eos, name


def build_backend(
    model, *, dtype: str, seed: int, attention_impl: str, block_size: int, kv_cache_dtype: str = "auto",
    speculative=None,
) -> ModelBackend:
    """A ``ModelBackend`` from a checkpoint directory or a ``ModelConfig`` (random weights),
    its KV pages in ``kv_cache_dtype`` (``kv.quant``). With a draft-model
    ``speculative`` config the backend runs the draft beside the target, its KV in the
    same blocks (``paged_jax.engine.draft``)."""
    draft = speculative is not None and speculative.method == "draft_model"
    if isinstance(model, ModelBackend):
        if kv_cache_dtype != "auto":
            raise ValueError(
                f"kv_cache_dtype={kv_cache_dtype!r} with a ModelBackend: the backend's init_pages decides "
                "its page format; pass 'auto'"
            )
        if draft:
            raise ValueError("speculative method 'draft_model' needs the target as a checkpoint or ModelConfig, "
                             "not a ModelBackend")
        return model
    from paged_jax import kv
    from paged_jax.steps import make_model_step

    config, params, eos, name = _load(model, dtype=dtype, seed=seed)

    def pages_for(cfg):
        return lambda num_blocks: kv.init_pages(cfg.num_layers, cfg.num_kv_heads, num_blocks, block_size,
                                                cfg.head_dim, dtype, kv_cache_dtype)

    backend = ModelBackend(
        step=make_model_step(config, attention_impl),
        params=params,
        init_pages=pages_for(config),
        vocab_size=config.vocab_size,
        eos_token_id=eos,
        max_position=config.max_seq_len,
        name=name,
    )
    if not draft:
        return backend
    from paged_jax.engine.draft import DraftPages, check_draft, make_draft_steps
    from paged_jax.model import ModelConfig

    target_pages = pages_for(config)
    # The draft's shape is checked before its weights are built or read.
    draft_shape = speculative.model
    if isinstance(draft_shape, (str, os.PathLike)) and os.path.isdir(draft_shape):
        draft_shape = ModelConfig.from_hf(draft_shape)
    if isinstance(draft_shape, ModelConfig):
        check_draft(config, draft_shape)
    # A ModelConfig draft gets random weights from the same seed: the target's own config
    # gives the target's own weights (acceptance 1, the machinery's pure overhead).
    draft_config, draft_params, _, draft_name = _load(speculative.model, dtype=dtype, seed=seed)
    steps = make_draft_steps(config, draft_config, attention_impl, speculative.num_speculative_tokens)
    draft_pages = pages_for(draft_config)
    return backend._replace(
        step=steps.step,
        params=(params, draft_params),
        init_pages=lambda num_blocks: DraftPages(target_pages(num_blocks), draft_pages(num_blocks)),
        name=f"{name}, draft {draft_name}",
        propose=steps.propose,
        # Sequences must fit both models (the draft sees every token too).
        max_position=min(config.max_seq_len, draft_config.max_seq_len),
    )


class LLM:
    """An offline engine: continuous batching over a paged (or static) KV cache.

    Args:
      model: checkpoint directory, ``ModelConfig`` (random weights) or ``ModelBackend``.
      block_size: tokens per KV block (a power of two).
      num_gpu_blocks: blocks in the device pool. Or give ``kv_cache_memory_bytes`` and
        the pool is as many blocks as fit. Neither: room for ``max_num_seqs`` sequences
        of ``max_model_len`` tokens (no memory pressure).
      max_num_seqs: sequences running at once (block-table rows; the largest batch).
      max_model_len: prompt + output tokens per sequence; default the model's maximum,
        capped by the pool.
      max_num_batched_tokens: tokens per step (decodes + prefill chunks); default
        ``max(max_model_len, max_num_seqs)`` up to 2048 but at least ``max_num_seqs``.
      preemption_mode: "recompute" or "swap" (see ``scheduler.py``).
      swap_space_blocks: host swap pool size in blocks (swap mode; default: as many as
        the device pool).
      allocation_policy: block allocation order: "lifo", "fifo", "lowest_id_first", "random".
      attention_impl: a name in ``attention.dispatch`` ("auto", "xla", "reference",
        "pallas", "pallas_interpret").
      dtype: parameter and compute dtype, and the KV dtype unless ``kv_cache_dtype`` says.
      kv_cache_dtype: "auto" (KV in ``dtype``), "int8" (per-token scales), "int8_channel"
        (per-block, per-channel scales) or "fp8_e4m3" (float8 values, per-token scales):
        quantised on write, dequantised on read by every attention implementation
        (``kv.quant``). A byte budget (``kv_cache_memory_bytes``) counts the scales.
      seed: random weights (ModelConfig) and default per-request sampling seeds.
      kv_cache: "paged" or "static" (each sequence reserves max_model_len up front).
      watermark: fraction of the pool kept free at admission (paged).
      admission_lookahead: paged: also keep free, at admission, the blocks the running
        sequences will take over this many steps (capped by each one's max_tokens), so a
        new request is not admitted only to be preempted again a few steps later. 0 (the
        default) admits like vLLM: prompt blocks above the watermark.
      victim_policy: name in ``victim.VICTIM_POLICIES`` or a function.
      share_blocks: True (default): forked completions and beams share blocks, copied on
        write. False: every fork and beam selection copies all its blocks (``unshare``):
        the baseline that measures what sharing saves.
      enable_prefix_caching: reuse the KV of cached full blocks across requests (vLLM's
        automatic prefix caching; ``prefix_cache.py``). A request reuses the longest
        cached run of its prompt's full blocks under its ``cache_salt`` (a prompt dict's
        field: requests share only within one salt; those without one share with each
        other). Blocks filled by generated tokens are cached too, so a conversation's
        next turn reuses its whole history. Off by default.
      eviction_policy: which cached-free block goes first when the pool runs out: a name
        in ``cache.EVICTION_POLICIES`` ("lru", "fifo", "lfu", "leaf_first") or an
        ``EvictionPolicy``.
      prefix_cache_hash: "sha256" (default), "blake2b" (cryptographic) or "python" (fast,
        64-bit, not collision-resistant), or a ``cache.HashFunction``. Every hit is also
        checked against the block's token ids and salt (and, for a hash that is not
        collision-resistant, its parent block), so a collision is a miss, never another
        sequence's KV.
      speculative_config: speculative decoding (``engine/speculative.py``), vLLM's keys:
        ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
        "prompt_lookup_min": 1}`` or ``{"method": "draft_model", "model": <checkpoint
        directory or ModelConfig>, "num_speculative_tokens": k}``. Greedy outputs are
        unchanged; sampled ones keep the target's distribution. Not with beam search.
        A draft model's KV shares the target's blocks (``bytes_per_block`` counts both).
      debug_checks: check every invariant after every op and step (slow; for tests).
    """

    def __init__(
        self,
        model,
        *,
        block_size: int = 16,
        num_gpu_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        preemption_mode: str = "recompute",
        swap_space_blocks: int | None = None,
        allocation_policy: str = "lifo",
        attention_impl: str = "auto",
        dtype: str = "float32",
        kv_cache_dtype: str = "auto",
        seed: int = 0,
        kv_cache: str = "paged",
        watermark: float = 0.01,
        admission_lookahead: int = 0,
        victim_policy="most_recently_admitted",
        share_blocks: bool = True,
        enable_prefix_caching: bool = False,
        eviction_policy="lru",
        prefix_cache_hash="sha256",
        speculative_config: dict | None = None,
        debug_checks: bool = False,
    ):
        if not isinstance(share_blocks, bool):
            raise ValueError(f"share_blocks={share_blocks!r}: must be True or False")
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching={enable_prefix_caching!r}: must be True or False")
        from paged_jax.cache import get_eviction_policy, get_hash
        from paged_jax.kv.quant import kv_format

        get_eviction_policy(eviction_policy)
        get_hash(prefix_cache_hash)
        from paged_jax.engine.speculative import SpeculativeConfig

        speculative = None if speculative_config is None else SpeculativeConfig.from_dict(speculative_config)
        kv_format(kv_cache_dtype)
        if not isinstance(model, ModelBackend):
            from paged_jax.attention.dispatch import check_reads

            check_reads(attention_impl, kv_cache_dtype)
        if enable_prefix_caching and kv_cache != "paged":
            raise ValueError(
                f"enable_prefix_caching=True needs kv_cache='paged': the {kv_cache!r} baseline shares no blocks"
            )
        if enable_prefix_caching and not share_blocks:
            raise ValueError("enable_prefix_caching=True shares blocks; it cannot run with share_blocks=False")
        if kv_cache not in KV_CACHE_MODES:
            raise ValueError(f"kv_cache={kv_cache!r}: unknown; choose one of {list(KV_CACHE_MODES)}")
        if num_gpu_blocks is not None and kv_cache_memory_bytes is not None:
            raise ValueError("give num_gpu_blocks or kv_cache_memory_bytes, not both")
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs!r}: must be an int >= 1")
        # Validate names before building anything expensive.
        from paged_jax.cache import get_policy

        get_policy(allocation_policy)
        SchedulerConfig(
            max_num_seqs=1, max_num_batched_tokens=1, block_size=block_size,
            preemption_mode=preemption_mode, victim_policy=victim_policy,
            admission_lookahead=admission_lookahead, share_blocks=share_blocks,
        )
        backend = build_backend(
            model, dtype=dtype, seed=seed, attention_impl=attention_impl, block_size=block_size,
            kv_cache_dtype=kv_cache_dtype, speculative=speculative,
        )

        bytes_per_block = kv_bytes_per_block(jax.eval_shape(lambda: backend.init_pages(1)))
        if kv_cache_memory_bytes is not None:
            num_gpu_blocks = int(kv_cache_memory_bytes) // bytes_per_block
            if num_gpu_blocks < 1:
                raise ValueError(
                    f"kv_cache_memory_bytes={kv_cache_memory_bytes}: smaller than one block ({bytes_per_block} bytes)"
                )
        limit = backend.max_position
        if max_model_len is None:
            max_model_len = limit if limit is not None else 2048
            if num_gpu_blocks is not None:
                max_model_len = min(max_model_len, num_gpu_blocks * block_size)
        if not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"max_model_len={max_model_len!r}: must be an int >= 2")
        if limit is not None and max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's maximum length {limit}")
        blocks_per_seq = blocks_for(max_model_len, block_size)
        if num_gpu_blocks is None:
            num_gpu_blocks = max_num_seqs * blocks_per_seq
        if num_gpu_blocks < blocks_per_seq:
            raise ValueError(
                f"max_model_len={max_model_len} needs {blocks_per_seq} blocks of {block_size} tokens "
                f"but the KV pool has {num_gpu_blocks}: lower max_model_len or enlarge the pool"
            )
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(min(max(max_model_len, max_num_seqs), 2048), max_num_seqs)
        if speculative is not None and speculative.num_speculative_tokens + 1 > blocks_per_seq * block_size:
            raise ValueError(
                f"num_speculative_tokens={speculative.num_speculative_tokens}: a round feeds k + 1 tokens, more "
                f"than a block-table row holds ({blocks_per_seq} blocks of {block_size} tokens)"
            )
        self.speculative = speculative

        self.kv_cache = kv_cache
        self.kv_cache_dtype = kv_cache_dtype
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.seed = seed
        self.backend = backend
        swapping = preemption_mode == "swap" and kv_cache == "paged"
        if not swapping:
            swap_space_blocks = 0
        elif swap_space_blocks is None:
            swap_space_blocks = num_gpu_blocks
        self.runner = ModelRunner(
            backend,
            RunnerConfig(
                num_blocks=num_gpu_blocks,
                block_size=block_size,
                max_num_seqs=max_num_seqs,
                max_blocks_per_seq=blocks_per_seq,
                max_num_batched_tokens=max_num_batched_tokens,
                allocation_policy=allocation_policy,
                debug=debug_checks,
                prefix_caching=enable_prefix_caching,
                num_speculative_tokens=speculative.num_speculative_tokens if speculative else 0,
            ),
            swap_space_blocks=swap_space_blocks,
        )
        if kv_cache == "paged":
            accounting = PagedAccounting(num_gpu_blocks, block_size, watermark)
        else:
            accounting = StaticAccounting(num_gpu_blocks, block_size, max_model_len)
        prefix_cache = None
        if enable_prefix_caching:
            prefix_cache = PrefixCache(num_gpu_blocks, block_size, hash_fn=prefix_cache_hash,
                                       eviction_policy=eviction_policy)
        scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                block_size=block_size,
                preemption_mode=preemption_mode,
                victim_policy=victim_policy,
                admission_lookahead=admission_lookahead,
                share_blocks=share_blocks,
                speculative=speculative,
            ),
            self.runner,
            accounting,
            swapping=swapping,
            prefix_cache=prefix_cache,
        )
        self.engine = LLMEngine(scheduler, self.runner, eos_token_id=backend.eos_token_id, debug_checks=debug_checks)
        self._next_request = 0

    # ------------------------------------------------------------------ generate

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list:
        """Run every prompt to completion; outputs in prompt order.

        Args:
          prompts: token-id lists or ``{"prompt_token_ids": [...], "cache_salt": str}``
            dicts (the salt optional: prefix caching shares blocks only within one salt),
            or one prompt.
          sampling_params: one ``SamplingParams`` for all, one per prompt, or None
            (defaults). A ``BeamSearchParams`` in the list makes that request a beam
            search (its output is then a ``BeamSearchOutput``), batched with the others.

        Returns a ``RequestOutput`` (``n`` completions) per sampling request and a
        ``BeamSearchOutput`` per beam search, in prompt order.

        Raises ValueError, before generating anything, for an empty prompt, a token
        outside the vocabulary, a prompt that cannot fit (``>= max_model_len`` tokens), or
        ``n`` or ``beam_width`` above ``max_num_seqs``, naming the request index and the
        limit. A request whose members need more blocks than the whole pool, even sharing
        their prompt, can never run: it is rejected with a warning naming the limit, its
        output has ``rejected`` set (and no tokens), and the other requests complete.
        """
        groups = self.add_requests(prompts, sampling_params)
        bar = _progress(len(groups)) if use_tqdm else None
        while self.engine.has_unfinished():
            self.engine.step()
            if bar is not None:
                bar.update(sum(g.finished for g in groups) - bar.n)
        self.engine.flush()
        if bar is not None:
            bar.close()
        return self.outputs(groups)

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for every prompt (vLLM's ``LLM.beam_search``), all in one batch:
        ``BeamSearchOutput``s in prompt order (see ``beam.py`` for the rules)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params={params!r}: expected BeamSearchParams")
        return self.generate(prompts, [params] * len(_normalise_prompts(prompts)), use_tqdm=use_tqdm)

    def add_requests(self, prompts, sampling_params=None) -> list[SequenceGroup]:
        """Validate and queue requests without running them (``generate`` = this, then
        ``engine.step()`` until done, then ``outputs``). For drivers that step engines
        themselves, e.g. a benchmark interleaving two engines. Same arguments and errors
        as ``generate``; nothing is queued if any request is bad."""
        prompts = _normalise_prompts(prompts)
        salts = [salt for _, salt in prompts]
        prompts = [tokens for tokens, _ in prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams | BeamSearchParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams | BeamSearchParams):
                raise ValueError(f"sampling_params[{i}]={p!r}: expected SamplingParams or BeamSearchParams")
            if isinstance(p, BeamSearchParams) and self.speculative is not None:
                raise ValueError(f"request {i}: beam search with speculative decoding is not supported "
                                 f"(speculative method {self.speculative.method!r})")
        rejected = {}
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            self._validate_prompt(i, prompt)
            if (why := self._validate_fit(i, prompt, p)) is not None:
                rejected[i] = why

        groups = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            rid = str(self._next_request)
            self._next_request += 1
            groups.append(self._group(rid, i, tuple(prompt), p))
            groups[-1].cache_salt = salts[i]
            if i in rejected:
                groups[-1].rejected = rejected[i]
                warnings.warn(rejected[i] + "; rejected (its output is empty)", stacklevel=3)
            else:
                self.engine.add(groups[-1])
        return groups

    def _group(self, rid: str, index: int, prompt: tuple[int, ...], p) -> SequenceGroup:
        """The ``SequenceGroup`` of one request: ``n`` completions, or ``beam_width`` beams."""
        max_tokens = min(p.max_tokens, self.max_model_len - len(prompt))
        if isinstance(p, BeamSearchParams):
            eos = self._beam_eos(p)
            seqs = [Sequence(rid, index, prompt, p, seed=0, max_tokens=max_tokens, completion=b)
                    for b in range(p.beam_width)]
            return SequenceGroup(rid, index, prompt, p, seqs, beam=beam_lib.init_state(p.beam_width, len(eos)),
                                 eos=eos)
        seed = seed_for(self.seed, rid, p.seed)
        seqs = [Sequence(rid, index, prompt, p, seed=completion_seed(seed, i), max_tokens=max_tokens, completion=i)
                for i in range(p.n)]
        return SequenceGroup(rid, index, prompt, p, seqs)

    def _beam_eos(self, p: BeamSearchParams) -> tuple[int, ...]:
        if p.ignore_eos:
            return ()
        if p.eos_token_id is not None:
            return p.eos_token_id
        eos = self.backend.eos_token_id
        return () if eos is None else (eos,)

    @staticmethod
    def outputs(groups: list[SequenceGroup]) -> list:
        """``RequestOutput``s (sampling) and ``BeamSearchOutput``s (beam search) of finished
        requests, in the given order."""
        out = []
        for g in groups:
            if g.beam is not None:
                out.append(BeamSearchOutput([], g.rejected) if g.rejected
                           else beam_lib.results(g.beam, g.prompt_token_ids, g.eos))
                continue
            reason = FinishReason.REJECTED.value if g.rejected else None
            out.append(RequestOutput(
                request_id=g.request_id,
                prompt_token_ids=list(g.prompt_token_ids),
                outputs=[
                    CompletionOutput(
                        index=s.completion,
                        token_ids=list(s.output_token_ids),
                        cumulative_logprob=s.cumulative_logprob,
                        finish_reason=reason or s.finish_reason.value,
                    )
                    for s in g.seqs
                ],
                rejected=g.rejected,
            ))
        return out

    def _validate_fit(self, i: int, prompt: list[int], p) -> str | None:
        """Raise for members beyond the table rows or beam candidates beyond the
        vocabulary; return why the request can never fit the pool (even with every
        member's prompt shared, the members' tails private), or None if it can."""
        members, field = (p.beam_width, "beam_width") if isinstance(p, BeamSearchParams) else (p.n, "n")
        limit = self.runner.config.max_num_seqs
        if members > limit:
            raise ValueError(f"request {i}: {field}={members} exceeds max_num_seqs={limit}")
        if isinstance(p, BeamSearchParams):
            k = beam_lib.num_candidates(p.beam_width, len(self._beam_eos(p)))
            if k > self.backend.vocab_size:
                raise ValueError(
                    f"request {i}: beam_width={p.beam_width} keeps {k} candidates a step, more than the "
                    f"vocabulary ({self.backend.vocab_size})"
                )
        bs = self.block_size
        total = min(len(prompt) + p.max_tokens, self.max_model_len)
        shared = (len(prompt) - 1) // bs if members > 1 and self.engine.scheduler.config.share_blocks else 0
        need = shared + members * (blocks_for(total, bs) - shared)
        if need > self.num_gpu_blocks:
            return (f"request {i}: {field}={members} sequences of up to {total} tokens need up to {need} blocks "
                    f"of {bs} tokens (the prompt's full blocks shared) but the KV pool has {self.num_gpu_blocks}: "
                    "it can never fit")
        return None

    def _validate_prompt(self, i: int, prompt: list[int]) -> None:
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
        vocab = self.backend.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens; it must be shorter than "
                f"max_model_len={self.max_model_len} (room for at least one output token; "
                f"the KV pool holds {self.num_gpu_blocks} blocks of {self.block_size} tokens)"
            )

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict:
        """Counters since construction (or ``reset_stats``); see ``stats.py``."""
        sched = self.engine.scheduler
        c = sched.counters
        out = self.engine.stats.summary()
        out.update(
            kv_cache=self.kv_cache,
            kv_cache_dtype=self.kv_cache_dtype,
            block_size=self.block_size,
            bytes_per_block=self.runner.bytes_per_block,
            preemption_mode=sched.config.preemption_mode,
            preemptions={"recompute": c.preemptions["recompute"], "swap": c.preemptions["swap"]},
            num_preemptions=sum(c.preemptions.values()),
            swap_outs=c.swap_outs,
            swap_ins=c.swap_ins,
            blocks_swapped_out=c.blocks_swapped_out,
            blocks_swapped_in=c.blocks_swapped_in,
            swap_fallbacks=c.swap_fallbacks,
            compiles=self.runner.traces["prefill"] + self.runner.traces["decode"] + self.runner.traces["verify"],
            speculative=None if self.speculative is None else self.speculative.method,
            compile_seconds=self.runner.compile_seconds,
            tokens_per_s_excl_compile=(
                out["generated_tokens"] / max(out["seconds"] - self.runner.compile_seconds, 1e-9)
                if out["seconds"] else 0.0
            ),
            traces=dict(self.runner.traces),
        )
        cache = sched.prefix_cache
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
        from paged_jax.engine.scheduler import SchedulerCounters
        from paged_jax.engine.stats import EngineStats

        self.engine.scheduler.counters = SchedulerCounters()
        if (cache := self.engine.scheduler.prefix_cache) is not None:
            from paged_jax.engine.prefix_cache import PrefixCacheCounters

            cache.counters = PrefixCacheCounters(peak_cached_blocks=cache.num_cached)
        self.runner.compile_seconds = 0.0
        self.engine.stats = EngineStats(block_size=self.block_size, num_blocks=self.num_gpu_blocks)


def _normalise_prompts(prompts) -> list[tuple[list[int], str | None]]:
    """(token ids, cache salt or None) per prompt."""
    if isinstance(prompts, dict) or (isinstance(prompts, Seq) and prompts and isinstance(prompts[0], numbers.Integral)):
        prompts = [prompts]
    out = []
    for i, p in enumerate(prompts):
        salt = None
        if isinstance(p, dict):
            if "prompt_token_ids" not in p:
                raise ValueError(f"prompt {i}: a dict prompt needs 'prompt_token_ids'")
            salt = p.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise ValueError(f"prompt {i}: cache_salt={salt!r} must be a string")
            p = p["prompt_token_ids"]
        if isinstance(p, str):
            raise ValueError(f"prompt {i} is a string: this engine has no tokenizer; pass token ids")
        out.append(([int(t) for t in p], salt))
    return out


def _progress(total: int):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is an optional extra
        return None
    return tqdm(total=total, desc="generate", unit="req")
