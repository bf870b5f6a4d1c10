"""A checkpoint's tokenizer: HF ``tokenizers`` (``tokenizer.json``) plus ``tokenizer_config.json``.

``Tokenizer.from_dir(path)`` reads a local Hugging Face checkpoint directory (never
downloads) and returns None when it has no ``tokenizer.json``. Ids are plain ``int``;
``encode`` returns ``list[int]``, ``decode`` takes any iterable of ints.

Semantics follow transformers' ``AutoTokenizer`` for a fast tokenizer:

- Special tokens (``encode(add_special_tokens=True)``): the ``tokenizer.json``
  post-processor is authoritative (Llama-3 style ``TemplateProcessing``). When it adds
  nothing, ``tokenizer_config.json``'s ``add_bos_token`` / ``add_eos_token`` do. For the
  Llama tokenizer classes (``LlamaTokenizer[Fast]``, ``CodeLlamaTokenizer[Fast]``,
  ``GemmaTokenizer[Fast]``), whose transformers class rebuilds the post-processor from
  the flags, the flags decide (BOS default on, EOS default off).
- ``decode(skip_special_tokens=True)`` drops every added token the backend marks special;
  ids outside the vocabulary decode to nothing (as the backend does).
  ``clean_up_tokenization_spaces`` from the config is applied (default off).
- ``vocab_size`` (and ``len()``) is the largest id + 1, added tokens included, so
  ``0 <= id < vocab_size`` is the range of ids the tokenizer knows. A model's embedding
  table is often larger (padded); the extra ids decode to "".

Malformed files raise ``ValueError`` naming the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import tokenizers

from paged_jax.text.chat import ChatTemplateError, render_chat

__all__ = ["Tokenizer"]

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

# transformers classes whose __init__ rebuilds the post-processor from add_bos/eos_token.
_FLAG_DRIVEN_CLASSES = frozenset({
    "LlamaTokenizer", "LlamaTokenizerFast", "CodeLlamaTokenizer", "CodeLlamaTokenizerFast",
    "GemmaTokenizer", "GemmaTokenizerFast",
})


def _token_content(value: Any, name: str, path: str) -> str | None:
    """A special token as HF writes it: a str, an AddedToken dict ``{"content": ...}``, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{path}: {name} must be a string or a {{'content': ...}} dict, got {value!r}")


def _clean_up_tokenization(text: str) -> str:
    # transformers' PreTrainedTokenizerBase.clean_up_tokenization, verbatim in effect.
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


class Tokenizer:
    """A checkpoint's tokenizer: HF ``tokenizers`` (tokenizer.json) + tokenizer_config.json.

    Attributes:
      backend: the raw ``tokenizers.Tokenizer``.
      config: the parsed tokenizer_config.json (``{}`` when absent).
      vocab_size: largest id + 1, added/special tokens included (also ``len(tokenizer)``).
      bos_token, eos_token, unk_token, pad_token: token strings from the config, or None.
      bos_token_id, eos_token_id: their ids (None when unset or not in the vocabulary).
      all_special_ids: ids of every added token marked special, plus bos/eos/unk/pad.
      chat_template: the default chat template, or None.
      chat_templates: every named template (``{"default": ...}`` for a single one).
      add_bos_token, add_eos_token: what ``encode(add_special_tokens=True)`` adds, resolved.
      clean_up_tokenization_spaces: whether ``decode`` applies transformers' clean-up.
      model_max_length: from the config, or None.
    """

    def __init__(self, backend: tokenizers.Tokenizer, config: dict | None = None, *,
                 chat_template: str | None = None, source: str = "<memory>"):
        config = dict(config or {})
        cfg_path = os.path.join(source, CONFIG_FILE)
        self.backend = backend
        self.config = config
        self.source = source
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values(), default=-1) + 1

        self.bos_token = _token_content(config.get("bos_token"), "bos_token", cfg_path)
        self.eos_token = _token_content(config.get("eos_token"), "eos_token", cfg_path)
        self.unk_token = _token_content(config.get("unk_token"), "unk_token", cfg_path)
        self.pad_token = _token_content(config.get("pad_token"), "pad_token", cfg_path)
        self.bos_token_id = self._id_of(self.bos_token)
        self.eos_token_id = self._id_of(self.eos_token)

        special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        for token in (self.bos_token, self.eos_token, self.unk_token, self.pad_token):
            if self._id_of(token) is not None:
                special.add(self._id_of(token))
        self.all_special_ids = frozenset(special)

        self.chat_templates = self._read_chat_templates(config.get("chat_template"), cfg_path)
        if chat_template is not None:  # chat_template.jinja wins, as in transformers
            self.chat_templates["default"] = chat_template
        self.chat_template = self.chat_templates.get("default")

        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        max_len = config.get("model_max_length")
        # HF writes a huge sentinel (1e30) for "no limit".
        self.model_max_length = int(max_len) if isinstance(max_len, int | float) and max_len < 1e18 else None

        self._resolve_special_token_policy(config, cfg_path)

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer | None:
        """The tokenizer of the checkpoint directory ``path``; None without a tokenizer.json."""
        path = os.fspath(path)
        tok_path = os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(tok_path):
            return None
        try:
            backend = tokenizers.Tokenizer.from_file(tok_path)
        except Exception as e:  # the Rust side raises a bare Exception for parse errors
            raise ValueError(f"{tok_path}: not a valid tokenizers tokenizer.json: {e}") from e
        config = {}
        cfg_path = os.path.join(path, CONFIG_FILE)
        if os.path.isfile(cfg_path):
            try:
                with open(cfg_path, encoding="utf-8") as f:
                    config = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{cfg_path}: not valid JSON: {e}") from e
            if not isinstance(config, dict):
                raise ValueError(f"{cfg_path}: expected a JSON object, got {type(config).__name__}")
        template = None
        jinja_path = os.path.join(path, CHAT_TEMPLATE_FILE)
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        return cls(backend, config, chat_template=template, source=path)

    @staticmethod
    def _read_chat_templates(value: Any, cfg_path: str) -> dict[str, str]:
        if value is None:
            return {}
        if isinstance(value, str):
            return {"default": value}
        if isinstance(value, list):
            templates = {}
            for entry in value:
                if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                        and isinstance(entry.get("template"), str)):
                    raise ValueError(
                        f"{cfg_path}: chat_template list entries must be {{'name': str, 'template': str}}, "
                        f"got {entry!r}"
                    )
                templates[entry["name"]] = entry["template"]
            return templates
        raise ValueError(f"{cfg_path}: chat_template must be a string or a list of named templates")

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def _resolve_special_token_policy(self, config: dict, cfg_path: str) -> None:
        for key in ("add_bos_token", "add_eos_token"):
            if key in config and not isinstance(config[key], bool):
                raise ValueError(f"{cfg_path}: {key} must be true or false, got {config[key]!r}")
        probe = "a"
        plain = self.backend.encode(probe, add_special_tokens=False).ids
        full = self.backend.encode(probe, add_special_tokens=True).ids
        processor_adds = full != plain
        flag_driven = config.get("tokenizer_class") in _FLAG_DRIVEN_CLASSES
        if processor_adds and not flag_driven:
            self._use_processor = True
            self.add_bos_token = bool(self.bos_token_id is not None and full[:1] == [self.bos_token_id])
            self.add_eos_token = bool(self.eos_token_id is not None and full[-1:] == [self.eos_token_id]
                                      and plain[-1:] != [self.eos_token_id])
            return
        self._use_processor = False
        default_bos = flag_driven  # LlamaTokenizerFast defaults add_bos_token=True
        self.add_bos_token = bool(config.get("add_bos_token", default_bos)) and self.bos_token_id is not None
        self.add_eos_token = bool(config.get("add_eos_token", False)) and self.eos_token_id is not None

    # ------------------------------------------------------------------ encode / decode

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens``, BOS/EOS as the checkpoint adds them."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        if add_special_tokens and self._use_processor:
            return list(self.backend.encode(text, add_special_tokens=True).ids)
        ids = list(self.backend.encode(text, add_special_tokens=False).ids)
        if add_special_tokens:
            if self.add_bos_token:
                ids.insert(0, self.bos_token_id)
            if self.add_eos_token:
                ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        """Text of ``ids`` (invalid UTF-8 becomes U+FFFD; unknown ids are dropped)."""
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None \
            else clean_up_tokenization_spaces
        return _clean_up_tokenization(text) if clean else text

    def convert_ids_to_tokens(self, ids: Iterable[int], skip_special_tokens: bool = False) -> list[str]:
        """Vocabulary strings of ``ids`` (byte-level form, e.g. "Ġthe"); "" for unknown ids."""
        out = []
        for i in ids:
            i = int(i)
            if skip_special_tokens and i in self.all_special_ids:
                continue
            token = self.backend.id_to_token(i)
            out.append("" if token is None else token)
        return out

    def convert_tokens_to_ids(self, tokens: Iterable[str]) -> list[int | None]:
        return [self.backend.token_to_id(t) for t in tokens]

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """The conversation rendered by the chat template (``chat_template``: a template name
        from ``chat_templates`` or a template string; default: the checkpoint's).

        ``tokenize=True`` returns ``encode(rendered, add_special_tokens=False)``: the
        template writes BOS itself, as in transformers.
        """
        if chat_template is None:
            template = self.chat_template
            if template is None:
                raise ChatTemplateError(
                    f"{self.source}: the tokenizer has no chat_template (tokenizer_config.json "
                    f"'chat_template' or {CHAT_TEMPLATE_FILE}); pass chat_template=..."
                )
        else:
            template = self.chat_templates.get(chat_template, chat_template)
        kwargs.setdefault("unk_token", self.unk_token)
        kwargs.setdefault("pad_token", self.pad_token)
        text = render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        return (f"Tokenizer({self.source!r}, vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
                f"eos={self.eos_token!r})")
