"""The OpenAI wire format: request bodies (pydantic), their sampling parameters, the
error shape, and the JSON of completions, chat completions and their stream chunks.

Fields follow OpenAI's API plus vLLM's extras (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``prompt_logprobs`` (not streamed),
``stream_options.continuous_usage_stats``). Unknown fields are ignored, as
vLLM ignores them; fields we cannot honour (``suffix``, ``best_of`` > n,
tools, a non-text ``response_format``) are a 400 naming them. ``echo`` with ``logprobs``
reports the prompt's tokens too, with their log-probabilities (the first has none: null),
and ``echo`` with ``max_tokens: 0`` returns the prompt alone, as vLLM does (what evaluation
harnesses send to score a text).
Log-probabilities that are -inf are reported as -9999.0 (JSON has no infinity; vLLM's choice).
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict

from paged_jax.engine.sampling import SamplingParams

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit (vLLM's default max_logprobs)
_NEG_INF = -9999.0


class ApiError(Exception):
    """An error response: ``status`` and OpenAI's ``{"error": {message, type, param, code}}``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             500: "internal_server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------- requests -> engine


def unsupported(req: _Sampling) -> None:
    """400 for fields we cannot honour (module docstring)."""
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise ApiError(400, f"best_of={req.best_of}: only best_of == n ({req.n}) is supported", "best_of")
    if isinstance(req, ChatRequest):
        if req.tools:
            raise ApiError(400, "tools are not supported", "tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise ApiError(400, f"response_format={req.response_format!r}: only type 'text' is supported",
                           "response_format")
        if req.continue_final_message and req.add_generation_prompt:
            raise ApiError(400, "continue_final_message=true needs add_generation_prompt=false",
                           "continue_final_message")


def num_logprobs(req: _Sampling) -> int | None:
    """The k of ``SamplingParams.logprobs`` the request asks for (None: none)."""
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        k, field = (req.top_logprobs or 0, "top_logprobs") if req.logprobs else (None, "top_logprobs")
    else:
        k, field = req.logprobs, "logprobs"
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise ApiError(400, f"{field}={k}: must be in [0, {MAX_LOGPROBS}]", field)
    return k


def num_prompt_logprobs(req: _Sampling) -> int | None:
    """vLLM's ``prompt_logprobs`` extra: per prompt token the k most likely (None: not asked);
    not with ``stream``, as vLLM answers."""
    k = req.prompt_logprobs
    if k is None:
        return None
    if not 0 <= k <= MAX_LOGPROBS:
        raise ApiError(400, f"prompt_logprobs={k}: must be in [0, {MAX_LOGPROBS}]", "prompt_logprobs")
    if req.stream:
        raise ApiError(400, "prompt_logprobs is not available when stream is true", "prompt_logprobs")
    return k


def prompt_logprobs_json(token_ids: list[int], entries: list | None, tokenizer, k: int) -> list:
    """vLLM's ``prompt_logprobs`` in a response: per prompt token None (the first) or
    ``{token id: {"logprob", "rank", "decoded_token"}}`` for the prompt's token and the ``k``
    most likely."""
    out = []
    for tok, entry in zip(token_ids, entries or [None] * len(token_ids), strict=True):
        if entry is None:
            out.append(None)
            continue
        keep = dict(_best(entry, k))
        keep.setdefault(tok, entry[tok])
        out.append({str(t): {"logprob": _lp(lp.logprob), "rank": lp.rank, "decoded_token": _token_text(lp, tokenizer, t)}
                    for t, lp in keep.items()})
    return out


def sampling_params(req: _Sampling, defaults: SamplingParams, *, max_tokens: int,
                    logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's ``SamplingParams``: its fields over the checkpoint's defaults (vLLM's
    rule). A field ``SamplingParams`` refuses is a 400 naming it and the limit."""
    if req.n < 1:
        raise ApiError(400, f"n={req.n}: must be an int >= 1", "n")
    kw = {name: getattr(req, name) if getattr(req, name) is not None else getattr(defaults, name)
          for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    bias = None
    if req.logit_bias:  # OpenAI's: token id strings to biases; clamped to [-100, 100] as vLLM does
        try:
            bias = {int(t): min(100.0, max(-100.0, float(b))) for t, b in req.logit_bias.items()}
        except ValueError:
            raise ApiError(400, f"logit_bias: keys must be token ids (integer strings), got "
                                f"{list(req.logit_bias)[:5]}", "logit_bias") from None
    try:
        return SamplingParams(
            **kw, max_tokens=max_tokens, n=req.n, seed=req.seed, stop=tuple(stop),
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
            stop_token_ids=tuple(req.stop_token_ids or ()), include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            logit_bias=bias,
        )
    except ValueError as e:
        raise ApiError(400, str(e), field_of(str(e))) from None


def field_of(message: str) -> str | None:
    """The field a ``name=value: ...`` message is about (None if it names none)."""
    head = message.split("=", 1)[0].split(":", 1)[0].strip()
    return head if head.isidentifier() else None


def chat_messages(messages: list[dict]) -> list[dict]:
    """Messages as a chat template reads them: content parts (``[{"type": "text", ...}]``)
    joined into one string; 400 for a malformed message."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] has no 'role' string", f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ApiError(400, f"messages[{i}]: only text content parts are supported",
                                   f"messages[{i}].content")
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                           f"messages[{i}].content")
        out.append({**m, "content": content})
    return out


# ---------------------------------------------------------------------------- engine -> responses


_ID_PREFIX = uuid.uuid4().hex[:12]  # random per process, drawn once
_ID_COUNTER = itertools.count()


def new_id(prefix: str) -> str:
    """A response id unique to this server (a random per-process prefix and a counter):
    no ``os.urandom`` system call per request, which releases the GIL and can wait up to
    the switch interval to get it back while the engine thread steps."""
    return f"{prefix}-{_ID_PREFIX}{next(_ID_COUNTER):012x}"


def now() -> int:
    return int(time.time())


def _lp(x: float) -> float:
    return x if x > _NEG_INF else _NEG_INF


def _best(entry: dict, k: int) -> list:
    """The ``k`` most likely ``(token id, Logprob)`` of one position's engine entry (by rank)."""
    return sorted(entry.items(), key=lambda kv: (kv[1].rank or 0, -kv[1].logprob))[:k]


def _token_text(entry, tokenizer, token: int) -> str:
    return entry.decoded_token if entry.decoded_token is not None else tokenizer.decode([token],
                                                                                     skip_special_tokens=False)


def completion_logprobs(token_ids: list[int], entries: list[dict | None], tokenizer, k: int,
                        offset: int = 0) -> dict:
    """The completions API's ``logprobs`` object for these tokens and their engine entries
    (``{id: Logprob}`` per token; None for a token without one, as the prompt's first:
    its text with null log-probabilities, as vLLM reports it); ``offset``: the text offset
    of the first token."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for tok, entry in zip(token_ids, entries, strict=True):
        if entry is None:
            text, value, entries_k = tokenizer.decode([tok], skip_special_tokens=False), None, None
        else:
            text, value, entries_k = _token_text(entry[tok], tokenizer, tok), _lp(entry[tok].logprob), None
            if k:
                entries_k = {}
                for t, lp in _best(entry, k):  # tokens with the same text (partial UTF-8) keep the likeliest
                    entries_k.setdefault(_token_text(lp, tokenizer, t), _lp(lp.logprob))
        tokens.append(text)
        token_logprobs.append(value)
        top.append(entries_k)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], entries: list[dict], tokenizer, k: int) -> dict:
    """The chat API's ``logprobs`` object (``{"content": [...]}``)."""
    content = []
    for tok, entry in zip(token_ids, entries, strict=True):
        text = _token_text(entry[tok], tokenizer, tok)
        best = _best(entry, k)
        content.append({
            "token": text, "logprob": _lp(entry[tok].logprob), "bytes": list(text.encode()),
            "top_logprobs": [{"token": (s := _token_text(lp, tokenizer, t)), "logprob": _lp(lp.logprob),
                              "bytes": list(s.encode())} for t, lp in best],
        })
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# ---------------------------------------------------------------------------- stream chunks

_ENC = json.JSONEncoder(separators=(",", ":")).encode  # json.dumps(obj, separators=(",", ":"))


class StreamChunks:
    """The server-sent events of one streamed response, rendered from pre-encoded parts:
    the envelope (id, object, created, model) is encoded once per response and each event
    only encodes its choices' strings (no dict per chunk). An event is exactly
    ``"data: " + json.dumps({"id", "object", "created", "model", "choices"[, "usage": null]},
    separators=(",", ":")) + "\n\n"`` with ``choices`` the given rendered choices; with
    ``running_usage`` (vLLM's ``stream_options.continuous_usage_stats``) every event's
    ``usage`` is what it returns then (the usage so far) instead of null."""

    def __init__(self, rid: str, obj: str, created: int, model: str, include_usage: bool, running_usage=None):
        self.head = f'data: {{"id":{_ENC(rid)},"object":{_ENC(obj)},"created":{int(created)},"model":{_ENC(model)},"choices":['
        self.foot = "]" + (',"usage":null' if include_usage else "") + "}\n\n"
        self.running_usage = running_usage

    def event(self, choices: list[str]) -> str:
        if self.running_usage is not None:
            return self._with_usage(choices, self.running_usage())
        return self.head + ",".join(choices) + self.foot

    def usage_event(self, usage: dict) -> str:
        """The last chunk of ``stream_options.include_usage``: no choices, the usage."""
        return self._with_usage([], usage)

    def _with_usage(self, choices: list[str], usage: dict) -> str:
        return self.head + ",".join(choices) + '],"usage":' + _ENC(usage) + "}\n\n"


def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason, stop_reason) -> str:
    """One choice of a completions stream chunk, as JSON."""
    return (f'{{"index":{index},"text":{_ENC(text)},"logprobs":{"null" if logprobs is None else _ENC(logprobs)},'
            f'"finish_reason":{_ENC(finish_reason)},"stop_reason":{_ENC(stop_reason)}}}')


def chat_choice(index: int, content: str, logprobs: dict | None, finish_reason, stop_reason) -> str:
    """One choice of a chat stream chunk, as JSON (``delta`` is ``{}`` for empty content)."""
    delta = f'{{"content":{_ENC(content)}}}' if content else "{}"
    return (f'{{"index":{index},"delta":{delta},"logprobs":{"null" if logprobs is None else _ENC(logprobs)},'
            f'"finish_reason":{_ENC(finish_reason)},"stop_reason":{_ENC(stop_reason)}}}')
