"""Frozen, validated description of a decoder of a registered family (``registry``).

A bad value raises ``ValueError`` naming the field and what is allowed, at construction
time. ``ModelConfig`` is hashable, so it can be a static argument or closed over by jit.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from paged_jax.dtypes import dtype_name, float_dtype
from paged_jax.model import registry

ROPE_TYPES = ("llama3", "linear", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as Hugging Face's ``rope_scaling`` / ``rope_parameters`` give it.

    ``rope_type``:
      - ``"llama3"``: frequency bands (long wavelengths slowed by ``factor``, short kept,
        the middle blended); needs ``low_freq_factor``, ``high_freq_factor`` and
        ``original_max_position_embeddings``.
      - ``"linear"``: every frequency divided by ``factor`` (position interpolation).
      - ``"yarn"``: NTK-by-parts, a ramp from interpolated to original frequencies between
        the dimensions that rotate ``beta_fast`` and ``beta_slow`` times over
        ``original_max_position_embeddings``; cos and sin scaled by ``attention_factor``
        (when None: ``0.1 ln(factor) + 1``, or the ratio of that with ``mscale`` and
        ``mscale_all_dim`` when both are set); ``truncate`` rounds the ramp's ends.
    """

    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling.rope_type={self.rope_type!r}: supported: {', '.join(ROPE_TYPES)}")
        if not self.factor > 0:
            raise ValueError(f"rope_scaling.factor={self.factor}: must be > 0")
        if self.rope_type == "linear":
            return
        if self.original_max_position_embeddings is None or self.original_max_position_embeddings < 1:
            raise ValueError("rope_scaling.original_max_position_embeddings must be >= 1")
        if self.rope_type == "llama3":
            if not (self.high_freq_factor or 0) > (self.low_freq_factor or 0) > 0:
                raise ValueError(
                    f"rope_scaling: need high_freq_factor ({self.high_freq_factor}) > "
                    f"low_freq_factor ({self.low_freq_factor}) > 0"
                )
        elif self.attention_factor is not None and not self.attention_factor > 0:
            raise ValueError(f"rope_scaling.attention_factor={self.attention_factor}: must be > 0")

    @property
    def attention_scaling(self) -> float:
        """The factor on cos and sin (on every query-key logit, squared): 1 except for yarn."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim))
        return mscale(self.factor)


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: must be a positive int")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    Attributes:
      vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads,
        head_dim: sizes; num_heads must be a multiple of num_kv_heads (MHA/GQA/MQA).
      rope_theta: RoPE base. rope_scaling: ``RopeScaling`` (llama3, linear, yarn) or None.
      rms_norm_eps: RMSNorm epsilon.
      max_position_embeddings: the checkpoint's value; the longest sequence accepted is
        ``max_seq_len`` (stretched by linear or yarn RoPE scaling, as vLLM does).
      sliding_window: Mistral/Qwen2 sliding-window size, or None. Sliding-window
        attention is not implemented: sequences are capped at this length
        (``max_seq_len``), where it is exact full attention.
      tie_word_embeddings: the LM head reuses the embedding matrix.
      attention_bias: q/k/v projections have biases (Qwen2; Llama with attention_bias).
      attention_out_bias: o_proj has a bias (Llama with attention_bias; not Qwen2).
      architecture: the HF architecture name of a registered family (``registry.FAMILIES``).
      dtype: parameter and compute dtype name: "float32", "bfloat16" or "float16".
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = False
    architecture: str = "LlamaForCausalLM"
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            _positive(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim}: RoPE needs an even head_dim")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta={self.rope_theta}: must be > 0")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps}: must be > 0")
        if self.sliding_window is not None:
            _positive("sliding_window", self.sliding_window)
        registry.family(self.architecture)  # ValueError naming the supported ones
        object.__setattr__(self, "dtype", dtype_name(self.dtype))  # "bf16", jnp.bfloat16 -> "bfloat16"

    # ------------------------------------------------------------------ derived

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return float_dtype(self.dtype)

    @property
    def max_context(self) -> int:
        """The context the checkpoint is meant for, derived as vLLM derives it: RoPE scaling
        that stretches positions extends ``max_position_embeddings`` (linear: times
        ``factor``; yarn: ``original_max_position_embeddings`` times ``factor``); llama3
        checkpoints already state their extended length."""
        s = self.rope_scaling
        if s is not None and s.rope_type == "linear":
            return int(self.max_position_embeddings * s.factor)
        if s is not None and s.rope_type == "yarn":
            return int(s.original_max_position_embeddings * s.factor)
        return self.max_position_embeddings

    @property
    def max_seq_len(self) -> int:
        """Longest sequence this implementation runs exactly (positions 0..max_seq_len-1):
        ``max_context``, or the sliding window if smaller."""
        if self.sliding_window is None:
            return self.max_context
        return min(self.max_context, self.sliding_window)

    def kv_bytes_per_token(self, dtype: Any = None) -> int:
        """Bytes of K + V per token over all layers: 2 * L * Hkv * D * itemsize.

        ``dtype`` is the KV page dtype; defaults to the model dtype.
        """
        itemsize = float_dtype(self.dtype if dtype is None else dtype).itemsize
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @property
    def num_params(self) -> int:
        """Parameter count of this family's module (the tied LM head counted once): the
        sizes of its parameters, shape only (nothing allocated), so a family with
        parameters of its own (Qwen3's q/k norms) is counted right."""
        return _count_params(self)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ Hugging Face

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict, *, dtype: str | None = None) -> ModelConfig:
        """Read a Hugging Face ``config.json`` (a directory, the file, or its dict).

        Understands both the transformers 4 keys (``rope_theta``, ``rope_scaling``,
        ``torch_dtype``) and the transformers 5 ones (``rope_parameters``, ``dtype``).
        ``dtype`` overrides the checkpoint's dtype.

        Raises ValueError for an unsupported architecture (naming it and the supported
        ones) or a feature this implementation lacks (other activations, mlp bias, other
        RoPE scalings, per-layer sliding windows on some layers only).
        """
        hf = _read_json(path_or_dict)
        fam = registry.family_of_hf(hf)
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={hf['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
        if hf.get("mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")

        rope = dict(hf.get("rope_parameters") or {})
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
        if partial is not None and float(partial) != 1.0:
            raise ValueError(f"partial_rotary_factor={partial}: only 1.0 (RoPE on the whole head) is supported")
        theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = hf.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"}
        rope_scaling = _rope_scaling(scaling, hf)

        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        bias = bool(hf.get("attention_bias", False))
        window = hf.get("sliding_window")
        fields = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rope_theta=theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            sliding_window=None if window is None else int(window),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bias,  # Llama's flag sets all four projections' biases
            attention_out_bias=bias,
            architecture=fam.architecture,
            dtype=dtype_name(dtype or hf.get("dtype") or hf.get("torch_dtype") or "float32"),
        )
        if fam.adjust is not None:
            fields = fam.adjust(fields, hf)
        return cls(**fields)


@functools.cache
def _count_params(config: ModelConfig) -> int:
    module = registry.family(config.architecture).module
    abstract = nnx.eval_shape(lambda: module(config, rngs=nnx.Rngs(0)))
    return int(sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param))))


def _read_json(path_or_dict) -> dict:
    if isinstance(path_or_dict, dict):
        return path_or_dict
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    return read_json_file(path)


def read_json_file(path: str) -> dict:
    """A checkpoint's JSON file as a dict; ValueError naming the file when it is malformed."""
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _rope_scaling(scaling: dict, hf: dict) -> RopeScaling | None:
    """``RopeScaling`` from HF's rope dict; ``hf`` (the whole config) supplies what
    transformers takes from it: a top-level ``original_max_position_embeddings`` (it wins,
    as in transformers) or else ``max_position_embeddings``, and yarn's missing factor."""
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return None
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)} or none)")
    if kind == "linear":
        return RopeScaling(factor=float(scaling["factor"]), rope_type="linear")
    original = hf.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
    original = int(original or hf.get("max_position_embeddings", 2048))
    if kind == "llama3":
        return RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=original,
        )
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else hf.get("max_position_embeddings", 2048) / original
    optional = {k: float(scaling[k]) for k in ("attention_factor", "mscale", "mscale_all_dim") if scaling.get(k)}
    return RopeScaling(
        factor=factor,
        original_max_position_embeddings=original,
        rope_type="yarn",
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        truncate=bool(scaling.get("truncate", True)),
        **optional,
    )
