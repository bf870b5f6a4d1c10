"""Where every array of a replica lives on its ``("data", "model")`` mesh.

- **Weights**, Megatron-style over "model": q/k/v projections and the MLP's gate/up are
  column-parallel (their output features split: whole heads, whole MLP columns), o_proj
  and down_proj row-parallel (their input features split; the partial products are summed
  by one all-reduce each per layer). Norms, the embedding and the LM head are replicated.
  Stacked per-layer parameters (``[L, ...]``) keep their layer axis whole.
- **KV pages** (``[L, Hkv, N, bs, D]``, and quantised pages' scales ``[L, Hkv, N, ...]``):
  split along the kv-head axis, so each device holds its heads of every block and a block
  id means the same block on every device.
- **The block manager** (tables, lengths, ref counts, the pool) and every step input:
  replicated over the replica's devices; each runs the same pure functions on its copy.

Arrays are built with ``jax.make_array_from_callback`` from host data every process holds
(each process loads the checkpoint), so the same code places them across processes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from paged_jax.model.config import ModelConfig
from paged_jax.parallel.mesh import MODEL, KVHeadLayout

# Parameter path (without the leading "layers") -> which axis of the unstacked tensor is
# split over "model": the output features of column-parallel projections (and their
# biases), the input features of row-parallel ones.
_COLUMN = {("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("mlp", "gate_proj"),
           ("mlp", "up_proj")}
_ROW = {("self_attn", "o_proj"), ("mlp", "down_proj")}

PAGE_SPEC = P(None, MODEL)  # every page leaf [L, Hkv, N, ...]: kv heads over "model"
REPLICATED = P()


def param_spec(path: tuple, ndim: int) -> P:
    """The ``PartitionSpec`` of one parameter, by its ``nnx`` path and rank.

    ``('layers', 'self_attn', 'q_proj', 'kernel')`` ([L, hidden, Hq*D]) -> P(None, None,
    'model'); its bias ([L, Hq*D]) -> P(None, 'model'); o_proj's kernel ([L, Hq*D,
    hidden]) -> P(None, 'model', None) and its bias replicated; anything else replicated.
    """
    parts = tuple(str(p) for p in path)
    if parts[0] != "layers" or len(parts) < 4:
        return REPLICATED
    module, leaf = parts[1:3], parts[-1]
    spec = [None] * ndim
    if module in _COLUMN:
        spec[-1] = MODEL  # kernel [L, in, out] and bias [L, out]: the output features
    elif module in _ROW and leaf == "kernel":
        spec[-2] = MODEL  # kernel [L, in, out]: the input features
    else:
        return REPLICATED
    return P(*spec)


def check_model(config: ModelConfig, tensor_parallel_size: int) -> KVHeadLayout:
    """The kv-head layout of ``config`` over t devices; ValueError naming the sizes when the
    heads (``KVHeadLayout``) or the MLP columns do not split over t."""
    layout = KVHeadLayout(config.num_heads, config.num_kv_heads, tensor_parallel_size)
    if config.intermediate_size % tensor_parallel_size:
        raise ValueError(f"intermediate_size={config.intermediate_size} is not divisible by "
                         f"tensor_parallel_size={tensor_parallel_size}")
    return layout


def replicate_kv_heads(config: ModelConfig, params: nnx.State, replicas: int) -> tuple[ModelConfig, nnx.State]:
    """The same model with every kv head stored ``replicas`` times (``KVHeadLayout``): k/v
    projections' output features repeated head by head, ``num_kv_heads`` multiplied.

    Query head h reads stored kv head ``h // (num_heads / (num_kv_heads * replicas))``,
    a copy of kv head ``h // (num_heads / num_kv_heads)``: the same attention, exactly
    (each copy's columns are the same dot products). ``replicas == 1``: unchanged."""
    if replicas == 1:
        return config, params
    d = config.head_dim

    def widen(path, x):
        parts = tuple(str(p) for p in path)
        if parts[:2] != ("layers", "self_attn") or parts[2] not in ("k_proj", "v_proj"):
            return x
        heads = x.reshape(*x.shape[:-1], config.num_kv_heads, d)
        return jnp.repeat(heads, replicas, axis=-2).reshape(*x.shape[:-1], -1)

    flat = [(p, v.replace(widen(p, v[...]))) for p, v in nnx.to_flat_state(params)]
    return config.replace(num_kv_heads=config.num_kv_heads * replicas), nnx.from_flat_state(flat)


def place(x, sharding: NamedSharding) -> jax.Array:
    """``x`` (host or device data every process holds in full) as a global array with
    ``sharding``: each device gets its slice, on whichever process it lives."""
    host = np.asarray(jax.device_get(x))
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_params(params: nnx.State, mesh: Mesh) -> nnx.State:
    """Every parameter placed by ``param_spec`` on ``mesh``."""
    flat = [(p, v.replace(place(v[...], NamedSharding(mesh, param_spec(p, v[...].ndim)))))
            for p, v in nnx.to_flat_state(params)]
    return nnx.from_flat_state(flat)


def replicate(tree, mesh: Mesh):
    """Every array leaf of ``tree`` replicated on ``mesh`` (the block manager's state)."""
    sharding = NamedSharding(mesh, REPLICATED)
    return jax.tree.map(lambda x: place(x, sharding), tree)


def page_shardings(abstract_pages, mesh: Mesh):
    """A ``NamedSharding`` per page leaf: kv heads (axis 1) over "model"."""
    return jax.tree.map(lambda _: NamedSharding(mesh, PAGE_SPEC), abstract_pages)


def per_device_bytes(tree) -> int:
    """Bytes of ``tree``'s leaves on the first device that holds any: what one device
    spends (the pages: ``1 / t`` of the pool when t divides the kv heads)."""
    leaves = jax.tree.leaves(tree)
    device = leaves[0].addressable_shards[0].device
    return sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == device)
