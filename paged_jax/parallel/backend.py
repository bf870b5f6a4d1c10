"""A replica's model on its mesh: what ``LLM(tensor_parallel_size=..., mesh=...)`` builds.

``resolve_mesh`` turns ``LLM``'s arguments into a mesh (or None: one device, the default
path, untouched); ``shard_model`` turns a loaded model into the sharded step and weights
(kv heads replicated first when the devices outnumber them); ``sharded_init`` makes the
empty pages directly in their sharding (no device ever holds the whole pool);
``check_supported`` refuses what this layout does not run, before any weight loads.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from paged_jax.model.config import ModelConfig
from paged_jax.parallel.mesh import DATA, MODEL, check_mesh, make_mesh, mesh_sizes, spans_processes
from paged_jax.parallel.sharding import check_model, page_shardings, replicate_kv_heads, shard_params
from paged_jax.parallel.step import make_sharded_step


def resolve_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1, mesh=None) -> Mesh | None:
    """The mesh ``LLM`` runs on: ``mesh`` (checked; t and d, when given, must match its
    axes), else ``make_mesh(t, d)``; None when t = d = 1 and no mesh is given (one device,
    no sharding anywhere). ValueError naming the sizes otherwise."""
    if mesh is None:
        if (tensor_parallel_size, data_parallel_size) == (1, 1):
            return None
        return make_mesh(tensor_parallel_size, data_parallel_size)
    t, d = mesh_sizes(check_mesh(mesh))
    for name, given, axis, size in (("tensor_parallel_size", tensor_parallel_size, MODEL, t),
                                    ("data_parallel_size", data_parallel_size, DATA, d)):
        if given not in (1, size):
            raise ValueError(f"{name}={given} but the mesh's {axis!r} axis has size {size}")
    return mesh


def check_supported(mesh: Mesh, *, speculative=None, preemption_mode: str = "recompute") -> None:
    """ValueError for what a sharded replica does not run: a draft model (its heads would
    need their own layout), swapping across processes (a swapped block's heads live on
    several hosts). The model's shape is ``sharding.check_model``'s."""
    if speculative is not None and speculative.method == "draft_model":
        raise ValueError("speculative method 'draft_model' is not supported on a mesh; use 'ngram'")
    if preemption_mode == "swap" and spans_processes(mesh):
        raise ValueError("preemption_mode='swap' is not supported on a mesh spanning processes; use 'recompute'")


def shard_model(config: ModelConfig, params, mesh: Mesh, attention_impl: str):
    """``(config, params, step)`` of a loaded model on ``mesh``: kv heads replicated if t
    exceeds them (``config.num_kv_heads`` becomes the stored count), weights placed
    Megatron-style, and the per-shard step (``step.make_sharded_step``)."""
    layout = check_model(config, mesh_sizes(mesh)[0])
    config, params = replicate_kv_heads(config, params, layout.replicas)
    return config, shard_params(params, mesh), make_sharded_step(config, attention_impl, mesh)


def sharded_init(init_pages, mesh: Mesh):
    """``num_blocks -> pages`` made in place on ``mesh``, kv heads split over "model"."""

    def init(num_blocks: int):
        abstract = jax.eval_shape(lambda: init_pages(num_blocks))
        return jax.jit(lambda: init_pages(num_blocks), out_shardings=page_shardings(abstract, mesh))()

    return init


def first_local_device(mesh: Mesh):
    """The mesh's first device this process drives (memory statistics are local)."""
    return next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
