"""Multi-turn conversations over the prefix cache.

Turn n + 1's prompt is turn n's prompt, its answer and the new tokens. With
``LLM(enable_prefix_caching=True)`` every full block of that history is already cached
(prompt blocks when they were prefilled, answer blocks when generation filled them), so
a turn computes only its new tokens plus the history's last, partly filled block:

    chat = Conversation(system_prompt_ids, cache_salt="user-42")
    chat.add_user(question_ids)
    out = llm.generate([chat.prompt()], params)[0]
    chat.add_answer(out.outputs[0].token_ids)
    chat.add_user(follow_up_ids)          # the next turn reuses everything above
"""

from __future__ import annotations

from collections.abc import Iterable


class Conversation:
    """A chat's token history (token ids; a template, if any, is the caller's).

    Args:
      tokens: the opening tokens (e.g. a system prompt).
      cache_salt: the tenant's salt: its blocks are shared only with prompts of the same salt.
    """

    def __init__(self, tokens: Iterable[int] = (), *, cache_salt: str | None = None):
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt={cache_salt!r} must be a string")
        self.tokens: list[int] = [int(t) for t in tokens]
        self.cache_salt = cache_salt
        self.turns = 0  # answers added

    def add_user(self, tokens: Iterable[int]) -> Conversation:
        """Append the next message's tokens."""
        self.tokens += [int(t) for t in tokens]
        return self

    def add_answer(self, tokens: Iterable[int]) -> Conversation:
        """Append the model's answer (``CompletionOutput.token_ids``)."""
        self.tokens += [int(t) for t in tokens]
        self.turns += 1
        return self

    def prompt(self) -> dict:
        """The next turn's prompt: the whole history, with the salt if there is one."""
        out: dict = {"prompt_token_ids": list(self.tokens)}
        if self.cache_salt is not None:
            out["cache_salt"] = self.cache_salt
        return out
