"""Model ids in the local Hugging Face hub cache: ``LLM("org/name", revision=...)``, never
downloading.

The cache is the first of ``$HF_HUB_CACHE``, ``$HUGGINGFACE_HUB_CACHE`` (its old name),
``$HF_HOME/hub``, ``$XDG_CACHE_HOME/huggingface/hub`` and ``~/.cache/huggingface/hub`` that is
set (as huggingface_hub chooses it). ``org/name`` lives in
``models--org--name/``: ``refs/<revision>`` (default ``main``) holds a commit hash, and
``snapshots/<commit>/`` the files; a revision that is itself a commit with a snapshot is taken
as is. The snapshot opens as an HF checkpoint directory (config.json + safetensors), or, when
it holds no config.json and exactly one ``.gguf`` file, as that GGUF file.

Anything missing is a ``ValueError`` naming every path looked at and how to fetch the model
(``huggingface-cli download org/name``: paged_jax itself never downloads).
"""

from __future__ import annotations

import glob
import os
import re

from paged_jax.model.source import CONFIG_FILE, HFDirectory, ModelSource, register_source

__all__ = ["cache_dir", "is_model_id", "resolve_snapshot"]

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def cache_dir() -> str:
    """The hub cache directory huggingface_hub would use (it need not exist)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return os.path.expanduser(os.environ[var])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = os.path.expanduser(xdg) if xdg else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "huggingface", "hub")


def is_model_id(model: str) -> bool:
    """``org/name`` that is not a local path."""
    return bool(_ID.match(model)) and not os.path.exists(model)


def resolve_snapshot(model_id: str, revision: str | None = None) -> str:
    """The snapshot directory of ``model_id`` at ``revision`` (default "main") in the cache;
    ValueError naming the paths looked at when it is not there."""
    revision = revision or "main"
    cache = cache_dir()
    repo = os.path.join(cache, "models--" + model_id.replace("/", "--"))
    looked = [repo]
    how = (f"; paged_jax never downloads: fetch it first (huggingface-cli download {model_id}"
           + (f" --revision {revision}" if revision != "main" else "") + ") or pass a local directory")
    if not os.path.isdir(repo):
        raise ValueError(f"model {model_id!r} is not in the local hub cache (looked at {repo}; cache from "
                         f"HF_HUB_CACHE / HF_HOME / ~/.cache/huggingface/hub = {cache}){how}")
    snapshots = os.path.join(repo, "snapshots")
    if _COMMIT.match(revision) and os.path.isdir(os.path.join(snapshots, revision)):
        return os.path.join(snapshots, revision)
    ref = os.path.join(repo, "refs", revision)
    looked.append(ref)
    if not os.path.isfile(ref):
        have = sorted(os.listdir(os.path.join(repo, "refs"))) if os.path.isdir(os.path.join(repo, "refs")) else []
        raise ValueError(f"model {model_id!r}: no revision {revision!r} in the local hub cache (looked at "
                         f"{', '.join(looked)}; revisions there: {', '.join(have) or 'none'}){how}")
    with open(ref) as f:
        commit = f.read().strip()
    snapshot = os.path.join(snapshots, commit)
    if not os.path.isdir(snapshot):
        raise ValueError(f"model {model_id!r}: {ref} names commit {commit} but {snapshot} does not exist{how}")
    return snapshot


def open_hub(model_id: str, *, revision: str | None = None) -> ModelSource:
    """The ``ModelSource`` of a cached model id (an HF directory, or its one GGUF file)."""
    snapshot = resolve_snapshot(model_id, revision)
    if os.path.isfile(os.path.join(snapshot, CONFIG_FILE)):
        return HFDirectory(snapshot)
    ggufs = sorted(glob.glob(os.path.join(snapshot, "*.gguf")))
    if len(ggufs) == 1:
        from paged_jax.model.gguf import GGUFFile

        return GGUFFile(ggufs[0])
    found = ", ".join(os.path.basename(g) for g in ggufs) or "none"
    raise ValueError(f"model {model_id!r}: snapshot {snapshot} has no {CONFIG_FILE} and not exactly one .gguf "
                     f"file (found: {found}); pass the file's path instead")


register_source("hub", is_model_id, open_hub)
