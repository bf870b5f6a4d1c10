"""A model ready for the engine: ``ModelBackend`` (the step, the weights, the page store) and
``build_backend``, which makes one from an ``EngineConfig``'s model part.

This is the seam between the model layers (``model``, ``kv``, ``steps``, ``parallel``) and
the engine: the runner sees only a ``ModelBackend``. Tests may pass their own (any step
obeying ``steps.py``'s contract; ``tests/engine_fakes.py`` is a small fake).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax


class ModelBackend(NamedTuple):
    """Everything the runner needs from a model.

    Attributes:
      step: the pure model step, ``paged_jax.steps``' contract: ``step(params,
        cache_state, pages, tokens int32[B, T], seq_ids int32[B], num_tokens int32[B]) ->
        (logits f32[B, V] at each row's last new token, cache_state, pages, status
        int32[B])``. Decode is ``T == 1``. The runner jits it (fused with sampling).
      params: the model parameters (a pytree).
      init_pages: ``num_blocks -> pages``: an empty KV page store for the pool (a
        ``KVPages`` or any pytree whose leaves are ``[..., num_blocks, block_size, F]``).
      vocab_size: V.
      eos_token_id: a custom backend's EOS (the engine config takes it from here; a
        checkpoint's come from its files: ``EngineConfig.model.eos_token_ids``).
      max_position: longest sequence the model supports (None: unbounded).
      name: a short description for reports.
      propose: with a draft model, its proposal program (``paged_jax.engine.draft``:
        ``propose(params, state, pages, last, seq_ids, num_tokens, temperature, top_k,
        top_p, seeds, steps) -> (proposals, q, logits, state, pages, status)``); None
        otherwise. Speculation without it (n-gram) needs ``step`` to accept
        ``all_logits=True`` (logits at every fed token).
      mesh: the replica's ``("data", "model")`` mesh when ``params`` and the pages are
        sharded over it (``paged_jax.parallel``); the block manager is then replicated on
        it. None: one device.
    """

    step: Callable
    params: Any
    init_pages: Callable[[int], Any]
    vocab_size: int
    eos_token_id: int | tuple[int, ...] | None = None
    max_position: int | None = None
    name: str = "model"
    propose: Callable | None = None
    mesh: Any = None


def page_factory(config, block_size: int, kv_cache_dtype: str) -> Callable[[int], Any]:
    """``num_blocks -> KVPages`` for a ``ModelConfig`` (``kv.init_pages``)."""
    from paged_jax import kv

    return lambda num_blocks: kv.init_pages(config.num_layers, config.num_kv_heads, num_blocks, block_size,
                                            config.head_dim, config.dtype, kv_cache_dtype)


def abstract_pages(model, *, block_size: int, kv_cache_dtype: str, draft=None):
    """The page store of one block, abstract (``jax.ShapeDtypeStruct`` leaves; nothing is
    allocated): what ``bytes_per_block`` and pool sizing read before any weight loads.
    ``model``: a ``ModelConfig`` or a ``ModelBackend``; ``draft``: a draft's ``ModelConfig``
    (its pages share the target's blocks)."""
    if isinstance(model, ModelBackend):
        return jax.eval_shape(lambda: model.init_pages(1))
    pages = page_factory(model, block_size, kv_cache_dtype)
    if draft is None:
        return jax.eval_shape(lambda: pages(1))
    from paged_jax.engine.draft import DraftPages

    draft_pages = page_factory(draft, block_size, kv_cache_dtype)
    return jax.eval_shape(lambda: DraftPages(pages(1), draft_pages(1)))


def _weights(spec, config, seed: int):
    """(params, name) of a model part's checkpoint (``spec.source``) or random weights."""
    from paged_jax.model import init_params, load_params
    from paged_jax.model.llama import pack_params

    if spec.source is None:
        _, params = init_params(config, seed)
        return pack_params(params), f"random {config.architecture} ({config.num_params / 1e6:.1f}M params, seed {seed})"
    _, params = load_params(spec.source, config)
    return pack_params(params), f"{config.architecture} from {spec.source.name}"


def build_backend(model_spec, *, block_size: int, kv_cache_dtype: str, attention_impl: str, speculative=None,
                  mesh=None) -> ModelBackend:
    """The ``ModelBackend`` of an ``EngineConfig``'s model part (``engine.config.ModelSpec``):
    its weights loaded from its source (or random from its seed), its KV pages in
    ``kv_cache_dtype`` (``kv.quant``). A draft-model ``speculative`` config runs the draft
    beside the target, its KV in the same blocks (``paged_jax.engine.draft``); a one-replica
    ``mesh`` shards weights and pages over its "model" axis (``paged_jax.parallel``). A
    ``ModelBackend`` given as the model is returned as is."""
    if model_spec.backend is not None:
        return model_spec.backend
    from paged_jax.steps import make_model_step

    config = model_spec.architecture
    params, name = _weights(model_spec, config, model_spec.seed)
    if model_spec.layer_loop == "unrolled":  # EngineArgs refuses it with a mesh
        from paged_jax.model.llama import unstack_layers

        params, name = unstack_layers(params, config.jnp_dtype), f"{name}, layers unrolled"
    if mesh is not None:
        from paged_jax.parallel.backend import shard_model, sharded_init

        config, params, step = shard_model(config, params, mesh, attention_impl)
        return ModelBackend(step=step, params=params,
                            init_pages=sharded_init(page_factory(config, block_size, kv_cache_dtype), mesh),
                            vocab_size=config.vocab_size, max_position=config.max_seq_len,
                            name=f"{name}, tensor parallel over {mesh.shape['model']} devices", mesh=mesh)
    target_pages = page_factory(config, block_size, kv_cache_dtype)
    backend = ModelBackend(step=make_model_step(config, attention_impl), params=params, init_pages=target_pages,
                           vocab_size=config.vocab_size, max_position=config.max_seq_len, name=name)
    if speculative is None or speculative.method != "draft_model":
        return backend
    from paged_jax.engine.draft import DraftPages, make_draft_steps

    draft = model_spec.draft
    # A ModelConfig draft gets random weights from the target's seed: the target's own config
    # gives the target's own weights (acceptance 1, the machinery's pure overhead).
    draft_params, draft_name = _weights(draft, draft.architecture, model_spec.seed)
    steps = make_draft_steps(config, draft.architecture, attention_impl, speculative.num_speculative_tokens)
    draft_pages = page_factory(draft.architecture, block_size, kv_cache_dtype)
    return backend._replace(
        step=steps.step,
        params=(params, draft_params),
        init_pages=lambda num_blocks: DraftPages(target_pages(num_blocks), draft_pages(num_blocks)),
        name=f"{name}, draft {draft_name}",
        propose=steps.propose,
        # Sequences must fit both models (the draft sees every token too).
        max_position=min(config.max_seq_len, draft.architecture.max_seq_len),
    )
