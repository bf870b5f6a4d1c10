"""Prefix caching end to end on the fake model (whose logits read every token a row's
table holds, so reusing the wrong block changes the output): outputs equal the cache-off
run under eviction and preemption, alone and mixed with parallel sampling and beam
search; salts isolate tenants; a forced hash collision is a miss; multi-turn reuse; bad
input. ``debug_checks`` runs the block manager's invariants and the index-vs-device check
(every cached block a row names holds that row's tokens) after every step."""

import numpy as np
import pytest
from engine_fakes import VOCAB, assert_drained, fake_backend

from paged_jax.cache import EVICTION_POLICIES, HashFunction
from paged_jax.engine import LLM, BeamSearchOutput, BeamSearchParams, Conversation, SamplingParams

BS = 4
MAX_LEN = 48
ROOMY = None  # 96 blocks: no pressure; the sizes of test_engine_sharing, so compiled shapes are shared
SMALL = 30  # blocks: eviction and preemption
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _llm(num_blocks, **kw):
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 32)
    return LLM(fake_backend(BS), block_size=BS, num_gpu_blocks=num_blocks, max_model_len=MAX_LEN,
               debug_checks=True, **kw)


def _shared_prefix_prompts(n, seed=0, system=13):
    """``n`` prompts behind one ``system``-token prefix, a few of them repeated."""
    rng = np.random.default_rng(seed)
    head = rng.integers(0, VOCAB, system).tolist()
    prompts = [head + rng.integers(0, VOCAB, int(rng.integers(1, 10))).tolist() for _ in range(n)]
    return prompts + prompts[:3]


def _completions(outs):
    return [[c.token_ids for c in o.outputs] if not isinstance(o, BeamSearchOutput)
            else [(s.tokens, s.score) for s in o.sequences] for o in outs]


PROMPTS = _shared_prefix_prompts(12)


@pytest.fixture(scope="module")
def cold():
    """The cache-off outputs, in a pool large enough for no pressure at all."""
    return _completions(_llm(ROOMY).generate(PROMPTS, GREEDY, use_tqdm=False))


CASES = [(p, SMALL, "recompute") for p in sorted(EVICTION_POLICIES)] + [("lru", ROOMY, "recompute"),
                                                                       ("lru", SMALL, "swap")]


@pytest.mark.slow
@pytest.mark.parametrize("policy,blocks,mode", CASES,
                         ids=[f"{p}-{'roomy' if b is ROOMY else 'evicting'}-{m}" for p, b, m in CASES])
def test_outputs_equal_the_cache_off_run(cold, policy, blocks, mode):
    llm = _llm(blocks, enable_prefix_caching=True, eviction_policy=policy, preemption_mode=mode)
    assert _completions(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == cold
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["prefix_cache_hit_rate"] == stats["prefix_cache_hit_tokens"] / stats["prefix_cache_query_tokens"]
    if blocks == SMALL:
        assert stats["prefix_cache_evictions"] > 0 and stats["num_preemptions"] > 0
    else:
        assert stats["prefix_cache_evictions"] == 0
    assert_drained(llm)


@pytest.mark.slow
def test_hits_skip_the_prefill_of_cached_blocks():
    """Sequential requests with one 13-token prefix: every request after the first
    computes only what follows the prefix's three full blocks."""
    llm = _llm(ROOMY, enable_prefix_caching=True, max_num_seqs=1)
    outs = llm.generate(PROMPTS[:6], GREEDY, use_tqdm=False)
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] == 5 * 12
    assert stats["prefill_tokens"] == sum(map(len, PROMPTS[:6])) - 5 * 12
    assert _completions(outs) == _completions(_llm(ROOMY).generate(PROMPTS[:6], GREEDY, use_tqdm=False))


@pytest.mark.slow
def test_generated_blocks_are_cached_so_a_conversation_reuses_its_history():
    llm = _llm(ROOMY, enable_prefix_caching=True)
    chat = Conversation(PROMPTS[0][:6])
    computed = []
    short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for turn in range(3):
        before = llm.stats()["prefill_tokens"]
        out = llm.generate([chat.prompt()], short, use_tqdm=False)[0]
        chat.add_answer(out.outputs[0].token_ids)
        chat.add_user(list(range(turn + 1, turn + 6)))
        computed.append(llm.stats()["prefill_tokens"] - before)
    # Turn n + 1 recomputes at most its new tokens plus the last, partly filled block of
    # the history (its last answer token was never fed: it is fed now).
    for turn, tokens in enumerate(computed[1:], start=1):
        assert tokens <= 5 + BS, (turn, computed)
    cold = _llm(ROOMY).generate([chat.prompt()], short, use_tqdm=False)
    warm = llm.generate([chat.prompt()], short, use_tqdm=False)
    assert _completions(warm) == _completions(cold)


@pytest.mark.slow
def test_parallel_sampling_and_beam_search_compose_with_the_cache():
    prompts = PROMPTS[:6]
    params = [SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=5, ignore_eos=True),
              BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True), GREEDY] * 2
    want = _completions(_llm(ROOMY).generate(prompts, params, use_tqdm=False))
    llm = _llm(SMALL, enable_prefix_caching=True)  # evicting and preempting
    assert _completions(llm.generate(prompts, params, use_tqdm=False)) == want
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] > 0 and stats["prefix_cache_evictions"] > 0
    assert_drained(llm)


@pytest.mark.slow
def test_eviction_never_touches_a_referenced_block():
    """Before each step that evicts: no evicted block is named by a row that the step
    keeps, nor by a row it opens on cached blocks (the device would refuse too)."""
    llm = _llm(SMALL, enable_prefix_caching=True)
    runner = llm.engine.runner  # a spy on the runner: what each step's plan evicts
    run, evicted = runner.run, []

    def spy(plan):
        tables = llm.inspect().block_tables
        gone = set(plan.release) | {r for rows in plan.swap_out for r in rows}
        kept = {int(b) for r in range(tables.shape[0]) if r not in gone for b in tables[r] if b >= 0}
        kept |= {b for row in plan.prefix for b in row}
        assert not kept & set(plan.evict)
        evicted.extend(plan.evict)
        return run(plan)

    runner.run = spy
    assert _completions(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == _completions(
        _llm(ROOMY).generate(PROMPTS, GREEDY, use_tqdm=False))
    assert evicted


def test_salts_isolate_tenants():
    prompt = PROMPTS[0]
    llm = _llm(ROOMY, enable_prefix_caching=True)
    llm.generate([{"prompt_token_ids": prompt, "cache_salt": "a"}], GREEDY, use_tqdm=False)
    for other in ({"prompt_token_ids": prompt, "cache_salt": "b"}, {"prompt_token_ids": prompt}):
        before = llm.stats()["prefix_cache_hit_tokens"]
        llm.generate([other], GREEDY, use_tqdm=False)
        assert llm.stats()["prefix_cache_hit_tokens"] == before  # no hit across salts
    salts = {e.salt for e in llm.engine.scheduler.prefix_cache.index.entries.values()}
    assert salts == {"a", "b", None}
    before = llm.stats()["prefix_cache_hit_tokens"]
    llm.generate([{"prompt_token_ids": prompt, "cache_salt": "b"}, prompt], GREEDY, use_tqdm=False)
    assert llm.stats()["prefix_cache_hit_tokens"] == before + 2 * ((len(prompt) - 1) // BS * BS)


def test_salted_requests_running_together_share_no_block():
    prompt = PROMPTS[1]
    llm = _llm(ROOMY, enable_prefix_caching=True)
    llm.generate([{"prompt_token_ids": prompt, "cache_salt": s} for s in "ab"], GREEDY, use_tqdm=False)
    llm.generate([{"prompt_token_ids": prompt, "cache_salt": s} for s in "ab"], SamplingParams(max_tokens=1),
                 use_tqdm=False)
    index = llm.engine.scheduler.prefix_cache.index
    blocks = {s: {b for b, e in index.entries.items() if e.salt == s} for s in "ab"}
    assert blocks["a"] and blocks["b"] and not blocks["a"] & blocks["b"]


@pytest.mark.parametrize("resistant", [False, True], ids=["checked-parent", "trusted"])
def test_a_forced_hash_collision_is_a_miss(resistant):
    """Every key is the same: hits can only come from the token, salt and (for a hash
    that is not collision-resistant) parent-block checks, and outputs stay correct."""
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, VOCAB, (2, 9)).tolist()
    prompts = [a, b, a[:4] + b[4:], b[:4] + a[4:], a, b]
    constant = HashFunction("constant", lambda parent, salt, tokens: 0, resistant)
    want = _completions(_llm(ROOMY).generate(prompts, GREEDY, use_tqdm=False))
    llm = _llm(ROOMY, enable_prefix_caching=True, prefix_cache_hash=constant, max_num_seqs=1)
    assert _completions(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
    assert llm.stats()["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(eviction_policy="mru"), "eviction_policy='mru': unknown; choose one of"),
    (dict(prefix_cache_hash="md5"), "prefix_cache_hash='md5': unknown; choose one of"),
    (dict(kv_cache="static"), "needs kv_cache='paged'"),
    (dict(share_blocks=False), "cannot run with share_blocks=False"),
    (dict(enable_prefix_caching=1), "must be True or False"),
])
def test_bad_settings_are_refused(kwargs, match):
    kwargs = {"enable_prefix_caching": True, **kwargs}
    with pytest.raises(ValueError, match=match):
        _llm(SMALL, **kwargs)


def test_a_salt_that_is_not_a_string_is_refused_and_nothing_is_queued():
    llm = _llm(SMALL, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="prompt 1: cache_salt=3 must be a string"):
        llm.generate([[1, 2, 3], {"prompt_token_ids": [1, 2], "cache_salt": 3}], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()
