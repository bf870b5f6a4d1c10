"""Model families: the extension surface for a new architecture.

A ``ModelFamily`` says which Hugging Face ``config.json`` it reads (its ``architectures``
name and ``model_type``), the Flax NNX module that computes it, and how its config differs
from the Llama-family parse ``ModelConfig.from_hf`` does for every family (``adjust``: the
parsed fields and the raw dict in, the fields out). Families register themselves where
their module is defined (``llama.py``: Llama, Mistral, Qwen2; ``qwen3.py``: Qwen3); the
package imports them all, so ``FAMILIES`` is complete once ``paged_jax.model`` is imported.
Checkpoint tensors are named from the module's parameter paths (``checkpoint.hf_names``), so
a family whose parameters mirror Hugging Face's needs nothing more. ``docs/EXTENDING.md``
shows a new family end to end; the model tests run every registered family.

This module is a leaf (it imports nothing of the model), so the config can validate an
architecture name against it and the modules can register into it without an import circle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One architecture.

    Attributes:
      architecture: the HF ``architectures[0]`` name, e.g. "LlamaForCausalLM".
      model_type: config.json's ``model_type``, e.g. "llama" (used when ``architectures``
        is absent).
      module: the ``nnx.Module`` class, built as ``module(config, rngs=rngs)``; it computes
        ``(hidden, kv) = module(tokens, positions, kv, attend)`` and ``module.logits(hidden)``
        (``llama.LlamaForCausalLM``'s contract).
      adjust: ``(fields: dict, hf: dict) -> dict``: this family's rules on top of the common
        parse (``ModelConfig.from_hf``): e.g. Qwen2's bias layout. Raise ValueError for a
        config the module cannot run. None: the common parse as is.
      gguf_architecture: the GGUF ``general.architecture`` this family reads (None: none).
    """

    architecture: str
    model_type: str
    module: type
    adjust: Callable[[dict, dict], dict] | None = None
    gguf_architecture: str | None = None


FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Add (or replace) a family under its architecture name; returns it."""
    FAMILIES[family.architecture] = family
    return family


def unsupported(what: str, name: Any) -> str:
    return f"unsupported {what} {name!r}; supported: {', '.join(FAMILIES)}"


def family(architecture: str) -> ModelFamily:
    """The family registered as ``architecture``; ValueError naming the supported ones."""
    if architecture not in FAMILIES:
        raise ValueError(unsupported("architecture", architecture))
    return FAMILIES[architecture]


def family_of_hf(hf: dict) -> ModelFamily:
    """The family a config.json dict names (``architectures[0]``, else ``model_type``)."""
    archs = hf.get("architectures") or []
    if archs:
        return family(archs[0])
    by_type = {f.model_type: f for f in FAMILIES.values()}
    model_type = hf.get("model_type")
    if model_type not in by_type:
        raise ValueError(unsupported("model_type", model_type))
    return by_type[model_type]
