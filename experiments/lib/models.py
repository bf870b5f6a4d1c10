"""Every model the studies run: Llama-shaped ``ModelConfig``s with random weights (only
their shapes matter to a study; ``paged_jax.model.init_params`` draws the weights).

A test swaps one for a tiny model or the engine tests' fake backend by patching it here
(``monkeypatch.setattr(models, "memory_model", ...)``); studies read every one through
this module at call time.
"""

from __future__ import annotations

from paged_jax.model import ModelConfig

# The vocabulary of ``memory_model`` and of the random-token workloads run on it (a test
# that swaps the model for the fake backend sets this to the fake's vocabulary).
VOCAB = 2048

# decode_step's model (4 layers, d=256, GQA 8:4, 4 KB of fp32 KV per token, 4.0M
# parameters); preemption, table_growth and small_kv time the same one.
DECODE_STEP_MODEL = ModelConfig(
    vocab_size=2048, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8,
    num_kv_heads=4, head_dim=32, max_position_embeddings=4096,
)


def memory_model(max_model_len: int):
    """A small Llama-shaped decoder with random weights (2 layers, d=128, GQA 4:2, 0.8M
    parameters, vocabulary ``VOCAB``): sharing and paging are structural, so its size does
    not matter to memory; its logits decide how beams diverge. The memory, block-size,
    beam, parallel-sampling and prefix-caching studies run it."""
    return ModelConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=32, max_position_embeddings=max_model_len)


def llama_33m(max_model_len: int):
    """The throughput study's model: 8 layers, d=512, GQA 8:2, ~33M parameters, weight
    reading dominated at batches 8-64 on a CPU (so a decode step costs about the same at 8
    and 32+ rows, as in real LLMs). Beam, quantized, speculative and sweep ("small") run it too."""
    return ModelConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        max_position_embeddings=max_model_len,
    )


def one_b(quick: bool):
    """Llama-3.2-1B's shape (random weights); ``quick``: a 2-layer, 256-wide stand-in."""
    if quick:
        return ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=64, max_position_embeddings=256)
    return ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                       num_kv_heads=8, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True)


def tiny(max_model_len: int):
    """The sweep's "tiny" model (2 layers, d=64, GQA 4:2): overhead-bound, tokens/s on it is
    mostly the engine's own cost."""
    return ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, max_position_embeddings=max_model_len)
