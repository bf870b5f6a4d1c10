"""The public offline API, with vLLM's names: ``LLM``, ``SamplingParams``, ``RequestOutput``.

    llm = LLM("tests/fixtures/llama_text", max_num_seqs=8)
    outs = llm.generate(["The river", {"prompt_token_ids": [4, 5]}],
                        SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, stop=["\n\n"]))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids, llm.stats()

``model`` is a local Hugging Face checkpoint directory, a ``ModelConfig`` (random weights
from ``seed``), or a ``ModelBackend`` (any step functions obeying the contract in
``paged_jax/steps.py``; tests use a small fake). A checkpoint with a ``tokenizer.json``
takes text prompts and returns text (``paged_jax.text``); without one, token ids only.

Differences from vLLM worth knowing: prompts longer than ``max_model_len - 1`` are
rejected up front, before anything is generated (vLLM raises too); generation stops at
``max_model_len`` total tokens with finish reason "length"; without ``num_gpu_blocks`` or
``kv_cache_memory_bytes`` the pool is sized from device memory (``memory.py``) without a
profiling pass; ``kv_cache="static"`` runs the pre-PagedAttention baseline
(``accounting.py``); an exception inside ``generate`` (Ctrl-C included) aborts every
unfinished request and empties the pool, so the next call starts clean.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings

import jax

from paged_jax import buckets
from paged_jax.compilation_cache import enable_compilation_cache, mappings_pressure
from paged_jax.config import blocks_for
from paged_jax.dtypes import dtype_name
from paged_jax.engine import beam as beam_lib
from paged_jax.engine.accounting import PagedAccounting, StaticAccounting
from paged_jax.engine.beam import BeamSearchOutput, BeamSearchParams
from paged_jax.engine.engine import LLMEngine
from paged_jax.engine.memory import check_utilization, kv_budget_bytes
from paged_jax.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from paged_jax.engine.prefix_cache import PrefixCache
from paged_jax.engine.prompts import normalise_prompts
from paged_jax.engine.runner import ModelBackend, ModelRunner, RunnerConfig
from paged_jax.engine.sampling import SamplingParams, as_token_ids, completion_seed, seed_for
from paged_jax.engine.scheduler import Scheduler, SchedulerConfig
from paged_jax.engine.sequence import FinishReason, SeqStatus, Sequence, SequenceGroup
from paged_jax.engine.text_output import TextOutputs
from paged_jax.kv.pages import bytes_per_block as kv_bytes_per_block

KV_CACHE_MODES = ("paged", "static")
# vLLM's order of magnitude: a batch of prompts prefills in a step or two, so a first call
# compiles one or two prefill shapes rather than one per small chunk.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


def _load(model, *, dtype: str, seed: int):
    """(ModelConfig, params, GenerationDefaults, name) of a checkpoint directory or a
    ``ModelConfig`` (random weights from ``seed``). ``dtype="auto"``: the checkpoint's
    (config.json's ``torch_dtype``), a ``ModelConfig``'s own."""
    from paged_jax.model import ModelConfig, init_params, load_model, open_source
    from paged_jax.model.generation_config import GenerationDefaults

    auto = dtype == "auto"
    if isinstance(model, ModelConfig):
        config = model if auto else model.replace(dtype=dtype)
        _, params = init_params(config, seed)
        name = f"random {config.architecture} ({config.num_params / 1e6:.1f}M params, seed {seed})"
        return config, params, GenerationDefaults(), name
    if isinstance(model, (str, os.PathLike)):
        if not os.path.isdir(model):
            raise ValueError(f"model={model!r}: not a local checkpoint directory (no downloads)")
        source = open_source(model)
        defaults = source.generation_defaults()
        config, _, params = load_model(source, dtype=None if auto else dtype)
        return config, params, defaults, f"{config.architecture} from {model}"
    raise ValueError(
        f"model={model!r}: expected a local HF checkpoint directory, a ModelConfig or a ModelBackend"
    )


def build_backend(
    model, *, dtype: str, seed: int, attention_impl: str, block_size: int, kv_cache_dtype: str = "auto",
    speculative=None, mesh=None,
) -> ModelBackend:
    """A ``ModelBackend`` from a checkpoint directory or a ``ModelConfig`` (random weights),
    its KV pages in ``kv_cache_dtype`` (``kv.quant``). With a draft-model
    ``speculative`` config the backend runs the draft beside the target, its KV in the
    same blocks (``paged_jax.engine.draft``). With a one-replica ``mesh`` the weights and
    pages are sharded over its "model" axis (``paged_jax.parallel``)."""
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

    config, params, defaults, name = _load(model, dtype=dtype, seed=seed)
    step = None
    if mesh is not None:
        from paged_jax.parallel.backend import shard_model

        config, params, step = shard_model(config, params, mesh, attention_impl)

    def pages_for(cfg):
        return lambda num_blocks: kv.init_pages(cfg.num_layers, cfg.num_kv_heads, num_blocks, block_size,
                                                cfg.head_dim, cfg.dtype, kv_cache_dtype)

    backend = ModelBackend(
        step=step or make_model_step(config, attention_impl),
        params=params,
        init_pages=pages_for(config),
        vocab_size=config.vocab_size,
        eos_token_id=defaults.eos_token_ids or None,
        max_position=config.max_seq_len,
        name=name,
    )
    if mesh is not None:
        from paged_jax.parallel.backend import sharded_init

        return backend._replace(init_pages=sharded_init(backend.init_pages, mesh), mesh=mesh,
                                name=f"{name}, tensor parallel over {mesh.shape['model']} devices")
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
    # The draft computes in the target's dtype: their KV pages share blocks.
    draft_config, draft_params, _, draft_name = _load(speculative.model, dtype=config.dtype, seed=seed)
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
        the pool is as many blocks as fit. Neither: sized like vLLM's, from
        ``gpu_memory_utilization`` of the accelerator's memory (on the CPU a fixed
        budget, ``PAGED_JAX_CPU_KVCACHE_SPACE`` GiB, default 4; ``memory.py``), never more
        than ``max_num_seqs`` sequences of ``max_model_len`` tokens can use.
      gpu_memory_utilization: the fraction of accelerator memory the weights and the
        pool may take together (default 0.9); the rest is left for activations.
      max_num_seqs: sequences running at once (block-table rows; the largest batch).
      max_model_len: prompt + output tokens per sequence; default the model's maximum,
        capped (with a warning) at what the pool holds.
      max_num_batched_tokens: tokens per step (decodes + prefill chunks); default 2048
        (at least ``max_num_seqs``), so a first batch of prompts prefills in a call or two.
      decode_buckets: the decode batch sizes compiled (each one program); default powers
        of two from 8 up to ``max_num_seqs`` (``buckets.decode_buckets``): a first call
        compiles few programs. Finer sizes (``buckets.multiples_of(8, max_num_seqs)``)
        pad less where rows cost compute (CPU throughput studies).
      preemption_mode: "recompute" or "swap" (see ``scheduler.py``).
      swap_space_blocks: host swap pool size in blocks (swap mode; default: as many as
        the device pool).
      allocation_policy: block allocation order: "lifo", "fifo", "lowest_id_first", "random".
      attention_impl: a name in ``attention.dispatch`` ("auto", "xla", "reference",
        "pallas", "pallas_interpret").
      dtype: parameter and compute dtype, and the KV dtype unless ``kv_cache_dtype`` says:
        "auto" (the checkpoint's ``torch_dtype``; a ``ModelConfig``'s own), "float32",
        "bfloat16" or "float16".
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
      generation_config: "auto" (default): requests without ``SamplingParams`` get the
        checkpoint's generation_config.json defaults (temperature, top_p, top_k, min_p,
        repetition_penalty, max_new_tokens); "vllm": ``SamplingParams()``. Generation
        stops at every EOS id of config.json, generation_config.json and the tokenizer.
      tokenizer: a directory with ``tokenizer.json`` (default: the checkpoint's own).
      skip_tokenizer_init: no tokenizer: token ids in and out only.
      debug_checks: check every invariant after every op and step (slow; for tests).
      tensor_parallel_size: t devices per replica (vLLM's name): weights split
        Megatron-style, KV pages split by kv head (replicated when t exceeds the kv
        heads), block manager replicated (``paged_jax.parallel``). With t > 1,
        ``kv_cache_memory_bytes`` and the memory-sized pool are per device.
      data_parallel_size: d replicas, each with its own pool, block manager and
        scheduler; ``LLM(...)`` then returns a ``parallel.DataParallelLLM`` that assigns
        requests by ``data_parallel_policy`` ("round_robin", "least_loaded" or a
        function, ``parallel.replicas``) and returns outputs in prompt order.
      mesh: instead of t and d, a ``jax.sharding.Mesh`` with axes ("data", "model").

    JAX's persistent compilation cache is turned on (``paged_jax.compilation_cache``:
    ``~/.cache/paged_jax/jax``; ``PAGED_JAX_COMPILATION_CACHE=<dir>`` or ``=0``), so a
    second process does not compile the engine's programs again.
    """

    def __new__(cls, model=None, *args, data_parallel_size: int = 1, mesh=None, **kwargs):
        # d > 1 replicas: the data-parallel front end (one LLM per replica) in place of one engine.
        from paged_jax.parallel.backend import data_parallel_size as replicas

        if cls is LLM and replicas(1, data_parallel_size, mesh) > 1:
            from paged_jax.parallel.replicas import DataParallelLLM

            return super().__new__(DataParallelLLM)
        return super().__new__(cls)

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
        decode_buckets=None,
        preemption_mode: str = "recompute",
        swap_space_blocks: int | None = None,
        allocation_policy: str = "lifo",
        attention_impl: str = "auto",
        dtype: str = "auto",
        kv_cache_dtype: str = "auto",
        gpu_memory_utilization: float = 0.9,
        generation_config: str = "auto",
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
        tokenizer: str | os.PathLike | None = None,
        skip_tokenizer_init: bool = False,
        debug_checks: bool = False,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        mesh=None,
        data_parallel_policy="round_robin",
    ):
        from paged_jax.parallel.backend import check_supported, first_local_device, resolve_mesh

        del data_parallel_policy  # one replica: nothing to assign (DataParallelLLM uses it)
        mesh = resolve_mesh(tensor_parallel_size, data_parallel_size, mesh)
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
        if num_gpu_blocks is not None and (
                isinstance(num_gpu_blocks, bool) or not isinstance(num_gpu_blocks, int) or num_gpu_blocks < 1):
            raise ValueError(f"num_gpu_blocks={num_gpu_blocks!r}: the KV pool needs an int >= 1 blocks")
        if kv_cache_memory_bytes is not None and (
                isinstance(kv_cache_memory_bytes, bool) or not isinstance(kv_cache_memory_bytes, int)
                or kv_cache_memory_bytes < 1):
            raise ValueError(f"kv_cache_memory_bytes={kv_cache_memory_bytes!r}: must be an int >= 1")
        check_utilization(gpu_memory_utilization)
        if dtype != "auto":
            dtype_name(dtype)
        if generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config={generation_config!r}: 'auto' (the checkpoint's "
                             "generation_config.json defaults) or 'vllm' (SamplingParams' own)")
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs!r}: must be an int >= 1")
        buckets.decode_buckets(max_num_seqs, decode_buckets)
        # Validate names before building anything expensive.
        from paged_jax.cache import get_policy

        get_policy(allocation_policy)
        SchedulerConfig(
            max_num_seqs=1, max_num_batched_tokens=1, block_size=block_size,
            preemption_mode=preemption_mode, victim_policy=victim_policy,
            admission_lookahead=admission_lookahead, share_blocks=share_blocks,
        )
        if mesh is not None:
            check_supported(mesh, model=model, speculative=speculative, preemption_mode=preemption_mode)
        attention_impl = self._tiled_impl(model, attention_impl, block_size, speculative)
        tok = self._tokenizer(model, tokenizer, skip_tokenizer_init)
        enable_compilation_cache()
        if (pressure := mappings_pressure()) is not None:
            warnings.warn(pressure, stacklevel=2)
        backend = build_backend(
            model, dtype=dtype, seed=seed, attention_impl=attention_impl, block_size=block_size,
            kv_cache_dtype=kv_cache_dtype, speculative=speculative, mesh=mesh,
        )

        bytes_per_block = kv_bytes_per_block(jax.eval_shape(lambda: backend.init_pages(1)))
        if mesh is not None:  # a device holds 1/t of every block: budgets are per device
            bytes_per_block //= mesh.shape["model"]
        if kv_cache_memory_bytes is not None:
            num_gpu_blocks = int(kv_cache_memory_bytes) // bytes_per_block
            if num_gpu_blocks < 1:
                raise ValueError(
                    f"kv_cache_memory_bytes={kv_cache_memory_bytes}: smaller than one block ({bytes_per_block} bytes)"
                )
        sized_by = None
        if num_gpu_blocks is None:  # vLLM's sizing from device memory (``memory.py``)
            budget, sized_by = kv_budget_bytes(gpu_memory_utilization,
                                               None if mesh is None else first_local_device(mesh))
            pool_limit = budget // bytes_per_block
            if pool_limit < 1:
                raise ValueError(f"no room for a KV block ({bytes_per_block} bytes) with {sized_by}; "
                                 "give num_gpu_blocks or kv_cache_memory_bytes")
        else:
            pool_limit = num_gpu_blocks
        limit = backend.max_position
        if max_model_len is None:
            max_model_len = limit if limit is not None else 2048
            if max_model_len > pool_limit * block_size:
                warnings.warn(
                    f"max_model_len capped at {pool_limit * block_size} tokens (the model allows {max_model_len}): "
                    f"the KV pool holds {pool_limit} blocks of {block_size} tokens"
                    + (f" ({sized_by})" if sized_by else "") + "; pass max_model_len or a larger pool to choose",
                    stacklevel=2,
                )
                max_model_len = pool_limit * block_size
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"max_model_len={max_model_len!r}: must be an int >= 2")
        if limit is not None and max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's maximum length {limit}")
        blocks_per_seq = blocks_for(max_model_len, block_size)
        if num_gpu_blocks is None:  # no more than the engine could ever hold
            num_gpu_blocks = min(pool_limit, max_num_seqs * blocks_per_seq)
        if num_gpu_blocks < blocks_per_seq:
            raise ValueError(
                f"max_model_len={max_model_len} needs {blocks_per_seq} blocks of {block_size} tokens "
                f"but the KV pool has {num_gpu_blocks}" + (f" ({sized_by})" if sized_by else "")
                + ": lower max_model_len or enlarge the pool"
            )
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_num_seqs)
        if speculative is not None and speculative.num_speculative_tokens + 1 > blocks_per_seq * block_size:
            raise ValueError(
                f"num_speculative_tokens={speculative.num_speculative_tokens}: a round feeds k + 1 tokens, more "
                f"than a block-table row holds ({blocks_per_seq} blocks of {block_size} tokens)"
            )
        self.speculative = speculative
        from paged_jax.model import open_source
        from paged_jax.model.generation_config import GenerationDefaults

        checkpoint = isinstance(model, (str, os.PathLike))
        self.generation_defaults = (open_source(model).generation_defaults() if checkpoint and generation_config == "auto"
                                    else GenerationDefaults())

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
                decode_buckets=None if decode_buckets is None else tuple(decode_buckets),
            ),
            swap_space_blocks=swap_space_blocks,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            preemption_mode=preemption_mode,
            victim_policy=victim_policy,
            admission_lookahead=admission_lookahead,
            share_blocks=share_blocks,
            speculative=speculative,
        )

        def make_scheduler() -> Scheduler:
            """A scheduler with empty queues over ``self.runner``'s state (``_reset``)."""
            if kv_cache == "paged":
                accounting = PagedAccounting(num_gpu_blocks, block_size, watermark)
            else:
                accounting = StaticAccounting(num_gpu_blocks, block_size, max_model_len)
            prefix_cache = None
            if enable_prefix_caching:
                prefix_cache = PrefixCache(num_gpu_blocks, block_size, hash_fn=prefix_cache_hash,
                                           eviction_policy=eviction_policy)
            return Scheduler(scheduler_config, self.runner, accounting, swapping=swapping,
                             prefix_cache=prefix_cache)

        self._make_scheduler = make_scheduler
        scheduler = make_scheduler()
        self.tokenizer = tok
        # Generation stops at every EOS the checkpoint names (config.json, generation_config.json)
        # and at its tokenizer's, as vLLM stops.
        eos = as_token_ids(backend.eos_token_id)
        if tok is not None and tok.eos_token_id is not None and tok.eos_token_id not in eos:
            eos += (tok.eos_token_id,)
        self.eos_token_ids = eos
        self.engine = LLMEngine(scheduler, self.runner, eos_token_id=self.eos_token_ids or None,
                                debug_checks=debug_checks)
        self.engine.text = None if tok is None else TextOutputs(tok)
        self._next_request = 0
        self._requests: dict[str, SequenceGroup] = {}  # add_request's, until step() reports them finished

    # ------------------------------------------------------------------ generate

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list:
        """Run every prompt to completion; outputs in prompt order.

        Args:
          prompts: token-id lists (or 1-D integer arrays), strings (the model has a
            tokenizer), ``{"prompt_token_ids": [...]}`` or ``{"prompt": str}`` dicts with an
            optional ``"cache_salt"`` (prefix caching shares blocks only within one salt),
            or one prompt.
          sampling_params: one ``SamplingParams`` for all, one per prompt, or None
            (``get_default_sampling_params()``). A ``BeamSearchParams`` in the list makes that request a beam
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
        bar = _Progress(groups, self) if use_tqdm else None
        try:
            while self.engine.has_unfinished():
                self._times(self.engine.step())
                if bar is not None:
                    bar.update()
            self.engine.flush()
        except BaseException:  # Ctrl-C included: never leave half a step behind
            self._reset()
            raise
        finally:
            if bar is not None:
                bar.close()
        return self.outputs(groups)

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

    # ------------------------------------------------------------------ streaming

    def add_request(self, prompt, params=None, request_id: str | None = None) -> str:
        """Queue one request without running it (vLLM's ``LLMEngine.add_request``); returns
        its id. ``step()`` runs the engine one step at a time, for notebooks that stream."""
        (group,) = self.add_requests([prompt], None if params is None else [params])
        if request_id is not None:
            if not isinstance(request_id, str) or request_id in self._requests:
                raise ValueError(f"request_id={request_id!r}: must be a new string")
            group.request_id = request_id
            for s in group.seqs:
                s.request_id = request_id
        self._requests[group.request_id] = group
        return group.request_id

    def step(self) -> list:
        """One engine step: the outputs (so far) of every request ``add_request`` queued that
        is still running or finished in this step; a finished one is reported once."""
        if self.engine.has_unfinished():
            try:
                self._times(self.engine.step())
                if not self.engine.has_unfinished():
                    self.engine.flush()
            except BaseException:
                self._reset()
                raise
        groups = [g for g in self._requests.values()]
        self._requests = {rid: g for rid, g in self._requests.items() if not _done(g)}
        return self.outputs(groups)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished()

    def abort(self, request_ids) -> None:
        """Abort unfinished requests by id (vLLM's ``abort_request``): their completions end
        with finish reason "abort" and the tokens so far; their blocks are released at the
        next step. ValueError, before anything changes, for an id that is not running."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        sched = self.engine.scheduler
        live = {g.request_id: g for g in [*sched.waiting, *sched.running, *sched.swapped]}
        unknown = [r for r in ids if r not in live]
        if unknown:
            raise ValueError(f"unknown request ids (never added, or already finished): {unknown}")
        for rid in dict.fromkeys(ids):
            sched.abort(live[rid])

    def _times(self, finished: list[Sequence]) -> None:
        """Record first-token and finish times (``RequestMetrics``) after a step."""
        now = time.time()
        for g in self.engine.scheduler.running:
            if g.metrics is not None and "first_token_time" not in g.metrics and any(s.output_token_ids for s in g.seqs):
                g.metrics["first_token_time"] = now
        for s in finished:
            m = s.group.metrics
            if m is not None:
                m.setdefault("first_token_time", now)
                if s.group.finished:
                    m["finished_time"] = now

    def _reset(self) -> None:
        """Back to an empty, consistent engine after a call was interrupted anywhere (in the
        scheduler's planning, between a device call and its host bookkeeping, or with the
        donated KV arrays lost): every unfinished request is aborted (finish reason
        "abort"), the block manager starts from an empty pool (the prefix cache with it),
        the host swap pool is emptied. Compiled programs, the pages' memory (unless lost)
        and the statistics are kept."""
        from paged_jax.engine.swap import HostSwapPool

        old = self.engine.scheduler
        for group in [*old.waiting, *old.running, *old.swapped]:
            for s in group.seqs:
                if s.finish_reason is None:
                    s.finish_reason = FinishReason.ABORT
                s.slot, s.row_live = None, False
            group.status = SeqStatus.FINISHED
        runner = self.runner
        runner.cache_state = runner.empty_state()
        if any(leaf.is_deleted() for leaf in jax.tree.leaves(runner.pages)):
            runner.pages = runner.backend.init_pages(runner.config.num_blocks)
        runner.swap_pool = HostSwapPool.for_pages(runner.swap_pool.capacity, runner.pages)
        runner.view = runner._fresh_view()
        scheduler = self._make_scheduler()
        scheduler.counters = old.counters
        self.engine.scheduler = scheduler

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for every prompt (vLLM's ``LLM.beam_search``), all in one batch:
        ``BeamSearchOutput``s in prompt order (see ``beam.py`` for the rules)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params={params!r}: expected BeamSearchParams")
        return self.generate(prompts, [params] * len(normalise_prompts(prompts, self.tokenizer)), use_tqdm=use_tqdm)

    def add_requests(self, prompts, sampling_params=None) -> list[SequenceGroup]:
        """Validate and queue requests without running them (``generate`` = this, then
        ``engine.step()`` until done, then ``outputs``). For drivers that step engines
        themselves, e.g. a benchmark interleaving two engines. Same arguments and errors
        as ``generate``; nothing is queued if any request is bad."""
        given = normalise_prompts(prompts, self.tokenizer)
        prompts = [p.token_ids for p in given]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
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

        groups, now = [], time.time()
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            rid = str(self._next_request)
            self._next_request += 1
            groups.append(self._group(rid, i, tuple(prompt), p))
            groups[-1].cache_salt = given[i].cache_salt
            groups[-1].prompt_text = given[i].text
            groups[-1].metrics = {"arrival_time": now}
            if i in rejected:
                groups[-1].rejected = rejected[i]
                warnings.warn(rejected[i] + "; rejected (its output is empty)", stacklevel=3)
            else:
                self.engine.add(groups[-1])
        return groups

    @staticmethod
    def _tiled_impl(model, impl: str, block_size: int, speculative) -> str:
        """``impl``, or "xla" where "auto" would pick Pallas kernels that cannot tile this
        model; ValueError, before any weight loads, when a named Pallas impl cannot."""
        from paged_jax.attention.dispatch import resolve_impl, tiling_problem
        from paged_jax.model import ModelConfig

        if isinstance(model, ModelBackend):
            return impl
        configs = [model]
        if speculative is not None and speculative.method == "draft_model":
            configs.append(speculative.model)
        chosen = resolve_impl(impl)
        for cfg in configs:
            if isinstance(cfg, (str, os.PathLike)):
                if not os.path.isdir(cfg):
                    return impl  # _load names the problem
                cfg = ModelConfig.from_hf(cfg)
            if not isinstance(cfg, ModelConfig):
                return impl
            problem = tiling_problem(chosen, head_dim=cfg.head_dim, block_size=block_size, num_heads=cfg.num_heads,
                                     num_kv_heads=cfg.num_kv_heads)
            if problem is None:
                continue
            if impl != "auto":
                raise ValueError(problem + "; use attention_impl='xla'")
            warnings.warn(problem + "; 'auto' uses 'xla'", stacklevel=3)
            return "xla"
        return impl

    @staticmethod
    def _tokenizer(model, path, skip: bool):
        """The checkpoint's ``Tokenizer`` (or ``path``'s), checked against the model's
        vocabulary before any weight is read; None without one."""
        from paged_jax.text import Tokenizer

        if skip:
            return None
        if path is None:
            if not isinstance(model, (str, os.PathLike)) or not os.path.isdir(model):
                return None
            tok = Tokenizer.from_dir(model)
        else:
            tok = Tokenizer.from_dir(path)
            if tok is None:
                raise ValueError(f"tokenizer={os.fspath(path)!r}: no tokenizer.json there")
        if tok is not None and isinstance(model, (str, os.PathLike)):
            from paged_jax.model import ModelConfig

            vocab = ModelConfig.from_hf(model).vocab_size
            if len(tok) > vocab:
                raise ValueError(f"the tokenizer has {len(tok)} ids but the model's vocabulary is {vocab}: "
                                 "they do not belong together")
        return tok

    def get_tokenizer(self):
        """The model's ``paged_jax.text.Tokenizer`` (None without one): ``encode``,
        ``decode``, ``apply_chat_template``, and the raw HF tokenizer as ``.backend``."""
        return self.tokenizer

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None) -> list:
        """Generate replies to conversations (vLLM's ``LLM.chat``): ``messages`` is one
        conversation (a list of ``{"role", "content"}`` dicts) or a list of them, rendered
        with the checkpoint's chat template (or ``chat_template``) in a sandboxed Jinja
        environment as transformers renders it, then generated like text prompts. The
        template writes any BOS itself, so none is added when encoding."""
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer: this model has none (no tokenizer.json)")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message=True continues the last message; "
                             "it cannot also add a generation prompt (set add_generation_prompt=False)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=False,
                chat_template=chat_template, **(chat_template_kwargs or {}))
            if continue_final_message:  # cut the template's end-of-turn after the last message
                last = conversation[-1]["content"]
                text = text[: text.rindex(last) + len(last)]
            prompts.append(text)
        ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in prompts]
        outs = self.generate([{"prompt_token_ids": i} for i in ids], sampling_params, use_tqdm=use_tqdm)
        return [dataclasses.replace(o, prompt=t) if isinstance(o, RequestOutput) else o
                for o, t in zip(outs, prompts, strict=True)]

    def get_default_sampling_params(self) -> SamplingParams:
        """The ``SamplingParams`` a request gets when the caller gives none: the
        checkpoint's generation_config.json defaults (``generation_config="auto"``),
        else ``SamplingParams()`` (vLLM's ``LLM.get_default_sampling_params``)."""
        fields = {f.name for f in dataclasses.fields(SamplingParams)}
        return SamplingParams(**{k: v for k, v in self.generation_defaults.sampling.items() if k in fields})

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
        return self.eos_token_ids

    def outputs(self, groups: list[SequenceGroup]) -> list:
        """``RequestOutput``s (sampling) and ``BeamSearchOutput``s (beam search) of the
        given requests, in the given order (unfinished ones as they stand)."""
        out = []
        text = self.engine.text
        for g in groups:
            if g.beam is not None:
                result = (BeamSearchOutput([], g.rejected) if g.rejected
                          else beam_lib.results(g.beam, g.prompt_token_ids, g.eos))
                if text is not None:
                    result = result._replace(sequences=[b._replace(text=text.decode(b.tokens))
                                                        for b in result.sequences])
                out.append(result)
                continue
            reason = FinishReason.REJECTED.value if g.rejected else None
            metrics = g.metrics or {"arrival_time": time.time()}
            out.append(RequestOutput(
                request_id=g.request_id,
                prompt_token_ids=list(g.prompt_token_ids),
                outputs=[
                    CompletionOutput(
                        index=s.completion,
                        token_ids=list(s.output_token_ids),
                        cumulative_logprob=s.cumulative_logprob,
                        finish_reason=reason or (s.finish_reason.value if s.finish_reason else None),
                        text="" if text is None else text.text(s, final=s.finish_reason is not None),
                        logprobs=self._decoded(s.output_logprobs),
                        stop_reason=s.stop_reason,
                    )
                    for s in g.seqs
                ],
                finished=_done(g),
                rejected=g.rejected,
                prompt=g.prompt_text,
                prompt_logprobs=self._decoded(g.prompt_logprobs),
                metrics=RequestMetrics(**metrics),
            ))
        return out

    def _decoded(self, logprobs: list | None) -> list | None:
        """Per-position ``{id: Logprob}`` dicts with ``decoded_token`` filled in (the model
        has a tokenizer), as vLLM reports them."""
        if logprobs is None or self.tokenizer is None:
            return logprobs
        tok = self.tokenizer
        return [None if d is None else {t: dataclasses.replace(lp, decoded_token=tok.decode([t], skip_special_tokens=False))
                                        for t, lp in d.items()} for d in logprobs]

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


def _done(group: SequenceGroup) -> bool:
    return group.rejected is not None or all(s.finish_reason is not None for s in group.seqs)


class _Progress:
    """``generate``'s bar: requests done, output tokens/s, and the phase ("compiling" while
    the last step compiled a program, so a first call's minute of XLA work is named)."""

    def __init__(self, groups: list[SequenceGroup], llm: LLM):
        from tqdm.auto import tqdm

        self.groups, self.llm = groups, llm
        self.tokens0 = llm.engine.stats.generated_tokens
        self.compiled = llm.runner.compile_seconds
        self.bar = tqdm(total=len(groups), desc="compiling", unit="req", dynamic_ncols=True)

    def update(self) -> None:
        compiled = self.llm.runner.compile_seconds
        self.bar.set_description("compiling" if compiled > self.compiled else "generating", refresh=False)
        self.compiled = compiled
        tokens = self.llm.engine.stats.generated_tokens - self.tokens0
        elapsed = self.bar.format_dict["elapsed"]
        self.bar.set_postfix_str(f"{tokens} tokens, {tokens / max(elapsed, 1e-9):.1f} tok/s", refresh=False)
        self.bar.update(sum(g.finished for g in self.groups) - self.bar.n)

    def close(self) -> None:
        self.bar.set_description("generated", refresh=False)
        self.bar.close()
