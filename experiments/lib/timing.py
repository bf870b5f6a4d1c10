"""Step timings several studies share: decode step time vs batch on bare step functions,
and an engine's decode step times from its timeline."""

from __future__ import annotations

import time

import numpy as np

from experiments.lib.comparison import BLOCK_SIZE
from paged_jax.config import blocks_for


def step_curve(config, batches: list[int], contexts: list[int], max_model_len: int,
               attention_impl: str = "xla") -> list[dict]:
    """Decode step time vs batch, every row holding ``context`` tokens. Plain decode steps
    (``paged_jax.steps``) with the study's attention ("xla": it reads the blocks each row
    holds, whatever the table width), without the sampler."""
    import jax.numpy as jnp

    from paged_jax.cache import append_slots, init_state, open_sequences
    from paged_jax.config import CacheConfig
    from paged_jax.model import init_params
    from paged_jax.steps import init_pages_for, make_step_fns

    _, params = init_params(config, 0)
    fns = make_step_fns(config, attention_impl=attention_impl)
    width = blocks_for(max_model_len, BLOCK_SIZE)
    rows = []
    for ctx in contexts:
        ctx = min(ctx, max_model_len - 8)
        for b in batches:
            cache = CacheConfig(num_blocks=b * width, block_size=BLOCK_SIZE, max_seqs=b, max_blocks_per_seq=width)
            state, pages = init_state(cache), init_pages_for(config, cache)
            ids = jnp.arange(b, dtype=jnp.int32)
            state, _ = open_sequences(state, ids)
            state, _ = append_slots(state, ids, jnp.full((b,), ctx - 1, jnp.int32), max_tokens=max_model_len)
            tokens = jnp.zeros((b,), jnp.int32)
            logits, state, pages, _ = fns.decode(params, state, pages, tokens, ids)  # compile
            logits.block_until_ready()
            times = []
            for _ in range(5):  # rows grow by a token a call: negligible next to ctx
                start = time.perf_counter()
                logits, state, pages, _ = fns.decode(params, state, pages, tokens, ids)
                logits.block_until_ready()
                times.append(time.perf_counter() - start)
            ms = float(np.median(times)) * 1e3
            rows.append({"batch": b, "context": ctx, "step_ms": ms, "tokens_per_s": b / ms * 1e3})
    return rows


def decode_step_seconds(llm, batch: int) -> list[float]:
    """Wall times of the engine's decode steps (``batch`` rows, nothing prefilled, nothing
    compiled), from ``EngineStats.timeline``."""
    rows = llm.engine.stats.timeline
    ends = [0.0] + [r.end_seconds for r in rows]
    return [ends[i + 1] - ends[i] for i, r in enumerate(rows)
            if r.batch == batch and r.compile_seconds == 0 and r.prefilled == 0]
