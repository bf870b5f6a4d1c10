"""Llama-family decoders (Llama, Qwen2, Mistral) in Flax NNX, and HF checkpoint loading."""

# Hugging Face checkpoints (local directories only).
from paged_jax.model.checkpoint import CheckpointError, load_model, load_params, save_params

# Configuration.
from paged_jax.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling

# The module, its cache backends and pure entry points for jax.jit.
from paged_jax.model.llama import (
    AttendFn,
    ContiguousKV,
    LlamaForCausalLM,
    PagedContext,
    dense_attend,
    dense_forward,
    forward,
    init_contiguous_kv,
    init_params,
    logits_from_hidden,
    make_contiguous_attend,
    make_paged_attend,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES", "AttendFn", "CheckpointError", "ContiguousKV", "LlamaForCausalLM",
    "ModelConfig", "PagedContext", "RopeScaling", "dense_attend", "dense_forward", "forward",
    "init_contiguous_kv", "init_params", "load_model", "load_params", "logits_from_hidden",
    "make_contiguous_attend", "make_paged_attend", "save_params",
]
