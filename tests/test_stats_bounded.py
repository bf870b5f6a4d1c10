"""EngineStats stays bounded in a long-running server: the per-step timeline is a ring
buffer of the last ``timeline_limit`` steps, per-request peaks keep the last
``request_limit`` requests, and the summary (running totals) stays exact over every step."""

import random

import pytest

from paged_jax.engine.stats import TIMELINE_LIMIT, EngineStats


def _steps(n: int, seed: int = 0):
    rng = random.Random(seed)
    for i in range(n):
        batch = rng.randint(1, 8)
        yield dict(batch=batch, generated=batch, prefilled=rng.choice([0, 0, 12]), tokens_held=batch * 3,
                   allocated_blocks=batch, charged_blocks=batch, seconds=rng.uniform(0.01, 0.1),
                   waiting=rng.choice([0, 0, 2]) if i < n - 7 else 0,
                   compile_seconds=0.5 if i % 50 == 0 else 0.0, request_blocks={f"r{i}": (batch, batch + 1)})


def test_timeline_is_a_ring_buffer_and_the_summary_stays_exact():
    bounded, full = EngineStats(block_size=4, num_blocks=64, timeline_limit=16, request_limit=5), \
        EngineStats(block_size=4, num_blocks=64, timeline_limit=10_000, request_limit=10_000)
    rows = list(_steps(300))
    for row in rows:
        bounded.record_step(**row)
        full.record_step(**row)
    assert len(bounded.timeline) == 16 and len(full.timeline) == 300
    assert list(bounded.timeline) == list(full.timeline)[-16:]  # the newest steps, oldest first
    assert list(bounded.request_blocks) == [f"r{i}" for i in range(295, 300)]  # the newest requests
    a, b = bounded.summary(), full.summary()
    a.pop("request_peak_blocks"), b.pop("request_peak_blocks")
    assert a == b  # the same running totals
    assert a["saturated_steps"] + a["drain_steps"] == 300 and a["drain_steps"] >= 7


def test_the_split_from_running_totals_matches_a_scan_of_the_timeline():
    """The saturated/drain figures equal the definition applied to every step's record."""
    stats = EngineStats(block_size=4, num_blocks=64)
    for row in _steps(200, seed=3):
        stats.record_step(**row)
    rows = list(stats.timeline)
    last = max(i for i, r in enumerate(rows) if r.waiting > 0)
    sat = rows[: last + 1]
    s = stats.summary()
    assert s["saturated_steps"] == last + 1
    assert s["saturated_seconds"] == pytest.approx(rows[last].end_seconds)
    assert s["saturated_generated_tokens"] == sum(r.generated for r in sat)
    steady = rows[last].end_seconds - sum(r.compile_seconds for r in sat)
    assert s["saturated_tokens_per_s"] == pytest.approx(sum(r.generated for r in sat) / steady)
    assert s["drain_mean_running_batch"] == pytest.approx(
        sum(r.batch for r in rows[last + 1:]) / (len(rows) - last - 1))


def test_limits_are_validated_and_default_bounded():
    assert EngineStats(block_size=4, num_blocks=8).timeline.maxlen == TIMELINE_LIMIT
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="timeline_limit"):
            EngineStats(block_size=4, num_blocks=8, timeline_limit=bad)
        with pytest.raises(ValueError, match="request_limit"):
            EngineStats(block_size=4, num_blocks=8, request_limit=bad)
