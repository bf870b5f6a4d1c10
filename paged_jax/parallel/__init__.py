"""Beyond one device: tensor parallelism over kv heads and data-parallel replicas on a mesh.

``LLM(..., tensor_parallel_size=t, data_parallel_size=d)`` or ``LLM(..., mesh=Mesh(...,
("data", "model")))``. Within a replica (one row of the mesh, t devices): weights split
Megatron-style, KV pages split along their kv-head axis, attention (every
implementation) and the K/V writes per shard under ``shard_map``, the block manager
replicated: the same pure functions, no page ever moving between devices. Across
replicas: independent engines, composed by ``LLM`` with a router (``engine/router.py``). Multi-host: the same code
under ``jax.distributed.initialize``, one process per host.

- ``mesh``: ``make_mesh``, ``check_mesh``, ``replica_meshes``, ``KVHeadLayout``.
- ``sharding``: the partition specs, kv-head replication, placement.
- ``step``: the per-shard attention and the sharded model step.
- ``backend``: what the engine config and backend call (``resolve_mesh``, ``shard_model``, ...).
- ``hlo``: collectives of a compiled program (tests and ``experiments/scaling.py``).
"""

from paged_jax.parallel.mesh import AXES, DATA, MODEL, KVHeadLayout, check_mesh, make_mesh, replica_meshes

__all__ = ["AXES", "DATA", "MODEL", "KVHeadLayout", "check_mesh", "make_mesh", "replica_meshes"]
