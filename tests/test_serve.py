"""The OpenAI-compatible server with real clients on localhost: the official ``openai``
package (sync and async) and httpx, against a server the test starts on 127.0.0.1 at a
free port (uvicorn in a thread), with the engine core stepped on the server's loop
("inline", ``build_app(llm)``'s default) or on a thread ("thread"), both the ``LLM`` the test holds, or in
its own process ("process": an ``LLM`` built there from the same options). Outputs through the server equal ``LLM.generate`` / ``LLM.chat``; a dropped
client leaves no block allocated; bad inputs get their 4xx in OpenAI's error shape. Every
wait is bounded."""

import asyncio
import json
import os
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from engine_fakes import fake_backend  # noqa: E402

from paged_jax import LLM, SamplingParams  # noqa: E402
from paged_jax.serve import AsyncEngine, InlineEngine, ProcessEngine, start_in_thread  # noqa: E402

TEXT = os.path.join(os.path.dirname(__file__), "fixtures", "llama_text")
KW = dict(block_size=8, num_gpu_blocks=96, max_num_seqs=8, max_model_len=96, max_num_batched_tokens=64)
KEY = "sekret"
NAME = "tiny"
TIMEOUT = 60.0


def _corpus_prompts(n: int) -> list[str]:
    with open(os.path.join(TEXT, "corpus.txt"), encoding="utf-8") as f:
        words = f.read().split()
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        start, length = int(rng.integers(0, len(words) - 20)), int(rng.integers(2, 12))
        out.append(" ".join(words[start:start + length]))
    return out


PROMPTS = _corpus_prompts(64)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
EXTRA = {"ignore_eos": True}


@pytest.fixture(scope="module", params=["inline", "thread", "process"])
def served(request):
    llm = LLM(TEXT, **KW)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    if request.param == "inline":
        server = start_in_thread(llm, model_name=NAME, api_key=KEY)
    elif request.param == "thread":
        server = start_in_thread(engine=AsyncEngine(llm), model_name=NAME, api_key=KEY)
    else:  # the server's engine is another LLM, in the child; llm is the reference
        server = start_in_thread(engine=ProcessEngine(TEXT, KW, warmup=False), model_name=NAME, api_key=KEY)
    try:
        yield llm, server, want
    finally:
        server.stop()


def _reference(llm, server):
    """An ``LLM`` to compute references with while serving: the fixture's, unless the
    server steps that one (then another, built alike)."""
    return LLM(TEXT, **KW) if _in_process(server) else llm


def _in_process(server) -> bool:
    """The server steps an ``LLM`` of this process (inline or thread), not one in a child."""
    return getattr(server.engine, "llm", None) is not None


def _client(server, key=KEY):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, timeout=TIMEOUT, max_retries=0)


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def _assert_idle(llm, server, timeout=TIMEOUT):
    """Wait until the engine has nothing running or held, then check no block is held: as
    the device has it (inline, thread: nothing steps an idle engine) or as the child's
    ``usage()`` reports it (process)."""
    assert server.engine.wait_idle(timeout), "the engine did not go idle"
    deadline = time.monotonic() + timeout
    while _metric(server, "paged_jax:kv_cache_blocks_used") != 0:
        assert time.monotonic() < deadline, "blocks still used"
        time.sleep(0.05)
    u = server.engine.usage()
    assert u.blocks_used == 0 and u.running == u.waiting == u.swapped == 0, u
    if _in_process(server):
        cache = llm.inspect()
        assert cache.idle and cache.num_free == cache.num_blocks and not cache.rows


def test_completions_stream_and_not_equal_generate(served):
    llm, server, want = served
    c = _client(server)
    r = c.completions.create(model=NAME, prompt=PROMPTS[:3], max_tokens=8, temperature=0, extra_body=EXTRA)
    assert [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)] == want[:3]
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == sum(
        len(llm.get_tokenizer().encode(p)) for p in PROMPTS[:3])
    assert all(ch.finish_reason == "length" for ch in r.choices)
    chunks = list(c.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body=EXTRA))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want[3]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    # vLLM's continuous_usage_stats: every chunk carries the usage so far
    prompt_tokens = len(llm.get_tokenizer().encode(PROMPTS[3]))
    for create in (c.completions.create, c.chat.completions.create):
        kw = dict(prompt=PROMPTS[3]) if create == c.completions.create else dict(
            messages=[{"role": "user", "content": PROMPTS[3]}])
        chunks = list(create(model=NAME, max_tokens=8, temperature=0, stream=True, extra_body=EXTRA,
                             stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw))
        used = [ch.usage.completion_tokens for ch in chunks]
        assert all(ch.usage is not None for ch in chunks) and used == sorted(used) and used[-1] == 8
        assert chunks[-1].choices == []
        if create == c.completions.create:
            assert {ch.usage.prompt_tokens for ch in chunks} == {prompt_tokens}


def test_chat_stream_and_not_equal_llm_chat(served):
    llm, server, _ = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me of the sea."}]
    # The server's engine owns its LLM while serving: the reference renders the same prompt.
    ids = llm.get_tokenizer().encode(llm.chat_prompt(messages), add_special_tokens=False)
    c = _client(server)
    r = c.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0, extra_body=EXTRA)
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens == len(ids)
    streamed = c.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True,
                                         extra_body=EXTRA)
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == r.choices[0].message.content
    out = c.completions.create(model=NAME, prompt=ids, max_tokens=10, temperature=0, extra_body=EXTRA)
    assert out.choices[0].text == r.choices[0].message.content  # the same tokens by the token-id route


def test_n_seed_and_logprobs(served):
    _, server, want = served
    c = _client(server)
    kw = dict(model=NAME, prompt=PROMPTS[5], max_tokens=6, temperature=0.9, seed=7, n=3, extra_body=EXTRA)
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    texts = [ch.text for ch in sorted(a.choices, key=lambda ch: ch.index)]
    assert sorted(ch.index for ch in a.choices) == [0, 1, 2] and len(set(texts)) > 1
    assert texts == [ch.text for ch in sorted(b.choices, key=lambda ch: ch.index)]  # seeded: reproducible
    streamed = {}
    for ch in c.completions.create(**kw, stream=True):
        for choice in ch.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == texts
    g = c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3, extra_body=EXTRA)
    lp = g.choices[0].logprobs
    assert g.choices[0].text == want[0] and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert tok in top and len(top) <= 3 and value <= 0 and max(top.values()) == pytest.approx(value)  # greedy: the best
    chat = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                     temperature=0, logprobs=True, top_logprobs=2, extra_body=EXTRA)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob
                                     for t in content)


def test_echo_with_logprobs_scores_the_prompt(served):
    """What evaluation harnesses send to score a text (lm-eval's loglikelihood): echo with
    logprobs and max_tokens 0 or 1; the prompt's tokens come back with their log-probabilities
    (the first has none), equal to ``SamplingParams.prompt_logprobs`` offline; streamed, the
    first event carries them."""
    llm, server, _ = served
    llm = _reference(llm, server)
    c = _client(server)
    prompt = PROMPTS[3]
    ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=2, prompt_logprobs=2,
                                                ignore_eos=True), use_tqdm=False)[0]
    ids, tok = ref.prompt_token_ids, llm.get_tokenizer()
    ref_lp = [None] + [ref.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i > 0]
    texts = [tok.decode([t], skip_special_tokens=False) for t in ids]

    only = c.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
    ch = only.choices[0]
    assert ch.text == prompt and ch.finish_reason == "length"
    assert ch.logprobs.tokens == texts and ch.logprobs.top_logprobs[0] is None
    assert ch.logprobs.token_logprobs[0] is None
    assert ch.logprobs.token_logprobs[1:] == pytest.approx(ref_lp[1:], abs=1e-4)
    assert ch.logprobs.text_offset == [sum(len(x) for x in texts[:i]) for i in range(len(texts))]
    assert all(len(top) <= 2 for top in ch.logprobs.top_logprobs[1:])
    assert only.usage.prompt_tokens == len(ids)

    one = c.completions.create(model=NAME, prompt=prompt, max_tokens=1, echo=True, logprobs=2, temperature=0,
                               extra_body=EXTRA)
    ch1 = one.choices[0]
    assert ch1.text == prompt + ref.outputs[0].text and ch1.text.startswith(prompt)
    assert ch1.logprobs.tokens[:-1] == texts and len(ch1.logprobs.token_logprobs) == len(ids) + 1
    assert ch1.logprobs.token_logprobs[-1] == pytest.approx(ref.outputs[0].logprobs[0][ref.outputs[0].token_ids[0]].logprob,
                                                            abs=1e-4)

    tokens, lps, text, events = [], [], "", 0
    for chunk in c.completions.create(model=NAME, prompt=prompt, max_tokens=3, echo=True, logprobs=2,
                                      temperature=0, stream=True, extra_body=EXTRA):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                events += 1
                if events == 1:
                    assert choice.logprobs.tokens[:len(ids)] == texts  # the prompt, in the first event
                tokens += choice.logprobs.tokens
                lps += choice.logprobs.token_logprobs
    assert text.startswith(prompt) and len(tokens) == len(ids) + 3 and lps[0] is None
    assert lps[1:len(ids)] == pytest.approx(ref_lp[1:], abs=1e-4)

    # vLLM's prompt_logprobs extra: {token id: {logprob, rank, decoded_token}} per prompt token
    extra = c.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0,
                                 extra_body={"prompt_logprobs": 1, **EXTRA}).model_dump()["choices"][0]
    plp = extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None and extra["text"] == ref.outputs[0].text
    for i in range(1, len(ids)):
        entry = plp[i]
        assert str(ids[i]) in entry and len(entry) <= 2 and min(v["rank"] for v in entry.values()) == 1
        assert entry[str(ids[i])]["logprob"] == pytest.approx(ref_lp[i], abs=1e-4)
        assert entry[str(ids[i])]["decoded_token"] == texts[i]
    chat = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=1,
                                     temperature=0, extra_body={"prompt_logprobs": 0}).model_dump()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    with pytest.raises(openai.BadRequestError, match="stream"):
        c.completions.create(model=NAME, prompt=prompt, max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1})

    two = c.completions.create(model=NAME, prompt=[PROMPTS[1], PROMPTS[2]], max_tokens=0, echo=True, temperature=0)
    assert [x.text for x in sorted(two.choices, key=lambda x: x.index)] == [PROMPTS[1], PROMPTS[2]]
    assert all(x.logprobs is None for x in two.choices)


def test_logit_bias(served):
    """OpenAI's ``logit_bias`` (token id strings to [-100, 100], clamped as vLLM does) gives
    what ``SamplingParams.logit_bias`` gives offline, in completions and chat."""
    llm, server, _ = served
    llm = _reference(llm, server)
    c = _client(server)
    ids = llm.get_tokenizer().encode(" lighthouse", add_special_tokens=False)
    forced = {str(ids[0]): 250}  # clamped to 100
    greedy = llm.generate([PROMPTS[4]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    banned = {str(t): -100 for t in set(greedy)}
    for bias in (forced, banned):
        want = llm.generate([PROMPTS[4]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                         logit_bias={int(t): max(-100, min(100, b))
                                                                     for t, b in bias.items()}),
                            use_tqdm=False)[0].outputs[0]
        got = c.completions.create(model=NAME, prompt=PROMPTS[4], max_tokens=6, temperature=0, logit_bias=bias,
                                   extra_body=EXTRA)
        assert got.choices[0].text == want.text
    assert set(want.token_ids).isdisjoint(greedy)  # the ban changed every token
    chat = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                     temperature=0, logit_bias=forced, logprobs=True, extra_body=EXTRA)
    assert [t.token for t in chat.choices[0].logprobs.content] == [llm.get_tokenizer().decode([ids[0]])] * 3


def test_stop_strings(served):
    _, server, want = served
    c = _client(server)
    i = next(i for i, w in enumerate(want) if len(w) > 6 and w[3:6].strip() and w.find(w[3:6]) == 3)
    stop = want[i][3:6]
    for stream in (False, True):
        r = c.completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=8, temperature=0, stop=[stop],
                                 stream=stream, extra_body=EXTRA)
        chunks = list(r) if stream else [r]
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text == want[i][:3]
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"


def test_64_concurrent_clients_equal_generate(served):
    """64 clients at once (half streaming): continuous batching across HTTP requests, each
    output the offline greedy one; the engine ends idle with no block held."""
    llm, server, want = served

    async def one(client, i):
        kw = dict(model=NAME, prompt=PROMPTS[i], max_tokens=8, temperature=0, extra_body=EXTRA)
        if i % 2:
            return "".join([ch.choices[0].text async for ch in await client.completions.create(**kw, stream=True)
                            if ch.choices])
        return (await client.completions.create(**kw)).choices[0].text

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=TIMEOUT,
                                      max_retries=0) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(64))), 2 * TIMEOUT)

    got = asyncio.run(main())
    assert got == want
    _assert_idle(llm, server)
    assert _metric(server, "paged_jax:time_to_first_token_seconds_count") >= 64


def test_requests_are_answered_between_the_steps_of_a_long_stream(served):
    """While one stream runs 80 steps, /health, /tokenize and a short completion are answered
    before it ends: the inline engine yields the loop after every step, the others step
    beside it."""
    llm, server, want = served
    body = {"model": NAME, "prompt": PROMPTS[2], "max_tokens": 80, "temperature": 0, "stream": True,
            "ignore_eos": True}
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=TIMEOUT, headers=auth) as h, h.stream("POST", server.url + "/v1/completions",
                                                                    json=body) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data:"))
        next(lines)
        with httpx.Client(timeout=TIMEOUT, headers=auth) as other:
            assert other.get(server.url + "/health").status_code == 200
            assert other.post(server.url + "/tokenize", json={"prompt": "the sea"}).json()["count"] > 0
            short = other.post(server.url + "/v1/completions", json={
                "model": NAME, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, **EXTRA}).json()
        rest = list(lines)
    assert short["choices"][0]["text"] == want[0]
    assert len(rest) > 10 and rest[-1] == "data: [DONE]"  # still running (an engine holding the loop: 1-2 merged)
    _assert_idle(llm, server)


def test_the_inline_engine_runs_on_asyncios_own_loop(served):
    """Its turns are timers due at once; under uvloop (uvicorn's "auto" where installed) that
    made libuv take one new connection per step (server._event_loop)."""
    _, server, _ = served
    if not isinstance(server.engine, InlineEngine):
        pytest.skip("the inline engine only")
    assert type(server.engine._loop).__module__.startswith("asyncio"), type(server.engine._loop)


def test_a_dropped_client_frees_its_blocks(served):
    llm, server, _ = served
    aborted = _metric(server, "paged_jax:request_aborted_total")
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 80, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=TIMEOUT) as h, h.stream("POST", server.url + "/v1/completions", json=body,
                                                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [line for line in (next(lines) for _ in range(6)) if line.startswith("data:")]
        assert got and json.loads(got[0][5:])["choices"]
    # the connection is closed mid-stream: the server aborts the request
    _assert_idle(llm, server)
    assert _metric(server, "paged_jax:request_aborted_total") == aborted + 1
    # and serves the next client as before
    r = _client(server).completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                           extra_body=EXTRA)
    assert r.choices[0].text == served[2][1]


def _error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    return err["message"]


def test_bad_inputs_get_their_4xx(served):
    _, server, _ = served
    url, auth = server.url, {"Authorization": f"Bearer {KEY}"}

    def post(path, body, headers=auth):
        data = body if isinstance(body, str | bytes) else json.dumps(body)
        return httpx.post(url + path, content=data, headers={**headers, "Content-Type": "application/json"},
                          timeout=TIMEOUT)

    ok = {"model": NAME, "prompt": "The sea", "max_tokens": 4}
    assert "not valid JSON" in _error(post("/v1/completions", "{not json"), 400)
    assert "JSON object" in _error(post("/v1/completions", "[1, 2]"), 400)
    _error(post("/v1/completions", {"model": NAME}), 400, "prompt")
    _error(post("/v1/completions", {**ok, "max_tokens": "many"}), 400, "max_tokens")
    assert "does not exist" in _error(post("/v1/completions", {**ok, "model": "gpt-9"}), 404, "model")
    long = " ".join(["lighthouse"] * 200)
    assert "max_model_len=96" in _error(post("/v1/completions", {**ok, "prompt": long}), 400, "prompt")
    assert "at most" in _error(post("/v1/completions", {**ok, "max_tokens": 500}), 400, "max_tokens")
    assert "must be" in _error(post("/v1/completions", {**ok, "temperature": -1}), 400, "temperature")
    assert "(0, 1]" in _error(post("/v1/completions", {**ok, "top_p": 2}), 400, "top_p")
    _error(post("/v1/completions", {**ok, "n": 0}), 400, "n")
    assert "max_num_seqs=8" in _error(post("/v1/completions", {**ok, "n": 9}), 400)
    assert "[0, 20]" in _error(post("/v1/completions", {**ok, "logprobs": 50}), 400, "logprobs")
    _error(post("/v1/completions", {**ok, "presence_penalty": 5}), 400, "presence_penalty")
    _error(post("/v1/completions", {**ok, "prompt": [1, 2, 100000]}), 400, "prompt")
    assert "token ids" in _error(post("/v1/completions", {**ok, "logit_bias": {"one": 5}}), 400, "logit_bias")
    assert "vocabulary" in _error(post("/v1/completions", {**ok, "logit_bias": {"10000000": 5}}), 400, "logit_bias")
    assert ">= 1" in _error(post("/v1/completions", {**ok, "max_tokens": 0}), 400, "max_tokens")  # 0: with echo only
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
    _error(post("/v1/chat/completions", {**chat, "messages": []}), 400, "messages")
    _error(post("/v1/chat/completions", {**chat, "top_logprobs": 2}), 400, "top_logprobs")
    _error(post("/v1/chat/completions", {**chat, "max_completion_tokens": 0}), 400, "max_completion_tokens")
    _error(post("/v1/chat/completions", {**chat, "messages": [{"role": "wizard", "content": "x"}]}), 400, "messages")
    # the official client raises its typed errors
    c = _client(server)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        c.completions.create(model=NAME, prompt=long, max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-9", prompt="x", max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        _client(server, key="wrong").completions.create(model=NAME, prompt="x", max_tokens=4)
    _error(post("/v1/completions", ok, headers={}), 401)
    _error(httpx.get(url + "/v1/models", timeout=TIMEOUT), 401)


def test_models_health_metrics_tokenize(served):
    llm, server, _ = served
    c = _client(server)
    (model,) = c.models.list().data
    assert model.id == NAME
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200
    auth = {"Authorization": f"Bearer {KEY}"}
    tok = llm.get_tokenizer()
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPTS[0]}, headers=auth, timeout=TIMEOUT).json()
    assert r["tokens"] == tok.encode(PROMPTS[0]) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 96
    r = httpx.post(server.url + "/detokenize", json={"tokens": tok.encode(PROMPTS[0])}, headers=auth,
                   timeout=TIMEOUT).json()
    assert r["prompt"] == tok.decode(tok.encode(PROMPTS[0]))
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_used", "kv_cache_usage_perc",
                 "prefix_cache_hit_rate", "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket"):
        assert f"paged_jax:{name}" in text, name


# ---------------------------------------------------------------------------- the fake model: fast


@pytest.fixture(scope="module")
def fake_llm():
    return LLM(fake_backend(4), block_size=4, num_gpu_blocks=64, max_model_len=64, max_num_seqs=2,
               max_num_batched_tokens=32)


def test_back_pressure_503_and_drain_finishes_in_flight_streams(fake_llm):
    """max_waiting=1 with 2 rows: of 6 simultaneous requests some get 503 (OpenAI's shape),
    the admitted ones finish; stopping the server mid-stream lets the stream finish."""
    server = start_in_thread(fake_llm, max_waiting=1)
    try:
        body = {"prompt": [1, 2, 3], "max_tokens": 40, "temperature": 0, "ignore_eos": True}

        async def one(client):
            return await client.post(server.url + "/v1/completions", json=body)

        async def main():
            async with httpx.AsyncClient(timeout=TIMEOUT) as client:
                return await asyncio.wait_for(asyncio.gather(*(one(client) for _ in range(6))), TIMEOUT)

        codes = sorted(r.status_code for r in asyncio.run(main()))
        assert 503 in codes and 200 in codes and set(codes) == {200, 503}, codes
        assert server.engine.wait_idle(TIMEOUT)
        # drain: a stream in flight when the server is told to stop runs to its end
        with httpx.Client(timeout=TIMEOUT) as h, h.stream("POST", server.url + "/v1/completions",
                                                          json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            server.engine.begin_drain()
            with pytest.raises(openai.APIStatusError) as refused:
                openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=TIMEOUT,
                              max_retries=0).completions.create(model="paged_jax", prompt=[1], max_tokens=2)
            assert refused.value.status_code == 503
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        texts = [json.loads(x[5:]) for x in [first, *rest[:-1]]]
        assert texts[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        server.stop()
    assert fake_llm.inspect().idle
