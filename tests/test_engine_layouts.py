"""The engine's two batch layouts (``LLM(batch_layout=...)``): "packed" (the default: every
row of a step in one model call, tokens one after another) and "padded" (decodes in one
call, prefill chunks in padded calls). They run the same schedule, so their outputs must be
the same request for request: tokens identical, log-probabilities to rounding, whatever the
sampling options, chunking, sharing and preemption; and a packed step is one model call."""

import os

import numpy as np
import pytest
from engine_fakes import VOCAB, assert_drained, fake_backend

from paged_jax.engine import LLM, SamplingParams

TEXT = os.path.join(os.path.dirname(__file__), "fixtures", "llama_text")


def _params():
    return [
        SamplingParams(temperature=0, max_tokens=9, logprobs=3),
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=7, seed=5, n=2),
        SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=2),
        SamplingParams(temperature=0.7, top_k=20, max_tokens=8, seed=2, repetition_penalty=1.3,
                       frequency_penalty=0.5, min_tokens=3),
        SamplingParams(temperature=0, max_tokens=12, min_p=0.1),
    ]


def _run(layout: str, **kw):
    llm = LLM(TEXT, dtype="float32", block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=96,
              batch_layout=layout, debug_checks=True, seed=3, **kw)
    rng = np.random.default_rng(11)
    prompts = [{"prompt_token_ids": rng.integers(3, 400, int(n)).tolist()} for n in (1, 5, 17, 40, 9, 33, 2, 60)]
    params = [_params()[i % 5] for i in range(len(prompts))]
    return llm, llm.generate(prompts, params, use_tqdm=False)


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        assert [o.token_ids for o in x.outputs] == [o.token_ids for o in y.outputs]
        for ox, oy in zip(x.outputs, y.outputs):
            np.testing.assert_allclose(ox.cumulative_logprob, oy.cumulative_logprob, rtol=1e-4, atol=1e-4)
            for dx, dy in zip(ox.logprobs or [], oy.logprobs or []):
                assert dx.keys() == dy.keys()
        for px, py in zip(x.prompt_logprobs or [], y.prompt_logprobs or []):
            if px is not None:
                assert px.keys() == py.keys()
                for t in px:
                    np.testing.assert_allclose(px[t].logprob, py[t].logprob, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pressure", [None, "recompute", "swap"])
def test_packed_and_padded_give_the_same_outputs(pressure):
    """Chunked prefill (a 32-token budget), every sampling option, n = 2 sharing blocks,
    prompt logprobs (a call of their own), and with a small pool preemption."""
    kw = {} if pressure is None else {"num_gpu_blocks": 26, "preemption_mode": pressure}
    llm, packed = _run("packed", **kw)
    _, padded = _run("padded", **kw)
    _same(packed, padded)
    if pressure is not None:
        assert llm.stats()["num_preemptions"] > 0
    assert set(llm.engine.runner.traces) <= {"step"}  # (programs another engine compiled are not counted)


def test_a_packed_step_is_one_model_call():
    """Decodes and new prompts' chunks in one call per step (prompt-logprob rows aside)."""
    llm = LLM(fake_backend(4), block_size=4, num_gpu_blocks=128, max_model_len=64, max_num_seqs=8,
              max_num_batched_tokens=32)
    runner = llm.engine.runner
    calls, per_step = [], []
    call = runner._call

    def counting(name, items, shape, statuses, prompt=False):
        calls.append((name, shape, sorted(len(w.tokens) for w in items)))
        return call(name, items, shape, statuses, prompt)

    runner._call = counting
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i in range(6):
        llm.add_request({"prompt_token_ids": rng.integers(1, VOCAB, 5 + 4 * i).tolist()}, params)
    mixed = False
    while llm.has_unfinished_requests():
        before = len(calls)
        llm.step()
        per_step.append(len(calls) - before)
        mixed |= any(1 in lens and max(lens) > 1 for _, _, lens in calls[before:])
    assert max(per_step) == 1 and mixed  # some step fed decodes and chunks in one call
    for name, (rows, width), lens in calls:
        assert name == "step" and sum(lens) <= width and len(lens) <= rows
    assert_drained(llm)


def test_batch_layout_is_validated_and_follows_the_kv_format():
    backend = fake_backend(4)
    assert LLM(backend, block_size=4, num_gpu_blocks=16).engine.runner.packed
    with pytest.raises(ValueError, match="batch_layout='sideways': unknown; choose one of"):
        LLM(backend, block_size=4, num_gpu_blocks=16, batch_layout="sideways")
    # per-channel scales are written a row's block at a time: padded by default, packed refused
    tiny = os.path.join(os.path.dirname(__file__), "fixtures", "llama")
    llm = LLM(tiny, block_size=8, num_gpu_blocks=16, kv_cache_dtype="int8_channel", max_model_len=64)
    assert not llm.engine.runner.packed
    with pytest.raises(ValueError, match="batch_layout='packed' cannot write kv_cache_dtype='int8_channel'"):
        LLM(tiny, block_size=8, num_gpu_blocks=16, kv_cache_dtype="int8_channel", batch_layout="packed")
