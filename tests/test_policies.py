"""One contract test suite, run over every registered allocation policy, under jit: the
pool's rules, batched = sequential, and the host counterpart handing out what the device does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.cache import POLICIES, get_policy, lifo
from paged_jax.cache import random as random_policy

N = 32
ALL = sorted(POLICIES)  # the live registry: a registered policy is tested by being registered


def jitted(policy):
    return jax.jit(policy.allocate), jax.jit(policy.release)


def want(k, width=8):
    return jnp.arange(width) < k


@pytest.mark.parametrize("name", ALL)
class TestPolicyContract:
    def test_init_holds_every_block_once(self, name):
        policy = get_policy(name)
        pool = policy.init(N)
        assert int(policy.num_free(pool)) == N
        assert sorted(policy.free_blocks(pool).tolist()) == list(range(N))

    def test_allocate_gives_distinct_free_ids_where_wanted(self, name):
        policy = get_policy(name)
        allocate, _ = jitted(policy)
        pool = policy.init(N)
        mask = jnp.array([True, False, True, True, False, True, False, False])
        pool2, ids, ok = allocate(pool, mask)
        ids = np.asarray(ids)
        assert bool(ok)
        assert (ids[~np.asarray(mask)] == -1).all()
        taken = ids[np.asarray(mask)]
        assert len(set(taken.tolist())) == 4 and ((taken >= 0) & (taken < N)).all()
        assert int(policy.num_free(pool2)) == N - 4
        assert not set(taken.tolist()) & set(policy.free_blocks(pool2).tolist())

    def test_exhaustion_is_all_or_nothing(self, name):
        policy = get_policy(name)
        allocate, _ = jitted(policy)
        pool = policy.init(6)
        pool, _, ok = allocate(pool, want(4))
        assert bool(ok)
        again, _, ok = allocate(pool, want(3))
        assert not bool(ok)
        for a, b in zip(jax.tree.leaves(pool), jax.tree.leaves(again)):
            np.testing.assert_array_equal(a, b)

    def test_release_then_drain_and_refill(self, name):
        policy = get_policy(name)
        allocate, release = jitted(policy)
        pool = policy.init(N)
        seen = []
        for _ in range(N // 8):
            pool, ids, ok = allocate(pool, want(8))
            assert bool(ok)
            seen += np.asarray(ids).tolist()
        assert sorted(seen) == list(range(N)) and int(policy.num_free(pool)) == 0
        back = jnp.asarray(seen[:8], jnp.int32)
        pool = release(pool, back, jnp.ones(8, bool))
        assert sorted(policy.free_blocks(pool).tolist()) == sorted(seen[:8])
        pool = release(pool, jnp.asarray(seen[8:16], jnp.int32), jnp.arange(8) % 2 == 0)
        assert int(policy.num_free(pool)) == 12
        assert set(seen[8:16:2]) <= set(policy.free_blocks(pool).tolist())

    def test_batched_is_sequential_and_the_host_counterpart_agrees(self, name):
        """Random batches (masked entries anywhere) through the device, one block at a time
        through the device, and through the host counterpart: the same ids, the same pool."""
        policy = get_policy(name)
        allocate, release = jitted(policy)
        rng = np.random.default_rng(0)
        batched = one = policy.init(N)
        host = policy.host(N)
        held = []
        for _ in range(40):
            mask = rng.random(8) < 0.5
            k = int(mask.sum())
            if rng.random() < 0.5 and k <= int(policy.num_free(batched)):
                batched, ids, ok = allocate(batched, jnp.asarray(mask))
                got = np.asarray(ids)[mask].tolist()
                singles = []
                for _ in range(k):
                    one, i, _ = allocate(one, want(1, 1))
                    singles.append(int(i[0]))
                assert bool(ok) and got == singles == [host.take() for _ in range(k)]
                held += got
            elif held:
                k = min(k, len(held)) or 1
                out = [held.pop(int(rng.integers(len(held)))) for _ in range(k)]
                ids = np.full(8, -1, np.int32)
                slots = np.sort(rng.choice(8, k, replace=False))
                ids[slots] = out
                batched = release(batched, jnp.asarray(ids), jnp.asarray(ids >= 0))
                for b in out:
                    one = release(one, jnp.asarray([b], jnp.int32), jnp.ones(1, bool))
                    host.give(b)
            order = np.asarray(policy.free_blocks(jax.device_get(batched))).tolist()
            assert order == np.asarray(policy.free_blocks(jax.device_get(one))).tolist() == host.ordered().tolist()
            assert host.num_free == int(policy.num_free(batched))
            assert policy.host_pool(batched).ordered().tolist() == order  # the counterpart of any pool

    def test_zero_request_changes_nothing(self, name):
        policy = get_policy(name)
        allocate, release = jitted(policy)
        pool = policy.init(N)
        pool2, ids, ok = allocate(pool, want(0))
        pool3 = release(pool2, jnp.full(8, -1, jnp.int32), jnp.zeros(8, bool))
        assert bool(ok) and (np.asarray(ids) == -1).all()
        for a, b in zip(jax.tree.leaves(pool), jax.tree.leaves(pool3)):
            np.testing.assert_array_equal(a, b)


def _free_then_allocate(name, freed):
    policy = get_policy(name)
    allocate, release = jitted(policy)
    pool = policy.init(N)
    pool, ids, _ = allocate(pool, want(8))
    pool, _, _ = allocate(pool, want(24, 24))  # empty the pool
    pool = release(pool, jnp.asarray(freed + [-1] * (8 - len(freed)), jnp.int32), want(len(freed)))
    return np.asarray(allocate(pool, want(len(freed)))[1])[: len(freed)].tolist()


def test_lifo_hands_out_most_recently_freed_first():
    assert _free_then_allocate("lifo", [5, 2, 7]) == [7, 2, 5]


def test_fifo_hands_out_oldest_freed_first():
    assert _free_then_allocate("fifo", [5, 2, 7]) == [5, 2, 7]


def test_lowest_id_first_hands_out_address_order():
    assert _free_then_allocate("lowest_id_first", [5, 2, 7]) == [2, 5, 7]


def test_random_is_seeded_and_scatters():
    def first_ids(seed):
        policy = random_policy(seed)
        _, ids, _ = jax.jit(policy.allocate)(policy.init(1024), jnp.ones(16, bool))
        return np.asarray(ids).tolist()

    assert first_ids(3) == first_ids(3)
    assert first_ids(3) != first_ids(4)
    assert first_ids(3) != list(range(16))


def test_factories_are_cached_so_jit_does_not_retrace():
    assert lifo() is lifo() and random_policy(1) is random_policy(1)
    assert random_policy(1) is not random_policy(2)


def test_unknown_policy_lists_the_valid_ones():
    with pytest.raises(ValueError, match="lowest_id_first"):
        get_policy("best_fit")
    assert {"lifo", "fifo", "lowest_id_first", "random"} <= set(POLICIES)
