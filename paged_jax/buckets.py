"""Padding to buckets: the one place batch and length shapes are chosen.

Every jitted step compiles once per input shape, so a serving loop whose batches grow and
shrink by one row at a time must pad them to a small set of shapes. Host-side NumPy only;
padding rows carry sequence id ``NO_SEQ``, which every block-manager op and step ignores.

- ``bucket``: the next power of two (or the smallest of given buckets), with a floor and
  a cap.
- ``decode_buckets`` / ``decode_rows``: decode batch sizes (powers of two from 8 by default).
- ``prefill_shapes`` / ``plan_prefill``: prefill calls of power-of-two (rows, width) with
  bounded area.
- ``packed_width`` / ``packed_shapes`` / ``pack_batch``: a packed call (every row's tokens
  one after another, ``paged_jax.steps``): rows padded to a decode bucket, tokens to a
  width that is the rows (a decode step) or a power of two.
- ``pad_batch`` / ``pad_decode`` / ``pad_ids``: the padded arrays themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from paged_jax.cache.sentinels import NO_SEQ

MIN_PREFILL_WIDTH = 16  # narrowest prefill chunk: below it a call costs the same anyway


def bucket(n: int, buckets: Sequence[int] | None = None, *, lo: int = 1, cap: int | None = None) -> int:
    """Smallest bucket >= ``max(n, lo)``: a power of two, or the smallest of ``buckets``;
    with ``cap``, at most ``cap`` (which must itself be >= n).

    Raises ValueError if n < 0, if n exceeds every given bucket, or if n > cap.
    """
    if n < 0:
        raise ValueError(f"cannot bucket a negative size ({n})")
    if cap is not None and n > cap:
        raise ValueError(f"size {n} exceeds the cap {cap}")
    n = max(n, lo)
    if buckets is None:
        size = 1 << max(n - 1, 0).bit_length()
    else:
        fits = [x for x in buckets if x >= n]
        if not fits:
            raise ValueError(f"size {n} exceeds the largest bucket {max(buckets)}")
        size = min(fits)
    return size if cap is None else min(size, cap)


def decode_buckets(cap: int, sizes: Sequence[int] | None = None) -> tuple[int, ...]:
    """The decode batch sizes steps compile, ascending, the largest ``cap``
    (``max_num_seqs``).

    Default: powers of two from 8, then ``cap``. Each size is a compiled program (seconds
    on a CPU), so a first call that fills the batch and drains it compiles at most
    ``log2(cap / 8) + 1`` of them; padding costs up to 2x rows, which is nearly free
    where a decode step reads the weights (an accelerator, small batches) and costs in
    proportion where matmuls are compute-bound (CPU above ~8 rows). ``sizes`` (e.g.
    multiples of 8, as CPU throughput studies pass) chooses finer or coarser steps; sizes
    above ``cap`` are dropped and ``cap`` is always added.
    """
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ValueError(f"cap={cap!r}: must be an int >= 1")
    if sizes is None:
        sizes = [1 << p for p in range(3, cap.bit_length())]
    else:
        sizes = list(sizes)
        bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1]
        if bad or not sizes:
            raise ValueError(f"decode buckets {sizes!r}: need a non-empty list of ints >= 1")
    return tuple(sorted({int(s) for s in sizes if s < cap} | {cap}))


def multiples_of(step: int, cap: int) -> tuple[int, ...]:
    """``step, 2 step, ...`` up to ``cap`` (and ``cap``): fine decode buckets."""
    return decode_buckets(cap, range(step, cap + 1, step))


def decode_rows(n: int, sizes: Sequence[int]) -> int:
    """Rows of a decode call for ``n`` sequences: the smallest of ``sizes`` (ascending,
    from ``decode_buckets``) holding them."""
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"{n} decode rows exceed the largest bucket {sizes[-1]}")


def prefill_area(max_num_batched_tokens: int) -> int:
    """The most padded tokens one prefill call computes: the token budget rounded up to a
    power of two, at least ``MIN_PREFILL_WIDTH``."""
    return bucket(max_num_batched_tokens, lo=MIN_PREFILL_WIDTH)


def prefill_shapes(area: int, max_rows: int, max_width: int | None = None) -> list[tuple[int, int]]:
    """Every prefill call shape ``(rows, width)`` that ``plan_prefill`` may use, widest first.

    Both are powers of two: width from ``MIN_PREFILL_WIDTH`` up to ``area`` (and up to the
    bucket of ``max_width``, the longest chunk there can be), rows from 1 up to
    ``max_rows``, with ``rows * width <= area``. A call never computes more than ``area``
    padded tokens, and a lone chunk of ``n`` tokens costs at most ``max(16, 2n)``.
    """
    shapes = []
    # chunked prefill: no chunk is wider than the area, however long a row may grow
    width = area if max_width is None else bucket(min(max_width, area), lo=MIN_PREFILL_WIDTH, cap=area)
    while width >= MIN_PREFILL_WIDTH:
        rows = 1
        while rows * width <= area and rows <= max_rows:
            shapes.append((rows, width))
            rows *= 2
        width //= 2
    return shapes


def plan_prefill(lengths: Sequence[int], area: int, max_rows: int) -> list[tuple[int, int, list[int]]]:
    """Group chunks into prefill calls: ``[(rows, width, chunk indices), ...]``.

    Longest chunks first; a call's width is the power of two (>= 16) holding its longest
    chunk, and it takes as many of the next chunks as ``rows * width <= area`` allows, its
    rows padded to a power of two. Padding stays below 2x in each dimension.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    calls: list[tuple[int, int, list[int]]] = []
    while order:
        width = bucket(max(lengths[order[0]], 1), lo=MIN_PREFILL_WIDTH, cap=area)
        take = order[: min(area // width, max_rows)]
        order = order[len(take):]
        calls.append((bucket(len(take), cap=max_rows), width, take))
    return calls


def packed_width(total: int, rows: int) -> int:
    """Token width of a packed call of ``rows`` (padded) rows feeding ``total`` tokens:
    ``rows`` when they fit (a decode step: one token per row), else the power of two
    (>= ``MIN_PREFILL_WIDTH``) holding them. So a call computes less than 2x its tokens,
    and the widths a batch of ``rows`` compiles are few (``packed_shapes``)."""
    if total < 0 or rows < 1:
        raise ValueError(f"a packed call of {total} tokens in {rows} rows")
    return rows if total <= rows else bucket(total, lo=MIN_PREFILL_WIDTH)


def packed_shapes(row_buckets: Sequence[int], max_tokens: int) -> list[tuple[int, int]]:
    """Every ``(rows, width)`` a packed call may take when a step feeds at most
    ``max_tokens`` tokens (``packed_width`` for each row bucket): each bucket's decode
    shape, then the powers of two above it up to the one holding ``max_tokens``."""
    shapes = []
    top = bucket(max_tokens, lo=MIN_PREFILL_WIDTH)
    for rows in row_buckets:
        shapes.append((rows, rows))
        width = bucket(rows + 1, lo=MIN_PREFILL_WIDTH)
        while width <= top:
            shapes.append((rows, width))
            width *= 2
    return shapes


class PackedBatch(NamedTuple):
    """A packed batch (numpy, ready for a model step): row b's tokens right after row b-1's."""

    tokens: np.ndarray  # int32[width]; 0 past the last row's tokens
    seq_ids: np.ndarray  # int32[rows]; NO_SEQ (-1) for padding rows
    num_tokens: np.ndarray  # int32[rows]; 0 for padding rows
    starts: np.ndarray  # int32[len(token_lists)]: where each given row's tokens start


def pack_batch(seq_ids: Sequence[int], token_lists: Sequence[Sequence[int]], *, rows: int,
               width: int) -> PackedBatch:
    """Pack rows' new tokens one after another into ``width`` slots, the rows padded to
    ``rows`` (``packed_width`` chooses the width)."""
    if len(seq_ids) != len(token_lists):
        raise ValueError(f"{len(seq_ids)} seq_ids but {len(token_lists)} token lists")
    lens = np.fromiter((len(x) for x in token_lists), np.int64, len(token_lists))
    if len(seq_ids) > rows or lens.sum() > width:
        raise ValueError(f"{len(seq_ids)} rows of {int(lens.sum())} tokens do not fit {rows} rows x {width} tokens")
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int32) if len(lens) else np.zeros(0, np.int32)
    tokens = np.zeros(width, np.int32)
    if len(lens):
        tokens[: int(lens.sum())] = np.concatenate([np.asarray(x, np.int32) for x in token_lists])
    num = np.zeros(rows, np.int32)
    num[: len(lens)] = lens
    return PackedBatch(tokens, pad_ids(seq_ids, rows), num, starts)


def pad_ids(ids: Sequence[int], size: int) -> np.ndarray:
    """int32[size]: ``ids`` followed by ``NO_SEQ`` padding."""
    if len(ids) > size:
        raise ValueError(f"{len(ids)} ids do not fit in {size}")
    out = np.full((size,), NO_SEQ, np.int32)
    out[: len(ids)] = ids
    return out


class PaddedBatch(NamedTuple):
    """A prefill batch padded to buckets (numpy, ready for a model step)."""

    tokens: np.ndarray  # int32[B_bucket, T_bucket]; 0 past each row's tokens
    seq_ids: np.ndarray  # int32[B_bucket]; NO_SEQ (-1) for padding rows
    num_tokens: np.ndarray  # int32[B_bucket]; 0 for padding rows


def pad_batch(
    seq_ids: Sequence[int],
    token_lists: Sequence[Sequence[int]],
    *,
    batch_buckets: Sequence[int] | None = None,
    length_buckets: Sequence[int] | None = None,
    shape: tuple[int, int] | None = None,
) -> PaddedBatch:
    """Pad ragged prefill chunks to a (batch, length) bucket, or to ``shape`` exactly.

    Args:
      seq_ids: one sequence id per row.
      token_lists: the new tokens of each row (a chunk; lengths may differ).
      batch_buckets, length_buckets: allowed padded sizes; default powers of two.
      shape: ``(rows, width)`` to pad to (e.g. from ``plan_prefill``); overrides buckets.
    """
    if len(seq_ids) != len(token_lists):
        raise ValueError(f"{len(seq_ids)} seq_ids but {len(token_lists)} token lists")
    if shape is None:
        shape = (bucket(len(seq_ids), batch_buckets), bucket(max((len(x) for x in token_lists), default=1), length_buckets))
    b, t = shape
    if len(seq_ids) > b or any(len(x) > t for x in token_lists):
        raise ValueError(f"{len(seq_ids)} chunks of up to {max(map(len, token_lists), default=0)} tokens do not fit {shape}")
    tokens = np.zeros((b, t), np.int32)
    num = np.zeros((b,), np.int32)
    for i, toks in enumerate(token_lists):
        tokens[i, : len(toks)] = toks
        num[i] = len(toks)
    return PaddedBatch(tokens, pad_ids(seq_ids, b), num)


def pad_decode(
    seq_ids: Sequence[int], tokens: Sequence[int], *, batch_buckets: Sequence[int] | None = None,
    size: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens int32[B], seq_ids int32[B])`` for a decode step (one token per row);
    ``B`` is ``size`` or the batch bucket. Padding rows have seq_id NO_SEQ and token 0."""
    if len(seq_ids) != len(tokens):
        raise ValueError(f"{len(seq_ids)} seq_ids but {len(tokens)} tokens")
    b = bucket(len(seq_ids), batch_buckets) if size is None else size
    out_tokens = np.zeros((b,), np.int32)
    out_tokens[: len(tokens)] = tokens
    return out_tokens, pad_ids(seq_ids, b)
