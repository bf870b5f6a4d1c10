
"""The attention cost ablation: zeros, and nothing read."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.lib import ablations
from paged_jax.attention import dispatch
from paged_jax.kv import KVPages

# Studies and multi-process runs: minutes on 2 cores; `make test-fast` skips them.
pytestmark = pytest.mark.slow


def test_no_attention_is_zeros_and_reads_no_page(monkeypatch):
    monkeypatch.setattr(dispatch, "IMPLS", dict(dispatch.IMPLS))
    assert ablations.register() == "none" and dispatch.resolve_impl("none") == "none"
    rng = np.random.default_rng(0)
    pages = KVPages(*(jnp.asarray(rng.standard_normal((3, 2, 12, 4, 8)), jnp.float32) for _ in range(2)))
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 8)), jnp.bfloat16)
    tables, lengths, q_lens = jnp.zeros((2, 4), jnp.int32), jnp.array([6, 11]), jnp.array([2, 3])
    out = dispatch.paged_attention(q, pages, tables, lengths, q_lens, layer=1, impl="none")
    assert out.shape == q.shape and out.dtype == q.dtype and not np.asarray(out, np.float32).any()
    # In the compiled program nothing touches the pages: a study times everything but attention.
    hlo = (
        jax.jit(
            lambda q, pages, layer: dispatch.paged_attention(
                q, pages, tables, lengths, q_lens, layer=layer, impl="none"
            )
        )
        .lower(q, pages, 1)
        .compile()
        .as_text()
    )
    assert "gather" not in hlo and "dot" not in hlo
    # ... which the same check would see for real attention.
    real = (
        jax.jit(
            lambda q, pages, layer: dispatch.paged_attention(
                q, pages, tables, lengths, q_lens, layer=layer, impl="reference"
            )
        )
        .lower(q, pages, 1)
        .compile()
        .as_text()
    )
    assert "gather" in real and "dot" in real
