"""Sharing in the engine, over the fake model (``engine_fakes``): parallel sampling
(``n > 1``) forks the prompt, beam search selects parents every step, and both equal
their independent references, under memory pressure too, in both preemption modes.

The fake's logits are a function of every token a row holds, read back through the block
table, so a wrong fork, a lost copy-on-write or a beam rebuilt from the wrong parent
changes the output; and the arithmetic is identical however the tokens reached the cache,
so every "equal" below is exact. Engines run with ``debug_checks=True``: the block
manager's invariants, the device agreeing with the host, and the host view agreeing with
the device, after every step.
"""

import functools
import re

import jax.numpy as jnp
import numpy as np
import pytest
from engine_fakes import VOCAB, assert_drained, fake_backend

from paged_jax.engine import LLM, VICTIM_POLICIES, BeamSearchOutput, BeamSearchParams, SamplingParams

BS = 4
MAX_LEN = 48
SMALL = 30  # blocks: too few for everything below at once


def _llm(num_blocks=None, **kw):
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 32)
    return LLM(fake_backend(BS, eos_token_id=kw.pop("eos", None)), block_size=BS, num_gpu_blocks=num_blocks,
               max_model_len=MAX_LEN, debug_checks=True, **kw)


def _prompts(n, seed=0, lo=2, hi=20):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, rng.integers(lo, hi)).tolist() for _ in range(n)]


def _completions(outs):
    return [[c.token_ids for c in o.outputs] if not isinstance(o, BeamSearchOutput)
            else [(s.tokens, s.score) for s in o.sequences] for o in outs]


# ----------------------------------------------------------------------------- parallel sampling


@pytest.mark.slow
def test_parallel_sampling_forks_the_prompt_and_each_completion_has_its_own_stream():
    prompts = _prompts(4, seed=1)
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10)
    llm = _llm()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all([c.index for c in o.outputs] == [0, 1, 2, 3] for o in outs)
    streams = _completions(outs)
    assert all(len({tuple(t) for t in s}) > 1 for s in streams)  # completions differ
    # Completion 0's stream is the request's own: an n = 1 request draws the same tokens.
    alone = _llm().generate(prompts, SamplingParams(temperature=1.0, seed=7, max_tokens=10), use_tqdm=False)
    assert [s[0] for s in streams] == [o.outputs[0].token_ids for o in alone]
    # Reproducible; the prompt's blocks were shared while the completions ran.
    assert _completions(_llm().generate(prompts, params, use_tqdm=False)) == streams
    stats = llm.stats()
    assert stats["peak_blocks_unshared"] > stats["peak_blocks_used"]
    assert_drained(llm)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_parallel_sampling_is_unchanged_by_memory_pressure(mode):
    prompts = _prompts(6, seed=2)
    params = [SamplingParams(n=3, temperature=0.8, top_p=0.9, seed=i, max_tokens=14) for i in range(6)]
    roomy = _completions(_llm().generate(prompts, params, use_tqdm=False))
    llm = _llm(SMALL, preemption_mode=mode)
    assert _completions(llm.generate(prompts, params, use_tqdm=False)) == roomy
    assert llm.stats()["preemptions"][mode] > 0
    assert_drained(llm)


def test_a_one_token_prompt_opens_every_completion_at_once():
    outs = _llm().generate([[5]], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6), use_tqdm=False)
    alone = _llm().generate([[5]], SamplingParams(temperature=1.0, seed=3, max_tokens=6), use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone[0].outputs[0].token_ids and len(outs[0].outputs) == 3


@pytest.mark.parametrize("poison", ["source", "copy"])
@pytest.mark.filterwarnings("ignore:request 0. the model's logits are NaN")  # the poison, as intended
def test_copy_on_write_never_lets_a_sibling_read_the_other_block(poison):
    """Two completions share the prompt's partial last block; the first decode copies it
    for one of them. NaN written afterwards into one of the two blocks reaches the row
    that holds it (its output changes) and never its sibling (output unchanged)."""
    prompt = list(range(1, 7))  # 6 tokens, BS 4: block 1 is partial and shared by the fork
    partial = len(prompt) // BS
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8)
    reference = _completions(_llm().generate([prompt], params, use_tqdm=False))[0]
    llm = _llm()
    (group,) = llm.add_requests([prompt], params)
    llm.engine.step()  # prefill: the prompt's blocks, in the first completion's row
    source = int(llm.inspect().block_tables[group.seqs[0].slot, partial])
    while not all(s.row_live and s.num_computed > len(prompt) for s in group.seqs):
        llm.engine.step()
    tables = llm.inspect().block_tables
    rows = [tables[s.slot] for s in group.seqs]
    assert rows[0][0] == rows[1][0]  # the full prompt block stays shared
    blocks = [int(r[partial]) for r in rows]
    assert source in blocks and blocks[0] != blocks[1]  # one kept the source, one got the copy
    target = source if poison == "source" else sum(blocks) - source
    owner = blocks.index(target)
    runner = llm.engine.runner  # fault injection: poison one block's keys on the device
    runner.pages = type(runner.pages)(k=runner.pages.k.at[:, :, target].set(jnp.nan), v=runner.pages.v)
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.engine.flush()
    got = _completions(llm.outputs([group]))[0]
    assert got[1 - owner] == reference[1 - owner]  # the sibling never read the poisoned block
    assert got[owner] != reference[owner]  # the poison was where the owner reads
    assert_drained(llm)


# ----------------------------------------------------------------------------- beam search


def _fake_logprobs(tokens: list[int]) -> np.ndarray:
    """The fake model's next-token log-probabilities after ``tokens``, in NumPy."""
    idx = np.arange(len(tokens))
    feat = ((np.asarray(tokens, np.float32) + 1) * (np.cos(idx * 0.37) + 1.5)).sum() + len(tokens) * 0.1
    v = np.arange(VOCAB, dtype=np.float32)
    logits = np.sin(np.float32(feat) * (v + 1) * 0.0137 + 0.5 * v) * 4.0
    logits = logits.astype(np.float64)
    return (logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())).astype(np.float32)


def hf_beam_search(prompt, width, max_tokens, eos, length_penalty, early_stopping):
    """transformers' vectorised beam search (``_beam_search``), transcribed over NumPy with
    the full vocabulary: the oracle for the engine's top-K version."""
    k = max(2, 1 + len(eos)) * width
    neg = np.float32(-1e9)
    running = [list(prompt) for _ in range(width)]
    running_scores = np.full(width, neg, np.float32)
    running_scores[0] = 0
    finished = [list(prompt)] * width
    finished_scores = np.full(width, neg, np.float32)
    is_finished = np.zeros(width, bool)
    improvable = True
    for cur in range(max_tokens):
        lp = np.stack([_fake_logprobs(r) for r in running]) + running_scores[:, None]
        flat = lp.reshape(-1)
        order = np.argsort(-flat, kind="stable")[:k]
        top = flat[order]
        beams, toks = order // VOCAB, order % VOCAB
        cand = [running[b] + [int(t)] for b, t in zip(beams, toks, strict=True)]
        hits = np.array([t in eos or cur + 1 >= max_tokens for t in toks])
        alive = top + hits * neg
        nxt = np.argsort(-alive, kind="stable")[:width]
        new_running, new_scores = [cand[i] for i in nxt], alive[nxt]
        top_mask = np.arange(k) < width
        fin = top / np.float32((cur + 1) ** length_penalty)
        fin = fin + np.float32(neg) * (np.all(is_finished) and early_stopping is True)
        fin = fin + np.float32(neg) * (not improvable)
        fin = fin + np.float32(neg) * ~(hits & top_mask)
        merged = finished + cand
        merged_scores = np.concatenate([finished_scores, fin.astype(np.float32)])
        merged_flags = np.concatenate([is_finished, hits & top_mask])
        keep = np.argsort(-merged_scores, kind="stable")[:width]
        finished = [merged[i] for i in keep]
        finished_scores, is_finished = merged_scores[keep], merged_flags[keep]
        running, running_scores = new_running, new_scores
        length = cur + 1
        hypothetical = max_tokens if (early_stopping == "never" and length_penalty > 0) else length
        best = running_scores[0] / np.float32(hypothetical**length_penalty)
        worst = np.where(is_finished, finished_scores.min(), neg)
        improvable = improvable and bool(np.any(best > worst))
        if not (improvable and not (is_finished.all() and early_stopping is True) and not hits.all()):
            break
    return [(seq, float(score)) for seq, score in zip(finished, finished_scores, strict=True)]


CASES = [  # (width, eos, length_penalty, early_stopping)
    (1, (), 1.0, False), (2, (), 1.0, False), (4, (3, 11), 1.0, True), (4, (7,), 0.5, False),
    (8, (), 2.0, "never"), (3, (5,), 1.0, "never"),
]


@pytest.mark.parametrize("width,eos,lp,es", CASES)
def test_beam_search_equals_the_full_vocabulary_oracle(width, eos, lp, es):
    prompts = _prompts(3, seed=width)
    params = BeamSearchParams(beam_width=width, max_tokens=9, length_penalty=lp, early_stopping=es,
                              eos_token_id=list(eos) if eos else None, ignore_eos=not eos)
    outs = _llm().beam_search(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        want = hf_beam_search(prompt, width, 9, eos, lp, es)
        assert [s.tokens for s in out.sequences] == [w for w, _ in want]
        np.testing.assert_allclose([s.score for s in out.sequences], [s for _, s in want], rtol=1e-5)
        for s in out.sequences:
            n = len(s.tokens) - len(prompt)
            assert s.score == pytest.approx(s.cum_logprob / n**lp, rel=1e-5)
            assert s.finish_reason == ("stop" if eos and s.tokens[-1] in eos else "length")


def _widest_group(running):
    """A victim policy that preempts the request with the most members (beams first)."""
    return max(range(len(running)), key=lambda i: (running[i].num_seqs, running[i].admitted_at))


MIXED_PROMPTS = _prompts(6, seed=9)
MIXED_PARAMS = [
    BeamSearchParams(beam_width=4, max_tokens=10, ignore_eos=True),
    SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=12),
    SamplingParams(temperature=0, max_tokens=12),
    BeamSearchParams(beam_width=2, max_tokens=12, eos_token_id=[3, 4], early_stopping=True),
    SamplingParams(n=2, temperature=0.7, seed=2, max_tokens=9),
    SamplingParams(temperature=0, max_tokens=8),
]


@functools.cache
def _mixed_roomy():
    roomy = _llm().generate(MIXED_PROMPTS, MIXED_PARAMS, use_tqdm=False)
    assert isinstance(roomy[0], BeamSearchOutput) and len(roomy[0].sequences) == 4
    assert len(roomy[1].outputs) == 3 and len(roomy[5].outputs) == 1
    return _completions(roomy)


@pytest.mark.slow
@pytest.mark.parametrize("mode,victim", [
    ("recompute", "most_recently_admitted"), ("swap", "most_recently_admitted"), ("recompute", _widest_group),
], ids=["recompute-latest", "swap-latest", "recompute-widest"])
def test_beams_parallel_and_plain_requests_mixed_under_pressure(mode, victim):
    victims = []

    def spy(running):
        i = policy(running)
        victims.append(running[i].num_seqs)
        return i

    policy = victim if callable(victim) else VICTIM_POLICIES[victim]
    llm = _llm(22, preemption_mode=mode, victim_policy=spy)
    squeezed = llm.generate(MIXED_PROMPTS, MIXED_PARAMS, use_tqdm=False)
    assert _completions(squeezed) == _mixed_roomy()
    assert llm.stats()["preemptions"][mode] > 0
    if callable(victim):
        assert 4 in victims  # a beam search of width 4 was preempted (and resumed) whole
    assert_drained(llm)


@pytest.mark.slow
def test_without_sharing_every_fork_is_a_full_copy_and_outputs_are_unchanged():
    """``share_blocks=False`` (the baseline of the beam study): forks and beam selections
    copy every block, so physical blocks equal the unshared count at every step, and
    the outputs are those of the sharing engine, under pressure too."""
    llm = _llm(26, preemption_mode="swap", share_blocks=False)
    assert _completions(llm.generate(MIXED_PROMPTS, MIXED_PARAMS, use_tqdm=False)) == _mixed_roomy()
    assert llm.stats()["preemptions"]["swap"] > 0
    timeline = llm.engine.stats.timeline
    assert all(r.charged_blocks == r.unshared_blocks for r in timeline)
    assert max(r.unshared_blocks for r in timeline) > 0
    peaks = llm.stats()["request_peak_blocks"]
    assert len(peaks) == 4 and all(p["physical"] == p["unshared"] for p in peaks.values())
    assert_drained(llm)


def test_beam_search_saves_blocks_by_sharing():
    llm = _llm()
    llm.beam_search(_prompts(1, seed=4, lo=12, hi=18), BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True))
    s = llm.stats()
    assert s["peak_blocks_unshared"] > s["peak_blocks_used"] > 0
    assert 0 < s["mean_blocks_used"] < s["mean_blocks_unshared"]
    # The only request: its own peaks are the engine's.
    (request,) = s["request_peak_blocks"].values()
    assert request == {"physical": s["peak_blocks_allocated"], "unshared": s["peak_blocks_unshared"]}
    assert_drained(llm)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs,match", [
    (dict(beam_width=0), "beam_width=0"), (dict(beam_width=2, length_penalty=float("nan")), "length_penalty"),
    (dict(beam_width=2, early_stopping="sometimes"), "early_stopping"),
    (dict(beam_width=2, max_tokens=0), "max_tokens=0"), (dict(beam_width=2, eos_token_id=[]), "eos_token_id"),
])
def test_beam_search_params_name_the_bad_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kwargs)


@pytest.mark.slow
def test_requests_that_can_never_fit_are_refused_up_front():
    llm = _llm(SMALL, max_num_seqs=4)
    with pytest.raises(ValueError, match="beam_width=8 exceeds max_num_seqs=4"):
        llm.beam_search([[1, 2]], BeamSearchParams(beam_width=8, max_tokens=4))
    with pytest.raises(ValueError, match="n=5 exceeds max_num_seqs=4"):
        llm.generate([[1, 2]], SamplingParams(n=5))
    with pytest.raises(ValueError, match=r"n=0: must be an int >= 1"):
        SamplingParams(n=0)
    assert llm.stats()["steps"] == 0
    # More blocks than the pool (4 x 12 private > 30): rejected up front, the others complete.
    impossible = [BeamSearchParams(beam_width=4, max_tokens=46, ignore_eos=True), SamplingParams(n=4, max_tokens=46)]
    fine = [SamplingParams(max_tokens=5), BeamSearchParams(beam_width=2, max_tokens=5)]
    prompts = _prompts(4, seed=9, lo=2, hi=4)
    with pytest.warns(UserWarning) as warned:
        outs = llm.generate(prompts, [fine[0], impossible[0], impossible[1], fine[1]], use_tqdm=False)
    messages = [str(w.message) for w in warned]
    assert len(messages) == 2 and "request 2: n=4" in messages[1]
    assert re.match(r"request 1: beam_width=4 .* 48 blocks .* pool has 30: it can never fit", messages[0])
    assert outs[1].sequences == [] and "can never fit" in outs[1].rejected
    assert [c.finish_reason for c in outs[2].outputs] == ["rejected"] * 4 and outs[2].rejected
    assert all(c.token_ids == [] for c in outs[2].outputs)
    alone = _llm(SMALL, max_num_seqs=4).generate([prompts[0], prompts[3]], fine, use_tqdm=False)
    assert _completions([outs[0], outs[3]]) == _completions(alone) and outs[0].rejected is None
    assert_drained(llm)
