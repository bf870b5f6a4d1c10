"""Where a model comes from, read once: a ``ModelSource``.

Every format the engine loads is a ``ModelSource``: its config in Hugging Face's
``config.json`` keys (``config``), its ``generation_config.json`` (or None), its tensors by
HF name in HF layout (``read_tensor``, one at a time, so loading holds at most one tensor
beyond the weights), and its tokenizer. ``ModelConfig.from_hf(source.config)`` and
``checkpoint.load_params(source, config)`` then work the same for every format, and an
``LLM`` parses its checkpoint's files exactly once.

``open_source(model)`` picks the format. Built in: a local HF checkpoint directory
(``HFDirectory``: config.json + safetensors). Other formats register an opener
(``register_source``): GGUF files, ids in the local hub cache, the embedded default model.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Collection

import numpy as np

from paged_jax.dtypes import SAFETENSORS_TAGS
from paged_jax.model.config import ModelConfig, read_json_file
from paged_jax.model.generation_config import GenerationDefaults, generation_defaults

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


class CheckpointError(ValueError):
    """A checkpoint that does not match its config (or is not a checkpoint at all)."""


class ModelSource:
    """A model's files, parsed once. Subclasses set the attributes and implement the methods.

    Attributes:
      name: what to call it in reports and errors (a path).
      config: the model's config as config.json's keys (a dict; do not mutate).
      generation_config: generation_config.json's keys, or None.
      declared_dtype: the dtype name every tensor is stored in ("float32", "bfloat16",
        "float16"), checked on read, or None when the format does not declare one.
    """

    name: str
    config: dict
    generation_config: dict | None = None
    declared_dtype: str | None = None

    def tensor_names(self) -> Collection[str]:
        """Every tensor's HF name (``model.layers.0.self_attn.q_proj.weight``, ...)."""
        raise NotImplementedError

    def read_tensor(self, name: str) -> np.ndarray:
        """One tensor in HF layout (a Linear's weight is [out, in]) as a float NumPy array
        (bf16 as ``ml_dtypes.bfloat16``). CheckpointError naming it if it cannot be read."""
        raise NotImplementedError

    def tokenizer(self):
        """The model's ``paged_jax.text.Tokenizer``, or None if the source has none."""
        return None

    def model_config(self, dtype: str | None = None) -> ModelConfig:
        """The ``ModelConfig`` of ``config`` (``dtype`` overrides the stored one)."""
        return ModelConfig.from_hf(self.config, dtype=dtype)

    def generation_defaults(self) -> GenerationDefaults:
        """EOS ids, BOS and sampling defaults from ``config`` and ``generation_config``."""
        return generation_defaults(self.config, self.generation_config, where=self.name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class HFDirectory(ModelSource):
    """A local Hugging Face checkpoint directory: config.json, optional
    generation_config.json, and ``model.safetensors``, several ``*.safetensors`` files or
    shards listed by ``model.safetensors.index.json``. Tensors are read lazily with
    ``safetensors.safe_open`` (numpy; bf16 as ``ml_dtypes.bfloat16``)."""

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
            raise CheckpointError(f"{path}: no {CONFIG_FILE} (not a Hugging Face checkpoint directory)")
        self.name = self.path = path
        self.config = read_json_file(os.path.join(path, CONFIG_FILE))
        gen = os.path.join(path, GENERATION_CONFIG_FILE)
        self.generation_config = read_json_file(gen) if os.path.exists(gen) else None
        declared = self.config.get("dtype") or self.config.get("torch_dtype")
        self.declared_dtype = declared if declared in SAFETENSORS_TAGS.values() else None
        self._index: dict[str, str] | None = None

    def _tensor_index(self) -> dict[str, str]:
        """Tensor name -> the safetensors file holding it (built on first use)."""
        if self._index is not None:
            return self._index
        from safetensors import safe_open

        index_path = os.path.join(self.path, INDEX_FILE)
        if os.path.exists(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            self._index = {name: os.path.join(self.path, file) for name, file in weight_map.items()}
            return self._index
        files = sorted(glob.glob(os.path.join(self.path, "*.safetensors")))
        if not files:
            raise CheckpointError(f"{self.path}: no *.safetensors file and no {INDEX_FILE}")
        index = {}
        for file in files:
            with safe_open(file, framework="numpy") as f:
                for name in f.keys():
                    index[name] = file
        self._index = index
        return index

    def tensor_names(self) -> Collection[str]:
        return self._tensor_index().keys()

    def read_tensor(self, name: str) -> np.ndarray:
        from safetensors import safe_open

        file = self._tensor_index()[name]
        array = None
        with safe_open(file, framework="numpy") as f:
            tag = f.get_slice(name).get_dtype()
            try:
                array = f.get_tensor(name)
            except (TypeError, ValueError):  # a safetensors without numpy bf16 support
                pass
        if array is None:
            with safe_open(file, framework="flax") as f:
                array = np.asarray(f.get_tensor(name))
        if tag not in SAFETENSORS_TAGS:
            raise CheckpointError(f"tensor {name!r} has dtype {tag}; expected a float (F32, BF16, F16)")
        if self.declared_dtype is not None and SAFETENSORS_TAGS[tag] != self.declared_dtype:
            raise CheckpointError(
                f"tensor {name!r} has dtype {SAFETENSORS_TAGS[tag]} but config.json declares {self.declared_dtype}"
            )
        return array

    def tokenizer(self):
        from paged_jax.text import Tokenizer

        return Tokenizer.from_dir(self.path)


# ---------------------------------------------------------------------------- opening

# (name, matches(model) -> bool, open(model, revision) -> ModelSource), tried in order.
_OPENERS: list[tuple[str, Callable[[str], bool], Callable[..., ModelSource]]] = []


def register_source(name: str, matches: Callable[[str], bool], opener: Callable[..., ModelSource]) -> None:
    """Teach ``open_source`` a format: ``matches(model_str)`` says whether ``opener(model_str,
    revision=...)`` should open it. Tried in registration order, after directories."""
    _OPENERS[:] = [o for o in _OPENERS if o[0] != name] + [(name, matches, opener)]


def open_source(model, *, revision: str | None = None) -> ModelSource:
    """The ``ModelSource`` of ``model``: a ``ModelSource`` (returned as is), a local HF
    checkpoint directory, or whatever a registered opener accepts. ValueError naming what was
    tried when nothing does (no downloads, ever)."""
    if isinstance(model, ModelSource):
        return model
    if not isinstance(model, str | os.PathLike):
        raise ValueError(f"model={model!r}: expected a path, a model id or a ModelSource")
    path = os.fspath(model)
    if os.path.isdir(path):
        if revision is not None:
            raise ValueError(f"revision={revision!r} with a local directory {path!r}: a directory has no revisions")
        return HFDirectory(path)
    for _, matches, opener in _OPENERS:
        if matches(path):
            return opener(path, revision=revision)
    known = ", ".join(name for name, _, _ in _OPENERS)
    raise ValueError(f"model={path!r}: not a local checkpoint directory"
                     + (f" nor anything the registered sources take ({known})" if known else "")
                     + " (paged_jax never downloads)")
