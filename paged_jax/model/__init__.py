"""Decoder families in Flax NNX (``registry``: Llama, Qwen2, Mistral, Qwen3, ...) and their loading
from any ``ModelSource`` (a local HF directory, or a registered format)."""

# Loading: where a model comes from, and its parameters.
from paged_jax.model.checkpoint import CheckpointError, load_model, load_params, save_params

# Configuration and the families.
from paged_jax.model.config import ModelConfig, RopeScaling
from paged_jax.model.gguf import GGUFFile  # registers the GGUF source (.gguf files)
from paged_jax.model.hub import resolve_snapshot  # registers the hub-cache source (org/name ids)

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
from paged_jax.model.qwen3 import Qwen3ForCausalLM  # registers the Qwen3 family
from paged_jax.model.registry import FAMILIES, ModelFamily, register_family
from paged_jax.model.source import HFDirectory, ModelSource, open_source, register_source

__all__ = [
    "FAMILIES", "AttendFn", "GGUFFile", "HFDirectory", "ModelFamily", "ModelSource", "open_source", "register_family",
    "register_source", "CheckpointError", "ContiguousKV", "LlamaForCausalLM",
    "ModelConfig", "PagedContext", "Qwen3ForCausalLM", "RopeScaling", "dense_attend", "dense_forward", "forward",
    "init_contiguous_kv", "init_params", "load_model", "load_params", "logits_from_hidden",
    "make_contiguous_attend", "make_paged_attend", "resolve_snapshot", "save_params",
]
