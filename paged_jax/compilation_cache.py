"""JAX's persistent compilation cache, turned on by ``LLM`` unless the user says otherwise.

A first ``generate`` is mostly XLA compiling the engine's few step programs; with the
cache on, a second process (a rerun of a notebook, the next script of a sweep) reads them
back from disk instead. The directory, in order of precedence:

1. one the process already configured (``jax.config.jax_compilation_cache_dir``): kept;
2. ``PAGED_JAX_COMPILATION_CACHE=<dir>``; ``PAGED_JAX_COMPILATION_CACHE=0`` turns it off;
3. ``$XDG_CACHE_HOME/paged_jax/jax`` (``~/.cache/paged_jax/jax``).

Every program is cached however fast it compiled: the engine's small bookkeeping
programs add up to seconds on a first call.
"""

from __future__ import annotations

import os

import jax

ENV = "PAGED_JAX_COMPILATION_CACHE"
_OFF = ("0", "false", "off", "no")


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "paged_jax", "jax")


def enable_compilation_cache(path: str | os.PathLike | None = None) -> str | None:
    """Turn the persistent cache on (see the module docstring); returns its directory, or
    None when it is off. ``path`` overrides the environment and the default, not a
    directory the process configured itself."""
    if not jax.config.jax_enable_compilation_cache:  # the process turned caching off
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    setting = os.environ.get(ENV, "")
    if path is None and setting.lower() in _OFF:
        return None
    directory = os.fspath(path) if path is not None else (setting or default_dir())
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError:  # a read-only home: run without the cache rather than fail
        return None
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    try:  # JAX decides once per process whether the cache is used; ask it again
        from jax._src import compilation_cache

        compilation_cache.reset_cache()
    except (ImportError, AttributeError):
        pass
    return directory


# XLA:CPU maps memory for each compiled kernel: a model step holds ~430 mappings (jax 0.10),
# and Linux refuses more than ``vm.max_map_count`` (65530 by default) per process, at which
# point LLVM fails to allocate and the process segfaults inside XLA. Programs stay mapped
# while JAX's caches hold them: ``jax.clear_caches()`` unmaps the ones no longer needed.
MAPPINGS_WARNING_FRACTION = 0.6


def memory_mappings() -> tuple[int, int] | None:
    """``(mappings this process holds, the kernel's per-process limit)``, or None where the
    kernel does not say (not Linux)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            count = f.read().count(b"\n")
        with open("/proc/sys/vm/max_map_count") as f:
            return count, int(f.read())
    except (OSError, ValueError):
        return None


def mappings_pressure() -> str | None:
    """A warning's text when the process holds over ``MAPPINGS_WARNING_FRACTION`` of its
    memory-mapping limit (each compiled program holds hundreds), else None."""
    usage = memory_mappings()
    if usage is None or usage[0] < MAPPINGS_WARNING_FRACTION * usage[1]:
        return None
    count, limit = usage
    return (f"this process holds {count} of its {limit} memory mappings, mostly compiled XLA programs "
            "(hundreds each on a CPU); past the limit XLA crashes while compiling. Call jax.clear_caches() "
            "between experiments that no longer need each other's programs, or raise vm.max_map_count")
