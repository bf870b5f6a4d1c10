"""paged_jax: PagedAttention KV-cache management as pure JAX functions.

The names most scripts need, re-exported: the offline engine with vLLM's names, and the
block manager's configuration. Everything else lives in the subpackages (``cache``,
``kv``, ``attention``, ``model``, ``engine``).
"""

# The block pool's shape.
from paged_jax.config import CacheConfig

# The offline engine (vLLM's names).
from paged_jax.engine import (
    LLM,
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
)

# Packaged pretrained models by name: LLM("smollm2") (registers the aliases).
from paged_jax.models import smollm2

# Text: the checkpoint's tokenizer, streaming detokenisation, stop strings, chat templates.
from paged_jax.text import Tokenizer

__version__ = "0.1.0"

__all__ = [
    "LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "CacheConfig", "CompletionOutput",
    "Logprob", "RequestMetrics", "RequestOutput", "RequestOutputKind", "SamplingParams", "Tokenizer", "__version__", "smollm2",
]
