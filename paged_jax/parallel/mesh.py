"""The device mesh: ``("data", "model")`` axes, its validation, and how heads split over it.

A mesh for serving has two named axes:

- ``"model"`` (size t, tensor parallelism): a replica's weights are split Megatron-style
  over it and its KV pages along their kv-head axis; every device holds its heads of
  every block.
- ``"data"`` (size d, data parallelism): d independent replicas, one row of the mesh
  each, with their own pool, block manager and scheduler.

``make_mesh(t, d)`` builds one from the first ``t * d`` devices (all processes' devices
under ``jax.distributed``); ``check_mesh`` refuses a mesh without those axis names;
``replica_meshes`` cuts it into d one-row meshes. ``KVHeadLayout`` says how the kv heads
go over t devices: split when t divides them, replicated (vLLM's rule) when they divide
t, refused otherwise.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r}: must be an int >= 1")
    return int(value)


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1, devices=None) -> Mesh:
    """A ``(data_parallel_size, tensor_parallel_size)`` mesh with axes ``("data", "model")``.

    ``devices`` defaults to ``jax.devices()`` (every process's, under ``jax.distributed``);
    the first ``t * d`` are used, in order, so a replica's t devices are consecutive
    (on one host when t divides the devices per host). ValueError, naming the sizes, when t
    or d does not divide the device count or ``t * d`` exceeds it.
    """
    t = _positive("tensor_parallel_size", tensor_parallel_size)
    d = _positive("data_parallel_size", data_parallel_size)
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    for name, size in (("tensor_parallel_size", t), ("data_parallel_size", d)):
        if n % size:
            raise ValueError(f"{name}={size} does not divide the device count ({n})")
    if t * d > n:
        raise ValueError(f"tensor_parallel_size={t} x data_parallel_size={d} = {t * d} devices, "
                         f"more than the {n} available")
    return Mesh(np.array(devices[: t * d], dtype=object).reshape(d, t), AXES)


def check_mesh(mesh) -> Mesh:
    """``mesh`` itself if it is a ``jax.sharding.Mesh`` with axes "data" and "model" (in
    any order; other axes of size 1 are allowed); ValueError naming its axes otherwise."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh={mesh!r}: expected a jax.sharding.Mesh with axes {AXES}")
    shape = dict(mesh.shape)
    missing = [a for a in AXES if a not in shape]
    extra = {a: s for a, s in shape.items() if a not in AXES and s != 1}
    if missing or extra:
        raise ValueError(f"mesh axes {shape}: need axes named {AXES}" + (f" (missing {missing})" if missing else "")
                         + (f"; other axes must have size 1, got {extra}" if extra else ""))
    return mesh


def mesh_sizes(mesh: Mesh) -> tuple[int, int]:
    """(tensor_parallel_size, data_parallel_size) of a checked mesh."""
    shape = dict(check_mesh(mesh).shape)
    return int(shape[MODEL]), int(shape[DATA])


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One ``(1, t)`` mesh per data replica (its row of ``mesh``), axes ``("data", "model")``."""
    check_mesh(mesh)
    devices = np.moveaxis(mesh.devices.reshape([mesh.shape[a] for a in mesh.axis_names]),
                          [mesh.axis_names.index(DATA), mesh.axis_names.index(MODEL)], [0, 1])
    devices = devices.reshape(mesh.shape[DATA], mesh.shape[MODEL])
    return [Mesh(devices[i : i + 1], AXES) for i in range(devices.shape[0])]


def spans_processes(mesh: Mesh) -> bool:
    """Whether ``mesh`` holds devices of more than one process (``jax.distributed``)."""
    return len({d.process_index for d in mesh.devices.flat}) > 1


@dataclasses.dataclass(frozen=True)
class KVHeadLayout:
    """How a model's heads go over ``t`` devices.

    ``stored_kv_heads`` = the kv heads the pages hold: ``num_kv_heads`` when t divides
    them (each device holds ``num_kv_heads / t``), else t when ``num_kv_heads`` divides t:
    every kv head is stored ``replicas = t / num_kv_heads`` times (vLLM's rule), one copy
    per device, so a device's query heads find their kv head locally. Then a device holds
    ``1 / num_kv_heads`` of the unreplicated pool, not ``1 / t``.
    """

    num_heads: int
    num_kv_heads: int
    tensor_parallel_size: int

    def __post_init__(self):
        h, hkv, t = self.num_heads, self.num_kv_heads, self.tensor_parallel_size
        if h % t:
            raise ValueError(f"num_heads={h} is not divisible by tensor_parallel_size={t}")
        if hkv % t and t % hkv:
            raise ValueError(f"num_kv_heads={hkv} and tensor_parallel_size={t}: one must divide the other "
                             "(kv heads are split over the devices, or replicated when fewer than them)")

    @property
    def replicas(self) -> int:
        """Copies of each kv head in the pages (1: split, no copies)."""
        t, hkv = self.tensor_parallel_size, self.num_kv_heads
        return 1 if hkv % t == 0 else t // hkv

    @property
    def stored_kv_heads(self) -> int:
        return self.num_kv_heads * self.replicas
