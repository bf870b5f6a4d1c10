"""Load a Llama-family model from a local Hugging Face directory (never downloads).

A checkpoint directory holds ``config.json`` and either ``model.safetensors``, several
``*.safetensors`` files, or shards listed by ``model.safetensors.index.json``. Tensors are
read lazily with ``safetensors.safe_open`` (numpy framework; bf16 comes back as
``ml_dtypes.bfloat16``), checked against the shapes the config implies, cast to the
requested dtype and transposed into ``nnx.Linear``'s ``[in, out]`` layout.

Errors are ``CheckpointError`` (a ``ValueError``) naming the tensor: missing, wrong shape
(both shapes), a dtype that is not floating point or differs from the config's declared
dtype. An unsupported architecture raises from ``ModelConfig.from_hf``.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from paged_jax.dtypes import SAFETENSORS_TAGS
from paged_jax.model.config import ModelConfig
from paged_jax.model.llama import LlamaForCausalLM

INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that does not match its config (or is not a checkpoint at all)."""


def hf_names(path: tuple, num_layers: int) -> tuple[list[str], bool]:
    """HF tensor names of one of our parameter paths, and whether they are transposed.

    A decoder-layer parameter is stacked (``[num_layers, ...]``), so it has one HF tensor
    per layer: ``('layers', 'self_attn', 'q_proj', 'kernel')`` ->
    ``(['model.layers.0.self_attn.q_proj.weight', ...], True)``; every other parameter has
    one name.
    """
    parts = [str(p) for p in path]
    leaf = parts[-1]
    if leaf == "embedding":
        return ["model.embed_tokens.weight"], False
    if parts[0] == "lm_head":
        return ["lm_head.weight"], True
    suffix = "weight" if leaf == "kernel" else leaf  # norm "weight" and projection "bias"
    if parts[0] == "layers":
        rest = ".".join(parts[1:-1])
        return [f"model.layers.{i}.{rest}.{suffix}" for i in range(num_layers)], leaf == "kernel"
    return [f"model.{'.'.join(parts[:-1])}.{suffix}"], leaf == "kernel"


def _tensor_index(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file that holds it."""
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors file and no {INDEX_FILE}")
    index = {}
    for file in files:
        with safe_open(file, framework="numpy") as f:
            for name in f.keys():
                index[name] = file
    return index


def _read(file: str, name: str) -> tuple[np.ndarray, str]:
    """(array, dtype tag) of one tensor; bf16 as ml_dtypes.bfloat16."""
    with safe_open(file, framework="numpy") as f:
        tag = f.get_slice(name).get_dtype()
        try:
            return f.get_tensor(name), tag
        except (TypeError, ValueError):  # a safetensors without numpy bf16 support
            pass
    with safe_open(file, framework="flax") as f:
        return np.asarray(f.get_tensor(name)), tag


def _declared_dtype(path: str) -> str | None:
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    name = hf.get("dtype") or hf.get("torch_dtype")
    return name if name in SAFETENSORS_TAGS.values() else None


def load_params(
    path: str | os.PathLike, config: ModelConfig, *, dtype: Any = None
) -> tuple[nnx.GraphDef, nnx.State]:
    """Read every parameter of ``config``'s model from the checkpoint at ``path``.

    Args:
      path: local directory (config.json + safetensors).
      config: the model's config (usually ``ModelConfig.from_hf(path)``).
      dtype: parameter dtype; defaults to ``config.dtype``.

    Returns ``(graphdef, params)`` as ``nnx.split`` gives them.
    """
    path = os.fspath(path)
    if dtype is not None:
        config = config.replace(dtype=jnp.dtype(dtype).name)
    target = config.jnp_dtype
    declared = _declared_dtype(path)
    index = _tensor_index(path)

    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    graphdef, shapes = nnx.split(abstract)
    loaded = []
    for p, var in nnx.to_flat_state(shapes):
        names, transposed = hf_names(p, config.num_layers)
        shape = tuple(var.shape[1:] if p[0] == "layers" else var.shape)  # one layer's tensor
        want = shape[::-1] if transposed else shape
        arrays = []
        for name in names:
            if name not in index:
                raise CheckpointError(f"{path}: missing tensor {name!r} (shape {want})")
            array, tag = _read(index[name], name)
            if tag not in SAFETENSORS_TAGS:
                raise CheckpointError(f"tensor {name!r} has dtype {tag}; expected a float (F32, BF16, F16)")
            if declared is not None and SAFETENSORS_TAGS[tag] != declared:
                raise CheckpointError(
                    f"tensor {name!r} has dtype {SAFETENSORS_TAGS[tag]} but config.json declares {declared}"
                )
            if tuple(array.shape) != want:
                raise CheckpointError(
                    f"tensor {name!r} has shape {tuple(array.shape)}; the config implies {want}"
                )
            arrays.append(array.T if transposed else array)
        value = np.stack(arrays) if p[0] == "layers" else arrays[0]
        loaded.append((p, var.replace(jnp.asarray(value).astype(target))))
    return graphdef, nnx.from_flat_state(loaded)


def load_model(
    path: str | os.PathLike, *, dtype: Any = None
) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
    """``(model_config, graphdef, params)`` from a local HF directory.

    ``dtype`` (e.g. ``jnp.float32``) overrides the checkpoint's dtype for parameters and
    compute; a bf16 checkpoint loaded as float32 is upcast exactly.
    """
    config = ModelConfig.from_hf(path, dtype=None if dtype is None else jnp.dtype(dtype).name)
    graphdef, params = load_params(path, config)
    return config, graphdef, params


def save_params(path: str | os.PathLike, params: nnx.State) -> None:
    """Write ``params`` as an HF-layout ``model.safetensors`` (a round-trip aid for tests).

    Does not write config.json.
    """
    from safetensors.numpy import save_file

    tensors = {}
    for p, var in nnx.to_flat_state(params):
        array = np.asarray(jax.device_get(var[...]))
        stacked = p[0] == "layers"
        names, transposed = hf_names(p, array.shape[0] if stacked else 1)
        for name, one in zip(names, array if stacked else [array], strict=True):
            tensors[name] = np.ascontiguousarray(one.T if transposed else one)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(os.fspath(path), "model.safetensors"))
