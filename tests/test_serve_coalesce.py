"""Coalesced stream outputs: when a request's outputs pile up before its consumer reads them
(a slow client, a loop waiting for the GIL), the server sends what is new as one
server-sent event, and the stream still carries exactly the non-streamed completion: text
concatenated, logprobs per token (tokens, values, text offsets), stop strings, ``n`` > 1,
finish reasons and usage. A server whose engine hands outputs over only every third step
(all of them in one loop callback, so ``_put_all`` coalesces them for real) is the test bed."""

import asyncio
import os

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from paged_jax import LLM, CompletionOutput, RequestOutput, RequestOutputKind, SamplingParams  # noqa: E402
from paged_jax.serve import start_in_thread  # noqa: E402
from paged_jax.serve.async_engine import AsyncEngine, _put_all, _Stream  # noqa: E402

TEXT = os.path.join(os.path.dirname(__file__), "fixtures", "llama_text")
KW = dict(block_size=8, num_gpu_blocks=64, max_num_seqs=8, max_model_len=96, max_num_batched_tokens=64)
NAME = "tiny"
TIMEOUT = 60.0
PROMPTS = ["The river ran", "Once upon a time the", "She opened the door and"]
EXTRA = {"ignore_eos": True}


class LaggingEngine(AsyncEngine):
    """Hands the loop the reports of three steps at once (each step's outputs in order, in
    one loop iteration), as if the consumer had fallen three steps behind."""

    every = 3

    def __init__(self, llm, **kw):
        super().__init__(llm, **kw)
        self._held, self._steps = [], 0

    def _on_reports(self, reports) -> None:
        self._held.extend(reports)
        self._steps += 1
        if self._steps % self.every and not any(o.finished for r in reports for o in r.outputs):
            return
        held, self._held = self._held, []
        super()._on_reports(held)


@pytest.fixture(scope="module")
def served():
    llm = LLM(TEXT, **KW)
    want = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
                        use_tqdm=False)
    server = start_in_thread(llm, model_name=NAME, engine=LaggingEngine(llm))
    try:
        yield llm, server, want
    finally:
        server.stop()


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=TIMEOUT, max_retries=0)


def test_put_all_keeps_the_latest_output_and_an_error_sticks():
    async def main():
        s = _Stream(asyncio.get_running_loop(), 0.0)
        _put_all([(s, "a"), (s, "b")])
        assert s.item == "b" and s.coalesced == 1
        err = RuntimeError("engine failed")
        _put_all([(s, err), (s, "c")])
        assert s.item is err and s.coalesced == 2
        s.item, s.waiter = None, asyncio.get_running_loop().create_future()
        _put_all([(s, "d")])
        assert s.waiter.done() and s.item == "d"

    asyncio.run(main())


def test_put_all_merges_unread_deltas():
    async def main():
        s = _Stream(asyncio.get_running_loop(), 0.0, RequestOutputKind.DELTA)
        a = RequestOutput("r", [1, 2], [CompletionOutput(0, [5], -1.0, None, "ab", [{5: -1.0}]),
                                        CompletionOutput(1, [7], -0.5, None, "x", [{7: -0.5}])], finished=False)
        b = RequestOutput("r", None, [CompletionOutput(0, [6], -2.5, "length", "c", [{6: -1.5}])], finished=True)
        _put_all([(s, a)])
        _put_all([(s, b)])
        got = s.item
        assert s.coalesced == 1 and got.finished and got.prompt_token_ids == [1, 2]
        assert [(c.index, c.token_ids, c.text, c.logprobs, c.finish_reason, c.cumulative_logprob)
                for c in got.outputs] == [(0, [5, 6], "abc", [{5: -1.0}, {6: -1.5}], "length", -2.5),
                                          (1, [7], "x", [{7: -0.5}], None, -0.5)]

    asyncio.run(main())


def test_coalesced_completion_stream_equals_the_whole_completion(served):
    llm, server, want = served
    c = _client(server)
    for i, prompt in enumerate(PROMPTS):
        kw = dict(model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=2, extra_body=EXTRA)
        whole = c.completions.create(**kw).choices[0]
        chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        choices = [ch.choices[0] for ch in chunks if ch.choices]
        assert len(choices) < 12  # several tokens per event: coalesced
        assert "".join(ch.text for ch in choices) == whole.text == want[i].outputs[0].text
        lp = whole.logprobs
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            streamed = [x for ch in choices for x in getattr(ch.logprobs, field)]
            assert streamed == getattr(lp, field), field
        assert len(lp.tokens) == 12
        assert lp.token_logprobs == pytest.approx([e[t].logprob for t, e in zip(
            want[i].outputs[0].token_ids, want[i].outputs[0].logprobs, strict=True)], abs=1e-5)
        assert [ch.finish_reason for ch in choices][-1] == "length" == whole.finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_coalesced_chat_stream_equals_the_whole_message(served):
    _, server, _ = served
    c = _client(server)
    kw = dict(model=NAME, messages=[{"role": "user", "content": "Tell me of the sea."}], max_tokens=10,
              temperature=0, logprobs=True, top_logprobs=2, extra_body=EXTRA)
    whole = c.chat.completions.create(**kw).choices[0]
    chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    choices = [ch.choices[0] for ch in chunks[1:] if ch.choices]
    assert len(choices) < 10
    assert "".join(ch.delta.content or "" for ch in choices) == whole.message.content
    streamed = [t for ch in choices if ch.logprobs for t in ch.logprobs.content]
    assert [(t.token, t.logprob, [x.token for x in t.top_logprobs]) for t in streamed] == [
        (t.token, t.logprob, [x.token for x in t.top_logprobs]) for t in whole.logprobs.content]
    assert len(streamed) == 10 and chunks[-1].usage.completion_tokens == 10


def test_coalesced_streams_with_n_and_stop_strings(served):
    _, server, want = served
    c = _client(server)
    kw = dict(model=NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0.9, seed=3, n=3, extra_body=EXTRA)
    whole = sorted(c.completions.create(**kw).choices, key=lambda ch: ch.index)
    streamed, reasons = {}, {}
    for ch in c.completions.create(**kw, stream=True):
        for choice in ch.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    assert [streamed[i] for i in range(3)] == [ch.text for ch in whole]
    assert [reasons[i] for i in range(3)] == [ch.finish_reason for ch in whole]
    text = want[0].outputs[0].text
    cut = next(j for j in range(4, len(text) - 3) if text[j:j + 3].strip() and text.find(text[j:j + 3]) == j)
    stop = text[cut:cut + 3]
    for stream in (False, True):
        r = c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop],
                                 stream=stream, extra_body=EXTRA)
        chunks = list(r) if stream else [r]
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text[:cut]
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
