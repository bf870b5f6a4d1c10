"""Seeded synthetic request streams with skewed prompt and output lengths.

Each request is random token ids (uniform over the vocabulary; the content does not
matter to memory or throughput), a number of output tokens, and an arrival index (its
position in the stream: offline batches arrive all at once, in this order).

Lengths are lognormal, the usual model of chat-length data (a long right tail), with
parameters from the vLLM paper (Kwon et al., SOSP 2023, Fig. 11), measured on OPT's
2048-token context:

============  ==========  ===========  ==============================================
dataset       mean input  mean output  shape (sigma of log-length; our assumption)
============  ==========  ===========  ==============================================
ShareGPT      161.31      337.99       1.0 input, 0.9 output: long multi-turn chats
Alpaca        19.31       58.45        0.6 input, 0.8 output: short instructions
============  ==========  ===========  ==============================================

The means are the paper's; the sigmas are chosen by eye to give the long right tails of
its histograms and are not fitted (the paper gives no dispersion figures). Means are
scaled by ``max_model_len / 2048`` so a stream keeps its shape relative to the context
the engine serves. Each length is drawn as ``exp(N(mu, sigma))`` with ``mu = ln(mean) -
sigma**2 / 2`` (so the unclipped mean is ``mean``), rounded, and clipped so that
``1 <= prompt <= max_model_len - 1`` and ``1 <= prompt + output <= max_model_len``;
clipping lowers the realised means slightly (``describe`` reports them).

Fixed-length streams (every request the same) are the controls.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

PAPER_CONTEXT = 2048  # OPT's context, over which the paper's means were measured


class Request(NamedTuple):
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # output tokens to generate (run with ignore_eos for exact lengths)
    arrival: int  # position in the stream


class LengthModel(NamedTuple):
    """Lognormal prompt and output lengths, means at ``PAPER_CONTEXT``."""

    input_mean: float
    output_mean: float
    input_sigma: float
    output_sigma: float
    source: str


SHAREGPT = LengthModel(161.31, 337.99, 1.0, 0.9, "vLLM paper Fig. 11 (ShareGPT); sigmas assumed")
ALPACA = LengthModel(19.31, 58.45, 0.6, 0.8, "vLLM paper Fig. 11 (Alpaca); sigmas assumed")


def _lognormal(rng: np.random.Generator, n: int, mean: float, sigma: float) -> np.ndarray:
    mu = np.log(mean) - sigma**2 / 2
    return np.rint(rng.lognormal(mu, sigma, n)).astype(np.int64)


def synthetic(
    num_requests: int, model: LengthModel, *, max_model_len: int, vocab_size: int, seed: int = 0
) -> list[Request]:
    """``num_requests`` requests with lengths from ``model`` scaled to ``max_model_len``."""
    if num_requests < 0:
        raise ValueError(f"num_requests={num_requests}: must be >= 0")
    if max_model_len < 2:
        raise ValueError(f"max_model_len={max_model_len}: must be >= 2 (a prompt and an output token)")
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size}: must be >= 1")
    rng = np.random.default_rng(seed)
    scale = max_model_len / PAPER_CONTEXT
    inputs = np.clip(_lognormal(rng, num_requests, model.input_mean * scale, model.input_sigma), 1, max_model_len - 1)
    outputs = _lognormal(rng, num_requests, model.output_mean * scale, model.output_sigma)
    outputs = np.clip(outputs, 1, max_model_len - inputs)
    return [
        Request(tuple(rng.integers(0, vocab_size, int(p)).tolist()), int(o), i)
        for i, (p, o) in enumerate(zip(inputs, outputs, strict=True))
    ]


def sharegpt_like(num_requests: int, *, max_model_len: int, vocab_size: int, seed: int = 0) -> list[Request]:
    """Long, heavily skewed chats (ShareGPT's means, scaled to ``max_model_len``)."""
    return synthetic(num_requests, SHAREGPT, max_model_len=max_model_len, vocab_size=vocab_size, seed=seed)


def alpaca_like(num_requests: int, *, max_model_len: int, vocab_size: int, seed: int = 0) -> list[Request]:
    """Short instructions (Alpaca's means, scaled to ``max_model_len``)."""
    return synthetic(num_requests, ALPACA, max_model_len=max_model_len, vocab_size=vocab_size, seed=seed)


def fixed_length(
    num_requests: int, *, prompt_len: int, output_len: int, vocab_size: int, seed: int = 0
) -> list[Request]:
    """Every request ``prompt_len`` prompt tokens and ``output_len`` output tokens."""
    if prompt_len < 1 or output_len < 1:
        raise ValueError(f"prompt_len={prompt_len}, output_len={output_len}: both must be >= 1")
    rng = np.random.default_rng(seed)
    return [
        Request(tuple(rng.integers(0, vocab_size, prompt_len).tolist()), output_len, i)
        for i in range(num_requests)
    ]


def describe(requests: list[Request]) -> dict:
    """Realised length statistics of a stream (after clipping)."""
    p = np.array([len(r.prompt_token_ids) for r in requests], dtype=np.float64)
    o = np.array([r.max_tokens for r in requests], dtype=np.float64)
    if not len(requests):
        return {"num_requests": 0}
    return {
        "num_requests": len(requests),
        "mean_prompt": float(p.mean()),
        "mean_output": float(o.mean()),
        "p50_prompt": float(np.median(p)),
        "p99_prompt": float(np.percentile(p, 99)),
        "p50_output": float(np.median(o)),
        "p99_output": float(np.percentile(o, 99)),
        "max_total": int((p + o).max()),
    }
