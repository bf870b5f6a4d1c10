"""Load a model's parameters from a ``ModelSource`` (``source.py``: a local Hugging Face
directory, or any registered format), never downloading.

Tensors are read one at a time by HF name (``hf_names`` maps our parameter paths to
them), checked against the shapes the config implies, cast to the requested dtype and
transposed into ``nnx.Linear``'s ``[in, out]`` layout, so peak host memory is the
weights plus one tensor.

Errors are ``CheckpointError`` (a ``ValueError``) naming the tensor: missing, wrong shape
(both shapes), a dtype that is not floating point or differs from the declared one. An
unsupported architecture raises from ``ModelConfig.from_hf``.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.model.config import ModelConfig
from paged_jax.model.llama import abstract_model
from paged_jax.model.source import CheckpointError, ModelSource, open_source

__all__ = ["CheckpointError", "hf_names", "load_model", "load_params", "save_params"]


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


def load_params(
    source: ModelSource | str | os.PathLike, config: ModelConfig, *, dtype: Any = None
) -> tuple[nnx.GraphDef, nnx.State]:
    """Read every parameter of ``config``'s model from ``source``.

    Args:
      source: a ``ModelSource``, or anything ``open_source`` opens (a checkpoint directory).
      config: the model's config (usually ``source.model_config()``).
      dtype: parameter dtype; defaults to ``config.dtype``.

    Returns ``(graphdef, params)`` as ``nnx.split`` gives them.
    """
    source = open_source(source)
    if dtype is not None:
        config = config.replace(dtype=jnp.dtype(dtype).name)
    target = config.jnp_dtype
    names_held = source.tensor_names()
    graphdef, shapes = nnx.split(abstract_model(config))
    loaded = []
    for p, var in nnx.to_flat_state(shapes):
        names, transposed = hf_names(p, config.num_layers)
        shape = tuple(var.shape[1:] if p[0] == "layers" else var.shape)  # one layer's tensor
        want = shape[::-1] if transposed else shape
        arrays = []
        for name in names:
            if name not in names_held:
                raise CheckpointError(f"{source.name}: missing tensor {name!r} (shape {want})")
            array = source.read_tensor(name)
            if tuple(array.shape) != want:
                raise CheckpointError(
                    f"tensor {name!r} has shape {tuple(array.shape)}; the config implies {want}"
                )
            # Cast per tensor: a float32 copy of a whole bf16 model never exists at once.
            arrays.append(np.asarray(array.T if transposed else array).astype(target))
        value = np.stack(arrays) if p[0] == "layers" else arrays[0]
        loaded.append((p, var.replace(jnp.asarray(value))))
    return graphdef, nnx.from_flat_state(loaded)


def load_model(
    source: ModelSource | str | os.PathLike, *, dtype: Any = None
) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
    """``(model_config, graphdef, params)`` from a ``ModelSource`` or a local HF directory.

    ``dtype`` (e.g. ``jnp.float32``) overrides the checkpoint's dtype for parameters and
    compute; a bf16 checkpoint loaded as float32 is upcast exactly.
    """
    source = open_source(source)
    config = source.model_config(dtype=None if dtype is None else jnp.dtype(dtype).name)
    graphdef, params = load_params(source, config)
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
