"""What the sharing studies (beam, parallel sampling, prefix caching, multiturn, eviction)
share: their block size, workloads and roomy engines on ``models.memory_model``, and how
memory saved by sharing is measured (``memory_of``). ``workload`` also serves the memory study.

Memory is measured in KV blocks every engine step: *physical* = blocks allocated (a block
several sequences share counted once) and *unshared* = the blocks the same sequences
would hold if every block were private (ceil(length / block_size) each). The saving is
``1 - physical / unshared``, over the time average of both (each step weighs the same)
and at their peaks. The pool is roomy (nothing is preempted), so memory follows demand.
"""

from __future__ import annotations

from experiments.lib import models
from paged_jax.config import blocks_for

BLOCK_SIZE = 16
# Each workload's lengths scaled to this context (2048: the vLLM paper's own Alpaca means;
# ShareGPT at half scale keeps a CPU run short). Engines get just the room the requests need.
LENGTH_CONTEXTS = {"alpaca_like": 2048, "sharegpt_like": 1024}


def workload(name: str, num_requests: int, length_context: int, vocab_size: int, seed: int = 0):
    """Requests with ``name``'s lengths scaled to ``length_context`` (2048 = the paper's
    own means; see ``paged_jax.workloads``)."""
    from paged_jax import workloads

    make = {"alpaca_like": workloads.alpaca_like, "sharegpt_like": workloads.sharegpt_like}[name]
    return make(num_requests, max_model_len=length_context, vocab_size=vocab_size, seed=seed)


def study_streams(quick: bool) -> tuple[int, dict, dict]:
    """(requests per workload, each workload's length context, each workload's requests)
    for the beam and parallel studies (vocabulary ``models.VOCAB``): 4 requests and ShareGPT
    at 256 with ``quick``."""
    num_requests = 4 if quick else 16
    contexts = dict(LENGTH_CONTEXTS, sharegpt_like=256) if quick else dict(LENGTH_CONTEXTS)
    return num_requests, contexts, {name: workload(name, num_requests, c, models.VOCAB)
                                    for name, c in contexts.items()}


def engine_len(*streams) -> int:
    """The shortest ``max_model_len`` (a whole number of blocks) that holds every request
    of every stream."""
    longest = max(len(r.prompt_token_ids) + r.max_tokens for requests in streams for r in requests)
    return blocks_for(longest, BLOCK_SIZE) * BLOCK_SIZE


def roomy_engine(model, max_model_len: int, max_num_seqs: int, **kw):
    """An engine whose pool holds every sequence at full length (no preemption)."""
    from paged_jax.engine import LLM

    blocks = max_num_seqs * blocks_for(max_model_len, BLOCK_SIZE)
    return LLM(model, block_size=BLOCK_SIZE, num_gpu_blocks=blocks, max_num_seqs=max_num_seqs,
               max_model_len=max_model_len, max_num_batched_tokens=max(512, max_num_seqs), attention_impl="xla",
               **kw)


def engines(max_model_len: int, max_num_seqs: int):
    """A maker of roomy engines over one model (``models.memory_model``) with one set of
    shapes, so that a study compiles each step shape once however many engines it runs."""
    model = models.memory_model(max_model_len)
    return lambda **kw: roomy_engine(model, max_model_len, max_num_seqs, **kw)


def memory_of(llm) -> dict:
    """Physical vs unshared blocks of the run so far (``LLM.stats``), and the saving."""
    s = llm.stats()
    mean_physical, mean_unshared = s["mean_blocks_allocated"], s["mean_blocks_unshared"]
    return {
        "mean_physical_blocks": mean_physical,
        "mean_unshared_blocks": mean_unshared,
        "peak_physical_blocks": s["peak_blocks_allocated"],
        "peak_unshared_blocks": s["peak_blocks_unshared"],
        "saving": 1 - mean_physical / mean_unshared if mean_unshared else 0.0,
        "peak_saving": 1 - s["peak_blocks_allocated"] / s["peak_blocks_unshared"] if s["peak_blocks_unshared"] else 0.0,
        "steps": s["steps"],
        "tokens_per_s": s["tokens_per_s_excl_compile"],
    }
