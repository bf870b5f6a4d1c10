"""paged_jax: PagedAttention KV-cache management as pure JAX functions."""

from paged_jax.config import CacheConfig

__version__ = "0.1.0"

__all__ = ["CacheConfig", "__version__"]
