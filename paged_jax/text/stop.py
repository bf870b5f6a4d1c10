"""Stop strings on incrementally produced text (vLLM's ``stop`` / ``include_stop_str_in_output``).

``StopStrings(stop).check(text, new_len)`` is called after every detokenisation step with
the whole output text so far and the number of characters the step appended. It searches
only where a match can newly appear: a match must end inside the new characters, so it
starts within the last ``new_len + len(s) - 1`` characters.

Semantics: the sequence stops at the first place in the text where a stop string is
complete, i.e. the match with the smallest end position; among matches ending at the
same place, the longest (it starts earliest). The result does not depend on how the text
was chunked into steps, as long as ``check`` runs after every step until it matches.
(vLLM takes the first stop string in list order found in the new region; the two agree
whenever one step completes at most one match.) The text is cut before the stop string,
or just after it with ``include_stop_str_in_output``.

``stop_holdback(stop)`` is how many trailing characters a streamer should hold back while
stop strings are active (``max(len) - 1``): they may be the start of a stop string.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["StopStrings", "stop_holdback"]


def stop_holdback(stop: Iterable[str]) -> int:
    """Characters to hold back from streamed output: the longest stop string's length - 1 (0 if none)."""
    return max((len(s) for s in stop), default=1) - 1


class StopStrings:
    """vLLM's stop-string semantics on incrementally produced text.

    Attributes:
      stop: the stop strings (duplicates removed, order kept).
      include_stop_str_in_output: keep the matched stop string in the output.
      holdback: ``stop_holdback(stop)``.
    """

    def __init__(self, stop: Iterable[str], include_stop_str_in_output: bool = False):
        if isinstance(stop, str):
            stop = (stop,)
        stop = tuple(dict.fromkeys(stop))
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
        self.stop = stop
        self.include_stop_str_in_output = include_stop_str_in_output
        self.holdback = stop_holdback(stop)

    def __bool__(self) -> bool:
        return bool(self.stop)

    def check(self, text: str, new_len: int) -> tuple[str | None, int | None]:
        """``(matched stop string, length to truncate text to)``, or ``(None, None)``.

        Args:
          text: the whole output text so far.
          new_len: characters appended to it by the latest step (0 -> nothing to search).

        With ``include_stop_str_in_output`` the length is the end of the stop string (it
        may equal ``len(text)``: nothing to cut); otherwise its start.
        """
        if new_len <= 0 or not self.stop:
            return None, None
        new_start = len(text) - min(new_len, len(text))
        best: tuple[int, int, str] | None = None  # (end, -len, stop string)
        for s in self.stop:
            i = text.find(s, max(new_start - len(s) + 1, 0))
            if i < 0:
                continue
            key = (i + len(s), -len(s), s)
            if best is None or key[:2] < best[:2]:
                best = key
        if best is None:
            return None, None
        end, neg_len, s = best
        return s, end if self.include_stop_str_in_output else end + neg_len
