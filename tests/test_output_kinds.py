"""``SamplingParams.output_kind`` (vLLM's ``RequestOutputKind``): ``LLM.step()`` reporting
whole outputs every step, deltas, or final outputs only. The three runs of the same requests
(same seeds) in one engine must agree: the deltas of a request concatenated
(``OutputAccumulator``) are its cumulative output, token for token, character for character
and logprob for logprob, through ``n`` > 1, stop strings, logprobs, prompt logprobs, sampling
and preemption; a delta holds only what is new; FINAL_ONLY reports each request once."""

import dataclasses
import os

import pytest

from paged_jax import LLM, RequestOutputKind, SamplingParams
from paged_jax.engine.outputs import OutputAccumulator, merge_deltas

TEXT = os.path.join(os.path.dirname(__file__), "fixtures", "llama_text")
PROMPTS = ["The river ran", "Once upon a time the", "She opened the door and", "A"]


@pytest.fixture(scope="module")
def llm():
    # A small pool: four requests of up to 40 tokens preempt each other.
    return LLM(TEXT, block_size=8, num_gpu_blocks=14, max_num_seqs=4, max_model_len=96, max_num_batched_tokens=32)


def _run(llm, params: list[SamplingParams], kind: RequestOutputKind, tag: str) -> tuple[dict, int]:
    """Add every prompt with ``params`` at ``kind``, step to the end: request index -> the
    outputs step() reported for it, and the number of steps."""
    ids = {llm.add_request(p, dataclasses.replace(sp, output_kind=kind), request_id=f"{tag}-{i}"): i
           for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True))}
    got: dict[int, list] = {i: [] for i in ids.values()}
    steps = 0
    while llm.has_unfinished_requests():
        for out in llm.step():
            got[ids[out.request_id]].append(out)
        steps += 1
    for out in llm.step():  # nothing is left to report
        got[ids[out.request_id]].append(out)
    return got, steps


def _whole(out) -> list:
    return [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason,
             c.cumulative_logprob, None if c.logprobs is None else [
                 {t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in d.items()} for d in c.logprobs])
            for c in out.outputs]


CASES = {
    "greedy": dict(temperature=0, max_tokens=24, ignore_eos=True),
    "n3_sampled_logprobs": dict(temperature=0.9, seed=7, n=3, max_tokens=20, logprobs=2, ignore_eos=True),
    "stop_strings": dict(temperature=0.8, seed=3, max_tokens=40, stop=["th", "ing", " wa"], prompt_logprobs=1),
    "uneven_lengths": None,  # max_tokens differs per request
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_deltas_concatenate_to_the_cumulative_output(llm, case):
    kw = CASES[case]
    params = ([SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 9, 33, 17)] if kw is None
              else [SamplingParams(**kw)] * len(PROMPTS))
    whole, steps = _run(llm, params, RequestOutputKind.CUMULATIVE, f"c-{case}")
    deltas, delta_steps = _run(llm, params, RequestOutputKind.DELTA, f"d-{case}")
    final, _ = _run(llm, params, RequestOutputKind.FINAL_ONLY, f"f-{case}")
    assert steps == delta_steps
    if case == "stop_strings":
        assert any(c.finish_reason == "stop" for o in whole.values() for c in o[-1].outputs)
    for i in range(len(PROMPTS)):
        want = whole[i][-1]
        assert want.finished and [o.finished for o in whole[i]] == [False] * (len(whole[i]) - 1) + [True]
        # FINAL_ONLY: one output, the whole one
        assert len(final[i]) == 1 and final[i][0].finished and _whole(final[i][0]) == _whole(want)
        ds = deltas[i]
        assert ds[-1].finished and not any(d.finished for d in ds[:-1])
        assert ds[0].prompt_token_ids == want.prompt_token_ids and ds[0].prompt == want.prompt
        assert ds[0].prompt_logprobs == want.prompt_logprobs
        assert all(d.prompt_token_ids is None and d.prompt_logprobs is None for d in ds[1:])
        acc = OutputAccumulator()
        seen = {}
        for d in ds:
            assert d.outputs or d is ds[0] or d.finished, "a delta with no news"
            for c in d.outputs:
                assert c.token_ids or c.text or c.finish_reason, "an empty completion in a delta"
                n_before = seen.get(c.index, 0)
                assert c.logprobs is None or len(c.logprobs) == len(c.token_ids)
                seen[c.index] = n_before + len(c.token_ids)
            acc.add(d)
        got = acc.output()
        assert _whole(got) == _whole(want)
        assert got.prompt_token_ids == want.prompt_token_ids and got.finished
        # any two consecutive deltas merge into one that says both
        if len(ds) >= 3:
            acc2 = OutputAccumulator()
            acc2.add(ds[0])
            acc2.add(merge_deltas(ds[1], ds[2]))
            for d in ds[3:]:
                acc2.add(d)
            assert _whole(acc2.output()) == _whole(want)


def test_a_delta_is_what_one_step_added(llm):
    """Each greedy step adds one token per running completion: every delta after the first
    token carries exactly one (O(1) per step, not the whole output again), preempted or not."""
    llm.reset_stats()
    out, _ = _run(llm, [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * len(PROMPTS),
                  RequestOutputKind.DELTA, "one")
    for ds in out.values():
        sizes = [len(c.token_ids) for d in ds for c in d.outputs]
        assert sum(sizes) == 30 and set(sizes) <= {0, 1}
    assert llm.stats()["num_preemptions"] > 0


def test_aborted_delta_request_reports_its_finish(llm):
    rid = llm.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                     output_kind=RequestOutputKind.DELTA), request_id="ab")
    outs = [o for _ in range(4) for o in llm.step()]
    llm.abort(rid)
    while llm.has_unfinished_requests():
        outs += llm.step()
    outs += llm.step()
    assert outs[-1].finished and outs[-1].outputs[-1].finish_reason == "abort"
    assert sum(len(c.token_ids) for o in outs for c in o.outputs) == len(
        [t for o in outs for c in o.outputs for t in c.token_ids])


def test_output_kind_validated_and_generate_returns_whole_outputs(llm):
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=5)
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=True)
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = llm.generate(PROMPTS, sp, use_tqdm=False)
    for kind in RequestOutputKind:
        got = llm.generate(PROMPTS, dataclasses.replace(sp, output_kind=kind), use_tqdm=False)
        assert [_whole(o) for o in got] == [_whole(o) for o in want]


def test_whole_outputs_decode_each_logprob_entry_once(llm, monkeypatch):
    """CUMULATIVE reports every step's whole output; its logprob entries' text is decoded
    once per entry (kept on the sequence), not once per entry per step."""
    from paged_jax.engine import outputs

    decoded = []
    real = outputs.with_decoded_tokens
    monkeypatch.setattr(outputs, "with_decoded_tokens", lambda lps, tok: (decoded.append(len(lps or ())), real(lps, tok))[1])
    got, _ = _run(llm, [SamplingParams(temperature=0, max_tokens=20, logprobs=3, ignore_eos=True)] * len(PROMPTS),
                  RequestOutputKind.CUMULATIVE, "once")
    assert all(len(o[-1].outputs[0].logprobs) == 20 for o in got.values())
    assert sum(decoded) == 20 * len(PROMPTS)
