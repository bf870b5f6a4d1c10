"""GGUF files as a ``ModelSource``: ``LLM("model.gguf")``.

Parsed here with a bounds-checked reader (the file is memory-mapped; nothing is read until
asked; ``gguf.GGUFReader`` takes ~5 s over a 49k vocabulary) and dequantised with the ``gguf``
package (llama.cpp's own). ``GGUFFile(path)`` parses the header and metadata only, and checks
before any tensor is dequantised that:

- the file starts with the GGUF magic and every tensor lies inside the file (a truncated or
  corrupt file is a ``GGUFFormatError`` naming the offset and the file size);
- ``general.architecture`` is one a registered family reads (``ModelFamily.gguf_architecture``,
  plus ``mistral`` as Llama), else a ``ValueError`` naming it and the supported ones;
- every tensor the model needs has a type ``gguf.quants`` can dequantise (``SUPPORTED_TYPES``:
  F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, and the rest gguf knows), else a
  ``ValueError`` naming the tensor, its type and the supported ones.

Tensors (``read_tensor``, one at a time: peak host memory is one float32 tensor beyond the
weights) are dequantised by ``gguf.quants.dequantize`` (vectorised NumPy) to float32 in HF
layout (a Linear's weight ``[out, in]``); ``checkpoint.load_params`` then casts each to the
model dtype. Names map from llama.cpp's (``blk.3.attn_q.weight``) to Hugging Face's
(``model.layers.3.self_attn.q_proj.weight``). llama.cpp permutes the rows of Q and K of
``llama``-arch models (interleaved RoPE pairs, ``convert_hf_to_gguf.py``'s ``permute``); the
inverse is applied here, as transformers' ``LlamaTensorProcessor`` does. ``qwen2``/``qwen3``
use NEOX RoPE in llama.cpp and are stored unpermuted. No ``output.weight``: embeddings tied.

The config (``config``, in config.json's keys) comes from the metadata: ``{arch}.block_count``,
``embedding_length``, ``feed_forward_length``, ``attention.head_count(_kv)``,
``attention.key_length`` (else ``rope.dimension_count``, else hidden / heads),
``rope.freq_base``, ``rope.scaling.*`` (linear, yarn), a ``rope_freqs`` tensor recognised as
llama3 scaling, ``attention.layer_norm_rms_epsilon``, ``context_length``, ``vocab_size`` (else
the vocabulary's length). Parameters default to float32 (as transformers loads a GGUF);
``LLM(dtype=...)`` overrides.

The tokenizer comes from ``tokenizer.ggml.*``, built with HF ``tokenizers`` the way
transformers' GGUF converter builds it: ``gpt2`` (byte-level BPE: the vocabulary and merges,
GPT-2's split regex or the one ``tokenizer.ggml.pre`` names) and ``llama`` (SentencePiece BPE
with byte fallback, ``▁`` spaces; merges from the file or derived from the scores).
Control tokens (type 3) are special added tokens, user-defined ones (type 4) plain added
tokens; BOS/EOS/UNK/PAD from the ids, ``add_bos_token``/``add_eos_token`` from the flags
(default: BOS for ``llama``, none for ``gpt2``), the chat template from
``tokenizer.chat_template``. EOS for generation: ``eos_token_id`` and ``eot_token_id``.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import struct
from collections.abc import Collection

import numpy as np

from paged_jax.model import registry
from paged_jax.model.source import CheckpointError, ModelSource, register_source

__all__ = ["GGUFFile", "GGUFFormatError", "SUPPORTED_TYPES", "supported_architectures"]

MAGIC = b"GGUF"

# llama.cpp tensor names -> Hugging Face ones.
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors that are not parameters: llama3's per-dimension RoPE factors (read into the config).
IGNORED_TENSORS = {"rope_freqs.weight"}
# GGUF architectures whose Q/K rows llama.cpp permutes (its LLAMA RoPE type, "norm").
PERMUTED_QK = {"llama", "mistral"}
# GGUF architectures read by a family registered under another GGUF name.
GGUF_ALIASES = {"mistral": "llama"}

# tokenizer.ggml.pre -> split regex (transformers' GGUF_PRE_TOKENIZER_SPLITS); others: GPT-2's.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4
DEQUANT_CHUNK = 1 << 22  # elements dequantised at once (bounds the temporaries to ~100 MB)


class GGUFFormatError(CheckpointError):
    """Not a GGUF file, or a truncated or corrupt one."""


def _types():
    import gguf
    from gguf import quants

    t = gguf.GGMLQuantizationType
    return t, frozenset({t.F32, t.F16, *quants._type_traits})


def supported_type_names() -> list[str]:
    """Names of the GGML tensor types this loader dequantises (every one ``gguf.quants`` can)."""
    _, supported = _types()
    return sorted(t.name for t in supported)


SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # at least these (tested); see supported_type_names()


def supported_architectures() -> dict[str, registry.ModelFamily]:
    """GGUF ``general.architecture`` -> the registered family that reads it."""
    out: dict[str, registry.ModelFamily] = {}
    for fam in registry.FAMILIES.values():
        if fam.gguf_architecture is not None:
            out.setdefault(fam.gguf_architecture, fam)
    for alias, target in GGUF_ALIASES.items():
        if target in out:
            out.setdefault(alias, out[target])
    return out


# GGUFValueType ids -> struct format of a scalar (8: string, 9: array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry: ``shape`` in NumPy order (ggml's dims reversed: a weight is
    ``[out, in]``), ``type_id`` the GGML type, ``offset``/``n_bytes`` in the file."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int
    n_bytes: int


class _Parser:
    """GGUF v2/v3 header + metadata + tensor infos, parsed with ``struct`` over a memory map
    (``gguf.GGUFReader`` builds a NumPy view per vocabulary entry: ~5 s for a 49k vocabulary,
    this ~0.2 s). Every read is bounds-checked: a short file is a ``GGUFFormatError``."""

    def __init__(self, path: str, buf):
        self.path, self.buf, self.size = path, buf, len(buf)

    def need(self, offset: int, n: int, what: str) -> None:
        if offset + n > self.size:
            raise GGUFFormatError(f"{self.path}: truncated or corrupt GGUF file: {what} needs bytes up to "
                                  f"offset {offset + n} but the file has {self.size}")

    def scalar(self, fmt: str, offset: int, what: str):
        n = struct.calcsize("<" + fmt)
        self.need(offset, n, what)
        return struct.unpack_from("<" + fmt, self.buf, offset)[0], offset + n

    def string(self, offset: int, what: str) -> tuple[str, int]:
        n, offset = self.scalar("Q", offset, what)
        self.need(offset, n, what)
        try:
            return bytes(self.buf[offset:offset + n]).decode("utf-8"), offset + n
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"{self.path}: corrupt GGUF file: {what} is not UTF-8 ({e})") from None

    def value(self, kind: int, offset: int, what: str):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], offset, what)
        if kind == _STRING:
            return self.string(offset, what)
        if kind != _ARRAY:
            raise GGUFFormatError(f"{self.path}: corrupt GGUF file: {what} has value type {kind}")
        item, offset = self.scalar("I", offset, what)
        count, offset = self.scalar("Q", offset, what)
        if item in _SCALARS:
            fmt = "<" + _SCALARS[item]
            n = struct.calcsize(fmt) * count
            self.need(offset, n, what)
            values = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=count, offset=offset).tolist()
            return values, offset + n
        if item == _STRING:
            out = []
            unpack, buf = struct.unpack_from, self.buf
            for _ in range(count):
                self.need(offset, 8, what)
                (n,) = unpack("<Q", buf, offset)
                offset += 8
                self.need(offset, n, what)
                try:
                    out.append(bytes(buf[offset:offset + n]).decode("utf-8"))
                except UnicodeDecodeError as e:
                    raise GGUFFormatError(f"{self.path}: corrupt GGUF file: {what} is not UTF-8 ({e})") from None
                offset += n
            return out, offset
        out = []
        for _ in range(count):
            v, offset = self.value(item, offset, what)
            out.append(v)
        return out, offset

    def parse(self) -> tuple[int, dict, dict[str, TensorInfo]]:
        version, offset = self.scalar("I", 4, "the version")
        if version not in (2, 3):
            swapped = struct.unpack("<I", struct.pack(">I", version))[0]
            hint = " (a big-endian file?)" if swapped in (2, 3) else ""
            raise GGUFFormatError(f"{self.path}: GGUF version {version} is not supported (2 or 3){hint}")
        n_tensors, offset = self.scalar("Q", offset, "the tensor count")
        n_kv, offset = self.scalar("Q", offset, "the metadata count")
        if n_tensors > self.size or n_kv > self.size:
            raise GGUFFormatError(f"{self.path}: corrupt GGUF file: {n_tensors} tensors, {n_kv} metadata entries "
                                  f"in {self.size} bytes")
        meta = {}
        for i in range(n_kv):
            key, offset = self.string(offset, f"metadata entry {i}")
            kind, offset = self.scalar("I", offset, f"metadata {key!r}")
            meta[key], offset = self.value(kind, offset, f"metadata {key!r}")
        infos = []
        for i in range(n_tensors):
            name, offset = self.string(offset, f"tensor info {i}")
            n_dims, offset = self.scalar("I", offset, f"tensor {name!r}")
            if n_dims > 8:
                raise GGUFFormatError(f"{self.path}: corrupt GGUF file: tensor {name!r} has {n_dims} dims")
            self.need(offset, 8 * n_dims, f"tensor {name!r}")
            dims = struct.unpack_from(f"<{n_dims}Q", self.buf, offset)
            offset += 8 * n_dims
            type_id, offset = self.scalar("I", offset, f"tensor {name!r}")
            rel, offset = self.scalar("Q", offset, f"tensor {name!r}")
            infos.append((name, tuple(reversed(dims)), type_id, rel))
        align = meta.get("general.alignment", 32)
        if not isinstance(align, int) or align < 1 or align & (align - 1):
            raise GGUFFormatError(f"{self.path}: general.alignment={align!r}: not a power of two")
        data_start = -(-offset // align) * align
        tensors = {}
        for name, shape, type_id, rel in infos:
            if name in tensors:
                raise GGUFFormatError(f"{self.path}: corrupt GGUF file: tensor {name!r} appears twice")
            tensors[name] = TensorInfo(name, shape, type_id, data_start + rel, _tensor_bytes(self.path, name, shape,
                                                                                             type_id))
        return version, meta, tensors


def _tensor_bytes(path: str, name: str, shape: tuple[int, ...], type_id: int) -> int:
    """Bytes of a tensor of this GGML type (ValueError for a type id gguf does not know)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        kind = GGMLQuantizationType(type_id)
    except ValueError:
        raise ValueError(f"{path}: tensor {name!r} has GGML type id {type_id}, unknown to gguf "
                         f"{_gguf_version()}; supported types: {', '.join(supported_type_names())}") from None
    block, size = GGML_QUANT_SIZES[kind]
    n = math.prod(shape)
    if shape and shape[-1] % block:
        raise GGUFFormatError(f"{path}: tensor {name!r} {kind.name} rows of {shape[-1]} are not whole blocks of {block}")
    return n // block * size


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "?"


class GGUFFile(ModelSource):
    """A ``.gguf`` file (see the module docstring). ``dtype`` of the config: float32."""

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: no such GGUF file")
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != MAGIC:
            raise GGUFFormatError(f"{path}: not a GGUF file (starts with {magic!r}, expected {MAGIC!r})")
        self.name = self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        self.version, self.metadata, self.tensors = _Parser(path, self._map).parse()
        for t in self.tensors.values():
            if t.offset + t.n_bytes > size:
                raise GGUFFormatError(f"{path}: truncated: tensor {t.name!r} ends at byte "
                                      f"{t.offset + t.n_bytes} of a {size}-byte file")
        self.architecture = self._str("general.architecture")
        families = supported_architectures()
        if self.architecture not in families:
            raise ValueError(f"{path}: GGUF architecture {self.architecture!r} is not supported; "
                             f"supported: {', '.join(sorted(families))}")
        self.family = families[self.architecture]
        self._hf_to_gguf = self._map_names()
        self._check_types()
        self.config = self._config()
        self.generation_config = None

    # ------------------------------------------------------------------ metadata

    def get(self, key: str, default=None):
        """A metadata value (``str``, number, bool or list), or ``default``."""
        return self.metadata.get(key, default)

    def _str(self, key: str) -> str:
        value = self.get(key)
        if not isinstance(value, str):
            raise GGUFFormatError(f"{self.path}: metadata {key!r} missing or not a string")
        return value

    def _arch(self, key: str, default=None, *, required: bool = False):
        value = self.get(f"{self.architecture}.{key}", default)
        if value is None and required:
            raise GGUFFormatError(f"{self.path}: metadata {self.architecture}.{key} missing")
        if isinstance(value, list):  # a per-layer array: only a uniform one is supported
            if len(set(value)) != 1:
                raise ValueError(f"{self.path}: {self.architecture}.{key} differs between layers ({value[:8]}...): "
                                 "not supported")
            value = value[0]
        return value

    def _config(self) -> dict:
        """config.json's keys from the metadata."""
        hidden = int(self._arch("embedding_length", required=True))
        heads = int(self._arch("attention.head_count", required=True))
        kv_heads = int(self._arch("attention.head_count_kv", heads))
        head_dim = self._arch("attention.key_length") or self._arch("rope.dimension_count") or hidden // heads
        value_dim = self._arch("attention.value_length", head_dim)
        if int(value_dim) != int(head_dim):
            raise ValueError(f"{self.path}: attention.key_length {head_dim} != value_length {value_dim}: not supported")
        rot = self._arch("rope.dimension_count")
        if rot is not None and int(rot) != int(head_dim):
            raise ValueError(f"{self.path}: rope.dimension_count {rot} != head_dim {head_dim}: partial RoPE is "
                             "not supported")
        tokens = self.get("tokenizer.ggml.tokens")
        embed = self.tensors.get("token_embd.weight")
        vocab = self._arch("vocab_size") or (len(tokens) if tokens else None)
        if vocab is None and embed is not None:
            vocab = int(embed.shape[0])
        hf = {
            "architectures": [self.family.architecture],
            "model_type": self.family.model_type,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self._arch("feed_forward_length", required=True)),
            "num_hidden_layers": int(self._arch("block_count", required=True)),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": int(head_dim),
            "rope_theta": float(self._arch("rope.freq_base", 10000.0)),
            "rms_norm_eps": float(self._arch("attention.layer_norm_rms_epsilon", 1e-5)),
            "max_position_embeddings": int(self._arch("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": "blk.0.attn_q.bias" in self.tensors,
            "hidden_act": "silu",
            "dtype": "float32",
        }
        window = self._arch("attention.sliding_window")
        if window:
            hf["sliding_window"] = int(window)
            hf["use_sliding_window"] = True
        scaling = self._rope_scaling(hf)
        if scaling is not None:
            hf["rope_scaling"] = scaling
        for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("padding_token_id", "pad_token_id")):
            v = self.get(f"tokenizer.ggml.{key}")
            if v is not None:
                hf[name] = int(v)
        eot = self.get("tokenizer.ggml.eot_token_id")
        if eot is not None and "eos_token_id" in hf and int(eot) != hf["eos_token_id"]:
            hf["eos_token_id"] = [hf["eos_token_id"], int(eot)]
        return hf

    def _rope_scaling(self, hf: dict) -> dict | None:
        kind = self._arch("rope.scaling.type")
        factor = self._arch("rope.scaling.factor")
        original = self._arch("rope.scaling.original_context_length")
        if kind in (None, "none") and "rope_freqs.weight" in self.tensors:
            return self._llama3_scaling(hf)
        if kind in (None, "none"):
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(factor)}
        if kind == "yarn":
            out = {"rope_type": "yarn", "factor": float(factor),
                   "original_max_position_embeddings": int(original or hf["max_position_embeddings"])}
            for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow"),
                              ("rope.scaling.attn_factor", "attention_factor")):
                v = self._arch(key)
                if v:
                    out[name] = float(v)
            return out
        raise ValueError(f"{self.path}: rope.scaling.type {kind!r} is not supported (linear, yarn or none)")

    def _llama3_scaling(self, hf: dict) -> dict:
        """llama3 RoPE scaling recognised from llama.cpp's ``rope_freqs`` tensor (per-pair
        frequency divisors, written instead of metadata): Meta's low/high factors (1, 4), the
        largest divisor as ``factor``, and the original context (the metadata's
        ``rope.scaling.original_context_length``, else the power of two) that reproduces the
        tensor; ValueError when none does."""
        freqs = self._dequantize("rope_freqs.weight").astype(np.float64).ravel()
        d, theta = hf["head_dim"], hf["rope_theta"]
        inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        factor, low, high = float(freqs.max()), 1.0, 4.0
        stated = self._arch("rope.scaling.original_context_length")
        candidates = ([int(stated)] if stated else []) + [2**i for i in range(6, 21)]
        for original in candidates:
            wavelen = 2 * np.pi / inv
            smooth = (original / wavelen - low) / (high - low)
            divisor = np.where(wavelen < original / high, 1.0,
                               np.where(wavelen > original / low, factor, 1 / ((1 - smooth) / factor + smooth)))
            if freqs.shape == divisor.shape and np.allclose(divisor, freqs, rtol=1e-4):
                return dict(rope_type="llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                            original_max_position_embeddings=original)
        raise ValueError(f"{self.path}: rope_freqs does not match llama3 RoPE scaling (factor {factor}, low 1, "
                         "high 4, any power-of-two original context): not supported")

    # ------------------------------------------------------------------ tensors

    def _map_names(self) -> dict[str, str]:
        out = {}
        for name in self.tensors:
            if name in GLOBAL_TENSORS:
                out[GLOBAL_TENSORS[name]] = name
                continue
            parts = name.split(".")
            if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_TENSORS and parts[1].isdigit():
                out[f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{parts[3]}"] = name
        return out

    def _check_types(self) -> None:
        t, supported = _types()
        for name in [*self._hf_to_gguf.values(), *(n for n in IGNORED_TENSORS if n in self.tensors)]:
            kind = t(self.tensors[name].type_id)
            if kind not in supported:
                raise ValueError(f"{self.path}: tensor {name!r} has GGML type {kind.name}, which this loader cannot "
                                 f"dequantise; supported: {', '.join(supported_type_names())}")

    def tensor_names(self) -> Collection[str]:
        return self._hf_to_gguf.keys()

    def gguf_tensor_type(self, name: str) -> str:
        """The GGML type name (``"Q4_1"``) of the HF-named tensor ``name``."""
        t, _ = _types()
        return t(self.tensors[self._hf_to_gguf[name]].type_id).name

    def _dequantize(self, gguf_name: str) -> np.ndarray:
        from gguf import quants

        t = self.tensors[gguf_name]
        kind, _ = _types()
        kind = kind(t.type_id)
        raw = np.frombuffer(self._map, dtype=np.uint8, count=t.n_bytes, offset=t.offset)
        if kind == kind.F32:
            return raw.view(np.float32).reshape(t.shape).copy()
        if kind == kind.F16:
            return raw.view(np.float16).reshape(t.shape).astype(np.float32)
        # Whole chunks of blocks at once (gguf.quants.dequantize works 16 rows at a time and
        # concatenates: ~2x slower), into one preallocated float32 array.
        traits = quants._type_traits[kind]
        traits.init_grid()
        block, size = traits.block_size, traits.type_size
        blocks = raw.reshape(-1, size)
        out = np.empty(blocks.shape[0] * block, np.float32)
        step = max(1, DEQUANT_CHUNK // block)
        for start in range(0, blocks.shape[0], step):
            part = blocks[start:start + step]
            out[start * block:(start + len(part)) * block] = traits.dequantize_blocks(part).reshape(-1)
        return out.reshape(t.shape)

    def read_tensor(self, name: str) -> np.ndarray:
        """The HF-named tensor, dequantised to float32 (Q/K rows un-permuted for llama)."""
        if name not in self._hf_to_gguf:
            raise CheckpointError(f"{self.path}: no tensor {name!r}")
        gguf_name = self._hf_to_gguf[name]
        array = self._dequantize(gguf_name)
        if self.architecture in PERMUTED_QK and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            heads = self.config["num_attention_heads"] if ".attn_q." in gguf_name else self.config["num_key_value_heads"]
            array = unpermute_rows(array, heads)
        return array

    # ------------------------------------------------------------------ tokenizer

    def tokenizer(self):
        """The ``paged_jax.text.Tokenizer`` the metadata describes, or None without one."""
        if self.get("tokenizer.ggml.model") is None:
            return None
        return tokenizer_from_metadata(self.get, source=self.path)


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of a Q or K projection (weight ``[heads*D, in]`` or bias
    ``[heads*D]``): rows of each head go from RoPE pairs interleaved (``x0 y0 x1 y1 ...``)
    back to halves (``x0 x1 ... y0 y1 ...``), HF's rotate_half layout."""
    d2 = w.shape[0] // heads // 2
    return w.reshape(heads, d2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``permute`` (the inverse of ``unpermute_rows``), for writing GGUF files."""
    d2 = w.shape[0] // heads // 2
    return w.reshape(heads, 2, d2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------- tokenizer


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def derive_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece-BPE merges implied by a vocabulary and its scores (transformers'
    ``generate_merges``): every split of a token into two tokens, best merged score first."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in dict(zip(tokens, scores, strict=True)).items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def tokenizer_from_metadata(get, *, source: str = "<gguf>"):
    """A ``paged_jax.text.Tokenizer`` from ``tokenizer.ggml.*`` metadata (``get(key)`` reads a
    key, None when absent). ValueError for a tokenizer model other than gpt2 / llama."""
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE

    from paged_jax.text import Tokenizer

    kind = get("tokenizer.ggml.model")
    tokens = list(get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise GGUFFormatError(f"{source}: tokenizer.ggml.tokens missing or empty")
    types = list(get("tokenizer.ggml.token_type") or [])
    merges_raw = get("tokenizer.ggml.merges")
    if kind == "gpt2":
        spelling = bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
                 for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ")) for m in (merges_raw or [])]
        backend = Backend(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                              end_of_word_suffix="", fuse_unk=False))
        split = PRE_TOKENIZER_SPLITS.get(get("tokenizer.ggml.pre"))
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        backend.decoder = decoders.ByteLevel()
        default_bos = False
    elif kind == "llama":
        vocab = {t: i for i, t in enumerate(tokens)}
        if merges_raw:
            merges = [tuple(m.split(" ")) for m in merges_raw]
        else:
            scores = list(get("tokenizer.ggml.scores") or [0.0] * len(tokens))
            merges = derive_merges(tokens, scores)
        unk_id = get("tokenizer.ggml.unknown_token_id")
        backend = Backend(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None,
                              unk_token=None if unk_id is None else tokens[int(unk_id)]))
        prefix = get("tokenizer.ggml.add_space_prefix")
        prefix = True if prefix is None else bool(prefix)
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                         split=False)
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1))
        backend.decoder = decoders.Sequence(steps)
        default_bos = True
    else:
        raise ValueError(f"{source}: GGUF tokenizer model {kind!r} is not supported; supported: gpt2, llama")

    byte_level = kind == "gpt2"
    alphabet = set(bytes_to_unicode().values())
    control = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types, strict=False)
               if ty == TOKEN_CONTROL and (not byte_level or set(t) <= alphabet)]
    if control:
        backend.add_special_tokens(control)
    have = backend.get_vocab()
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types, strict=False)
            if ty == TOKEN_USER_DEFINED and t in have]
    if user:
        backend.add_tokens(user)

    config: dict = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        i = get(f"tokenizer.ggml.{key}")
        if i is not None and 0 <= int(i) < len(tokens):
            config[name] = tokens[int(i)]
    bos, eos = get("tokenizer.ggml.add_bos_token"), get("tokenizer.ggml.add_eos_token")
    config["add_bos_token"] = default_bos if bos is None else bool(bos)
    config["add_eos_token"] = False if eos is None else bool(eos)
    for token in (config.get("bos_token"), config.get("eos_token"), config.get("unk_token"), config.get("pad_token")):
        if token is not None and token not in {str(a) for a in control}:
            backend.add_special_tokens([AddedToken(token, normalized=False, special=True)])
    template = get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return Tokenizer(backend, config, source=source)


# ---------------------------------------------------------------------------- registration


def _is_gguf(model: str) -> bool:
    return model.lower().endswith(".gguf")


def _open(model: str, *, revision: str | None = None) -> GGUFFile:
    if revision is not None:
        raise ValueError(f"revision={revision!r} with a GGUF file {model!r}: a file has no revisions")
    return GGUFFile(model)


register_source("gguf", _is_gguf, _open)
