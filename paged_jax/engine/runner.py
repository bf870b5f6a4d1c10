"""The model runner: the only part of the engine that touches the device.

It owns the device state (the block manager's ``CacheState``, the KV pages, the model
parameters) and runs, on request of the scheduler: the jitted prefill / decode steps, the
sampler, the block-manager ops the scheduler needs (open, release, blocks_needed,
num_free) and the block copies of a swap. Every batch is padded to a bucket (a power of
two, capped at the configured maximum) so the number of compiled shapes stays bounded:
``O(log max_num_seqs)`` decode shapes, ``O(log max_num_seqs * log max_num_batched_tokens)``
prefill shapes at most. ``traces`` counts the step-function traces (compiles) this
runner's calls caused. The jitted functions are shared process-wide, so a second engine
with the same shapes compiles nothing; note that they keep whatever
``paged_jax.cache.set_debug_checks`` setting was on when they were first traced.

Padding rows use sequence id ``NO_SEQ`` (-1), which the step functions and cache ops
ignore.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.cache import (
    CacheState,
    append_slots,
    blocks_needed,
    check_invariants,
    init_state,
    num_free_blocks,
    open_sequences,
    raise_for_status,
    release,
)
from paged_jax.config import CacheConfig
from paged_jax.engine.sampling import sample
from paged_jax.engine.swap import block_layout

NO_SEQ = CacheState.NO_SEQ


class ModelBackend(NamedTuple):
    """Everything the runner needs from a model (built by ``llm.py`` or by a test).

    Attributes:
      prefill, decode: step functions with the contract of ``paged_jax.steps.StepFns``:
        ``prefill(params, cache_state, pages, tokens int32[B, T], seq_ids int32[B],
        num_tokens int32[B]) -> (logits f32[B, V], cache_state, pages, status int32[B])``
        and ``decode(params, cache_state, pages, tokens int32[B], seq_ids int32[B]) ->
        (logits, cache_state, pages, status)``.
      params: the model parameters (a pytree).
      init_pages: ``num_blocks -> pages``: an empty KV page store for the pool.
      read_blocks: ``(pages, ids int32[N]) -> pytree`` of those blocks' data (one axis
        of each leaf indexes the N blocks).
      write_blocks: ``(pages, ids int32[N], data) -> pages``.
      vocab_size: V.
      eos_token_id: stops generation unless ``ignore_eos``; None if the model has none.
      max_position: longest sequence the model supports (None: unbounded).
      name: a short description for reports.
    """

    prefill: Callable
    decode: Callable
    params: Any
    init_pages: Callable[[int], Any]
    read_blocks: Callable
    write_blocks: Callable
    vocab_size: int
    eos_token_id: int | None = None
    max_position: int | None = None
    name: str = "model"


def bucket(n: int, cap: int, lo: int = 1) -> int:
    """Smallest power of two >= max(n, lo), but at most ``cap`` (itself any int >= n)."""
    assert 0 < n <= cap, (n, cap)
    return min(max(lo, 1 << (n - 1).bit_length()), cap)


class StepOut(NamedTuple):
    """What a fused step returns besides the new state (device arrays until fetched)."""

    tokens: Any  # int32[B_pad]; the sampled token per row (meaningless for padding rows)
    logprobs: Any  # f32[B_pad]; its log-probability under the unmodified distribution
    num_free: Any  # int32[]; free blocks after the step
    status: Any  # int32[B_pad]; Status per row


class SampleRow(NamedTuple):
    temperature: float
    top_k: int
    top_p: float
    seed: int
    step: int  # index of the token being sampled in the request's output


_PAD_SAMPLE = SampleRow(0.0, -1, 1.0, 0, 0)


def _all_greedy(rows: list[SampleRow]) -> bool:
    """Static flag: a batch of greedy rows compiles without the sort (cheaper)."""
    return all(r.temperature == 0 for r in rows)


def _adopt(state, seq_ids, num_tokens, *, max_tokens):
    """Open rows and give them ``num_tokens`` fresh slots each (the swap-in path).

    Returns (state, rows int32[B, max_blocks_per_seq], status int32[B]): the rebuilt
    table rows, so the caller can write the swapped-in data into their blocks.
    """
    state, opened = open_sequences(state, seq_ids)
    state, res = append_slots(state, seq_ids, num_tokens, max_tokens=max_tokens)
    status = jnp.where(opened != 0, opened, res.status)
    return state, state.block_tables[jnp.maximum(seq_ids, 0)], status


# Jitted functions are shared by every runner (module-level caches), so engines with the
# same shapes compile once per process; a runner counts only the traces its calls cause.
_TRACES: collections.Counter = collections.Counter()


@functools.cache
def _fused(step: Callable) -> Callable:
    """jit(step, then sample, then count free blocks): one program and one dispatch per
    engine step. Its Python body runs only when it traces, which ``_TRACES`` counts.
    Cache state and pages are donated."""

    def traced(params, state, pages, *args, greedy_only):
        _TRACES[fused] += 1
        *step_args, temperature, top_k, top_p, seeds, steps = args
        logits, state, pages, status = step(params, state, pages, *step_args)
        tokens, logprobs = sample(logits, temperature, top_k, top_p, seeds, steps, greedy_only=greedy_only)
        return StepOut(tokens, logprobs, num_free_blocks(state), status), state, pages

    fused = jax.jit(traced, donate_argnums=(1, 2), static_argnames="greedy_only")
    return fused


@functools.cache
def _jit(fn: Callable, **kwargs) -> Callable:
    return jax.jit(fn, **kwargs)


_open = jax.jit(open_sequences, donate_argnums=0)
_release = jax.jit(release, donate_argnums=0)
_blocks_needed = jax.jit(blocks_needed)
_num_free = jax.jit(num_free_blocks)
_adopt_jit = jax.jit(_adopt, donate_argnums=0, static_argnames="max_tokens")


@dataclasses.dataclass
class RunnerConfig:
    num_blocks: int
    block_size: int
    max_num_seqs: int  # table rows = the largest decode batch
    max_blocks_per_seq: int
    max_num_batched_tokens: int  # the largest prefill chunk (and token budget per step)
    allocation_policy: str = "lifo"
    debug_checks: bool = False  # check_invariants + host/device agreement every step


class ModelRunner:
    """Device state and the jitted calls on it. Not thread-safe; one engine owns it."""

    def __init__(self, backend: ModelBackend, config: RunnerConfig):
        self.backend = backend
        self.config = config
        cache_config = CacheConfig(
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            max_seqs=config.max_num_seqs,
            max_blocks_per_seq=config.max_blocks_per_seq,
        )
        self.cache_config = cache_config
        self.cache_state = init_state(cache_config, config.allocation_policy)
        self.pages = backend.init_pages(config.num_blocks)
        self.params = backend.params
        self.traces: collections.Counter[str] = collections.Counter()
        self._prefill = _fused(backend.prefill)
        self._decode = _fused(backend.decode)
        self._read_blocks = _jit(backend.read_blocks)
        self._write_blocks = _jit(backend.write_blocks, donate_argnums=0)
        self.block_leaves, self.block_treedef, self._block_axes = block_layout(backend.read_blocks, self.pages)
        self.bytes_per_block = sum(
            int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in self.block_leaves
        )

    def _run_step(self, name: str, fused: Callable, *args, greedy_only: bool) -> StepOut:
        """Call a fused step, attributing any trace it causes to this runner."""
        before = _TRACES[fused]
        out, self.cache_state, self.pages = fused(
            self.params, self.cache_state, self.pages, *args, greedy_only=greedy_only
        )
        self.traces[name] += _TRACES[fused] - before
        return out

    # ------------------------------------------------------------------ cache ops

    @staticmethod
    def _ids(slots: list[int], size: int) -> np.ndarray:
        """int32[size]: the rows, padded with NO_SEQ (numpy: jit transfers it directly)."""
        return np.asarray(list(slots) + [NO_SEQ] * (size - len(slots)), np.int32)

    def open(self, slots: list[int]) -> None:
        """Make table rows live (empty) before their first prefill."""
        if not slots:
            return
        ids = self._ids(slots, bucket(len(slots), self.config.max_num_seqs))
        self.cache_state, status = _open(self.cache_state, ids)
        raise_for_status("open_sequences", ids, status)

    def release(self, slots: list[int]) -> None:
        """Free rows and every block only they held."""
        if not slots:
            return
        ids = self._ids(slots, bucket(len(slots), self.config.max_num_seqs))
        self.cache_state, status = _release(self.cache_state, ids)
        raise_for_status("release", ids, status)

    def blocks_needed(self, slots: list[int], num_tokens: list[int]) -> tuple[np.ndarray, int]:
        """(blocks each append would take, incl. copy-on-write, int[len(slots)]; free blocks)."""
        free = _num_free(self.cache_state)
        if not slots:
            return np.zeros((0,), np.int64), int(free)
        size = bucket(len(slots), self.config.max_num_seqs)
        ids = self._ids(slots, size)
        n = np.asarray(list(num_tokens) + [0] * (size - len(slots)), np.int32)
        need, free = jax.device_get((_blocks_needed(self.cache_state, ids, n), free))
        return np.asarray(need[: len(slots)], np.int64), int(free)

    def num_free_blocks(self) -> int:
        return int(_num_free(self.cache_state))

    # ------------------------------------------------------------------ steps

    def prefill(self, slots: list[int], chunks: list[list[int]], rows: list[SampleRow]) -> StepOut:
        """Append each chunk to its row and sample a token at each row's last one.

        Returns device arrays (fetch them with ``fetch``), padded to the row bucket.
        """
        cfg = self.config
        size = bucket(len(slots), cfg.max_num_seqs)
        width = bucket(max(map(len, chunks)), cfg.max_num_batched_tokens, lo=min(16, cfg.max_num_batched_tokens))
        tokens = np.zeros((size, width), np.int32)
        num_tokens = np.zeros((size,), np.int32)
        for i, chunk in enumerate(chunks):
            tokens[i, : len(chunk)] = chunk
            num_tokens[i] = len(chunk)
        return self._run_step(
            "prefill", self._prefill, tokens, self._ids(slots, size), num_tokens, *self._sampling(rows, size),
            greedy_only=_all_greedy(rows),
        )

    def decode(self, slots: list[int], tokens: list[int], rows: list[SampleRow]) -> StepOut:
        """Append one token to each row and sample the next (device arrays, padded)."""
        size = bucket(len(slots), self.config.max_num_seqs)
        toks = np.asarray(list(tokens) + [0] * (size - len(tokens)), np.int32)
        return self._run_step(
            "decode", self._decode, toks, self._ids(slots, size), *self._sampling(rows, size),
            greedy_only=_all_greedy(rows),
        )

    @staticmethod
    def _sampling(rows: list[SampleRow], size: int) -> tuple[jax.Array, ...]:
        """The sampler's per-row arrays, padded to ``size`` with greedy dummy rows."""
        pad = [*rows, *([_PAD_SAMPLE] * (size - len(rows)))]
        cols = list(zip(*pad, strict=True))
        return (
            np.asarray(cols[0], np.float32),
            np.asarray(cols[1], np.int32),
            np.asarray(cols[2], np.float32),
            np.asarray(cols[3], np.uint32),
            np.asarray(cols[4], np.int32),
        )

    @staticmethod
    def fetch(outs: list[StepOut]) -> list[StepOut]:
        """Bring step outputs to the host in one sync; raise if any step was rejected
        (the scheduler made room first, so a rejection is an engine bug)."""
        host = jax.device_get(outs)
        for out in host:
            raise_for_status("step", np.arange(len(out.status)), out.status)
        return [StepOut(*map(np.asarray, out)) for out in host]

    # ------------------------------------------------------------------ swap

    def swap_out(self, slot: int, num_blocks: int) -> list[np.ndarray]:
        """Copy the first ``num_blocks`` blocks of ``slot`` to host memory.

        Returns one numpy array per leaf of the block data, block axis first:
        ``[num_blocks, *block_shape]``. The row itself is left as is (release it next).
        """
        ids = np.asarray(self.cache_state.block_tables[slot, :num_blocks])
        assert (ids >= 0).all(), ids
        size = bucket(num_blocks, self.config.max_blocks_per_seq)
        padded = np.concatenate([ids, np.full(size - num_blocks, ids[-1])]).astype(np.int32)
        data = jax.device_get(jax.tree.leaves(self._read_blocks(self.pages, jnp.asarray(padded))))
        return [
            np.moveaxis(np.asarray(leaf), ax, 0)[:num_blocks]
            for leaf, ax in zip(data, self._block_axes, strict=True)
        ]

    def swap_in(self, slot: int, num_tokens: int, leaves: list[np.ndarray]) -> None:
        """Rebuild row ``slot`` holding ``num_tokens`` tokens whose blocks' data is ``leaves``.

        Opens the row and appends ``num_tokens`` fresh slots in one jitted call (fresh
        blocks from the pool, table row rebuilt, length set), then writes the host data
        into the new blocks in logical order.
        """
        num_blocks = leaves[0].shape[0]
        assert num_blocks == -(-num_tokens // self.config.block_size)
        ids = self._ids([slot], 1)
        self.cache_state, rows, status = _adopt_jit(
            self.cache_state, ids, np.asarray([num_tokens], np.int32),
            max_tokens=self.config.max_blocks_per_seq * self.config.block_size,
        )
        raise_for_status("swap-in (open + append_slots)", ids, status)
        new_ids = np.asarray(rows[0, :num_blocks])
        size = bucket(num_blocks, self.config.max_blocks_per_seq)
        # Pad by repeating the last block with its own data: an idempotent write.
        padded_ids = np.concatenate([new_ids, np.full(size - num_blocks, new_ids[-1])]).astype(np.int32)
        data = []
        for leaf, ax in zip(leaves, self._block_axes, strict=True):
            full = np.concatenate([leaf, np.repeat(leaf[-1:], size - num_blocks, axis=0)])
            data.append(jnp.asarray(np.moveaxis(full, 0, ax)))
        self.pages = self._write_blocks(
            self.pages, jnp.asarray(padded_ids), jax.tree.unflatten(self.block_treedef, data)
        )

    # ------------------------------------------------------------------ debug

    def check(self, held: dict[int, int]) -> None:
        """Block-manager invariants, and that the device agrees with the scheduler:
        exactly the rows in ``held`` (slot -> tokens) are live, with those lengths."""
        check_invariants(self.cache_state, op="engine step")
        active = np.asarray(self.cache_state.active)
        lens = np.asarray(self.cache_state.seq_lens)
        live = set(np.flatnonzero(active).tolist())
        if live != set(held):
            raise AssertionError(f"device live rows {sorted(live)} != scheduler's {sorted(held)}")
        for slot, n in held.items():
            if lens[slot] != n:
                raise AssertionError(f"row {slot}: device holds {lens[slot]} tokens, scheduler says {n}")
