import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import CacheConfig
from paged_jax.config import blocks_for


def test_derived_figures():
    config = CacheConfig(num_blocks=100_000, block_size=16, max_seqs=256, max_blocks_per_seq=128)
    assert config.max_tokens_per_seq == 2048
    assert config.num_slots == 1_600_000
    assert config.table_bytes == 256 * 128 * 4
    assert config.ref_count_bytes == 400_000  # ~0.4 MB for a 100k-block pool
    assert config.blocks_for(0) == 0 and config.blocks_for(16) == 1 and config.blocks_for(17) == 2


def test_blocks_for_on_ints_and_arrays_without_overflow():
    big = 2**31 - 1
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, big)] == [0, 1, 1, 2, 2**29]
    assert type(blocks_for(5, 4)) is int
    lens = [0, 1, 16, 17, big]
    expected = [-(-n // 16) for n in lens]
    got_np = blocks_for(np.asarray(lens, np.int32), 16)
    got_jax = blocks_for(jnp.asarray(lens, jnp.int32), 16)
    assert got_np.dtype == np.int32 and got_np.tolist() == expected
    assert got_jax.dtype == jnp.int32 and got_jax.tolist() == expected  # (n + 15) // 16 would wrap
    assert CacheConfig(num_blocks=8, block_size=16).blocks_for(np.asarray([17])).tolist() == [2]


def test_frozen():
    config = CacheConfig(num_blocks=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_blocks = 9


@pytest.mark.parametrize(
    "kwargs, field, value",
    [
        (dict(num_blocks=0), "num_blocks", "0"),
        (dict(num_blocks=-5), "num_blocks", "-5"),
        (dict(num_blocks=2.5), "num_blocks", "2.5"),
        (dict(num_blocks=True), "num_blocks", "True"),
        (dict(num_blocks=8, block_size=12), "block_size", "12"),
        (dict(num_blocks=8, block_size=512), "block_size", "512"),
        (dict(num_blocks=8, block_size=0), "block_size", "0"),
        (dict(num_blocks=8, max_seqs=0), "max_seqs", "0"),
        (dict(num_blocks=8, max_blocks_per_seq=0), "max_blocks_per_seq", "0"),
        (dict(num_blocks=2**30, block_size=256), "num_blocks", str(2**30)),
    ],
)
def test_bad_values_name_field_value_and_allowed(kwargs, field, value):
    with pytest.raises(ValueError) as err:
        CacheConfig(**kwargs)
    message = str(err.value)
    assert message.startswith(f"{field}=")
    assert value in message
    assert "must" in message


@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_every_power_of_two_block_size_is_allowed(block_size):
    assert CacheConfig(num_blocks=4, block_size=block_size).block_size == block_size
