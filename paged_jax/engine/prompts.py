"""Prompts as callers write them, checked and turned into token ids before anything runs.

Accepted, as vLLM accepts them: a list of token ids (ints; a 1-D numpy integer array), a
string (the model's tokenizer encodes it, special tokens such as BOS added as the
checkpoint does), ``{"prompt_token_ids": [...]}`` or ``{"prompt": str}`` (both with an
optional ``"cache_salt"``), or a list of any of these. Floats, bools and other
non-integers are rejected with the prompt's and the token's index (``int(1.7)`` would
silently make token 1).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence as Seq
from typing import NamedTuple

import numpy as np


class Prompt(NamedTuple):
    token_ids: list[int]
    text: str | None = None  # the prompt's text, when it came as text
    cache_salt: str | None = None


def _token_ids(i: int, p) -> list[int]:
    if isinstance(p, np.ndarray):
        if p.ndim != 1:
            raise ValueError(f"prompt {i}: a token-id array must be 1-D, got shape {p.shape}")
        if p.dtype.kind in "iu":
            return [int(t) for t in p]
        p = p.tolist()
    if not isinstance(p, Seq) or isinstance(p, str | bytes):
        raise ValueError(f"prompt {i}={p!r}: expected token ids (a list of ints), a string or a dict")
    for j, t in enumerate(p):
        if isinstance(t, bool | np.bool_) or not isinstance(t, numbers.Integral):
            raise ValueError(f"prompt {i}: token {j} is {t!r}; token ids must be ints")
    return [int(t) for t in p]


def is_one_prompt(prompts) -> bool:
    """``prompts`` is a single prompt rather than a list of them."""
    if isinstance(prompts, dict | str):
        return True
    if isinstance(prompts, np.ndarray):
        return prompts.ndim == 1
    return isinstance(prompts, Seq) and bool(prompts) and isinstance(prompts[0], numbers.Number)


def normalise_prompts(prompts, tokenizer=None) -> list[Prompt]:
    """One ``Prompt`` per prompt (see the module docstring); ``tokenizer`` (a
    ``paged_jax.text.Tokenizer`` or None) encodes text prompts."""
    if is_one_prompt(prompts):
        prompts = [prompts]
    out = []
    for i, p in enumerate(prompts):
        salt = None
        if isinstance(p, dict):
            unknown = set(p) - {"prompt_token_ids", "prompt", "cache_salt"}
            if unknown:
                raise ValueError(f"prompt {i}: unknown keys {sorted(unknown)} (expected 'prompt_token_ids' or "
                                 "'prompt', and optionally 'cache_salt')")
            if ("prompt_token_ids" in p) == ("prompt" in p):
                raise ValueError(f"prompt {i}: a dict prompt needs exactly one of 'prompt_token_ids' and 'prompt'")
            salt = p.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise ValueError(f"prompt {i}: cache_salt={salt!r} must be a string")
            if "prompt" in p and not isinstance(p["prompt"], str):
                raise ValueError(f"prompt {i}: 'prompt' must be a string, got {type(p['prompt']).__name__}")
            if "prompt_token_ids" in p:  # never text, even a string
                out.append(Prompt(_token_ids(i, p["prompt_token_ids"]), None, salt))
                continue
            p = p["prompt"]
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(f"prompt {i} is text but this model has no tokenizer (no tokenizer.json in its "
                                 "checkpoint, or skip_tokenizer_init=True): pass token ids")
            out.append(Prompt(tokenizer.encode(p), p, salt))
        else:
            out.append(Prompt(_token_ids(i, p), None, salt))
    return out
