"""Engine parts that need no model: sampling, the host swap pool, victim policies,
cache accounting, sequences, buckets."""

import dataclasses

import numpy as np
import pytest

from paged_jax.buckets import bucket
from paged_jax.engine import SamplingParams, SeqInfo, sample
from paged_jax.engine.accounting import PagedAccounting, StaticAccounting
from paged_jax.engine.sampling import seed_for
from paged_jax.engine.sequence import Sequence
from paged_jax.engine.swap import HostSwapPool, SwapPoolFullError
from paged_jax.engine.victim import (
    VICTIM_POLICIES,
    fewest_blocks,
    get_victim_policy,
    most_blocks,
    most_recently_admitted,
)

V = 32


def _logits(b, seed=0):
    return np.random.default_rng(seed).normal(size=(b, V)).astype(np.float32) * 2


def _run(logits, temperature, top_k=-1, top_p=1.0, seeds=0, steps=0, greedy_only=False):
    b = logits.shape[0]

    def col(x, dtype):
        return np.broadcast_to(np.asarray(x, dtype), (b,)).copy()

    tok, lp = sample(
        logits, col(temperature, np.float32), col(top_k, np.int32), col(top_p, np.float32),
        col(seeds, np.uint32), col(steps, np.int32), greedy_only=greedy_only,
    )
    return np.asarray(tok), np.asarray(lp)


# ----------------------------------------------------------------------------- SamplingParams


def test_sampling_params_defaults_and_freeze():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.n) == (16, 1.0, 1.0, -1, None, 1)
    p = SamplingParams(stop_token_ids=[3, 4])
    assert p.stop_token_ids == (3, 4) and hash(p) == hash(SamplingParams(stop_token_ids=(3, 4)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_tokens = 3


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(seed=1.5), "seed"),
        (dict(stop_token_ids=(-1,)), "stop_token_ids"),
        (dict(n=0), "n="),
    ],
)
def test_sampling_params_validation(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


def test_parallel_sampling_params_and_completion_seeds():
    assert SamplingParams(n=3).n == 3
    from paged_jax.engine.sampling import completion_seed

    assert completion_seed(1234, 0) == 1234  # completion 0 draws the request's own stream
    seeds = {completion_seed(1234, i) for i in range(8)}
    assert len(seeds) == 8 and all(0 <= x < 2**32 for x in seeds)
    assert completion_seed(1234, 3) == completion_seed(1234, 3) != completion_seed(1235, 3)


def test_greedy_is_argmax_with_raw_logprob():
    logits = _logits(4)
    for greedy_only in (False, True):
        tok, lp = _run(logits, 0.0, greedy_only=greedy_only)
        np.testing.assert_array_equal(tok, logits.argmax(-1))
        ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        np.testing.assert_allclose(lp, ref[np.arange(4), tok], rtol=1e-5)


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = _logits(8, seed=1)
    for steps in range(5):
        np.testing.assert_array_equal(_run(logits, 1.0, top_k=1, steps=steps)[0], logits.argmax(-1))
        np.testing.assert_array_equal(_run(logits, 1.0, top_p=1e-6, steps=steps)[0], logits.argmax(-1))


def test_samples_stay_in_top_k_and_follow_the_distribution():
    logits = np.tile(_logits(1, seed=2), (4096, 1))
    tok, _ = _run(logits, 1.0, top_k=5, seeds=np.arange(4096))
    top5 = set(np.argsort(-logits[0])[:5].tolist())
    assert set(tok.tolist()) <= top5 and len(set(tok.tolist())) == 5
    # Full distribution: empirical frequencies match softmax within sampling noise.
    tok, _ = _run(logits, 1.0, seeds=np.arange(4096))
    p = np.exp(logits[0] - logits[0].max())
    p /= p.sum()
    freq = np.bincount(tok, minlength=V) / 4096
    assert np.abs(freq - p).max() < 4 * np.sqrt(p.max() / 4096) + 1e-3


def test_top_p_keeps_the_nucleus():
    row = np.log(np.array([0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4), np.float32))
    tok, _ = _run(np.tile(row, (2000, 1)), 1.0, top_p=0.7, seeds=np.arange(2000))
    assert set(tok.tolist()) == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7


def test_a_rows_sample_depends_only_on_its_seed_and_step():
    logits = _logits(8, seed=3)
    seeds = np.arange(100, 108)
    steps = np.arange(8) * 3
    tok, _ = _run(logits, 0.9, seeds=seeds, steps=steps)
    again, _ = _run(logits, 0.9, seeds=seeds, steps=steps)
    np.testing.assert_array_equal(tok, again)
    # Reorder the batch, change its size and its neighbours: each row keeps its token.
    perm = np.array([5, 2, 7, 0])
    other = _logits(4, seed=9)
    mixed = np.concatenate([logits[perm], other])
    tok2, _ = _run(mixed, 0.9, seeds=np.concatenate([seeds[perm], [1, 2, 3, 4]]),
                   steps=np.concatenate([steps[perm], [0, 0, 0, 0]]))
    np.testing.assert_array_equal(tok2[:4], tok[perm])
    # A different step changes the draw for at least one row.
    tok3, _ = _run(logits, 0.9, seeds=seeds, steps=steps + 1)
    assert (tok3 != tok).any()


def test_derived_seeds_differ_per_request_and_engine():
    assert seed_for(0, "1", None) != seed_for(0, "2", None)
    assert seed_for(0, "1", None) != seed_for(1, "1", None)
    assert seed_for(0, "1", 7) == seed_for(5, "9", 7) == 7


# ----------------------------------------------------------------------------- host swap pool


def _pool(capacity):
    return HostSwapPool(capacity, [((2, 3), np.float32), ((4,), np.int32)], treedef=None)


def test_swap_pool_round_trip_and_free_list():
    pool = _pool(5)
    a = [np.arange(12, dtype=np.float32).reshape(2, 2, 3), np.arange(8, dtype=np.int32).reshape(2, 4)]
    ids = pool.store(a)
    assert len(ids) == 2 and pool.num_free == 3
    b = [np.ones((3, 2, 3), np.float32), np.ones((3, 4), np.int32)]
    ids_b = pool.store(b)
    assert not pool.can_store(1)
    with pytest.raises(SwapPoolFullError, match="1 blocks wanted, 0 free of 5"):
        pool.store([x[:1] for x in a])
    for got, want in zip(pool.load(ids), a, strict=True):
        np.testing.assert_array_equal(got, want)
    pool.check([ids, ids_b])
    pool.free(ids)
    assert pool.num_free == 2
    pool.check([ids_b])
    with pytest.raises(ValueError, match="not held"):
        pool.free(ids)
    with pytest.raises(AssertionError, match="inconsistent"):
        pool.check([ids_b, ids])


def test_zero_capacity_pool_stores_nothing():
    pool = _pool(0)
    assert not pool.can_store(1) and pool.can_store(0) and pool.reserve(0) == []


# ----------------------------------------------------------------------------- victims


def _info(admitted, blocks, rid="r"):
    return SeqInfo(rid, 0, admitted, 10, 10, blocks, 0)


def test_victim_policies_are_pure_and_pick_as_documented():
    running = [_info(3, 5), _info(7, 1), _info(5, 9)]
    assert most_recently_admitted(running) == 1
    assert fewest_blocks(running) == 1
    assert most_blocks(running) == 2
    assert most_recently_admitted(running) == 1  # no hidden state
    assert get_victim_policy("fewest_blocks") is fewest_blocks
    custom = lambda running: 0  # noqa: E731
    assert get_victim_policy(custom) is custom


def test_unknown_victim_policy_lists_the_valid_ones():
    with pytest.raises(ValueError) as e:
        get_victim_policy("oldest")
    for name in VICTIM_POLICIES:
        assert name in str(e.value)


# ----------------------------------------------------------------------------- accounting


def test_paged_admission_keeps_the_watermark_unless_alone():
    acc = PagedAccounting(num_blocks=100, block_size=16, watermark=0.05)  # 5 blocks kept
    assert acc.can_admit(10, free_blocks=15, others_running=True)
    assert not acc.can_admit(11, free_blocks=15, others_running=True)
    assert acc.can_admit(15, free_blocks=15, others_running=False)
    assert acc.charged_blocks(42) == 42 and acc.may_preempt


def test_static_admission_is_by_reservation():
    acc = StaticAccounting(num_blocks=20, block_size=4, max_model_len=30)  # 8 blocks each
    assert acc.max_concurrent == 2
    assert not acc.can_admit(2, free_blocks=20, others_running=False, num_seqs=3)  # a request of 3 cannot fit
    for _ in range(2):
        assert acc.can_admit(2, free_blocks=20, others_running=True)
        acc.on_admit()
    assert not acc.can_admit(1, free_blocks=20, others_running=True)
    assert acc.charged_blocks(3) == 16 and not acc.may_preempt
    acc.on_release()
    assert acc.can_admit(2, free_blocks=20, others_running=True)
    with pytest.raises(ValueError, match="reserves 8 blocks"):
        StaticAccounting(num_blocks=7, block_size=4, max_model_len=30)


# ----------------------------------------------------------------------------- sequence, buckets


def test_pending_tokens_span_prompt_and_output():
    s = Sequence("0", 0, (1, 2, 3), SamplingParams(), seed=0, max_tokens=4)
    s.output_token_ids += [7, 8]
    assert s.num_tokens == 5 and s.num_pending == 5
    assert s.pending_token_ids(4) == [1, 2, 3, 7]
    s.num_computed = 2
    assert s.pending_token_ids(3) == [3, 7, 8]
    s.num_computed = 4
    assert s.pending_token_ids(1) == [8] and s.num_pending == 1


def test_bucket_is_a_capped_power_of_two():
    assert [bucket(n, cap=8) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert bucket(5, cap=6) == 6 and bucket(1, cap=64, lo=16) == 16 and bucket(17, cap=64, lo=16) == 32


# ----------------------------------------------------------------------------- stats


def test_stats_split_the_run_at_the_last_waiting_step():
    """Saturated = up to the last step that ended with a request waiting; its tokens/s
    leave compile time out; the drain is the rest."""
    from paged_jax.engine.stats import EngineStats

    stats = EngineStats(block_size=4, num_blocks=8)
    # (batch, generated, seconds, waiting, compile seconds)
    steps = [(2, 2, 3.0, 3, 2.0), (4, 4, 1.0, 1, 0.0), (4, 4, 1.0, 0, 0.0), (4, 4, 1.0, 2, 0.0),
             (2, 2, 0.5, 0, 0.0), (1, 1, 0.5, 0, 0.0)]
    for batch, generated, seconds, waiting, compile_s in steps:
        stats.record_step(batch=batch, generated=generated, prefilled=0, tokens_held=batch * 4,
                          allocated_blocks=batch, charged_blocks=batch, seconds=seconds,
                          waiting=waiting, compile_seconds=compile_s)
    s = stats.summary()
    assert (s["saturated_steps"], s["drain_steps"]) == (4, 2)
    assert s["saturated_seconds"] == pytest.approx(6.0) and s["drain_seconds"] == pytest.approx(1.0)
    assert s["saturated_generated_tokens"] == 14 and s["drain_generated_tokens"] == 3
    assert s["saturated_tokens_per_s"] == pytest.approx(14 / 4.0)  # 2 s of compile left out
    assert s["drain_tokens_per_s"] == pytest.approx(3.0)
    assert s["saturated_mean_running_batch"] == pytest.approx(3.5)
    assert stats.timeline[0].waiting == 3 and stats.timeline[0].compile_seconds == 2.0


def test_stats_with_nothing_ever_waiting_is_all_drain():
    from paged_jax.engine.stats import EngineStats

    stats = EngineStats(block_size=4, num_blocks=8)
    assert stats.summary()["saturated_steps"] == 0 and stats.summary()["drain_tokens_per_s"] == 0.0
    stats.record_step(batch=1, generated=1, prefilled=0, tokens_held=1, allocated_blocks=1, charged_blocks=1,
                      seconds=0.5)
    s = stats.summary()
    assert (s["saturated_steps"], s["drain_steps"], s["saturated_tokens_per_s"]) == (0, 1, 0.0)
    assert s["drain_tokens_per_s"] == pytest.approx(2.0)


def test_decode_buckets_default_to_powers_of_two_capped_at_max_num_seqs():
    from paged_jax.buckets import decode_buckets, decode_rows, multiples_of

    assert decode_buckets(64) == (8, 16, 32, 64) and decode_buckets(48) == (8, 16, 32, 48)
    assert decode_buckets(8) == (8,) and decode_buckets(5) == (5,)
    assert multiples_of(8, 20) == (8, 16, 20) and decode_buckets(32, [100, 4, 4]) == (4, 32)
    sizes = decode_buckets(48)
    assert [decode_rows(n, sizes) for n in (1, 8, 9, 17, 33, 48)] == [8, 8, 16, 32, 48, 48]
    with pytest.raises(ValueError, match="exceed the largest bucket 48"):
        decode_rows(49, sizes)
    for bad in ([], [0], [2.5], [True]):
        with pytest.raises(ValueError, match="decode buckets"):
            decode_buckets(8, bad)
