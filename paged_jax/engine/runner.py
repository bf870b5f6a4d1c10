"""The model runner: the only part of the engine that touches the device.

It owns the device state (the block manager's ``CacheState``, the KV pages, the model
parameters) and runs, on request of the scheduler: the jitted prefill / decode steps, the
sampler, the block-manager ops the scheduler needs (open, release, blocks_needed,
num_free) and the block copies of a swap. Every batch is padded to a bucket so the number
of compiled shapes stays bounded: decode batches to multiples of 8 rows
(``decode_size``), prefill calls to power-of-two shapes of bounded area
(``prefill_shapes``), and the block-table view of a decode to at most three widths
(``table_width``; prefill calls see the whole table). ``traces`` counts the
step-function traces (compiles) this runner's calls caused. The jitted functions are shared process-wide, so a second engine
with the same shapes compiles nothing; note that they keep whatever
``paged_jax.cache.set_debug_checks`` setting was on when they were first traced.

Padding rows use sequence id ``NO_SEQ`` (-1), which the step functions and cache ops
ignore.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
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
    debug_checks_enabled,
    init_state,
    num_free_blocks,
    open_sequences,
    raise_for_status,
    release,
    set_debug_checks,
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

    def traced(params, state, pages, *args, greedy_only, width):
        _TRACES[fused] += 1
        *step_args, temperature, top_k, top_p, seeds, steps = args
        # The step sees only the first ``width`` table columns, which hold every block
        # of every live row (the caller guarantees it), so the narrowed state is a valid
        # CacheState; attention then reads width * block_size keys per row instead of
        # max_model_len. The columns are written back after the step.
        #
        # A decode call may also hold only some rows (``plan_decode`` groups rows by
        # width): then only *its* rows must fit in ``width`` columns. Rows outside the
        # call keep their other columns untouched in the full table (written back
        # below), but the narrowed view of them is cut short, so the block manager's
        # debug invariant check would reject the view. With debug checks on, the step's
        # own ops are traced without them and the whole state is checked after the
        # write-back instead.
        narrow = state.replace(block_tables=state.block_tables[:, :width])
        debug = debug_checks_enabled() and width < state.block_tables.shape[1]
        if debug:
            set_debug_checks(False)
        try:
            logits, narrow, pages, status = step(params, narrow, pages, *step_args)
        finally:
            if debug:
                set_debug_checks(True)
        state = narrow.replace(block_tables=state.block_tables.at[:, :width].set(narrow.block_tables))
        if debug:
            leaves, treedef = jax.tree.flatten(state)
            jax.debug.callback(
                lambda *xs: check_invariants(jax.tree.unflatten(treedef, xs), op="narrowed step"), *leaves
            )
        tokens, logprobs = sample(logits, temperature, top_k, top_p, seeds, steps, greedy_only=greedy_only)
        return StepOut(tokens, logprobs, num_free_blocks(state), status), state, pages

    fused = jax.jit(traced, donate_argnums=(1, 2), static_argnames=("greedy_only", "width"))
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
    narrow_tables: bool = True  # steps attend through only the table columns in use
    # Split a decode batch into calls by table width when the cost model says it pays
    # (``plan_decode``); needs narrow_tables.
    split_decode: bool = True
    # Relative decode-call cost: fixed + per padded row + per padded row per key read.
    # Fitted to the study model on the 2-core CPU with attention_impl="reference", whose
    # cost follows the width (ms: ~10 + 1.2 b + 0.0044 b keys);
    # only its ratios matter, and only to choose among groupings.
    decode_cost: tuple[float, float, float] = (10.0, 1.2, 0.0044)


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
        self.compile_seconds = 0.0  # wall time of step calls that traced
        self._prefill = _fused(backend.prefill)
        self._decode = _fused(backend.decode)
        self._read_blocks = _jit(backend.read_blocks)
        self._write_blocks = _jit(backend.write_blocks, donate_argnums=0)
        self.block_leaves, self.block_treedef, self._block_axes = block_layout(backend.read_blocks, self.pages)
        self.bytes_per_block = sum(
            int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in self.block_leaves
        )

    def table_width(self, max_blocks: int) -> int:
        """Table columns a step needs when no live row holds more than ``max_blocks``
        blocks: a power of two, at least ``max_blocks_per_seq / 4`` (so at most three
        widths and compiles stay bounded), capped at ``max_blocks_per_seq``."""
        full = self.config.max_blocks_per_seq
        if not self.config.narrow_tables:
            return full
        return bucket(max(max_blocks, 1), full, lo=bucket(-(-full // 4), full))

    def _run_step(self, name: str, fused: Callable, *args, greedy_only: bool, width: int) -> StepOut:
        """Call a fused step, attributing any trace it causes to this runner."""
        before = _TRACES[fused]
        start = time.perf_counter()
        out, self.cache_state, self.pages = fused(
            self.params, self.cache_state, self.pages, *args, greedy_only=greedy_only, width=width,
        )
        if traced := _TRACES[fused] - before:
            # Tracing and compiling happen inside the call, before it returns (execution
            # is asynchronous): the call's time is the compile time.
            self.traces[name] += traced
            self.compile_seconds += time.perf_counter() - start
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

    def prefill_area(self) -> int:
        """The most padded tokens one prefill call computes: ``max_num_batched_tokens``
        rounded up to a power of two (>= 16)."""
        return max(bucket(self.config.max_num_batched_tokens, 1 << 30), 16)

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every prefill call shape ``(rows, width)`` ``plan_prefill`` may use, widest first.

        Both are powers of two: width from 16 up to the area ``A`` (``prefill_area``),
        rows from 1 up to ``max_num_seqs``, with ``rows * width <= A``. A call therefore
        never computes more than ``A`` padded tokens, and a lone chunk of ``n`` tokens
        (the common case: a sequence admitted as another finished) costs at most
        ``max(16, 2n)`` rather than ``A``. At most ``log2(A / 16) + 1`` widths.
        """
        cfg = self.config
        area = self.prefill_area()
        shapes, width = [], area
        while width >= 16:
            rows = 1
            while rows * width <= area and rows <= cfg.max_num_seqs:
                shapes.append((rows, width))
                rows *= 2
            width //= 2
        return shapes

    def plan_prefill(self, lengths: list[int]) -> list[tuple[int, int, list[int]]]:
        """Group chunks into prefill calls: ``[(rows, width, chunk indices), ...]``.

        Longest chunks first; a call's width is the power of two (>= 16) holding its
        longest chunk, and it takes as many of the next chunks as ``rows * width <= A``
        allows, its rows padded to a power of two. Padding stays below 2x in each
        dimension, and a step's chunks (at most ``max_num_batched_tokens`` tokens) go in
        one call unless their lengths are very uneven.
        """
        area = self.prefill_area()
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        calls: list[tuple[int, int, list[int]]] = []
        while order:
            width = bucket(max(lengths[order[0]], 1), area, lo=16)
            take = order[: min(area // width, self.config.max_num_seqs)]
            order = order[len(take):]
            calls.append((bucket(len(take), self.config.max_num_seqs), width, take))
        return calls

    def prefill(
        self, slots: list[int], chunks: list[list[int]], rows: list[SampleRow], max_blocks: int, shape: tuple[int, int]
    ) -> StepOut:
        """Append each chunk to its row and sample a token at each row's last one.

        ``shape``: ``(rows, width)`` from ``plan_prefill``. ``max_blocks``: the most
        blocks any live row holds after this step; unused: a prefill call attends
        through the whole table (``max_blocks_per_seq`` columns), so each ``(rows,
        width)`` shape compiles once, not once per table width. A prefill's attention is
        a small part of its cost next to its matmuls (e.g. 256 new tokens over 1024
        keys: ~1/3 of the matmul FLOPs, at the widest), and while long sequences run,
        which is most of the time, the narrowed width would be the full one anyway.
        Returns device arrays (fetch them with ``fetch``).
        """
        del max_blocks
        size, width = shape
        assert len(slots) <= size and max(map(len, chunks)) <= width
        tokens = np.zeros((size, width), np.int32)
        num_tokens = np.zeros((size,), np.int32)
        for i, chunk in enumerate(chunks):
            tokens[i, : len(chunk)] = chunk
            num_tokens[i] = len(chunk)
        return self._run_step(
            "prefill", self._prefill, tokens, self._ids(slots, size), num_tokens, *self._sampling(rows, size),
            greedy_only=_all_greedy(rows), width=self.config.max_blocks_per_seq,
        )

    def plan_decode(self, blocks: list[int]) -> list[tuple[list[int], int]]:
        """Group decode rows into calls: ``[(row indices, max blocks among them), ...]``.

        ``blocks[i]``: blocks row i holds after its append. A call's attention reads
        ``decode_size(rows) * table_width(max blocks)`` keys, so one call for a batch of
        mostly short rows and a few long ones reads mostly padding; splitting it by table
        width costs one more call (its fixed cost, its own row padding). Rows sorted by
        length are cut at table-width boundaries, every cut subset is priced with
        ``decode_cost``, and the cheapest grouping wins (fewest calls on ties). The same
        rule serves every engine (the static baseline included).
        """
        order = sorted(range(len(blocks)), key=lambda i: blocks[i])
        if not (self.config.split_decode and self.config.narrow_tables) or len(blocks) < 2:
            return [(order, max(blocks))]
        widths = [self.table_width(blocks[i]) for i in order]
        cuts = [k for k in range(1, len(order)) if widths[k] != widths[k - 1]]
        fixed, per_row, per_key = self.config.decode_cost
        bs = self.config.block_size

        def cost(lo: int, hi: int) -> float:
            size = self.decode_size(hi - lo)
            return fixed + size * (per_row + per_key * widths[hi - 1] * bs)

        best = None
        for mask in range(1 << len(cuts)):
            bounds = [0, *(c for j, c in enumerate(cuts) if mask >> j & 1), len(order)]
            total = sum(cost(a, b) for a, b in zip(bounds, bounds[1:]))
            key = (total, len(bounds))
            if best is None or key < best[0]:
                best = (key, bounds)
        bounds = best[1]
        return [(order[a:b], blocks[order[b - 1]]) for a, b in zip(bounds, bounds[1:])]

    def decode_size(self, n: int) -> int:
        """Rows of a decode call for ``n`` sequences: a multiple of 8 (at least 8, at most
        ``max_num_seqs``). A padding row costs as much as a real one once the matmuls
        are compute-bound (CPU, batch >= ~8), so the buckets are finer than powers of two
        (padding < 8 rows), at the price of at most ``max_num_seqs / 8`` compiled sizes
        per table width. Below 8 rows the cost barely changes (weights dominate)."""
        cap = self.config.max_num_seqs
        return min(max(8, -(-n // 8) * 8), cap)

    def decode(self, slots: list[int], tokens: list[int], rows: list[SampleRow], max_blocks: int) -> StepOut:
        """Append one token to each row and sample the next (device arrays, padded)."""
        size = self.decode_size(len(slots))
        toks = np.asarray(list(tokens) + [0] * (size - len(tokens)), np.int32)
        return self._run_step(
            "decode", self._decode, toks, self._ids(slots, size), *self._sampling(rows, size),
            greedy_only=_all_greedy(rows), width=self.table_width(max_blocks),
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
        # Fetch the whole (small) table and slice on the host: device slicing with a
        # Python index would compile a program per (slot, length).
        ids = np.asarray(self.cache_state.block_tables)[slot, :num_blocks]
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
        new_ids = np.asarray(rows)[0, :num_blocks]
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
