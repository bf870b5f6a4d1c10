"""Output text as tokens arrive: each completion's detokeniser and its stop strings.

``TextOutputs`` is the engine's text side, present when the model has a tokenizer. After
every token the engine appends, ``on_token(seq)`` feeds it to the completion's
``IncrementalDetokenizer`` (``paged_jax.text``) and checks the request's ``stop``
strings on the new text; a match ends the completion (finish reason "stop",
``stop_reason`` the string) and the text is cut before it (after it with
``include_stop_str_in_output``). The token ids keep every sampled token, as vLLM's do.

Stop strings are not checked before ``min_tokens`` outputs, as vLLM does not. Beam
search rewrites its hypotheses every step, so its text is decoded once, at the end.
"""

from __future__ import annotations

import dataclasses

from paged_jax.engine.sequence import Sequence
from paged_jax.text import IncrementalDetokenizer, StopStrings, Tokenizer


@dataclasses.dataclass(eq=False)
class _Text:
    detokenizer: IncrementalDetokenizer
    stop: StopStrings
    cut: int | None = None  # the text's length once a stop string ended it
    flushed: bool = False


class TextOutputs:
    """Per-completion text for an engine whose model has ``tokenizer``."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def _state(self, seq: Sequence) -> _Text:
        state = seq.text_state
        if state is None:
            p = seq.params
            state = _Text(
                IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids,
                                       skip_special_tokens=getattr(p, "skip_special_tokens", True)),
                StopStrings(getattr(p, "stop", ()), getattr(p, "include_stop_str_in_output", False)),
            )
            seq.text_state = state
        return state

    def on_token(self, seq: Sequence) -> str | None:
        """Feed ``seq``'s newest output token; returns the stop string it completed, if any."""
        state = self._state(seq)
        new = seq.output_token_ids[len(state.detokenizer.token_ids):]
        delta = state.detokenizer.step(new)
        if not state.stop or len(seq.output_token_ids) < getattr(seq.params, "min_tokens", 0):
            return None
        # Text a previous min_tokens-suppressed step added is searched too: a stop string
        # may end anywhere after min_tokens is reached.
        matched, cut = state.stop.check(state.detokenizer.text, len(delta) if state.cut is None else 0)
        if matched is not None:
            state.cut = cut
        return matched

    def text(self, seq: Sequence, *, final: bool) -> str:
        """The completion's text so far; ``final``: everything held back released (call it
        once the sequence finished). Unfinished text holds back the characters that may
        still start a stop string, as vLLM streams it."""
        state = self._state(seq)
        if len(state.detokenizer.token_ids) < len(seq.output_token_ids):  # e.g. tokens appended elsewhere
            state.detokenizer.step(seq.output_token_ids[len(state.detokenizer.token_ids):])
        if final and not state.flushed:
            state.detokenizer.flush()
            state.flushed = True
        text = state.detokenizer.text
        if state.cut is not None:
            return text[: state.cut]
        if not final and state.stop.holdback:
            return text[: max(len(text) - state.stop.holdback, 0)]
        return text

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
