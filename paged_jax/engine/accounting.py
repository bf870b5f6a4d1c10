"""Cache accounting: who may be admitted, and what the KV memory is charged for.

The one place where the paged engine and the static baseline differ. Both run the same
scheduler, runner, block manager and step functions; only these answers change.

- ``PagedAccounting`` (PagedAttention, M4 in docs/SEED.md): a request is admitted when the blocks
  for the tokens it must prefill fit in the free pool above a watermark; it then grows a
  block at a time, and the scheduler preempts when the pool runs dry. Memory charged =
  blocks actually allocated.

- ``StaticAccounting`` (the pre-PagedAttention way, claims C1/C2): every admitted sequence
  reserves ``ceil(max_model_len / block_size)`` blocks up front, from a reservation
  counter over the same pool, so at most ``num_blocks // that`` sequences run at once.
  Memory charged = blocks reserved, whether or not tokens fill them.

  Design choice: the reservation is a counter, not a physically contiguous region. The
  sequence still takes its blocks lazily from the same block manager, but since the
  reservations never exceed the pool, its growth can never fail (the scheduler asserts
  that static mode never preempts). Contiguity would change neither what is charged nor
  the arithmetic of a step (attention reads through the block table either way), and
  the block manager has no "allocate a contiguous run" op; reserving physically would
  only add a second allocator. So the baseline is honest about what matters here:
  admission is limited by reservations, and utilisation is tokens held / slots reserved.
"""

from __future__ import annotations

from paged_jax.config import blocks_for


class PagedAccounting:
    """Admission above a watermark; charge = allocated blocks.

    Args:
      num_blocks, block_size: the device pool.
      watermark: fraction of the pool kept free at admission (vLLM's default 1%) so that
        running sequences can still grow for a while without preempting. Ignored when
        nothing else is running, so a lone request that fits the pool always starts.
    """

    kind = "paged"

    def __init__(self, num_blocks: int, block_size: int, watermark: float):
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark={watermark}: must be in [0, 1)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)

    def can_admit(self, num_blocks: int, free_blocks: int, others_running: bool, num_seqs: int = 1) -> bool:
        """Can a request whose ``num_seqs`` sequences must hold ``num_blocks`` blocks start now?"""
        del num_seqs
        keep = self.watermark_blocks if others_running else 0
        return free_blocks - num_blocks >= keep

    def on_admit(self, num_seqs: int = 1) -> None:
        del num_seqs  # paged memory is charged as it is allocated

    def on_release(self, num_seqs: int = 1) -> None:
        del num_seqs

    def charged_blocks(self, allocated_blocks: int) -> int:
        return allocated_blocks

    @property
    def may_preempt(self) -> bool:
        return True


class StaticAccounting:
    """Admission by reservation of ``max_model_len`` per sequence; charge = reserved blocks."""

    kind = "static"

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.per_seq_blocks = blocks_for(max_model_len, block_size)
        if self.per_seq_blocks > num_blocks:
            raise ValueError(
                f"kv_cache='static': one sequence reserves {self.per_seq_blocks} blocks "
                f"(max_model_len={max_model_len}) but the pool has {num_blocks}"
            )
        self.reserved_blocks = 0

    @property
    def max_concurrent(self) -> int:
        return self.num_blocks // self.per_seq_blocks

    def can_admit(self, num_blocks: int, free_blocks: int, others_running: bool, num_seqs: int = 1) -> bool:
        """Can ``num_seqs`` more sequences each reserve ``max_model_len``?"""
        del others_running
        fits = self.reserved_blocks + num_seqs * self.per_seq_blocks <= self.num_blocks
        # Reservations never exceed the pool, so the physical blocks are always there.
        assert not fits or free_blocks >= num_blocks
        return fits

    def on_admit(self, num_seqs: int = 1) -> None:
        self.reserved_blocks += num_seqs * self.per_seq_blocks

    def on_release(self, num_seqs: int = 1) -> None:
        self.reserved_blocks -= num_seqs * self.per_seq_blocks
        assert self.reserved_blocks >= 0

    def charged_blocks(self, allocated_blocks: int) -> int:
        assert allocated_blocks <= self.reserved_blocks, (allocated_blocks, self.reserved_blocks)
        return self.reserved_blocks

    @property
    def may_preempt(self) -> bool:
        return False


def make_accounting(config) -> PagedAccounting | StaticAccounting:
    """The accounting of an ``EngineConfig``'s cache mode ("paged" or "static")."""
    cache = config.cache
    if cache.mode == "paged":
        return PagedAccounting(cache.num_blocks, cache.block_size, cache.watermark)
    return StaticAccounting(cache.num_blocks, cache.block_size, config.model.max_model_len)
