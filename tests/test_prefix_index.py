"""The prefix index (chained block keys, salts, collisions) and the eviction policies:
one contract over every policy, then each policy's own order."""

import numpy as np
import pytest

from paged_jax.cache.eviction import EVICTION_POLICIES, get_eviction_policy
from paged_jax.cache.prefix import HASH_FUNCTIONS, HashFunction, PrefixIndex, block_keys, get_hash
from paged_jax.cache.sentinels import NO_BLOCK

BS = 4
N = 32


def _tree_consistent(meta, cached):
    """Every cached block's child count equals the cached blocks naming it as parent."""
    parents = meta.parent[cached]
    want = np.bincount(parents[parents != NO_BLOCK], minlength=len(cached))
    np.testing.assert_array_equal(meta.children[cached], want[cached])


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_every_eviction_policy_keeps_the_contract(name):
    """Random inserts (chains), hits and evictions: a choice is distinct, among the
    candidates only, as many as asked for (or all candidates), deterministic, and the
    prefix tree's bookkeeping stays consistent."""
    policy = get_eviction_policy(name)
    rng = np.random.default_rng(0)
    meta, cached, now = policy.init(N), np.zeros(N, bool), 0
    for _ in range(200):
        now += 1
        free = np.flatnonzero(~cached)
        op = rng.integers(4)
        if op == 0 and free.size:
            chain = rng.permutation(free)[: rng.integers(1, min(4, free.size) + 1)]
            root = rng.choice(np.flatnonzero(cached)) if cached.any() and rng.random() < 0.5 else NO_BLOCK
            parents = np.concatenate([[root], chain[:-1]])
            meta = policy.insert(meta, chain, parents, now)
            cached[chain] = True
        elif op == 1 and cached.any():
            meta = policy.touch(meta, rng.choice(np.flatnonzero(cached), size=2), now)
        elif op == 3 and cached.any():
            meta = policy.release(meta, rng.choice(np.flatnonzero(cached), size=2), now)
        elif cached.any():
            candidates = cached & (rng.random(N) < 0.6)
            k = int(rng.integers(0, 6))
            chosen = policy.choose(meta, candidates, k)
            assert len(set(chosen.tolist())) == len(chosen) <= min(k, int(candidates.sum()))
            if name != "leaf_first":  # which may find fewer leaves than asked for
                assert len(chosen) == min(k, int(candidates.sum()))
            assert candidates[chosen].all()
            np.testing.assert_array_equal(policy.choose(meta, candidates, k), chosen)  # pure
            meta = policy.forget(meta, chosen)
            cached[chosen] = False
        _tree_consistent(meta, cached)


def test_each_policy_evicts_in_its_own_order():
    # Blocks 0 -> 1 -> 2 (a chain), then 3 (a root); block 0 hit twice, block 3 once.
    orders = {}
    for name in EVICTION_POLICIES:
        p = get_eviction_policy(name)
        meta = p.insert(p.init(8), [0, 1, 2], [NO_BLOCK, 0, 1], now=1)
        meta = p.insert(meta, [3], [NO_BLOCK], now=2)
        meta = p.touch(meta, [0], now=3)
        meta = p.touch(meta, [0, 3], now=4)
        orders[name] = p.choose(meta, np.array([1, 1, 1, 1, 0, 0, 0, 0], bool), 4).tolist()
    assert orders["lru"] == [1, 2, 0, 3]  # last used 1, 1, 4, 4 (ties by id)
    assert orders["fifo"] == [0, 1, 2, 3]  # inserted 1, 1, 1, 2
    assert orders["lfu"] == [1, 2, 3, 0]  # uses 1, 1, 2, 3
    assert orders["leaf_first"] == [2, 1, 0, 3]  # the chain from its leaf up; 0 and 3 then tie (time 4)
    # A block whose descendant is still cached (but not a candidate) is never a leaf.
    p = get_eviction_policy("leaf_first")
    meta = p.insert(p.init(4), [0, 1], [NO_BLOCK, 0], now=1)
    assert p.choose(meta, np.array([1, 0, 0, 0], bool), 1).tolist() == []
    # A release is a recent use, not another use: lru and leaf_first keep block 1
    # (released last) longest; lfu still counts uses; fifo ignores both.
    for name, want in [("lru", [0, 2, 1]), ("leaf_first", [0, 2, 1]), ("lfu", [0, 2, 1]), ("fifo", [0, 1, 2])]:
        p = get_eviction_policy(name)
        meta = p.insert(p.init(4), [0, 1, 2], [NO_BLOCK, NO_BLOCK, NO_BLOCK], now=1)
        meta = p.release(meta, [1], now=2)
        assert p.choose(meta, np.array([1, 1, 1, 0], bool), 3).tolist() == want, name


def test_unknown_names_are_value_errors_listing_the_choices():
    with pytest.raises(ValueError, match=r"eviction_policy='mru'.*\['fifo', 'leaf_first', 'lfu', 'lru'\]"):
        get_eviction_policy("mru")
    with pytest.raises(ValueError, match=r"prefix_cache_hash='md5'.*blake2b.*python.*sha256"):
        get_hash("md5")


@pytest.mark.parametrize("hash_name", sorted(HASH_FUNCTIONS))
def test_keys_chain_the_whole_prefix_and_the_salt(hash_name):
    a = block_keys(list(range(10)), BS, hash_fn=hash_name)
    assert len(a) == 2  # the partial last block has no key
    # Same second block after another first block: another key.
    b = block_keys([9, 9, 9, 9] + list(range(4, 8)), BS, hash_fn=hash_name)
    assert a[1] != b[1]
    assert block_keys(list(range(8)), BS, salt="x", hash_fn=hash_name)[0] != a[0]
    assert block_keys(list(range(8)), BS, salt="", hash_fn=hash_name)[0] != a[0]  # "" is a salt
    assert block_keys(list(range(8)), BS, hash_fn=hash_name) == a  # deterministic


def test_match_reuses_the_longest_cached_prefix_but_never_the_last_token():
    index = PrefixIndex(N, BS)
    prompt = list(range(12))  # three full blocks
    assert index.match(prompt) == []
    assert index.insert(prompt + [50, 51], [5, 6, 7, 8]) == [5, 6, 7]  # the partial 4th is not cached
    assert index.match(prompt) == [5, 6]  # the block with the last prompt token is computed
    assert index.match(prompt + [50]) == [5, 6, 7]
    assert index.match(list(range(8)) + [99, 98, 97, 96, 95]) == [5, 6]  # diverges in block 2
    assert index.match([1] + prompt) == []
    # Another sequence that computed the same prefix: the cached blocks stay, and its
    # further blocks chain on them.
    assert index.insert(list(range(16)) + [7], [10, 11, 12, 13]) == [13]
    assert index.match(list(range(16)) + [7]) == [5, 6, 7, 13]
    index.check()


def test_salts_isolate_tenants():
    index = PrefixIndex(N, BS)
    prompt = list(range(9))
    index.insert(prompt, [0, 1], salt="alice")
    assert index.match(prompt, salt="alice") == [0, 1]
    assert index.match(prompt, salt="bob") == [] and index.match(prompt) == []
    index.insert(prompt, [2, 3])  # no salt: its own chain
    assert index.match(prompt) == [2, 3] and index.match(prompt, salt="alice") == [0, 1]


@pytest.mark.parametrize("resistant", [True, False])
def test_a_hash_collision_costs_a_miss_never_a_wrong_block(resistant):
    """A hash that maps every block to the same key: only the first block ever cached
    is found, and only by its own tokens."""
    constant = HashFunction("constant", lambda parent, salt, tokens: 0, resistant)
    index = PrefixIndex(N, BS, hash_fn=constant)
    assert index.insert(list(range(8)) + [0], [3, 4]) == [3]  # block 1's key is taken by block 3
    assert index.match(list(range(9))) == [3]
    assert index.match([7, 7, 7, 7, 7]) == []  # same key, other tokens
    assert index.insert([7, 7, 7, 7, 7], [9]) == []
    assert index.match(list(range(4)) + list(range(4)) + [1]) == [3]  # second block: a collision, a miss
    index.check()


def test_evict_drops_only_unreferenced_cached_blocks_in_policy_order():
    index = PrefixIndex(N, BS, eviction_policy="lru")
    index.insert(list(range(9)), [0, 1])
    index.insert(list(range(100, 109)), [2, 3])
    index.match(list(range(9)))  # 0 and 1 used again
    unreferenced = np.zeros(N, bool)
    unreferenced[[0, 1, 2, 20]] = True  # 3 is referenced; 20 is not cached
    assert index.evict(unreferenced, 5) == [2, 0, 1]
    assert len(index) == 1 and index.match(list(range(100, 109))) == []  # 3 is cut off from its root
    index.check()


def test_check_compares_entries_with_what_the_pool_stores():
    index = PrefixIndex(N, BS)
    index.insert(list(range(9)), [0, 1])
    index.check(lambda b: tuple(range(4 * b, 4 * b + 4)))
    with pytest.raises(AssertionError, match="block 1 stores other tokens"):
        index.check(lambda b: (0, 1, 2, 3))


@pytest.mark.parametrize("hash_name", ["sha256", "python"])
def test_an_insert_resumed_from_a_recorded_block_equals_one_from_the_start(hash_name):
    tokens = list(range(100, 120))  # five full blocks
    whole = PrefixIndex(N, BS, hash_fn=hash_name)
    whole.insert(tokens, [3, 4, 5, 6, 7])
    parts = PrefixIndex(N, BS, hash_fn=hash_name)
    parts.insert(tokens[:8], [3, 4])
    assert parts.insert(tokens, [3, 4, 5, 6, 7], start=2) == [5, 6, 7]
    assert parts.entries == whole.entries and parts.by_key == whole.by_key
    # A block before ``start`` the index does not hold: hashed from the start instead.
    other = PrefixIndex(N, BS, hash_fn=hash_name)
    assert other.insert(tokens, [3, 4, 5, 6, 7], start=2) == [3, 4, 5, 6, 7]
    assert other.entries == whole.entries
