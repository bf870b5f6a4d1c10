"""The engine over a fake model (``engine_fakes``): scheduling, preemption, swap,
the static baseline, validation. The fake's outputs change if any KV is lost or
misplaced, and are bit-identical however the tokens reached the cache, so every
"outputs equal" assertion below is exact.

Every engine here runs with ``debug_checks=True``: after every step the block manager's
invariants hold, the device's live rows and lengths equal the scheduler's, and the host
swap pool's accounting is exact (conftest also checks after every cache op).
"""

import numpy as np
import pytest
from engine_fakes import VOCAB, assert_drained, fake_backend

from paged_jax.engine import LLM, SamplingParams

BS = 4
MAX_LEN = 48  # 12 blocks per sequence
# One small pool for every squeezed engine (shared shapes, fewer compiles): two static
# reservations; far too few blocks for four sequences of up to 41 tokens.
SMALL = 26
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _prompts(n=12, seed=0, lo=1, hi=36):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, rng.integers(lo, hi)).tolist() for _ in range(n)]


def _llm(num_blocks=None, **kw):
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_num_batched_tokens", 16)
    return LLM(fake_backend(BS, eos_token_id=kw.pop("eos", None)), block_size=BS, num_gpu_blocks=num_blocks,
               max_model_len=MAX_LEN, debug_checks=True, **kw)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference():
    """Unconstrained: room for every sequence at max_model_len, big prefill chunks."""
    llm = _llm(max_num_batched_tokens=64)
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert llm.stats()["num_preemptions"] == 0
    return _tokens(outs)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_identical_outputs(reference, mode):
    llm = _llm(num_blocks=SMALL, preemption_mode=mode)
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert _tokens(outs) == reference
    stats = llm.stats()
    assert stats["preemptions"][mode] > 0 and stats["num_preemptions"] == stats["preemptions"][mode]
    assert stats["peak_blocks_used"] <= SMALL
    if mode == "swap":
        assert stats["swap_outs"] == stats["swap_ins"] > 0 and stats["swap_fallbacks"] == 0
        assert stats["blocks_swapped_out"] == stats["blocks_swapped_in"] > 0
    assert_drained(llm)


@pytest.mark.slow
def test_swap_falls_back_to_recompute_when_the_host_pool_is_full(reference):
    llm = _llm(num_blocks=SMALL, preemption_mode="swap", swap_space_blocks=8)
    assert _tokens(llm.generate(_prompts(), GREEDY, use_tqdm=False)) == reference
    stats = llm.stats()
    assert stats["swap_fallbacks"] > 0 and stats["preemptions"]["recompute"] == stats["swap_fallbacks"]
    assert stats["preemptions"]["swap"] == stats["swap_outs"]
    assert_drained(llm)


def test_static_baseline_matches_and_is_limited_by_reservations(reference):
    llm = _llm(num_blocks=SMALL, kv_cache="static")  # 26 // 12 = 2 reservations
    assert _tokens(llm.generate(_prompts(), GREEDY, use_tqdm=False)) == reference
    stats = llm.stats()
    assert stats["peak_running_batch"] == 2 and stats["num_preemptions"] == 0
    assert stats["peak_blocks_used"] == 24  # reserved, not allocated
    assert stats["peak_blocks_allocated"] <= 24
    paged = _llm(num_blocks=SMALL)
    paged.generate(_prompts(), GREEDY, use_tqdm=False)
    assert paged.stats()["mean_running_batch"] > stats["mean_running_batch"]
    assert paged.stats()["kv_utilization"] > stats["kv_utilization"]
    # Reservations cap the static batch at 2 while requests wait: the saturated phase
    # runs (nearly) full, the drain does not, and the split accounts for every step and token.
    assert stats["saturated_steps"] > 0 and stats["drain_steps"] > 0
    assert stats["mean_running_batch"] < stats["saturated_mean_running_batch"] <= 2
    assert stats["saturated_steps"] + stats["drain_steps"] == stats["steps"]
    assert stats["saturated_generated_tokens"] + stats["drain_generated_tokens"] == stats["generated_tokens"]
    assert_drained(llm)


def test_swap_with_another_victim_policy(reference):
    llm = _llm(num_blocks=SMALL, preemption_mode="swap", victim_policy="fewest_blocks")
    assert _tokens(llm.generate(_prompts(), GREEDY, use_tqdm=False)) == reference
    assert llm.stats()["preemptions"]["swap"] > 0
    assert_drained(llm)


def test_custom_victim_function_sees_seq_infos(reference):
    seen = []

    def oldest(running):
        seen.append(running)
        return min(range(len(running)), key=lambda i: running[i].admitted_at)

    llm = _llm(num_blocks=SMALL, victim_policy=oldest)
    assert _tokens(llm.generate(_prompts(), GREEDY, use_tqdm=False)) == reference
    assert seen and all(info.num_blocks >= 1 and info.num_tokens >= info.num_computed for r in seen for info in r)
    assert_drained(llm)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=i, max_tokens=10) for i in range(8)]
    prompts = _prompts(8, seed=5)
    roomy = _tokens(_llm().generate(prompts, params, use_tqdm=False))
    squeezed = _llm(num_blocks=SMALL, preemption_mode="recompute")
    assert _tokens(squeezed.generate(prompts, params, use_tqdm=False)) == roomy
    assert squeezed.stats()["num_preemptions"] > 0
    # Alone, one request draws the same tokens as inside a batch.
    assert _tokens(_llm().generate([prompts[3]], params[3], use_tqdm=False))[0] == roomy[3]
    other = [SamplingParams(temperature=0.9, seed=100 + i, max_tokens=10) for i in range(8)]
    assert _tokens(_llm().generate(prompts, other, use_tqdm=False)) != roomy
    # Unseeded requests draw from (engine seed, request id): reproducible per engine.
    unseeded = SamplingParams(temperature=1.0, max_tokens=10)
    assert _tokens(_llm().generate(prompts, unseeded, use_tqdm=False)) == _tokens(
        _llm().generate(prompts, unseeded, use_tqdm=False)
    )


def test_stop_tokens_eos_and_length():
    prompt = _prompts(1, seed=1)[0]
    free_run = _llm().generate([prompt], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    toks = free_run.outputs[0].token_ids
    assert free_run.outputs[0].finish_reason == "length" and len(toks) == 10
    stop = toks[4]
    first = toks.index(stop)
    out = _llm().generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop]),
                          use_tqdm=False)[0].outputs[0]
    assert out.token_ids == toks[: first + 1] and out.finish_reason == "stop"
    eos_out = _llm(eos=stop).generate([prompt], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    assert eos_out[0].outputs[0].token_ids == toks[: first + 1]
    ignore = _llm(eos=stop).generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                                     use_tqdm=False)
    assert ignore[0].outputs[0].token_ids == toks
    # max_model_len caps the output: a 40-token prompt leaves room for 8.
    long = _llm().generate([list(range(40))], SamplingParams(temperature=0, max_tokens=100), use_tqdm=False)
    assert len(long[0].outputs[0].token_ids) == MAX_LEN - 40 and long[0].outputs[0].finish_reason == "length"


def test_outputs_shape_ids_order_and_logprobs(reference):
    llm = _llm()
    prompts = _prompts()
    outs = llm.generate([{"prompt_token_ids": p} if i % 2 else p for i, p in enumerate(prompts)], GREEDY,
                        use_tqdm=False)
    assert [o.request_id for o in outs] == [str(i) for i in range(len(prompts))]
    assert [o.prompt_token_ids for o in outs] == prompts and _tokens(outs) == reference
    assert all(o.finished and o.outputs[0].cumulative_logprob < 0 for o in outs)
    again = llm.generate(prompts[0], GREEDY, use_tqdm=False)  # a single prompt
    assert again[0].request_id == str(len(prompts)) and _tokens(again)[0] == reference[0]
    stats = llm.stats()
    assert 0 < stats["kv_utilization"] <= 1 and 1 <= stats["mean_running_batch"] <= stats["peak_running_batch"] <= 4
    assert stats["generated_tokens"] == sum(map(len, reference)) + len(reference[0]) and stats["tokens_per_s"] > 0
    # Bounded compiles: decode batches padded to 4, prefill batches to {1, 2, 4}, one
    # chunk width (16). Shapes an earlier engine compiled are not recounted.
    assert stats["compiles"] <= 4
    compiles = stats["compiles"]
    llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.stats()["compiles"] == compiles  # same shapes: nothing retraced


def test_bad_requests_are_rejected_before_anything_runs(reference):
    llm = _llm(num_blocks=SMALL)
    good = _prompts()
    with pytest.raises(ValueError, match=r"prompt 2 has 48 tokens.*max_model_len=48"):
        llm.generate(good[:2] + [list(range(48))] + good[2:], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        llm.generate([good[0], []], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=rf"prompt 0 has token ids outside \[0, {VOCAB}\)"):
        llm.generate([[VOCAB]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["hello"], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate([[1]], [GREEDY, GREEDY], use_tqdm=False)
    assert llm.stats()["steps"] == 0
    assert_drained(llm)
    # The engine is intact: the rest complete.
    assert _tokens(llm.generate(good, GREEDY, use_tqdm=False)) == reference


def test_bad_configurations_name_the_valid_choices():
    with pytest.raises(ValueError, match=r"preemption_mode='evict'.*\['recompute', 'swap'\]"):
        _llm(preemption_mode="evict")
    with pytest.raises(ValueError, match=r"kv_cache='dense'.*\['paged', 'static'\]"):
        _llm(kv_cache="dense")
    with pytest.raises(ValueError, match=r"allocation_policy='best_fit'.*fifo.*lifo"):
        _llm(allocation_policy="best_fit")
    with pytest.raises(ValueError, match=r"victim_policy='oldest'.*most_recently_admitted"):
        _llm(victim_policy="oldest")
    with pytest.raises(ValueError, match=r"max_model_len=48 needs 12 blocks of 4 tokens but the KV pool has 11"):
        _llm(num_blocks=11)
    with pytest.raises(ValueError, match="max_num_batched_tokens=2 must be >= max_num_seqs=4"):
        _llm(max_num_batched_tokens=2)


def test_kv_cache_memory_bytes_sizes_the_pool():
    probe = _llm()
    per_block = probe.config.cache.bytes_per_block  # fake: 1 layer x 1 head x 4 tokens x 1 x 2 (K, V) x 4 B
    assert per_block == 2 * BS * 4
    llm = LLM(fake_backend(BS), block_size=BS, kv_cache_memory_bytes=per_block * 20 + 5, max_model_len=MAX_LEN,
              max_num_seqs=4)
    assert llm.num_gpu_blocks == 20


@pytest.mark.slow
def test_admission_policies_order_the_waiting_queue_and_keep_the_outputs():
    """One row at a time, so admission order is the order requests run: "priority"
    admits lower priorities first (ties in arrival order), "shortest_prompt_first" the
    shortest prompts; FCFS keeps arrival order. The outputs are those of FCFS."""
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11, 12], [13, 14, 15]]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    def order(**kw):
        llm = _llm(max_num_seqs=1, **{k: v for k, v in kw.items() if k != "priority"})
        outs = llm.generate(prompts, params, use_tqdm=False, priority=kw.get("priority"))
        ran = sorted(range(len(outs)), key=lambda i: outs[i].metrics.first_token_time)
        assert_drained(llm)
        return ran, _tokens(outs)

    fcfs, want = order()
    assert fcfs == [0, 1, 2, 3]
    assert order(admission_policy="priority", priority=[2, 0, 1, 0]) == ([1, 3, 2, 0], want)
    assert order(admission_policy="shortest_prompt_first") == ([1, 3, 2, 0], want)
    with pytest.raises(ValueError, match="priority"):
        _llm().generate(prompts, params, use_tqdm=False, priority=[0, 1])
    with pytest.raises(ValueError, match="admission_policy='sjf'"):
        _llm(admission_policy="sjf")
