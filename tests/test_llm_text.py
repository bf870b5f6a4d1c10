"""Text in and out through ``LLM``: the checkpoint's tokenizer, stop strings, chat, a vLLM
script unchanged, and the engine left clean by an interrupted call."""

import os

import jax
import numpy as np
import pytest
from engine_fakes import assert_drained, fake_backend

from paged_jax import LLM, SamplingParams

TEXT = os.path.join(os.path.dirname(__file__), "fixtures", "llama_text")
LLAMA = os.path.join(os.path.dirname(__file__), "fixtures", "llama")
KW = dict(block_size=8, num_gpu_blocks=48, max_num_seqs=4, max_model_len=96, max_num_batched_tokens=64)
PROMPTS = ["The little lighthouse on the hill", "A cache is a small, fast memory", "Café au lait, s'il vous plaît"]


@pytest.fixture(scope="module")
def llm():
    return LLM(TEXT, **KW)


def test_checkpoint_defaults(llm):
    tok = llm.get_tokenizer()
    assert tok is not None and len(tok) <= llm.backend.vocab_size
    # config.json's <|end_of_text|>, generation_config.json's and the tokenizer's <|eot_id|>
    assert set(llm.eos_token_ids) == {396, 397}
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p) == (0.6, 0.9)
    # bf16 weights (the stacked layers' held as their uint16 bits: model.llama.pack_params)
    # where the CPU has bf16 dots; float32 where it has none (dtypes.auto_compute_dtype)
    from paged_jax.dtypes import cpu_has_bf16

    bf16 = jax.default_backend() != "cpu" or cpu_has_bf16()
    want = {"bfloat16", "uint16"} if bf16 else {"float32"}
    assert {str(leaf.dtype) for leaf in jax.tree.leaves(llm.backend.params)} == want
    assert llm.config.model.architecture.dtype == ("bfloat16" if bf16 else "float32")


def test_text_prompts_and_text_outputs(llm):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    by_ids = llm.generate([tok.encode(p) for p in PROMPTS], params, use_tqdm=False)
    for prompt, out, ids_out in zip(PROMPTS, outs, by_ids, strict=True):
        assert out.prompt == prompt and ids_out.prompt is None
        assert out.prompt_token_ids == tok.encode(prompt) and out.prompt_token_ids[0] == tok.bos_token_id
        c = out.outputs[0]
        assert c.token_ids == ids_out.outputs[0].token_ids
        # text = the completion decoded in the prompt's context (byte-level BPE: alone)
        assert c.text == tok.decode(c.token_ids) == ids_out.outputs[0].text
        assert out.metrics.arrival_time <= out.metrics.first_token_time <= out.metrics.finished_time
    dict_prompt = llm.generate({"prompt": PROMPTS[0]}, params, use_tqdm=False)[0]
    assert dict_prompt.outputs[0].token_ids == outs[0].outputs[0].token_ids


def _stop_case(llm):
    """A greedy completion and a stop string taken from the middle of its text."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for prompt in PROMPTS:
        c = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        text = c.text
        for start in range(2, len(text) - 4):
            stop = text[start:start + 3]
            if text.find(stop) == start and stop.strip():
                return prompt, params, c, stop, start
    pytest.fail("no completion with a usable stop string")


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings(llm, include):
    prompt, params, full, stop, start = _stop_case(llm)
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop, "never seen"],
                       include_stop_str_in_output=include)
    c = llm.generate(prompt, p, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full.text[: start + (len(stop) if include else 0)]
    # the tokens up to the one that completed the stop string are kept
    assert c.token_ids == full.token_ids[: len(c.token_ids)] and len(c.token_ids) < len(full.token_ids)
    assert full.text.startswith(llm.get_tokenizer().decode(c.token_ids)[: start])


def test_min_tokens_defers_stop_strings(llm):
    prompt, params, full, stop, start = _stop_case(llm)
    n = len(full.token_ids)
    c = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, stop=[stop],
                                            min_tokens=n), use_tqdm=False)[0].outputs[0]
    assert c.token_ids == full.token_ids and c.finish_reason == "length"


def test_chat(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True)
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert out.prompt == rendered
    assert out.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    assert out.prompt_token_ids.count(tok.bos_token_id) == 1  # the template's, not a second one
    two = llm.chat([messages, messages[1:]], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert two[0].outputs[0].token_ids == out.outputs[0].token_ids
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "no role"}], use_tqdm=False)


def test_a_vllm_script_runs_unchanged(llm):
    prompts = ["Hello, my name is", "The capital of France is", "The future of AI is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, stop=["\n\n"], logprobs=5)
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        c = output.outputs[0]
        assert isinstance(output.prompt, str) and isinstance(c.text, str)
        assert "\n\n" not in c.text
        assert len(c.logprobs) == len(c.token_ids)
        for token, entry in zip(c.token_ids, c.logprobs, strict=True):
            assert token in entry and len(entry) in (5, 6)
            assert all(isinstance(lp.decoded_token, str) for lp in entry.values())


def test_text_prompt_without_a_tokenizer_is_a_clear_error():
    llm = LLM(LLAMA, block_size=8, num_gpu_blocks=16, max_num_seqs=2)
    assert llm.get_tokenizer() is None
    with pytest.raises(ValueError, match="prompt 0 is text but this model has no tokenizer"):
        llm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}])
    skipped = LLM(TEXT, skip_tokenizer_init=True, **KW)
    assert skipped.get_tokenizer() is None


def test_a_tokenizer_larger_than_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="the tokenizer has 400 ids but the model's vocabulary is 256"):
        LLM(LLAMA, tokenizer=TEXT, num_gpu_blocks=16)


# ---------------------------------------------------------------- interrupted calls


class _Interrupt(KeyboardInterrupt):
    pass


@pytest.mark.parametrize("where", ["before_run", "after_run", "after_postprocess"])
def test_an_interrupted_generate_leaves_the_engine_clean(where):
    """Ctrl-C at three points of a step: the call's requests are aborted, no block is
    held, invariants hold, and the next call gives what a fresh engine gives."""
    kw = dict(block_size=4, num_gpu_blocks=24, max_model_len=48, max_num_seqs=4, debug_checks=True)
    prompts = [[1 + i, 2, 3, 4, 5][: 2 + i] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(fake_backend(4), **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(fake_backend(4), **kw)
    engine, calls = llm.engine, {"n": 0}
    run, postprocess = engine.runner.run, engine.postprocess

    def interrupt_run(plan):
        calls["n"] += 1
        if calls["n"] == 4 and where == "before_run":
            raise _Interrupt
        out = run(plan)
        if calls["n"] == 4 and where == "after_run":
            raise _Interrupt
        return out

    def interrupt_postprocess(step, result):
        out = postprocess(step, result)
        if calls["n"] == 4 and where == "after_postprocess":
            raise _Interrupt
        return out

    engine.runner.run, engine.postprocess = interrupt_run, interrupt_postprocess
    groups = llm.add_requests(prompts, params)
    with pytest.raises(_Interrupt):
        llm.generate([], params, use_tqdm=False)
    assert all(s.finish_reason.value == "abort" for g in groups for s in g.seqs)
    assert not llm.engine.has_unfinished()
    assert llm.inspect().num_available == llm.num_gpu_blocks  # inspect() checks the invariants
    engine.runner.run, llm.engine.postprocess = run, postprocess
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert_drained(llm)


def test_abort_between_steps():
    llm = LLM(fake_backend(4), block_size=4, num_gpu_blocks=24, max_model_len=48, max_num_seqs=4, debug_checks=True)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [3, 3]]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    ids = [llm.add_request(p, params) for p in prompts]
    outs = {}
    for _ in range(3):
        for o in llm.step():
            outs[o.request_id] = o
    llm.abort([ids[1], ids[3]])
    while llm.has_unfinished_requests():
        for o in llm.step():
            outs[o.request_id] = o
    done = {rid: outs[rid] for rid in ids}
    assert done[ids[0]].outputs[0].token_ids == want[0] and done[ids[2]].outputs[0].token_ids == want[2]
    for rid, w in ((ids[1], want[1]), (ids[3], want[3])):
        c = done[rid].outputs[0]
        assert c.finish_reason == "abort" and c.token_ids == w[: len(c.token_ids)] and len(c.token_ids) < len(w)
    assert_drained(llm)
    with pytest.raises(ValueError, match="unknown request"):
        llm.abort(["nope"])
    assert np.all(llm.inspect().seq_lens == 0)


def test_aborting_the_last_request_returns_its_blocks_at_the_next_step():
    """A server aborts a disconnected client's request; with nothing else running, the
    next ``step()`` releases its rows (no request needed to trigger it), and ``usage()``
    reads the same counts as ``inspect()`` without a device sync."""
    llm = LLM(fake_backend(4), block_size=4, num_gpu_blocks=24, max_model_len=48, max_num_seqs=4, debug_checks=True)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    rid = llm.add_request([1, 2, 3, 4, 5], params)
    llm.step()
    llm.step()
    u = llm.usage()
    assert (u.running, u.waiting, u.num_blocks) == (1, 0, 24) and u.blocks_used == llm.inspect().num_used == 2
    llm.abort(rid)
    assert llm.usage().running == 0 and llm.inspect().num_used == 2  # released at the next step
    (out,) = llm.step()
    assert out.request_id == rid and out.outputs[0].finish_reason == "abort" and out.finished
    assert llm.usage().blocks_used == 0 and llm.step() == []
    assert_drained(llm)
