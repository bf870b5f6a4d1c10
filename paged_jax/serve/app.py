"""The OpenAI-compatible HTTP app (FastAPI): ``build_app(llm)``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (server-sent events with
``"stream": true``; ``stream_options.include_usage`` adds a last chunk with the usage),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus), ``POST /tokenize``,
``POST /detokenize``. Errors are OpenAI's JSON shape (``protocol.ApiError``): 400 for a
malformed body or a bad parameter (naming the field and the limit, e.g. a prompt past
``max_model_len``), 404 for an unknown model (as OpenAI and vLLM answer), 401 without the
``--api-key`` (``/v1/*``, ``/tokenize``, ``/detokenize``), 503 under back-pressure or while
draining, 500 if the engine failed.

A client that disconnects aborts its requests (streaming: the response is cancelled;
non-streaming: the handler polls the connection), and their blocks return at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from paged_jax.engine.sampling import RequestOutputKind
from paged_jax.serve import protocol as P
from paged_jax.serve.async_engine import EngineClient, EngineError, InlineEngine, Overloaded

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's for /v1/completions
DRAIN_SECONDS = 30.0
DONE_EVENT = "data: [DONE]\n\n"  # the last event of every stream


class EventStream(StreamingResponse):
    """A server-sent-event response whose headers leave with its first event and whose last
    event (the one ending in ``data: [DONE]``) ends the body in the same write: two socket
    writes fewer per request, each a wake-up of the client, and the engine's first step is
    not queued behind the headers' write (with the inline engine the writes and the steps
    share one thread).

    A client that disconnects cancels the response's task (``asyncio.Task.cancel``, which
    lands at the task's next resumption, so the consumer's stream is left and its request
    aborted). Starlette's own watcher cancels through an anyio cancel scope, which skips a
    task whose awaited future is already done and retries on the loop's next pass: with the
    inline engine, whose every step completes that future before the retry runs, it never
    landed and a dropped client's request ran to its end."""

    async def __call__(self, scope, receive, send) -> None:
        me = asyncio.current_task()
        gone = False

        async def watch():
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            me.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not gone or me.uncancel() > 0:  # not (only) the disconnect's: someone else's to handle
                raise
        finally:
            watcher.cancel()

    async def stream_response(self, send) -> None:
        started = False
        async for chunk in self.body_iterator:
            if not started:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                started = True
            last = chunk.endswith(DONE_EVENT)
            await send({"type": "http.response.body", "body": chunk.encode(self.charset), "more_body": not last})
            if last:
                return
        if not started:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def build_app(llm=None, *, model_name: str | None = None, api_key: str | None = None, max_waiting: int = 512,
              engine: EngineClient | None = None) -> FastAPI:
    """The app serving ``llm`` as ``model_name`` (default: the model argument ``LLM`` got,
    as vLLM names it), from an ``InlineEngine`` (the engine core stepped on the app's own
    loop) unless ``engine`` is given (an ``AsyncEngine``: the core on a thread; an
    ``engine_process.ProcessEngine``: in a process of its own, then ``llm`` may be None,
    everything about the model is read from ``engine.model``). The engine starts with the
    app (its lifespan) and, at shutdown, new requests are refused while the running ones
    finish (up to ``DRAIN_SECONDS``). ``app.state.engine`` is the engine."""
    if engine is None and llm is None:
        raise ValueError("build_app needs an LLM or an engine")
    engine = engine or InlineEngine(llm, max_waiting=max_waiting)
    llm = engine.model  # the LLM, or an LLMInfo of one in another process: the same answers
    name = model_name or str(getattr(llm.config.model.source, "name", None) or "paged_jax")
    tokenizer = llm.get_tokenizer()
    defaults = llm.get_default_sampling_params()
    max_model_len = llm.max_model_len

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.begin_drain()
            await asyncio.to_thread(engine.wait_idle, DRAIN_SECONDS)
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="paged_jax", lifespan=lifespan)
    app.state.engine = engine
    app.state.model_name = name

    @app.exception_handler(P.ApiError)
    async def _api_error(request, e: P.ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    # ------------------------------------------------------------------ helpers

    def auth(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise P.ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")

    async def parse(request: Request, model):
        auth(request)
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise P.ApiError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise P.ApiError(400, "the body must be a JSON object")
        try:
            req = model.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            raise P.ApiError(400, f"{where}: {first['msg']}", where) from None
        if getattr(req, "model", None) not in (None, name):
            raise P.ApiError(404, f"The model `{req.model}` does not exist (this server serves `{name}`)",
                             "model", "model_not_found")
        return req

    def need_tokenizer(what: str) -> None:
        if tokenizer is None:
            raise P.ApiError(400, f"{what} needs a tokenizer: this model has none (send token ids)")

    def admit(ids: list[int], params, field: str, stream: bool):
        # As vLLM's server: deltas to stream, the final output alone to answer at once.
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        try:
            return engine.submit(ids, dataclasses.replace(params, output_kind=kind))
        except Overloaded as e:
            raise P.ApiError(503, str(e), code="overloaded") from None
        except ValueError as e:
            raise P.ApiError(400, str(e), P.field_of(str(e)) or field) from None

    def check_length(ids: list[int], max_tokens: int, field: str) -> None:
        if len(ids) >= max_model_len:
            raise P.ApiError(400, f"the prompt has {len(ids)} tokens; it must be shorter than "
                                  f"max_model_len={max_model_len}", field)
        if len(ids) + max_tokens > max_model_len:
            raise P.ApiError(400, f"max_tokens={max_tokens}: the prompt has {len(ids)} tokens and "
                                  f"max_model_len={max_model_len}, so at most {max_model_len - len(ids)} "
                                  "can be generated", "max_tokens")

    async def wait_all(request: Request, streams) -> list:
        """Every stream's last output; polls for a disconnect (then aborts them all)."""
        async def last(stream):
            last_out = None
            async for out in stream:
                last_out = out
            return last_out

        task = asyncio.gather(*(last(s) for s in streams))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    task.cancel()
                    raise P.ApiError(499, "client disconnected")
        except EngineError as e:
            raise P.ApiError(500, str(e)) from None
        finally:
            for s in streams:
                s.abort()

    async def merged(streams):
        """(index of the stream, output) as any stream advances."""
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i, s):
            try:
                async for out in s:
                    q.put_nowait((i, out))
                q.put_nowait((i, None))
            except Exception as e:  # noqa: BLE001 - re-raised by the consumer
                q.put_nowait((i, e))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            left = len(tasks)
            while left:
                i, item = await q.get()
                if item is None:
                    left -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                s.abort()

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    # ------------------------------------------------------------------ completions

    def completion_prompts(prompt) -> list[tuple[list[int], str | None]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise P.ApiError(400, "prompt is empty", "prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        out = []
        for p in prompt:
            if isinstance(p, str):
                need_tokenizer("a text prompt")
                out.append((tokenizer.encode(p), p))
            else:
                out.append((list(p), None))
        return out

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, P.CompletionRequest)
        P.unsupported(req)
        k = P.num_logprobs(req)
        prompt_n = P.num_prompt_logprobs(req)
        if k is not None or prompt_n is not None:
            need_tokenizer("logprobs")
        prompts = completion_prompts(req.prompt)
        max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        # echo with max_tokens 0: the prompt alone (with its logprobs), as vLLM: one token is
        # generated and dropped (it still counts as generated in the usage, as vLLM counts it).
        prompt_only = req.echo and max_tokens == 0
        if prompt_only:
            max_tokens = 1
        # echo with logprobs: the prompt's tokens are reported too; prompt_logprobs: vLLM's extra
        asked = [x for x in (k if req.echo else None, prompt_n) if x is not None]
        prompt_k = max(asked) if asked else None
        plan = []
        for ids, text in prompts:
            check_length(ids, max_tokens, "prompt")
            plan.append((ids, text, P.sampling_params(req, defaults, max_tokens=max_tokens, logprobs=k,
                                                      prompt_logprobs=prompt_k)))
        streams = []
        try:
            for ids, _, params in plan:
                streams.append(admit(ids, params, "prompt", req.stream))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        rid, created, n = P.new_id("cmpl"), P.now(), req.n

        def echo_text(i):
            if not req.echo:
                return ""
            ids, text = plan[i][0], plan[i][1]
            return text if text is not None else (tokenizer.decode(ids) if tokenizer else "")

        prompt_entries: dict[int, list] = {}  # stream -> its prompt's logprob entries (first output only)

        def shown(i, out, c, first: bool):
            """(text, token ids, logprob entries or None) of completion ``c`` of stream ``i``
            as the response shows it: the echoed prompt in front of its first output, the
            generated token dropped for ``prompt_only``."""
            if out.prompt_logprobs is not None:
                prompt_entries.setdefault(i, out.prompt_logprobs)
            text, ids, entries = ("", [], []) if prompt_only else (c.text, list(c.token_ids), c.logprobs)
            if first and req.echo:
                text = echo_text(i) + text
                if k is not None:
                    ids = list(plan[i][0]) + ids
                    entries = list(prompt_entries.get(i) or [None] * len(plan[i][0])) + list(entries or [])
            return text, ids, entries

        if not req.stream:
            finals = await wait_all(request, streams)
            choices, completion_tokens = [], 0
            for i, out in enumerate(finals):
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    text, ids, entries = shown(i, out, c, True)
                    lp = (P.completion_logprobs(ids, entries, tokenizer, k)
                          if k is not None and entries is not None else None)
                    choices.append({"index": i * n + c.index, "text": text, "logprobs": lp,
                                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                    if prompt_n is not None:
                        choices[-1]["prompt_logprobs"] = P.prompt_logprobs_json(plan[i][0], out.prompt_logprobs,
                                                                                tokenizer, prompt_n)
            prompt_tokens = sum(len(p[0]) for p in plan)
            return {"id": rid, "object": "text_completion", "created": created, "model": name,
                    "choices": choices, "usage": P.usage(prompt_tokens, completion_tokens)}

        include_usage = req.stream_options is not None and req.stream_options.include_usage
        # choice index -> [tokens sent, finished, text offset of the next token (the sum of the
        # sent tokens' texts, as the whole completion counts it: the text can lag the tokens
        # while a character's bytes are incomplete)]
        sent: dict[int, list[int]] = {}
        running = None
        if include_usage and req.stream_options.continuous_usage_stats:
            prompt_total = sum(len(p[0]) for p in plan)

            def running():
                return P.usage(prompt_total, sum(state[0] for state in sent.values()))
        render = P.StreamChunks(rid, "text_completion", created, name, include_usage, running)
        totals = [0]  # completion tokens of the finished choices

        def choices_of(i, out) -> list[str]:
            """The rendered choices of stream ``i``'s delta (what is new since the last event,
            however many tokens that is: deltas a slow consumer missed come merged), logprobs
            per token."""
            choices = []
            for c in out.outputs:
                idx = i * n + c.index
                state = sent.get(idx)
                first = state is None
                if first:
                    state = sent[idx] = [0, 0, 0]
                elif state[1]:
                    continue
                delta, ids, entries = shown(i, out, c, first)
                done = c.finish_reason is not None
                if not (delta or done or ids):
                    continue
                lp = None
                if k is not None and entries is not None:
                    lp = P.completion_logprobs(ids, entries, tokenizer, k, offset=state[2])
                    if lp["tokens"]:
                        state[2] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                choices.append(P.completion_choice(idx, delta, lp, c.finish_reason, c.stop_reason))
                state[0] += len(c.token_ids)
                state[1] = int(done)
                if done:
                    totals[0] += state[0]
            return choices

        async def events():
            tail = ""
            try:
                if len(streams) == 1:  # no merging task per request
                    async for out in streams[0]:
                        choices = choices_of(0, out)
                        if choices and out.finished:
                            tail = render.event(choices)  # the last one: sent with the usage and [DONE], one write
                        elif choices:
                            yield render.event(choices)
                else:
                    async for i, out in merged(streams):
                        choices = choices_of(i, out)
                        if choices:
                            yield render.event(choices)
                if include_usage:
                    tail += render.usage_event(P.usage(sum(len(p[0]) for p in plan), totals[0]))
            except EngineError as e:
                tail += sse(P.ApiError(500, str(e)).body())
            yield tail + DONE_EVENT

        return EventStream(events(), media_type="text/event-stream")

    # ------------------------------------------------------------------ chat

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await parse(request, P.ChatRequest)
        P.unsupported(req)
        need_tokenizer("chat")
        k = P.num_logprobs(req)
        prompt_n = P.num_prompt_logprobs(req)
        if not req.messages:
            raise P.ApiError(400, "messages is empty", "messages")
        messages = P.chat_messages(req.messages)
        try:
            text = llm.chat_prompt(messages, chat_template=req.chat_template,
                                   add_generation_prompt=req.add_generation_prompt,
                                   continue_final_message=req.continue_final_message,
                                   chat_template_kwargs=req.chat_template_kwargs)
        except Exception as e:  # noqa: BLE001 - the template raised (an unknown role, ...)
            raise P.ApiError(400, f"the chat template failed on these messages: {e}", "messages") from None
        ids = tokenizer.encode(text, add_special_tokens=False)
        given = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if given is not None and given < 1:
            raise P.ApiError(400, f"{field}={given}: must be an int >= 1", field)
        check_length(ids, 1, "messages")
        max_tokens = given if given is not None else max_model_len - len(ids)
        check_length(ids, max_tokens, "messages")
        params = P.sampling_params(req, defaults, max_tokens=max_tokens, logprobs=k, prompt_logprobs=prompt_n)
        stream = admit(ids, params, "messages", req.stream)
        rid, created, n = P.new_id("chatcmpl"), P.now(), req.n
        include_usage = req.stream_options is not None and req.stream_options.include_usage

        if not req.stream:
            (out,) = await wait_all(request, [stream])
            choices = []
            for c in out.outputs:
                lp = (P.chat_logprobs(c.token_ids, c.logprobs, tokenizer, k)
                      if k is not None and c.logprobs is not None else None)
                choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                                "logprobs": lp, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            body = {"id": rid, "object": "chat.completion", "created": created, "model": name, "choices": choices,
                    "usage": P.usage(len(ids), sum(len(c.token_ids) for c in out.outputs))}
            if prompt_n is not None:  # vLLM's extra, beside the choices
                body["prompt_logprobs"] = P.prompt_logprobs_json(ids, out.prompt_logprobs, tokenizer, prompt_n)
            return body

        sent = [[0, 0] for _ in range(n)]  # per choice: [tokens sent, finished]
        running = None
        if include_usage and req.stream_options.continuous_usage_stats:
            def running():
                return P.usage(len(ids), sum(state[0] for state in sent))
        render = P.StreamChunks(rid, "chat.completion.chunk", created, name, include_usage, running)
        totals = [0]  # completion tokens of the finished choices

        def choices_of(out) -> list[str]:
            """The rendered choices of the delta (what is new since the last event, however
            many tokens that is: deltas a slow consumer missed come merged), logprobs per token."""
            choices = []
            for c in out.outputs:
                state = sent[c.index]
                if state[1]:
                    continue
                done = c.finish_reason is not None
                if not (c.text or done or c.token_ids):
                    continue
                lp = None
                if k is not None and c.logprobs is not None:
                    lp = P.chat_logprobs(c.token_ids, c.logprobs, tokenizer, k)
                choices.append(P.chat_choice(c.index, c.text, lp, c.finish_reason, c.stop_reason))
                state[0] += len(c.token_ids)
                state[1] = int(done)
                if done:
                    totals[0] += state[0]
            return choices

        async def events():
            yield render.event([f'{{"index":{j},"delta":{{"role":"assistant","content":""}},"logprobs":null,'
                                '"finish_reason":null}' for j in range(n)])
            tail = ""
            try:
                async for out in stream:
                    choices = choices_of(out)
                    if choices and out.finished:
                        tail = render.event(choices)  # the last one: sent with the usage and [DONE], one write
                    elif choices:
                        yield render.event(choices)
                if include_usage:
                    tail += render.usage_event(P.usage(len(ids), totals[0]))
            except EngineError as e:
                tail += sse(P.ApiError(500, str(e)).body())
            yield tail + DONE_EVENT

        return EventStream(events(), media_type="text/event-stream")

    # ------------------------------------------------------------------ the rest

    @app.get("/v1/models")
    async def models(request: Request):
        auth(request)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": P.now(),
                                            "owned_by": "paged_jax", "max_model_len": max_model_len}]}

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse(P.ApiError(503, "the engine is not running").body(), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await parse(request, P.TokenizeRequest)
        need_tokenizer("tokenize")
        if (req.prompt is None) == (req.messages is None):
            raise P.ApiError(400, "give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            text = llm.chat_prompt(P.chat_messages(req.messages), add_generation_prompt=req.add_generation_prompt)
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await parse(request, P.DetokenizeRequest)
        need_tokenizer("detokenize")
        vocab = llm.config.model.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise P.ApiError(400, f"tokens outside [0, {vocab}): {bad[:5]}", "tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    return app
