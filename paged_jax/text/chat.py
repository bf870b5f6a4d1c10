"""Chat templates: render a conversation with a checkpoint's Jinja ``chat_template``.

``render_chat(template, messages, add_generation_prompt=..., bos_token=..., eos_token=...,
**kwargs) -> str`` renders the way transformers' ``apply_chat_template`` does: a
``jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)``
with the ``loopcontrols`` extension, a ``tojson`` filter that does not HTML-escape
(``ensure_ascii=False`` by default; ``indent``, ``separators``, ``sort_keys`` as
``json.dumps``), and the globals ``raise_exception(message)`` and ``strftime_now(format)``.
The template sees ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``,
``tools`` and ``documents`` (both None unless given) and any other keyword argument.

``messages`` is a list of dicts, each with a ``role`` (non-empty str) and a ``content``
(str, a list of content parts, or None, e.g. for an assistant turn that only calls tools);
other keys (``tool_calls``, ``name``, ...) pass through untouched.

Every failure is a ``ChatTemplateError`` (a ``ValueError``): a template that does not
compile, ``raise_exception`` called by the template (its message verbatim), a sandbox
violation such as ``{{ ''.__class__ }}`` (transformers renders that as an empty string;
here it raises), or any other error while rendering. Templates are compiled once per
distinct template string.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

__all__ = ["ChatTemplateError", "render_chat", "validate_messages"]


class ChatTemplateError(ValueError):
    """A chat template that failed to compile or render (or refused the conversation)."""


class _TemplateRaised(ChatTemplateError):
    """``raise_exception(message)`` inside a template; kept distinct so it is not re-wrapped."""


class _StrictSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    # The stock sandbox turns an unsafe attribute into an Undefined that renders as "";
    # a template poking at dunders is broken or hostile, so say so instead.
    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile (line {e.lineno}): {e.message}") from e


def validate_messages(messages: Any) -> list[dict]:
    """``messages`` as a list, or a ``ChatTemplateError`` saying which message is wrong and how."""
    if isinstance(messages, str | bytes | dict) or not isinstance(messages, list | tuple):
        raise ChatTemplateError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}"
        )
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        if "role" not in message or "content" not in message:
            missing = [k for k in ("role", "content") if k not in message]
            raise ChatTemplateError(f"messages[{i}] lacks {' and '.join(map(repr, missing))}")
        role, content = message["role"], message["content"]
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{i}]['role'] must be a non-empty str, got {role!r}")
        if content is not None and not isinstance(content, str | list):
            raise ChatTemplateError(
                f"messages[{i}]['content'] must be a str, a list of content parts or None, "
                f"got {type(content).__name__}"
            )
    return list(messages)


def render_chat(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool,
    bos_token: str | None,
    eos_token: str | None,
    **kwargs: Any,
) -> str:
    """The conversation rendered by ``template`` (see the module docstring)."""
    if not isinstance(template, str):
        raise ChatTemplateError(f"chat template must be a str, got {type(template).__name__}")
    messages = validate_messages(messages)
    compiled = _compile(template)
    variables = {"tools": None, "documents": None, **kwargs}
    try:
        return compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **variables,
        )
    except _TemplateRaised:
        raise
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"chat template blocked by the sandbox: {e}") from e
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template failed to render: {e}") from e
    except (TypeError, KeyError, AttributeError, IndexError, ValueError) as e:
        raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e
