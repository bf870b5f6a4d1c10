"""Request intake: what a caller hands ``generate`` / ``add_request``, checked against the
engine's limits and turned into ``SequenceGroup``s, before anything runs.

Every check happens for every request of a call before any is queued, so a bad request
loses nothing: ``ValueError`` names the request index and the limit (an empty prompt, a
token outside the vocabulary, a prompt that cannot fit ``max_model_len``, ``n`` or
``beam_width`` above ``max_num_seqs``, beam candidates beyond the vocabulary). A request
whose members can never fit the whole pool, even sharing their prompt, is *rejected*
instead (``rejection``): it gets an empty output naming the limit, and the call's other
requests run.
"""

from __future__ import annotations

import time

from paged_jax.config import blocks_for
from paged_jax.engine import beam as beam_lib
from paged_jax.engine.beam import BeamSearchParams
from paged_jax.engine.config import EngineConfig
from paged_jax.engine.prompts import Prompt
from paged_jax.engine.sampling import SamplingParams, completion_seed, seed_for
from paged_jax.engine.sequence import Sequence, SequenceGroup


def params_list(sampling_params, num_prompts: int, default) -> list:
    """One params object per prompt: ``sampling_params`` for all, one per prompt, or
    ``default`` (None given). ValueError for a wrong count or type."""
    if sampling_params is None:
        sampling_params = default
    if isinstance(sampling_params, SamplingParams | BeamSearchParams):
        params = [sampling_params] * num_prompts
    else:
        params = list(sampling_params)
        if len(params) != num_prompts:
            raise ValueError(f"{len(params)} sampling_params for {num_prompts} prompts")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams | BeamSearchParams):
            raise ValueError(f"sampling_params[{i}]={p!r}: expected SamplingParams or BeamSearchParams")
    return params


def priorities(priority, num_prompts: int) -> list[int]:
    """vLLM's ``priority``: None (all 0), or one int per prompt (lower runs sooner under
    ``admission_policy="priority"``)."""
    if priority is None:
        return [0] * num_prompts
    values = list(priority)
    if len(values) != num_prompts or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ValueError(f"priority={priority!r}: expected one int per prompt ({num_prompts})")
    return values


def beam_eos(config: EngineConfig, p: BeamSearchParams) -> tuple[int, ...]:
    """The ids that end a hypothesis of a beam search."""
    if p.ignore_eos:
        return ()
    if p.eos_token_id is not None:
        return p.eos_token_id
    return config.model.eos_token_ids


def validate(config: EngineConfig, i: int, prompt: list[int], p) -> str | None:
    """Raise ValueError for request ``i``'s impossible fields; return why it can never fit
    the pool (even with every member's prompt shared, the members' tails private), or None."""
    model, cache, sched = config.model, config.cache, config.scheduler
    if isinstance(p, BeamSearchParams) and config.speculative is not None:
        raise ValueError(f"request {i}: beam search with speculative decoding is not supported "
                         f"(speculative method {config.speculative.method!r})")
    if len(prompt) == 0:
        raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
    bad = [t for t in prompt if not 0 <= t < model.vocab_size]
    if bad:
        raise ValueError(f"prompt {i} has token ids outside [0, {model.vocab_size}): {bad[:5]}")
    if len(prompt) >= model.max_model_len:
        raise ValueError(
            f"prompt {i} has {len(prompt)} tokens; it must be shorter than max_model_len={model.max_model_len} "
            f"(room for at least one output token; the KV pool holds {cache.num_blocks} blocks of "
            f"{cache.block_size} tokens)")
    bias = getattr(p, "logit_bias", None)
    if bias and (outside := [t for t in bias if t >= model.vocab_size]):
        raise ValueError(f"request {i}: logit_bias: token ids outside the vocabulary [0, {model.vocab_size}): "
                         f"{sorted(outside)[:5]}")
    members, field = (p.beam_width, "beam_width") if isinstance(p, BeamSearchParams) else (p.n, "n")
    if members > sched.max_num_seqs:
        raise ValueError(f"request {i}: {field}={members} exceeds max_num_seqs={sched.max_num_seqs}")
    if isinstance(p, BeamSearchParams):
        k = beam_lib.num_candidates(p.beam_width, len(beam_eos(config, p)))
        if k > model.vocab_size:
            raise ValueError(f"request {i}: beam_width={p.beam_width} keeps {k} candidates a step, more than "
                             f"the vocabulary ({model.vocab_size})")
    bs = cache.block_size
    total = min(len(prompt) + p.max_tokens, model.max_model_len)
    shared = (len(prompt) - 1) // bs if members > 1 and sched.share_blocks else 0
    need = shared + members * (blocks_for(total, bs) - shared)
    if need > cache.num_blocks:
        return (f"request {i}: {field}={members} sequences of up to {total} tokens need up to {need} blocks "
                f"of {bs} tokens (the prompt's full blocks shared) but the KV pool has {cache.num_blocks}: "
                "it can never fit")
    return None


def make_group(config: EngineConfig, request_id: str, index: int, prompt: Prompt, p, *,
               priority: int = 0, rejected: str | None = None) -> SequenceGroup:
    """The ``SequenceGroup`` of one request: ``n`` completions, or ``beam_width`` beams,
    each capped at ``max_model_len``; default seeds from (engine seed, request id)."""
    tokens = tuple(prompt.token_ids)
    max_tokens = min(p.max_tokens, config.model.max_model_len - len(tokens))
    if isinstance(p, BeamSearchParams):
        eos = beam_eos(config, p)
        seqs = [Sequence(request_id, index, tokens, p, seed=0, max_tokens=max_tokens, completion=b)
                for b in range(p.beam_width)]
        group = SequenceGroup(request_id, index, tokens, p, seqs, beam=beam_lib.init_state(p.beam_width, len(eos)),
                              eos=eos)
    else:
        seed = seed_for(config.model.seed, request_id, p.seed)
        seqs = [Sequence(request_id, index, tokens, p, seed=completion_seed(seed, i), max_tokens=max_tokens,
                         completion=i) for i in range(p.n)]
        group = SequenceGroup(request_id, index, tokens, p, seqs)
    group.cache_salt = prompt.cache_salt
    group.prompt_text = prompt.text
    group.priority = priority
    group.rejected = rejected
    group.metrics = {"arrival_time": time.time()}
    return group


def cost(prompt: list[int], p) -> int:
    """The most tokens a request can hold: prompt + members x max_tokens (the router's load)."""
    members = p.beam_width if isinstance(p, BeamSearchParams) else p.n
    return len(prompt) + members * p.max_tokens
