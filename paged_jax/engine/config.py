"""One engine configuration, built once: ``EngineArgs`` -> ``EngineConfig`` (vLLM's
``EngineArgs.create_engine_config()`` -> ``VllmConfig``).

``EngineArgs`` holds every keyword ``LLM(...)`` takes, with its default and its meaning
(the one place they are documented). ``create_engine_config()`` validates them all, in an
order that fails before anything expensive (names and sizes first, then the checkpoint's
config files, parsed once, then the pool's arithmetic; no weight is read), and returns a
frozen ``EngineConfig`` of parts that every component takes whole or in part:

- ``model``: ``ModelSpec``: where the model comes from (a ``ModelSource``, a
  ``ModelConfig`` with random weights, or a ``ModelBackend``), its architecture config,
  tokenizer, EOS ids and generation defaults, the attention implementation, the longest
  sequence (``max_model_len``);
- ``cache``: ``KVCacheConfig``: the pool (blocks, block size, bytes per block, page format),
  its allocation policy, the static baseline, swap space, prefix caching;
- ``scheduler``: ``SchedulerConfig``: rows, the token budget, decode buckets, preemption,
  victim and admission policies, sharing;
- ``parallel``: ``ParallelConfig``: tensor/data parallel sizes, the mesh, the router;
- ``speculative``: ``SpeculativeConfig`` or None.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

from paged_jax import buckets
from paged_jax.backend import ModelBackend, abstract_pages
from paged_jax.config import CacheConfig, blocks_for
from paged_jax.dtypes import dtype_name
from paged_jax.engine.speculative import SpeculativeConfig

KV_CACHE_MODES = ("paged", "static")
LAYER_LOOPS = ("scan", "unrolled")  # how the decoder layers run (``LlamaForCausalLM.__call__``)
LAYER_LOOP_CHOICES = ("auto",) + LAYER_LOOPS  # "auto": ``auto_layer_loop``
PREEMPTION_MODES = ("recompute", "swap")
BATCH_LAYOUTS = ("packed", "padded")
# vLLM's order of magnitude: a batch of prompts prefills in a step or two, so a first call
# compiles one or two prefill shapes rather than one per small chunk.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_MODEL_LEN = 2048  # a ModelBackend that states no maximum


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: must be True or False")


def _check_count(name: str, value, lo: int = 1, what: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name}={value!r}: must be an int >= {lo}{what}")


# ---------------------------------------------------------------------------- the parts


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The model part.

    Attributes:
      source: the checkpoint's ``ModelSource`` (its files parsed once), or None for a
        ``ModelConfig`` (random weights) or a ``ModelBackend``.
      architecture: the decoder's ``ModelConfig`` (dtype resolved), None for a backend.
      backend: a ``ModelBackend`` given as the model, else None.
      seed: random weights (a ``ModelConfig``) and default per-request sampling seeds.
      tokenizer: a ``paged_jax.text.Tokenizer`` or None (token ids in and out only).
      eos_token_ids: every id that ends generation: the checkpoint's (config.json,
        generation_config.json) and the tokenizer's.
      generation_defaults: ``GenerationDefaults`` (sampling defaults empty unless
        ``generation_config="auto"``).
      attention_impl: the attention implementation's name (``attention.dispatch``); "auto"
        kept unless it would pick kernels that cannot tile the model (then "xla").
      max_model_len: prompt + output tokens per sequence.
      vocab_size: V.
      draft: the draft model's ``ModelSpec`` (speculative method "draft_model"), or None.
      layer_loop: "scan" or "unrolled" (``EngineArgs.layer_loop``, "auto" resolved).
    """

    source: Any
    architecture: Any
    backend: ModelBackend | None
    seed: int
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    generation_defaults: Any
    attention_impl: str
    max_model_len: int
    vocab_size: int
    draft: ModelSpec | None = None
    layer_loop: str = "scan"

    @property
    def name(self) -> str:
        if self.backend is not None:
            return self.backend.name
        if self.source is not None:
            return self.source.name
        return f"random {self.architecture.architecture}"

    @property
    def max_position(self) -> int | None:
        """Longest sequence the model (and its draft) can run; None: unbounded."""
        if self.backend is not None:
            return self.backend.max_position
        limit = self.architecture.max_seq_len
        if self.draft is not None:
            limit = min(limit, self.draft.architecture.max_seq_len)
        return limit


@dataclasses.dataclass(frozen=True)
class KVCacheConfig:
    """The cache part: the device pool and what runs on it.

    Attributes:
      block_size: tokens per block. num_blocks: blocks in the device pool.
      max_blocks_per_seq: block-table columns (``ceil(max_model_len / block_size)``).
      bytes_per_block: one block's bytes on one device (values, scales, a draft's pages).
      kv_cache_dtype: the page format (``kv.quant``). mode: "paged" or "static".
      allocation_policy: ``cache.POLICIES`` name or an ``AllocationPolicy``.
      watermark: fraction of the pool kept free at admission (paged).
      swap_space_blocks: host swap pool blocks (0 unless preemption swaps).
      prefix_caching, eviction_policy, prefix_cache_hash: automatic prefix caching.
      sized_by: how the pool size was decided (for messages), or None if given.
    """

    block_size: int
    num_blocks: int
    max_blocks_per_seq: int
    bytes_per_block: int
    kv_cache_dtype: str = "auto"
    mode: str = "paged"
    allocation_policy: Any = "lifo"
    watermark: float = 0.01
    swap_space_blocks: int = 0
    prefix_caching: bool = False
    eviction_policy: Any = "lru"
    prefix_cache_hash: Any = "sha256"
    sized_by: str | None = None

    def __post_init__(self):
        if self.mode not in KV_CACHE_MODES:
            raise ValueError(f"kv_cache={self.mode!r}: unknown; choose one of {list(KV_CACHE_MODES)}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark={self.watermark}: must be in [0, 1)")
        if self.prefix_caching and self.mode != "paged":
            raise ValueError(
                f"enable_prefix_caching=True needs kv_cache='paged': the {self.mode!r} baseline shares no blocks")

    def device_shape(self, max_num_seqs: int) -> CacheConfig:
        """The block manager's shape (``cache.init_state``)."""
        return CacheConfig(num_blocks=self.num_blocks, block_size=self.block_size, max_seqs=max_num_seqs,
                           max_blocks_per_seq=self.max_blocks_per_seq)

    def blocks_for(self, num_tokens):
        return blocks_for(num_tokens, self.block_size)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler part.

    Attributes:
      max_num_seqs: table rows: sequences running at once, the largest batch.
      max_num_batched_tokens: tokens a step feeds (decodes + prefill chunks).
      block_size: the pool's (the scheduler's block arithmetic).
      decode_buckets: the decode batch sizes compiled (``buckets.decode_buckets``).
      batch_layout: "packed": a step's rows (decodes and prefill chunks alike) feed one model
        call, their tokens one after another (``buckets.pack_batch``); "padded": decodes in
        one call and chunks in calls of padded ``[rows, width]`` (``buckets.plan_prefill``).
      preemption_mode: "recompute" or "swap".
      victim_policy: which running request to preempt (``victim.VICTIM_POLICIES``).
      admission_policy: the order waiting requests are admitted in (``admission``).
      admission_lookahead: steps of the running sequences' growth kept free at admission.
      share_blocks: False: forks and beam selections copy every block (a baseline).
      speculative: ``SpeculativeConfig`` or None.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    decode_buckets: tuple[int, ...] | None = None
    batch_layout: str = "packed"
    preemption_mode: str = "recompute"
    victim_policy: Any = "most_recently_admitted"
    admission_policy: Any = "fcfs"
    admission_lookahead: int = 0
    share_blocks: bool = True
    speculative: SpeculativeConfig | None = None

    def __post_init__(self):
        from paged_jax.engine.admission import get_admission_policy
        from paged_jax.engine.victim import get_victim_policy

        _check_count("max_num_seqs", self.max_num_seqs)
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode={self.preemption_mode!r}: unknown; choose one of {list(PREEMPTION_MODES)}")
        if self.batch_layout not in BATCH_LAYOUTS:
            raise ValueError(f"batch_layout={self.batch_layout!r}: unknown; choose one of {list(BATCH_LAYOUTS)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_num_seqs={self.max_num_seqs} (every running sequence decodes each step)")
        _check_count("admission_lookahead", self.admission_lookahead, 0)
        _check_bool("share_blocks", self.share_blocks)
        # One normalised home for the sizes: ascending, capped at max_num_seqs, which is always one.
        object.__setattr__(self, "decode_buckets", buckets.decode_buckets(self.max_num_seqs, self.decode_buckets))
        object.__setattr__(self, "victim_policy", get_victim_policy(self.victim_policy))
        object.__setattr__(self, "admission_policy", get_admission_policy(self.admission_policy))


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The parallel part: t devices per replica, d replicas (``mesh``: axes ("data",
    "model"), or None on one device), and the policy routing requests to replicas."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    mesh: Any = None
    data_parallel_policy: Any = "round_robin"

    def replica_meshes(self) -> list:
        """One mesh per replica (None: one device)."""
        if self.mesh is None:
            return [None]
        from paged_jax.parallel.mesh import replica_meshes

        return list(replica_meshes(self.mesh))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from (the module docstring lists the parts)."""

    model: ModelSpec
    cache: KVCacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    speculative: SpeculativeConfig | None = None
    debug_checks: bool = False

    def device_shape(self) -> CacheConfig:
        return self.cache.device_shape(self.scheduler.max_num_seqs)


# ---------------------------------------------------------------------------- the arguments


@dataclasses.dataclass
class EngineArgs:
    """Every ``LLM(...)`` keyword (vLLM's names where vLLM has one).

    Args:
      model: a local Hugging Face checkpoint directory, anything a registered model source
        opens (``paged_jax.model.open_source``: a GGUF file, a hub id in the local cache,
        ...), a ``ModelSource``, a ``ModelConfig`` (random weights from ``seed``) or a
        ``ModelBackend`` (any step functions obeying ``paged_jax/steps.py``'s contract).
      revision: the hub revision of a model id (never downloaded).
      block_size: tokens per KV block (a power of two).
      num_gpu_blocks: blocks in the device pool. Or give ``kv_cache_memory_bytes`` and the
        pool is as many blocks as fit. Neither: sized like vLLM's, from
        ``gpu_memory_utilization`` of the accelerator's memory less the weights (on the
        CPU a fixed budget, ``PAGED_JAX_CPU_KVCACHE_SPACE`` GiB, default 4; ``memory.py``),
        never more than ``max_num_seqs`` sequences of ``max_model_len`` tokens can use.
      gpu_memory_utilization: the fraction of accelerator memory the weights and the pool
        may take together (default 0.9); the rest is left for activations.
      max_num_seqs: sequences running at once (block-table rows; the largest batch).
      max_model_len: prompt + output tokens per sequence; default the model's maximum,
        capped (with a warning) at what the pool holds.
      max_num_batched_tokens: tokens per step (decodes + prefill chunks); default 2048 (at
        least ``max_num_seqs``), so a first batch of prompts prefills in a call or two.
      decode_buckets: the row counts a step's model call is padded to (each one program, with
        each token width: ``buckets.packed_width``); default powers of two from 8 up to
        ``max_num_seqs`` (``buckets.decode_buckets``).
      batch_layout: "packed" (default): every row of a step, decodes and prefill chunks
        alike, in one model call, their tokens packed one after another (as vLLM's
        flattened batch: no padding between prompts); "padded": decodes in one call and
        prefill chunks in padded ``[rows, width]`` calls (the layout before packing, kept as
        a baseline; the default for ``kv_cache_dtype="int8_channel"``, whose per-block
        scales are written row by row).
      preemption_mode: "recompute" or "swap" (``scheduler.py``).
      swap_space_blocks: host swap pool size in blocks (swap mode; default: the device pool's).
      allocation_policy: block allocation order: a name in ``cache.POLICIES`` ("lifo",
        "fifo", "lowest_id_first", "random") or an ``AllocationPolicy``.
      attention_impl: a name in ``attention.dispatch.IMPLS`` or "auto".
      layer_loop: how the decoder layers run: "scan" (one ``lax.scan`` over stacked
        weights: one layer's program, the shortest compile) or "unrolled" (a loop over
        per-layer weight arrays: XLA:CPU copies each layer's weights out of the stack under
        the scan, so unrolled steps are faster at small batches, 2026-12-07 on SmolLM2-135M
        fp32: 47 -> 34 ms at 2 rows, 64 -> 48 ms at 8; compiles ~2-3x longer per shape).
        "unrolled" runs one device's own model: not with tensor or data parallelism, nor
        a ModelBackend. "auto" (default): ``auto_layer_loop``, unrolled where it can run on
        CPU, else the scan (logged).
      dtype: parameter and compute dtype, and the KV dtype unless ``kv_cache_dtype`` says:
        "auto" (a ``ModelConfig``'s own; for a checkpoint, what is faster here for its dtype:
        ``dtypes.auto_compute_dtype``, logged), "float32", "bfloat16", "float16".
      kv_cache_dtype: "auto" (KV in ``dtype``), "int8" (per-token scales), "int8_channel"
        (per-block, per-channel scales), "fp8_e4m3", or a float dtype (``kv.quant``).
      seed: random weights (a ``ModelConfig``) and default per-request sampling seeds.
      kv_cache: "paged" or "static" (each sequence reserves ``max_model_len`` up front).
      watermark: fraction of the pool kept free at admission (paged).
      admission_lookahead: paged: also keep free, at admission, the blocks the running
        sequences will take over this many steps (capped by each one's max_tokens).
      victim_policy: a name in ``victim.VICTIM_POLICIES`` or a function.
      admission_policy: the order waiting requests are admitted in: a name in
        ``admission.ADMISSION_POLICIES`` ("fcfs" default, "priority",
        "shortest_prompt_first") or a function (``admission.py``).
      share_blocks: True: forked completions and beams share blocks, copied on write.
        False: every fork and beam selection copies all its blocks (the baseline).
      enable_prefix_caching: vLLM's automatic prefix caching (``prefix_cache.py``).
      eviction_policy: a name in ``cache.EVICTION_POLICIES`` or an ``EvictionPolicy``.
      prefix_cache_hash: "sha256" (default), "blake2b" or "python", or a ``cache.HashFunction``.
      speculative_config: vLLM's keys: ``{"method": "ngram", "num_speculative_tokens": k,
        "prompt_lookup_max": 4, "prompt_lookup_min": 1}`` or ``{"method": "draft_model",
        "model": <checkpoint or ModelConfig>, "num_speculative_tokens": k}``.
      generation_config: "auto": requests without ``SamplingParams`` get the checkpoint's
        generation_config.json defaults; "vllm": ``SamplingParams()``.
      tokenizer: a directory with ``tokenizer.json``, a GGUF file or a hub id (default: the model's own).
      skip_tokenizer_init: no tokenizer: token ids in and out only.
      debug_checks: check every invariant after every op and step (slow; for tests).
      tensor_parallel_size: t devices per replica: weights split Megatron-style, KV pages
        split by kv head, block manager replicated (``paged_jax.parallel``).
      data_parallel_size: d replicas, each with its own pool, block manager and scheduler;
        ``data_parallel_policy`` routes requests ("round_robin", "least_loaded" or a
        function, ``router.py``).
      mesh: instead of t and d, a ``jax.sharding.Mesh`` with axes ("data", "model").
    """

    model: Any
    revision: str | None = None
    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 64
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    decode_buckets: Any = None
    batch_layout: str | None = None
    preemption_mode: str = "recompute"
    swap_space_blocks: int | None = None
    allocation_policy: Any = "lifo"
    attention_impl: str = "auto"
    layer_loop: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    generation_config: str = "auto"
    seed: int = 0
    kv_cache: str = "paged"
    watermark: float = 0.01
    admission_lookahead: int = 0
    victim_policy: Any = "most_recently_admitted"
    admission_policy: Any = "fcfs"
    share_blocks: bool = True
    enable_prefix_caching: bool = False
    eviction_policy: Any = "lru"
    prefix_cache_hash: Any = "sha256"
    speculative_config: dict | None = None
    tokenizer: str | os.PathLike | None = None
    skip_tokenizer_init: bool = False
    debug_checks: bool = False
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    mesh: Any = None
    data_parallel_policy: Any = "round_robin"

    # ------------------------------------------------------------------ building

    def create_engine_config(self) -> EngineConfig:
        """Validate every argument and build the ``EngineConfig`` (no weight is read)."""
        self._check_names()
        speculative = None if self.speculative_config is None else SpeculativeConfig.from_dict(
            self.speculative_config)
        scheduler = SchedulerConfig(  # its own checks: modes, policies, the budget
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=(self.max_num_batched_tokens if self.max_num_batched_tokens is not None
                                    else max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs)),
            block_size=self.block_size, decode_buckets=self.decode_buckets, batch_layout=self._batch_layout(),
            preemption_mode=self.preemption_mode, victim_policy=self.victim_policy, admission_policy=self.admission_policy,
            admission_lookahead=self.admission_lookahead, share_blocks=self.share_blocks, speculative=speculative,
        )
        parallel = self._parallel(speculative)
        model = self._model_spec(speculative, parallel)
        cache, max_model_len = self._cache(model, speculative, parallel)
        model = dataclasses.replace(model, max_model_len=max_model_len)
        if speculative is not None and speculative.num_speculative_tokens + 1 > cache.max_blocks_per_seq * self.block_size:
            raise ValueError(
                f"num_speculative_tokens={speculative.num_speculative_tokens}: a round feeds k + 1 tokens, more "
                f"than a block-table row holds ({cache.max_blocks_per_seq} blocks of {self.block_size} tokens)")
        return EngineConfig(model=model, cache=cache, scheduler=scheduler, parallel=parallel,
                            speculative=speculative, debug_checks=self.debug_checks)

    def _check_names(self) -> None:
        """Every name and flag, before anything is read."""
        from paged_jax.cache import get_eviction_policy, get_hash, get_policy
        from paged_jax.engine.memory import check_utilization
        from paged_jax.kv.quant import kv_format

        _check_bool("share_blocks", self.share_blocks)
        _check_bool("enable_prefix_caching", self.enable_prefix_caching)
        _check_bool("skip_tokenizer_init", self.skip_tokenizer_init)
        _check_bool("debug_checks", self.debug_checks)
        get_eviction_policy(self.eviction_policy)
        get_hash(self.prefix_cache_hash)
        get_policy(self.allocation_policy)
        kv_format(self.kv_cache_dtype)
        if self.layer_loop not in LAYER_LOOP_CHOICES:
            raise ValueError(f"layer_loop={self.layer_loop!r}: unknown; choose one of {list(LAYER_LOOP_CHOICES)}")
        if self.kv_cache not in KV_CACHE_MODES:
            raise ValueError(f"kv_cache={self.kv_cache!r}: unknown; choose one of {list(KV_CACHE_MODES)}")
        if self.enable_prefix_caching and self.kv_cache != "paged":
            raise ValueError(
                f"enable_prefix_caching=True needs kv_cache='paged': the {self.kv_cache!r} baseline shares no blocks")
        if self.enable_prefix_caching and not self.share_blocks:
            raise ValueError("enable_prefix_caching=True shares blocks; it cannot run with share_blocks=False")
        if self.num_gpu_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("give num_gpu_blocks or kv_cache_memory_bytes, not both")
        if self.num_gpu_blocks is not None:
            _check_count("num_gpu_blocks", self.num_gpu_blocks, 1, " (the KV pool needs blocks)")
        if self.kv_cache_memory_bytes is not None:
            _check_count("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        check_utilization(self.gpu_memory_utilization)
        if self.dtype != "auto":
            dtype_name(self.dtype)
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config={self.generation_config!r}: 'auto' (the checkpoint's "
                             "generation_config.json defaults) or 'vllm' (SamplingParams' own)")
        CacheConfig(num_blocks=1, block_size=self.block_size)  # block_size: a power of two in [1, 256]

    def _batch_layout(self) -> str:
        """``batch_layout``, or its default: "packed", or "padded" for per-channel KV scales
        (written a row's block at a time, which needs the padded rows)."""
        from paged_jax.kv.quant import kv_format

        per_channel = kv_format(self.kv_cache_dtype).per_channel
        if self.batch_layout is None:
            return "padded" if per_channel else "packed"
        if self.batch_layout == "packed" and per_channel:
            raise ValueError(f"batch_layout='packed' cannot write kv_cache_dtype={self.kv_cache_dtype!r} pages "
                             "(per-channel scales are written row by row); use batch_layout='padded'")
        return self.batch_layout

    def _parallel(self, speculative) -> ParallelConfig:
        from paged_jax.engine.router import get_router
        from paged_jax.parallel.backend import check_supported, resolve_mesh
        from paged_jax.parallel.mesh import mesh_sizes

        get_router(self.data_parallel_policy)
        mesh = resolve_mesh(self.tensor_parallel_size, self.data_parallel_size, self.mesh)
        if mesh is None:
            return ParallelConfig(data_parallel_policy=self.data_parallel_policy)
        if isinstance(self.model, ModelBackend):
            raise ValueError("a mesh (tensor_parallel_size > 1 or mesh=...) needs the model as a checkpoint "
                             "directory or a ModelConfig, not a ModelBackend")
        check_supported(mesh, speculative=speculative, preemption_mode=self.preemption_mode)
        t, d = mesh_sizes(mesh)
        return ParallelConfig(tensor_parallel_size=t, data_parallel_size=d, mesh=mesh,
                              data_parallel_policy=self.data_parallel_policy)

    def _model_spec(self, speculative, parallel: ParallelConfig) -> ModelSpec:
        """The model part: the checkpoint's files parsed once (config, generation config,
        tokenizer), the draft's config, the attention implementation."""
        from paged_jax.model import ModelConfig
        from paged_jax.model.generation_config import GenerationDefaults

        model = self.model
        draft = speculative is not None and speculative.method == "draft_model"
        if self.layer_loop == "unrolled" and (isinstance(model, ModelBackend) or parallel.mesh is not None):
            raise ValueError(f"layer_loop={self.layer_loop!r} runs one device's own model: not with "
                             + ("a ModelBackend (its step is its own)" if isinstance(model, ModelBackend)
                                else "tensor or data parallelism (their shardings are of stacked weights)")
                             + "; use layer_loop='scan'")
        if isinstance(model, ModelBackend):
            if self.kv_cache_dtype != "auto":
                raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} with a ModelBackend: the backend's "
                                 "init_pages decides its page format; pass 'auto'")
            if draft:
                raise ValueError("speculative method 'draft_model' needs the target as a checkpoint or "
                                 "ModelConfig, not a ModelBackend")
            tokenizer = self._tokenizer(None, None)
            eos = _as_ids(model.eos_token_id)
            return ModelSpec(source=None, architecture=None, backend=model, seed=self.seed, tokenizer=tokenizer,
                             eos_token_ids=_with_tokenizer_eos(eos, tokenizer),
                             generation_defaults=GenerationDefaults(), attention_impl=self.attention_impl,
                             max_model_len=0, vocab_size=model.vocab_size)
        from paged_jax.attention.dispatch import check_reads

        check_reads(self.attention_impl, self.kv_cache_dtype)
        dtype = None if self.dtype == "auto" else self.dtype
        if isinstance(model, ModelConfig):
            source, arch = None, (model if dtype is None else model.replace(dtype=dtype))
            defaults = GenerationDefaults()
        else:
            from paged_jax.model import open_source

            source = open_source(model, revision=self.revision)
            if dtype is None:
                dtype = _auto_dtype(source.model_config().dtype, str(model))
            arch = source.model_config(dtype=dtype)
            defaults = source.generation_defaults()
        if parallel.mesh is not None:
            from paged_jax.parallel.sharding import check_model

            check_model(arch, parallel.tensor_parallel_size)
        tokenizer = self._tokenizer(source, arch.vocab_size)
        sampling_defaults = defaults if self.generation_config == "auto" else dataclasses.replace(defaults, sampling={})
        draft_spec = self._draft_spec(speculative.model, arch) if draft else None
        impl = self._tiled_impl([arch] + ([draft_spec.architecture] if draft_spec else []))
        return ModelSpec(source=source, architecture=arch, backend=None, seed=self.seed, tokenizer=tokenizer,
                         eos_token_ids=_with_tokenizer_eos(defaults.eos_token_ids, tokenizer),
                         generation_defaults=sampling_defaults, attention_impl=impl, max_model_len=0,
                         vocab_size=arch.vocab_size, draft=draft_spec,
                         layer_loop=self._layer_loop(parallel, arch.num_layers))

    def _layer_loop(self, parallel: ParallelConfig, num_layers: int) -> str:
        """``layer_loop`` with "auto" resolved for this model (one device's own, checked)."""
        if self.layer_loop != "auto":
            return self.layer_loop
        import jax

        from paged_jax.dtypes import logger

        loop, why = auto_layer_loop(jax.default_backend(), parallel.mesh is not None)
        logger.info("layer_loop='auto': %s for %d layers (%s)", loop, num_layers, why)
        return loop

    def _draft_spec(self, draft, target) -> ModelSpec:
        """The draft's part: its config checked against the target's (same vocabulary)
        before any weight is read; it computes in the target's dtype (their KV pages share
        blocks)."""
        from paged_jax.engine.draft import check_draft
        from paged_jax.model import ModelConfig, open_source
        from paged_jax.model.generation_config import GenerationDefaults

        if isinstance(draft, ModelConfig):
            source, arch = None, draft.replace(dtype=target.dtype)
        else:
            source = open_source(draft)
            arch = source.model_config(dtype=target.dtype)
        check_draft(target, arch)
        return ModelSpec(source=source, architecture=arch, backend=None, seed=self.seed, tokenizer=None,
                         eos_token_ids=(), generation_defaults=GenerationDefaults(),
                         attention_impl=self.attention_impl, max_model_len=0, vocab_size=arch.vocab_size)

    def _tiled_impl(self, archs) -> str:
        """``attention_impl``, or "xla" where "auto" would pick kernels that cannot tile these
        models; ValueError, before any weight loads, when a named implementation cannot."""
        from paged_jax.attention.dispatch import resolve_impl, tiling_problem

        impl = self.attention_impl
        chosen = resolve_impl(impl)
        for cfg in archs:
            problem = tiling_problem(chosen, head_dim=cfg.head_dim, block_size=self.block_size,
                                     num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads)
            if problem is None:
                continue
            if impl != "auto":
                raise ValueError(problem + "; use attention_impl='xla'")
            warnings.warn(problem + "; 'auto' uses 'xla'", stacklevel=4)
            return "xla"
        return impl

    def _tokenizer(self, source, vocab: int | None):
        """The model's ``Tokenizer`` (or ``tokenizer``'s), checked against the vocabulary
        before any weight is read; None without one."""
        from paged_jax.text import Tokenizer

        if self.skip_tokenizer_init:
            return None
        if self.tokenizer is not None:
            if os.path.isdir(self.tokenizer):
                tok = Tokenizer.from_dir(self.tokenizer)
            else:  # a GGUF file, a hub id in the local cache, ...: whatever the model sources open
                from paged_jax.model import open_source

                tok = open_source(self.tokenizer).tokenizer()
            if tok is None:
                raise ValueError(f"tokenizer={os.fspath(self.tokenizer)!r}: no tokenizer there (tokenizer.json "
                                 "or GGUF tokenizer.ggml.*)")
        else:
            tok = None if source is None else source.tokenizer()
        if tok is not None and vocab is not None and len(tok) > vocab:
            raise ValueError(f"the tokenizer has {len(tok)} ids but the model's vocabulary is {vocab}: "
                             "they do not belong together")
        return tok

    def _cache(self, model: ModelSpec, speculative, parallel: ParallelConfig) -> tuple[KVCacheConfig, int]:
        """The pool: bytes per block from the abstract pages, its size (given, from a byte
        budget, or from device memory less the weights), and ``max_model_len``."""
        from paged_jax.kv.pages import bytes_per_block as kv_bytes_per_block

        bs = self.block_size
        pages = abstract_pages(model.backend or model.architecture, block_size=bs, kv_cache_dtype=self.kv_cache_dtype,
                               draft=None if model.draft is None else model.draft.architecture)
        per_block = kv_bytes_per_block(pages)
        t = parallel.tensor_parallel_size
        per_block //= t  # a device holds 1/t of every block: budgets are per device
        num_blocks, sized_by = self.num_gpu_blocks, None
        if self.kv_cache_memory_bytes is not None:
            num_blocks = int(self.kv_cache_memory_bytes) // per_block
            if num_blocks < 1:
                raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes}: smaller than one block "
                                 f"({per_block} bytes)")
        if num_blocks is None:  # vLLM's sizing from device memory (``memory.py``)
            from paged_jax.engine.memory import kv_budget_bytes, weight_bytes

            device = None
            if parallel.mesh is not None:
                from paged_jax.parallel.backend import first_local_device

                device = first_local_device(parallel.mesh)
            budget, sized_by = kv_budget_bytes(self.gpu_memory_utilization, device,
                                               weight_bytes=weight_bytes(model) // t)
            pool_limit = budget // per_block
            if pool_limit < 1:
                raise ValueError(f"no room for a KV block ({per_block} bytes) with {sized_by}; "
                                 "give num_gpu_blocks or kv_cache_memory_bytes")
        else:
            pool_limit = num_blocks
        limit = model.max_position
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = limit if limit is not None else DEFAULT_MAX_MODEL_LEN
            if max_model_len > pool_limit * bs:
                warnings.warn(
                    f"max_model_len capped at {pool_limit * bs} tokens (the model allows {max_model_len}): "
                    f"the KV pool holds {pool_limit} blocks of {bs} tokens"
                    + (f" ({sized_by})" if sized_by else "") + "; pass max_model_len or a larger pool to choose",
                    stacklevel=4)
                max_model_len = pool_limit * bs
        _check_count("max_model_len", max_model_len, 2)
        if limit is not None and max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's maximum length {limit}")
        blocks_per_seq = blocks_for(max_model_len, bs)
        if num_blocks is None:  # no more than the engine could ever hold
            num_blocks = min(pool_limit, self.max_num_seqs * blocks_per_seq)
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"max_model_len={max_model_len} needs {blocks_per_seq} blocks of {bs} tokens "
                f"but the KV pool has {num_blocks}" + (f" ({sized_by})" if sized_by else "")
                + ": lower max_model_len or enlarge the pool")
        swapping = self.preemption_mode == "swap" and self.kv_cache == "paged"
        swap = 0 if not swapping else (num_blocks if self.swap_space_blocks is None else self.swap_space_blocks)
        _check_count("swap_space_blocks", swap, 0)
        if self.kv_cache == "static" and blocks_per_seq > num_blocks:
            raise ValueError(f"kv_cache='static': one sequence reserves {blocks_per_seq} blocks "
                             f"(max_model_len={max_model_len}) but the pool has {num_blocks}")
        cache = KVCacheConfig(
            block_size=bs, num_blocks=num_blocks, max_blocks_per_seq=blocks_per_seq, bytes_per_block=per_block,
            kv_cache_dtype=self.kv_cache_dtype, mode=self.kv_cache, allocation_policy=self.allocation_policy,
            watermark=self.watermark, swap_space_blocks=swap, prefix_caching=self.enable_prefix_caching,
            eviction_policy=self.eviction_policy, prefix_cache_hash=self.prefix_cache_hash, sized_by=sized_by,
        )
        return cache, max_model_len


def _auto_dtype(checkpoint_dtype: str, model: str) -> str:
    """``dtype="auto"`` for a checkpoint: ``dtypes.auto_compute_dtype`` on this platform,
    said in one log line (logger "paged_jax", INFO)."""
    import jax

    from paged_jax.dtypes import auto_compute_dtype, logger

    platform = jax.default_backend()
    dtype, why = auto_compute_dtype(checkpoint_dtype, platform)
    logger.info("dtype='auto': %s for %s (checkpoint %s, %s: %s)", dtype, model, checkpoint_dtype, platform, why)
    return dtype


def auto_layer_loop(platform: str, sharded: bool) -> tuple[str, str]:
    """``layer_loop="auto"`` for a model of our own: ("unrolled" or "scan", why).

    Unrolled on CPU with one device: XLA:CPU copies each layer's weights out of the
    stacked arrays on every step under the scan (a dynamic-slice fusion before each dot),
    which costs a small-batch step 15-40% (``experiments layer_loop``, 2026-12-07 Intel
    VM, SmolLM2-135M fp32: 0.62-0.85x the scan's step at 1-64 rows); the price is a 2-3x
    longer compile per shape, paid once with the persistent compilation cache. The scan
    elsewhere: a mesh shards stacked weights, and on accelerators compile time is the
    scan's reason to be while no step gain has been measured there."""
    if sharded:
        return "scan", "a mesh shards the stacked weights"
    if platform != "cpu":
        return "scan", f"{platform}: one layer body compiles once; no unrolled step gain measured there"
    return "unrolled", "cpu: the scan copies each layer's weights out of the stack every step"


def _as_ids(value) -> tuple[int, ...]:
    from paged_jax.engine.sampling import as_token_ids

    return as_token_ids(value)


def _with_tokenizer_eos(eos: tuple[int, ...], tokenizer) -> tuple[int, ...]:
    """The checkpoint's EOS ids and the tokenizer's (vLLM stops at both)."""
    eos = tuple(eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos += (tokenizer.eos_token_id,)
    return eos
