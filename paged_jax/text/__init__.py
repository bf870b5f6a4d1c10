"""Text in and out: a checkpoint's tokenizer, chat templates, streaming detokenisation, stop strings.

- ``Tokenizer``: ``tokenizer.json`` (HF ``tokenizers``) + ``tokenizer_config.json``.
- ``render_chat`` / ``Tokenizer.apply_chat_template``: sandboxed Jinja chat templates.
- ``IncrementalDetokenizer``: generated ids -> text deltas (vLLM's prefix/read offsets).
- ``StopStrings`` / ``stop_holdback``: vLLM's stop-string semantics on streamed text.
"""

from paged_jax.text.chat import ChatTemplateError, render_chat, validate_messages
from paged_jax.text.detokenize import IncrementalDetokenizer
from paged_jax.text.stop import StopStrings, stop_holdback
from paged_jax.text.tokenizer import Tokenizer

__all__ = [
    "ChatTemplateError", "IncrementalDetokenizer", "StopStrings", "Tokenizer", "render_chat",
    "stop_holdback", "validate_messages",
]
