"""The model step over a replica's mesh: XLA partitions the matmuls, attention runs per shard.

``make_sharded_step(config, impl, mesh)`` is ``steps.make_model_step``'s step with one
difference: the copy-on-write copies and each layer's K/V write and paged attention run
under ``jax.shard_map`` over
"model", on the device's own kv heads of the pages and its own query heads, whatever
the implementation (the Pallas kernels included: each sees a model with ``Hq / t`` query
and ``Hkv / t`` kv heads). The block tables, lengths and slot mapping enter every shard
whole (replicated), so a block id names the same block on every device and no page ever
moves between devices. Everything else is XLA's SPMD partitioning of the sharded weights
(``sharding.param_spec``): q/k/v and gate/up column-parallel, o_proj and down_proj
row-parallel, i.e. two all-reduces of ``[B, T, hidden]`` per layer and none of the pages.

The step's outputs are pinned: logits, status and the block manager replicated, the
pages split by kv head, so every later program (housekeeping, snapshot, the next step)
sees the same shardings and compiles once.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from paged_jax.kv.pages import copy_blocks
from paged_jax.model.config import ModelConfig
from paged_jax.model.llama import PagedContext, make_paged_attend
from paged_jax.parallel.mesh import MODEL
from paged_jax.parallel.sharding import PAGE_SPEC, REPLICATED

HEADS = P(None, None, MODEL)  # q [B, T, Hq, D], k and v [B, T, Hkv, D]: heads over "model"


@functools.cache
def sharded_attend_factory(mesh: Mesh):
    """``(ctx, *, impl) -> AttendFn`` running ``make_paged_attend``'s write + attention
    per shard on ``mesh`` (one object per mesh, so the step built from it is cached)."""

    def factory(ctx: PagedContext, *, impl: str):
        def local(pages, layer, q, k, v, ctx):
            return make_paged_attend(ctx, impl=impl)(pages, layer, q, k, v)

        def attend(pages, layer, q, k, v):
            return jax.shard_map(
                local, mesh=mesh, in_specs=(PAGE_SPEC, REPLICATED, HEADS, HEADS, HEADS, REPLICATED),
                out_specs=(HEADS, PAGE_SPEC), check_vma=False,
            )(pages, layer, q, k, v, ctx)

        return attend

    return factory


@functools.cache
def sharded_copy(mesh: Mesh):
    """``kv.copy_blocks`` per shard: each device copies its heads of the blocks. (Left to
    XLA's partitioner the copy was local too, but over the global pool's shape, whose
    flattening around a size-1 local head axis cost two pool copies per step.)"""
    return jax.shard_map(copy_blocks, mesh=mesh, in_specs=(PAGE_SPEC, REPLICATED, REPLICATED), out_specs=PAGE_SPEC,
                         check_vma=False)


@functools.cache
def make_sharded_step(model_config: ModelConfig, attention_impl: str, mesh: Mesh):
    """The model step (``paged_jax.steps``' contract) for weights placed by
    ``sharding.shard_params`` and pages split by kv head on ``mesh`` (module docstring).
    ``model_config.num_kv_heads`` is the stored kv heads (after any replication)."""
    from paged_jax.steps import make_model_step

    step = make_model_step(model_config, attention_impl, make_attend=sharded_attend_factory(mesh),
                           copy=sharded_copy(mesh))
    replicated, paged = NamedSharding(mesh, REPLICATED), NamedSharding(mesh, PAGE_SPEC)

    def sharded_step(params, state, pages, tokens, seq_ids, num_tokens, *, all_logits: bool = False):
        logits, state, pages, status = step(params, state, pages, tokens, seq_ids, num_tokens,
                                            all_logits=all_logits)
        pin = jax.lax.with_sharding_constraint
        return (pin(logits, replicated), pin(state, replicated), pin(pages, jax.tree.map(lambda _: paged, pages)),
                pin(status, replicated))

    return sharded_step
