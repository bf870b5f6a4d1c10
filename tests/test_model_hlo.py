"""HLO guard on the model's jitted decode step: attention reads every layer's pages in place."""

import re

import jax.numpy as jnp
import pytest

from paged_jax.parallel.hlo import copies as hlo_copies


def _while_shapes(hlo: str) -> list[str]:
    return [line for line in hlo.splitlines() if re.search(r"\swhile\(", line)]


def test_model_step_reads_layers_in_place():
    """Inside the jitted decode step the attention loops take every layer's pages, not a
    layer slice: a slice taken outside a loop would be materialised (one layer's pages
    copied per layer per step, i.e. the whole pool per step)."""
    from paged_jax import CacheConfig
    from paged_jax.cache import init_state
    from paged_jax.model import ModelConfig, init_params
    from paged_jax.steps import init_pages_for, make_step_fns

    cfg = ModelConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=256,
    )
    cc = CacheConfig(num_blocks=48, block_size=4, max_seqs=8, max_blocks_per_seq=18)
    _, params = init_params(cfg, 0)
    fns = make_step_fns(cfg, attention_impl="xla")
    state, pages = init_state(cc), init_pages_for(cfg, cc)
    hlo = fns.decode.lower(params, state, pages, jnp.zeros(4, jnp.int32), jnp.arange(4, dtype=jnp.int32))
    loops = _while_shapes(hlo.compile().as_text())
    layer_shape, all_shape = "f32[2,48,4,16]", "f32[2,2,48,4,16]"
    assert loops and all(all_shape in line for line in loops)
    assert not any(layer_shape in line for line in loops)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int8", *(pytest.param(d, marks=pytest.mark.slow) for d in ("int8_channel", "fp8_e4m3"))])
def test_decode_step_never_converts_or_copies_the_pool(kv_cache_dtype):
    """No pool-sized convert or copy in a decode step over sub-fp32 pages or scales
    (values and scales are gathered and scattered as same-width integers): XLA:CPU
    otherwise converts the whole pool, or every scale, per layer per step."""
    from paged_jax import CacheConfig
    from paged_jax.cache import init_state
    from paged_jax.model import ModelConfig, init_params
    from paged_jax.steps import init_pages_for, make_step_fns

    cfg = ModelConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=256,
    )
    cc = CacheConfig(num_blocks=48, block_size=4, max_seqs=8, max_blocks_per_seq=18)  # 48: the pool's mark
    _, params = init_params(cfg, 0)
    fns = make_step_fns(cfg, attention_impl="xla")
    state, pages = init_state(cc), init_pages_for(cfg, cc, kv_cache_dtype=kv_cache_dtype)
    hlo = fns.decode.lower(params, state, pages, jnp.zeros(4, jnp.int32), jnp.arange(4, dtype=jnp.int32))
    text = hlo.compile().as_text()
    bad = hlo_copies(text, r"^\w+\[2,2,48,\d+(,\d+)?\]")
    assert not bad, bad


def test_decode_step_copies_blocks_only_when_asked():
    """The copy-on-write copies of a decode step sit under a conditional on the pool: most
    steps copy nothing, and an unconditional gather read M blocks of every layer per step
    (64 rows of SmolLM2: 47 MB, ~16 ms of the fp32 step on 2 cores)."""
    from paged_jax import CacheConfig
    from paged_jax.cache import init_state
    from paged_jax.model import ModelConfig, init_params
    from paged_jax.steps import init_pages_for, make_step_fns

    cfg = ModelConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=256,
    )
    cc = CacheConfig(num_blocks=48, block_size=4, max_seqs=8, max_blocks_per_seq=18)
    _, params = init_params(cfg, 0)
    fns = make_step_fns(cfg, attention_impl="xla")
    state, pages = init_state(cc), init_pages_for(cfg, cc)
    text = fns.decode.lower(params, state, pages, jnp.zeros(4, jnp.int32), jnp.arange(4, dtype=jnp.int32)).compile().as_text()
    pool = "f32[2,2,48,4,16]"
    conds = [line for line in text.splitlines() if re.search(r"\sconditional\(", line)]
    assert any(line.split("conditional(")[0].count(pool) == 2 for line in conds), conds
