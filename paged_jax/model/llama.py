"""A Llama-family decoder (Llama 2/3, Qwen2, Mistral) in Flax NNX, cache-agnostic.

The module computes projections, RoPE, MLPs and norms; what happens to each layer's new
K/V and how attention reads the past is an ``AttendFn`` passed in by the caller:

    attend(kv, layer, q [B, T, Hq, D], k [B, T, Hkv, D], v [B, T, Hkv, D]) -> (out [B, T, Hq, D], kv)

``kv`` is whatever cache the backend threads through the layers (a ``KVPages``, a
contiguous cache, or nothing); ``layer`` is a traced int32 scalar. Three backends live
here: ``dense_attend`` (no cache, full causal attention: the test oracle),
``make_paged_attend`` (write through the slot mapping, attend through the block tables
via ``attention.dispatch``) and ``make_contiguous_attend`` (a ``[L, B, max_len]`` cache:
the non-paged baseline).

Layers run under one ``jax.lax.scan``: every per-layer parameter is stacked along a
leading ``num_layers`` axis (``nnx.vmap`` builds them), and the cache is the scan's
carry, so a compiled step holds one layer body whatever the depth. Compile time does not
grow with the number of layers, and the cache is updated in place at index ``layer``
(every backend indexes the layer itself instead of being handed a slice, which would be
materialised). Or, with the stacked leaves split into ``PerLayer`` arrays
(``unstack_layers``; ``layer_loop="unrolled"``, the engine's default on one CPU device),
as a Python loop over the layers: XLA:CPU copies each layer's weights out of the stack
under the scan, and reads separate arrays where they lie, at the price of a program
holding every layer.

Hot loops never call the module directly: they ``nnx.split`` it once and run a pure
function ``f(graphdef, params, ...)`` under plain ``jax.jit`` (``forward`` below), which
merges at trace time only; ``nnx.jit`` costs ~0.3 ms a call.

Parameter names mirror Hugging Face's (``model.layers.{i}.self_attn.q_proj`` becomes row
``i`` of the stacked ``layers.self_attn.q_proj``); ``nnx.Linear`` kernels are ``[in,
out]``, the transpose of HF's ``weight``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.attention import dense_causal_attention, dispatch
from paged_jax.kv.pages import KVPages, write_tokens
from paged_jax.model.config import ModelConfig, RopeScaling
from paged_jax.model.registry import ModelFamily, family, register_family

AttendFn = Callable[[Any, jax.Array, jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]

# --------------------------------------------------------------------------- RoPE


class Rope(NamedTuple):
    """What RoPE needs besides positions: ``inv_freq`` float32[head_dim // 2] and the
    factor on cos and sin (``scaling``; 1 except for yarn)."""

    inv_freq: np.ndarray
    scaling: float = 1.0


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """float32[head_dim // 2] inverse frequencies with the config's scaling applied, as HF
    computes them (in float32, from ``rope_theta ** (2i / head_dim)``)."""
    d = config.head_dim
    exponent = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    pos_freqs = (np.float32(config.rope_theta) ** exponent).astype(np.float32)
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    s = config.rope_scaling
    if s is None:
        return inv_freq
    if s.rope_type == "linear":
        return (inv_freq / np.float32(s.factor)).astype(np.float32)
    if s.rope_type == "yarn":
        return _yarn_inv_freq(s, pos_freqs, d, config.rope_theta)
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the middle band blended.
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def _yarn_inv_freq(s: RopeScaling, pos_freqs: np.ndarray, dim: int, base: float) -> np.ndarray:
    """YaRN's NTK-by-parts frequencies: original (extrapolated) below the dimension that
    turns ``beta_fast`` times over the original context, interpolated (/ factor) above the
    one that turns ``beta_slow`` times, a linear ramp between (float32, as HF)."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (np.float32(1) - ramp.astype(np.float32)).astype(np.float32)
    interpolated = (np.float32(1) / (np.float32(s.factor) * pos_freqs)).astype(np.float32)
    original = (np.float32(1) / pos_freqs).astype(np.float32)
    return (interpolated * (1 - extrapolation) + original * extrapolation).astype(np.float32)


def rope_tables(config: ModelConfig) -> Rope:
    """The model's ``Rope`` (frequencies and cos/sin scaling) from its config."""
    scaling = 1.0 if config.rope_scaling is None else config.rope_scaling.attention_scaling
    return Rope(rope_inv_freq(config), scaling)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, scaling: float = 1.0) -> jax.Array:
    """Rotate ``x: [B, T, H, D]`` by ``positions: int32[B, T]`` (HF's rotate-half layout:
    pairs are ``(i, i + D/2)``), cos and sin times ``scaling``. Computed in fp32, returned
    in x.dtype."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


# --------------------------------------------------------------------------- layers


def as_bits(x: jax.Array) -> jax.Array:
    """A 16-bit float array as its uint16 bits (a bitcast); anything else unchanged."""
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16)
    return x


def pack_params(params):
    """``params`` (``nnx.split``'s state) with the stacked layers' 16-bit float leaves held
    as their uint16 bits: what the engine passes to its steps (``build_backend``).

    XLA:CPU has no 16-bit float dynamic-slice: the scan's per-layer slice of bf16 stacked
    weights was rewritten to f32, and loop-invariant code motion hoisted the convert out
    of the scan, so every step converted all weights to f32 and each layer's slice back
    to bf16. As bits, the slice is an integer move and each layer's weights are bitcast
    back inside the scan (``from_bits``). The model accepts packed or unpacked layers
    (unpacked ones are bitcast on every call: correct, one weights copy per step)."""
    return jax.tree_util.tree_map_with_path(lambda path, x: as_bits(x) if _in_layers(path) else x, params)


def _in_layers(path) -> bool:
    """Whether a parameter's tree path is under the stacked ``layers`` (its first key)."""
    return bool(path) and getattr(path[0], "key", getattr(path[0], "name", None)) == "layers"


@jax.tree_util.register_pytree_node_class
class PerLayer:
    """One stacked layer parameter held as ``num_layers`` separate arrays (``unstack_layers``).

    Under the layer scan each step slices every stacked weight per layer, and XLA:CPU
    materialises each slice (a copy of all the weights per step, ~30% of the matmul time at
    1-8 rows, docs/results/notes/serving.md); separate arrays are read where they lie. A
    pytree node, so jit, donation and ``device_put`` see the arrays."""

    def __init__(self, arrays):
        self.arrays = tuple(arrays)

    def tree_flatten(self):
        return self.arrays, None

    @classmethod
    def tree_unflatten(cls, _, arrays):
        return cls(arrays)


def _is_per_layer(x) -> bool:
    return isinstance(x, PerLayer)


def _is_unstacked(layer_params) -> bool:
    leaves = jax.tree.leaves(layer_params, is_leaf=_is_per_layer)
    return bool(leaves) and all(map(_is_per_layer, leaves))


def unstack_layers(params, dtype):
    """``params`` (``nnx.split``'s state, packed or not) with every stacked layer leaf as a
    ``PerLayer`` of its ``num_layers`` slices (copied once, here; 16-bit ones back from
    their bits to ``dtype``, as nothing slices them any more): the model then runs its
    layers as an unrolled loop (``layer_loop="unrolled"``: faster fp32 steps, a longer
    compile per shape)."""
    def unstack(path, x):
        return PerLayer(from_bits(x[i], dtype) for i in range(x.shape[0])) if _in_layers(path) else x

    return jax.tree_util.tree_map_with_path(unstack, params)


def from_bits(x: jax.Array, dtype) -> jax.Array:
    """uint16 bits (``as_bits``) back to the 16-bit float ``dtype``; anything else unchanged."""
    if x.dtype == jnp.uint16 and jnp.dtype(dtype).itemsize == 2:
        return jax.lax.bitcast_convert_type(x, dtype)
    return x



class RMSNorm(nnx.Module):
    """``weight * x / rms(x)``, normalised in fp32 and cast back before the scale (as HF)."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


def _accumulate_f32(dtype) -> bool:
    """Whether dots of ``dtype`` operands ask for float32 results (16-bit floats).

    XLA:CPU has bf16 dots only with float32 accumulation *and* output
    (``preferred_element_type``); a bf16-out dot is rewritten to f32 with both operands
    converted first, i.e. every weight converted on every step. Measured on the 2-core
    AVX512-BF16 CPU ([64, 576] x [576, 1536], under contention, 2026-12-03): f32 3.0 ms,
    bf16-out 2.8 ms, bf16 in / f32 out 0.68 ms; the tied LM head [64, 576] x [49152,
    576]^T: 112, 324 and 64 ms. The result is rounded to the model dtype after the dot,
    as transformers' bf16 matmuls do (f32 accumulation, bf16 output)."""
    return jnp.dtype(dtype).itemsize == 2


class Linear(nnx.Linear):
    """``nnx.Linear`` (same parameters, ``kernel [in, out]``) that accumulates 16-bit
    dots in float32 (``_accumulate_f32``) and returns the model dtype."""

    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        return super().__call__(inputs, out_sharding=out_sharding).astype(self.dtype)


def _linear(cfg: ModelConfig, din: int, dout: int, bias: bool, rngs: nnx.Rngs) -> nnx.Linear:
    dtype = cfg.jnp_dtype
    pet = jnp.float32 if _accumulate_f32(dtype) else None
    return Linear(din, dout, use_bias=bias, dtype=dtype, param_dtype=dtype, preferred_element_type=pet, rngs=rngs)


def head_logits(hidden: jax.Array, weight: jax.Array, *, transposed: bool) -> jax.Array:
    """float32[..., V] = ``hidden [..., H] @ weight`` (``weight [H, V]``, or the embedding
    ``[V, H]`` when ``transposed``), accumulated and returned in float32 (16-bit weights
    stay 16-bit: see ``_accumulate_f32``)."""
    hidden = hidden.astype(weight.dtype)
    contract = (((hidden.ndim - 1,), (1 if transposed else 0,)), ((), ()))
    return jax.lax.dot_general(hidden, weight, contract, preferred_element_type=jnp.float32)


class Attention(nnx.Module):
    """GQA self-attention projections + RoPE; the cache work is the ``attend`` callback's.

    A family that normalises or otherwise transforms the per-head queries and keys before
    RoPE (Qwen3's q/k RMSNorm) overrides ``transform_qk``."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = _linear(cfg, h, cfg.num_heads * d, cfg.attention_bias, rngs)
        self.k_proj = _linear(cfg, h, cfg.num_kv_heads * d, cfg.attention_bias, rngs)
        self.v_proj = _linear(cfg, h, cfg.num_kv_heads * d, cfg.attention_bias, rngs)
        self.o_proj = _linear(cfg, cfg.num_heads * d, h, cfg.attention_out_bias, rngs)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d

    def __call__(self, x, positions, rope: Rope, kv, layer: jax.Array, attend: AttendFn):
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        q, k = self.transform_qk(q, k)
        q = apply_rope(q, positions, *rope)
        k = apply_rope(k, positions, *rope)
        out, kv = attend(kv, layer, q, k, v)
        return self.o_proj(out.astype(x.dtype).reshape(b, t, -1)), kv

    def transform_qk(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        """q [B, T, Hq, D], k [B, T, Hkv, D] before RoPE: unchanged here."""
        return q, k


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(cfg, h, i, False, rngs)
        self.up_proj = _linear(cfg, h, i, False, rngs)
        self.down_proj = _linear(cfg, i, h, False, rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    attention_cls: type = Attention  # a family's attention (a subclass) goes here

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtype = cfg.jnp_dtype
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = self.attention_cls(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, positions, rope: Rope, kv, layer: jax.Array, attend: AttendFn):
        attn, kv = self.self_attn(self.input_layernorm(x), positions, rope, kv, layer, attend)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv


def _stacked_layers(config: ModelConfig, rngs: nnx.Rngs, layer_cls: type) -> DecoderLayer:
    """``num_layers`` decoder layers (``layer_cls``) as one module whose parameters have a
    leading layer axis (each layer initialised from its own split of ``rngs``)."""

    @nnx.split_rngs(splits=config.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return layer_cls(config, rngs)

    return make(rngs)


class LlamaForCausalLM(nnx.Module):
    """Embedding, ``num_layers`` decoder layers (stacked, see the module docstring), final
    norm, LM head (tied or not). A family changes a layer by subclassing with its own
    ``layer_cls`` (e.g. ``qwen3.py``)."""

    layer_cls: type = DecoderLayer

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        dtype = config.jnp_dtype
        self.embed_tokens = nnx.Embed(
            config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        self.layers = _stacked_layers(config, rngs, self.layer_cls)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = (
            None if config.tie_word_embeddings
            else _linear(config, config.hidden_size, config.vocab_size, False, rngs)
        )

    def __call__(self, tokens, positions, kv, attend: AttendFn):
        """Final-normed hidden states of ``tokens``.

        Args:
          tokens: int32[B, T] (ids must be in [0, vocab); out-of-range ids are clamped).
          positions: int32[B, T] absolute positions (RoPE).
          kv: the backend's cache, threaded through ``attend`` layer by layer.

        Returns (hidden [B, T, hidden_size] in the model dtype, kv).
        """
        rope = rope_tables(self.config)
        x = self.embed_tokens(tokens)
        layer_def, layer_params = nnx.split(self.layers)

        dtype = self.config.jnp_dtype
        if _is_unstacked(layer_params):  # one array per layer (``unstack_layers``): no slices to copy
            for i in range(self.config.num_layers):
                params = jax.tree.map(lambda p: from_bits(p.arrays[i], dtype), layer_params, is_leaf=_is_per_layer)
                x, kv = nnx.merge(layer_def, params)(x, positions, rope, kv, jnp.int32(i), attend)
            return self.norm(x), kv

        def one_layer(carry, per_layer):
            x, kv = carry
            params, index = per_layer
            params = jax.tree.map(lambda p: from_bits(p, dtype), params)
            return nnx.merge(layer_def, params)(x, positions, rope, kv, index, attend), None

        indices = jnp.arange(self.config.num_layers, dtype=jnp.int32)
        layer_params = jax.tree.map(as_bits, layer_params)
        (x, kv), _ = jax.lax.scan(one_layer, (x, kv), (layer_params, indices))
        return self.norm(x), kv

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32[..., vocab] from final-normed hidden states (model-dtype operands, float32
        accumulation and result)."""
        if self.lm_head is None:
            out = head_logits(hidden, self.embed_tokens.embedding[...], transposed=True)
        else:
            out = head_logits(hidden, self.lm_head.kernel[...], transposed=False)
            if self.lm_head.bias is not None:
                out = out + self.lm_head.bias[...].astype(jnp.float32)
        return out.astype(jnp.float32)


def module_class(config: ModelConfig) -> type:
    """The ``nnx.Module`` class of ``config``'s family (``registry``)."""
    return family(config.architecture).module


def abstract_model(config: ModelConfig) -> nnx.Module:
    """``config``'s module with abstract (shape-only) parameters: nothing allocated."""
    module = module_class(config)
    return nnx.eval_shape(lambda: module(config, rngs=nnx.Rngs(0)))


def init_params(config: ModelConfig, seed: int = 0) -> tuple[nnx.GraphDef, nnx.State]:
    """Random weights (flax default initialisers): ``(graphdef, params)`` from ``nnx.split``.

    One jitted program per config (built eagerly, the initialisers would dispatch and
    compile op by op: seconds per call on CPU, growing with depth)."""
    graphdef, params = _jitted_init(config)(jax.random.key(seed))
    return graphdef, params


@functools.cache
def _jitted_init(config: ModelConfig):
    module = module_class(config)
    graphdef = nnx.split(nnx.eval_shape(lambda: module(config, rngs=nnx.Rngs(0))))[0]

    @jax.jit
    def init(key):
        return nnx.split(module(config, rngs=nnx.Rngs(key)))[1]

    return lambda key: (graphdef, init(key))


# --------------------------------------------------------------------------- backends


def dense_attend(kv, layer, q, k, v):
    """No cache: full causal attention of the T tokens over themselves (``kv`` unused)."""
    del layer
    return dense_causal_attention(q, k, v), kv


class PagedContext(NamedTuple):
    """What every layer of a paged step shares (from ``append_slots`` and the cache state).

    Padded steps feed ``[B, T]`` tokens; packed steps feed ``[1, N]``: every row's new
    tokens one after another, row b's from ``q_starts[b]`` (``paged_jax.steps``)."""

    slot_mapping: jax.Array  # int32[B, T] (packed: [1, N]); physical slot per new token, -1 for padding
    block_tables: jax.Array  # int32[B, P]; the batch rows' block tables (after the append)
    lengths: jax.Array  # int32[B]; KV length including the new tokens; 0 for padding rows
    q_lens: jax.Array  # int32[B]; new tokens per row (<= T)
    q_starts: jax.Array | None = None  # int32[B]: packed steps only, where row b's tokens start


def make_paged_attend(ctx: PagedContext, *, impl: str = "auto") -> AttendFn:
    """Backend over ``kv = KVPages`` (all layers): write the layer's new K/V through the
    slot mapping, then attend through the block tables (one contract for decode, T = 1,
    and chunks, padded or packed; ``attention.dispatch`` picks the implementation)."""

    def attend(pages: KVPages, layer: jax.Array, q, k, v):
        pages = write_tokens(pages, ctx.slot_mapping, k, v, layer=layer)
        if ctx.q_starts is None:
            out = dispatch.paged_attention(
                q, pages, ctx.block_tables, ctx.lengths, ctx.q_lens, layer=layer, impl=impl
            )
        else:  # q [1, N, Hq, D]: the packed batch
            out = dispatch.ragged_paged_attention(
                q[0], pages, ctx.block_tables, ctx.lengths, ctx.q_starts, ctx.q_lens, layer=layer, impl=impl
            )[None]
        return out, pages

    return attend


class ContiguousKV(NamedTuple):
    """A non-paged cache: every sequence owns ``max_len`` contiguous slots.

    Head-major like the pages (``[..., Hkv, tokens, D]``), so attention reads it without
    a transpose and the comparison with the paged cache is about paging only.
    """

    k: jax.Array  # [num_layers, B, num_kv_heads, max_len, head_dim]
    v: jax.Array  # [num_layers, B, num_kv_heads, max_len, head_dim]


def init_contiguous_kv(config: ModelConfig, batch: int, max_len: int, dtype=None) -> ContiguousKV:
    """Zero contiguous cache ``[L, batch, Hkv, max_len, D]`` (dtype defaults to the model's)."""
    shape = (config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim)
    dtype = config.jnp_dtype if dtype is None else dtype
    return ContiguousKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def make_contiguous_attend(positions: jax.Array, lengths: jax.Array, q_lens: jax.Array) -> AttendFn:
    """Backend over ``kv = ContiguousKV``: row b of the batch is cache row b; new tokens
    go to ``positions[b, t]`` (``t < q_lens[b]``), attention reads ``lengths[b]`` keys."""

    def attend(kv: ContiguousKV, layer: jax.Array, q, k, v):
        b, t = positions.shape
        max_len = kv.k.shape[3]
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        real = jnp.arange(t)[None, :] < q_lens[:, None]
        cols = jnp.where(real, positions, max_len)  # padding tokens are dropped
        # kv.k[layer, rows, :, cols] is [B, T, Hkv, D] (advanced indices first): k's layout.
        kc = kv.k.at[layer, rows, :, cols].set(k.astype(kv.k.dtype), mode="drop")
        vc = kv.v.at[layer, rows, :, cols].set(v.astype(kv.v.dtype), mode="drop")
        out = dense_causal_attention(
            q, kc[layer], vc[layer], lengths=lengths, q_lens=q_lens, heads_first=True
        )
        return out, ContiguousKV(kc, vc)

    return attend


# --------------------------------------------------------------------------- pure entry points


def forward(graphdef, params, tokens, positions, kv, attend: AttendFn):
    """Pure ``(hidden [B, T, H], kv)`` for ``jax.jit``: merges the module at trace time."""
    model = nnx.merge(graphdef, params)
    return model(tokens, positions, kv, attend)


def logits_from_hidden(graphdef, params, hidden):
    """Pure LM head: float32[..., vocab]."""
    return nnx.merge(graphdef, params).logits(hidden)


def dense_forward(graphdef, params, tokens: jax.Array) -> jax.Array:
    """No-cache forward of whole sequences: float32[B, T, vocab] logits at every position.

    tokens: int32[B, T], positions 0..T-1. The oracle for every cached path.
    """
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    model = nnx.merge(graphdef, params)
    hidden, _ = model(tokens, positions, None, dense_attend)
    return model.logits(hidden)


# --------------------------------------------------------------------------- the families


def _qwen2_fields(fields: dict, hf: dict) -> dict:
    """Qwen2 hard-codes bias on q/k/v and none on o_proj, and applies its sliding window
    only when ``use_sliding_window`` is set (on every layer: mixed layers are refused)."""
    fields = {**fields, "attention_bias": True, "attention_out_bias": False}
    if not hf.get("use_sliding_window", False):
        return {**fields, "sliding_window": None}
    layer_types = hf.get("layer_types") or []
    if layer_types and len(set(layer_types)) > 1:
        raise ValueError("sliding-window attention on some layers only is not supported")
    return fields


register_family(ModelFamily("LlamaForCausalLM", "llama", LlamaForCausalLM, gguf_architecture="llama"))
register_family(ModelFamily("Qwen2ForCausalLM", "qwen2", LlamaForCausalLM, adjust=_qwen2_fields,
                            gguf_architecture="qwen2"))
register_family(ModelFamily("MistralForCausalLM", "mistral", LlamaForCausalLM, gguf_architecture="llama"))
