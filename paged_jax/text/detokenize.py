"""Incremental detokenisation: generated ids -> text deltas, the way vLLM does it.

``IncrementalDetokenizer(tokenizer, prompt_ids)`` then ``step(new_ids) -> str`` per
engine step and ``flush() -> str`` at the end; ``.text`` is the concatenation of
everything returned (the prompt's own text is not included).

Method (vLLM's ``prefix_offset`` / ``read_offset``): keep a window ``ids[prefix:]`` and the
length of ``decode(ids[prefix:read])``, the text already accounted for. A step decodes
only the window; the new text is what the window's decoding adds beyond that prefix.
Decoding a window rather than single tokens keeps context-dependent decoders right
(SentencePiece's leading-space strip, tokens that split or merge characters). When the
window's text ends in U+FFFD (a UTF-8 sequence later ids may complete), the offsets stay
put and only the text before that trailing run of U+FFFD is emitted: a character before
it is final, while the run itself may still change (one U+FFFD per incomplete sequence
in byte-level lossy UTF-8; with ``ByteFallback`` a whole run of byte tokens is U+FFFD
per byte until it is valid). Once the text ends in a real character the window moves on
(``prefix <- read``, ``read <- n``), so a step decodes O(new ids + a few) ids; only steps
whose text keeps ending in U+FFFD (garbage bytes) let the window grow. The constructor
decodes the prompt once, to start the context window where it decodes like the end of
the whole prompt (``PROMPT_CONTEXT`` ids back, further if that is inside a character).

Invariant (tested): write ``D = tokenizer.decode(., skip_special_tokens)`` (without
transformers' clean-up). If ``D(prompt_ids)`` does not end in U+FFFD (true for a prompt
that is the encoding of a string), then after ``step`` over the output ids in any
chunking followed by ``flush``::

    D(prompt_ids + output_ids).startswith(D(prompt_ids))
    text == D(prompt_ids + output_ids)[len(D(prompt_ids)):]

and every intermediate ``text`` is a prefix of the final one: no step emits a U+FFFD that
later ids turn into a character. For byte-level BPE (Llama-3, Qwen, GPT-2 style) that is
all; decoding splits at character boundaries, so the prompt's context only matters when
the prompt ends inside a character (which is then attributed to the prompt, as in vLLM).
For SentencePiece-style decoders (``▁`` marks, ``Strip``) the context supplies the leading
space of the first output word. One exception, inherent in the decoder: ``ByteFallback``
turns a run of byte tokens that contains any invalid byte into one U+FFFD per byte,
retroactively, including characters already emitted; the invariant then holds only when
``D(prompt_ids + output_ids)`` has no U+FFFD. Ids outside the vocabulary add no text.

``spaces_between_special_tokens`` is accepted for vLLM's signature; like vLLM's fast
(``tokenizers``-backed) detokenizer and transformers' fast decode it has no effect.
"""

from __future__ import annotations

from collections.abc import Iterable

from paged_jax.text.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

REPLACEMENT = "\ufffd"
# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt tokens kept as decoding context.
PROMPT_CONTEXT = 5
# How far back past PROMPT_CONTEXT to look for a clean window start (then: the whole prompt).
MAX_CONTEXT_BACKTRACK = 16


class IncrementalDetokenizer:
    """Streams the text of generated ids (see the module docstring for the invariant).

    Attributes:
      text: output text so far (excluding the prompt's text).
      token_ids: the output ids seen so far.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Iterable[int], *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._ids = [int(i) for i in prompt_ids]
        self._num_prompt = len(self._ids)
        self._prefix = self._context_start()
        self._read = self._num_prompt
        self._prefix_len = len(self._decode(self._prefix, self._read))
        self._emitted = 0  # chars emitted past _prefix_len while the window is held
        self.text = ""

    @property
    def token_ids(self) -> list[int]:
        return self._ids[self._num_prompt:]

    def _context_start(self) -> int:
        """Where the prompt's context window starts: PROMPT_CONTEXT ids back, moved further back
        while the window alone decodes differently from the end of the whole prompt (it starts
        inside a character: a run of byte tokens decodes as a whole)."""
        start = max(self._num_prompt - PROMPT_CONTEXT, 0)
        if start == 0:
            return 0
        whole = self._decode(0, self._num_prompt)
        for _ in range(MAX_CONTEXT_BACKTRACK):
            if whole.endswith(self._decode(start, self._num_prompt)):
                return start
            start -= 1
            if start == 0:
                break
        return 0

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self.tokenizer.backend.decode(self._ids[start:stop], skip_special_tokens=self.skip_special_tokens)

    def step(self, new_ids: Iterable[int]) -> str:
        """The text that ``new_ids`` add (possibly ""); also appended to ``.text``."""
        self._ids.extend(int(i) for i in new_ids)
        window = self._decode(self._prefix)
        if window.endswith(REPLACEMENT):
            delta = window.rstrip(REPLACEMENT)[self._prefix_len + self._emitted:]
            self._emitted += len(delta)
        else:
            delta = window[self._prefix_len + self._emitted:]
            # Move on only once the window adds text: a step of skipped special tokens keeps
            # the old context (a SentencePiece window must not start at a bare "▁word").
            if len(window) > self._prefix_len:
                self._prefix, self._read = self._read, len(self._ids)
                self._prefix_len = len(self._decode(self._prefix, self._read))
                self._emitted = 0
        self.text += delta
        return delta

    def flush(self) -> str:
        """Whatever is held back (a trailing invalid byte sequence, as U+FFFD like ``decode``)."""
        window = self._decode(self._prefix)
        delta = window[self._prefix_len + self._emitted:]
        self._emitted += len(delta)
        self.text += delta
        return delta
