"""The model decodes through the Pallas kernels (interpret mode on CPU) exactly as it does
through the XLA reference: prefill through the multi-query kernel, decode through the
decode kernel, over a shuffled pool with a forked (copy-on-write) prefix."""

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import CacheConfig
from paged_jax.buckets import pad_batch, pad_decode
from paged_jax.cache import fork, init_state, open_sequences, raise_for_status
from paged_jax.model import ModelConfig, init_params
from paged_jax.steps import init_pages_for, make_step_fns

# Studies and multi-process runs: minutes on 2 cores; `make test-fast` skips them.
pytestmark = pytest.mark.slow


# head_dim 64 and block_size 8 are the smallest shapes the kernels take.
CFG = ModelConfig(
    vocab_size=96, hidden_size=128, intermediate_size=128, num_layers=1, num_heads=4,
    num_kv_heads=2, head_dim=64, max_position_embeddings=128,
)
CACHE = CacheConfig(num_blocks=24, block_size=8, max_seqs=4, max_blocks_per_seq=4)


def run(impl: str, kv_cache_dtype: str = "auto"):
    """Prefill two prompts, fork one, decode 6 greedy steps; returns every step's logits."""
    graphdef, params = init_params(CFG, seed=1)
    fns = make_step_fns(CFG, attention_impl=impl)
    state = init_state(CACHE, "random")  # scattered physical layout
    pages = init_pages_for(CFG, CACHE, kv_cache_dtype=kv_cache_dtype)
    state, status = open_sequences(state, jnp.asarray([0, 1], jnp.int32))
    raise_for_status("open", [0, 1], status)
    prompts = [[5, 17, 3, 44, 9, 61, 2, 8, 30, 11, 7], [40, 2, 9]]  # 11 tokens: mid-block
    batch = pad_batch([0, 1], prompts, batch_buckets=[4], length_buckets=[16])
    logits, state, pages, status = fns.prefill(params, state, pages, *batch)
    raise_for_status("prefill", [0, 1], status)
    out = [np.asarray(logits[:2])]
    state, status = fork(state, jnp.asarray([0], jnp.int32), jnp.asarray([2], jnp.int32))
    raise_for_status("fork", [0], status)
    next_tokens = [int(np.argmax(out[0][0])), int(np.argmax(out[0][1])), int(np.argmax(out[0][0]) + 1) % 96]
    for _ in range(6):
        tokens, seq_ids = pad_decode([0, 1, 2], next_tokens, batch_buckets=[4])
        logits, state, pages, status = fns.decode(params, state, pages, tokens, seq_ids)
        raise_for_status("decode", [0, 1, 2], status)
        step = np.asarray(logits[:3])
        out.append(step)
        next_tokens = [int(t) for t in np.argmax(step, axis=-1)]
    return out


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_model_through_pallas_interpret_matches_xla(kv_cache_dtype):
    """Also over quantised pages: the kernels load each tile's scales (copy-on-write
    carrying them) and agree with the XLA path on the same quantised cache."""
    xla, pallas = run("xla", kv_cache_dtype), run("pallas_interpret", kv_cache_dtype)
    for a, b in zip(xla, pallas):
        assert np.isfinite(b).all()
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(np.argmax(b, -1), np.argmax(a, -1))
