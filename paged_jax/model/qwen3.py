"""Qwen3 (``Qwen3ForCausalLM``): the Llama decoder with an RMSNorm on every query and key
head before RoPE, and ``head_dim`` decoupled from ``hidden_size / num_attention_heads``.

As transformers' ``modeling_qwen3.py`` computes it: ``q_norm`` and ``k_norm`` are RMSNorms
over ``head_dim`` (one weight ``[head_dim]`` each, shared by all heads, eps
``rms_norm_eps``), applied to the per-head projections ``[B, T, H, head_dim]``, normalised
in fp32 and cast back before the scale, then RoPE. Biases follow ``attention_bias`` on all
four projections (q/k/v and o_proj; vLLM's ``qwen3.py`` gives o_proj no bias, transformers
does: this follows transformers). The checkpoint names are HF's
(``model.layers.{i}.self_attn.q_norm.weight``) because the parameter paths mirror them.
"""

from __future__ import annotations

import jax

from paged_jax.model.config import ModelConfig
from paged_jax.model.llama import Attention, DecoderLayer, LlamaForCausalLM, RMSNorm
from paged_jax.model.registry import ModelFamily, register_family

# Qwen3Config's defaults for keys a config.json may omit, where they differ from the common
# parse's (a head_dim of its own, not hidden_size // num_attention_heads): HF key -> (field, value).
HF_DEFAULTS = {"head_dim": ("head_dim", 128), "num_key_value_heads": ("num_kv_heads", 32),
               "max_position_embeddings": ("max_position_embeddings", 32768)}
HF_SLIDING_WINDOW, HF_MAX_WINDOW_LAYERS = 4096, 28


class Qwen3Attention(Attention):
    """GQA attention with per-head q/k RMSNorm (``q_norm``, ``k_norm``: ``[head_dim]``)."""

    def __init__(self, cfg: ModelConfig, rngs):
        super().__init__(cfg, rngs)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.jnp_dtype)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.jnp_dtype)

    def transform_qk(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        """q [B, T, Hq, D], k [B, T, Hkv, D] in the model dtype, each head normalised over D."""
        return self.q_norm(q), self.k_norm(k)


class Qwen3DecoderLayer(DecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer


def qwen3_fields(fields: dict, hf: dict) -> dict:
    """Qwen3Config's rules on top of the common parse: its defaults for omitted keys, and
    its sliding window, which applies only with ``use_sliding_window`` and only on the
    layers ``layer_types`` marks ``"sliding_attention"`` (when absent: layers
    ``max_window_layers`` and above). A window on every layer caps ``max_seq_len`` as for
    Mistral; on no layer it is dropped; on some layers only it is refused."""
    fields = {**fields, **{field: value for key, (field, value) in HF_DEFAULTS.items() if key not in hf}}
    layers = fields["num_layers"]
    window = hf.get("sliding_window", HF_SLIDING_WINDOW) if hf.get("use_sliding_window", False) else None
    layer_types = hf.get("layer_types")
    if layer_types is None:
        first = hf.get("max_window_layers", HF_MAX_WINDOW_LAYERS)
        layer_types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                       for i in range(layers)]
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown or len(layer_types) != layers:
        raise ValueError(f"layer_types={layer_types!r}: expected {layers} entries of 'full_attention' "
                         "or 'sliding_attention'")
    sliding = sum(t == "sliding_attention" for t in layer_types)
    if window is None or sliding == 0:
        return {**fields, "sliding_window": None}
    if sliding < layers:
        raise ValueError(f"sliding-window attention on some layers only is not supported ({sliding} of {layers} "
                         f"layers slide: use_sliding_window with max_window_layers/layer_types)")
    return {**fields, "sliding_window": int(window)}


register_family(ModelFamily("Qwen3ForCausalLM", "qwen3", Qwen3ForCausalLM, adjust=qwen3_fields,
                            gguf_architecture="qwen3"))
