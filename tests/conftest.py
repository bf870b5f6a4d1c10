"""Shared test setup: CPU, cheap compiles, a persistent compilation cache, invariant checks after every op."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# LLVM -O0: the suite's time is mostly XLA:CPU compiling small programs, which this
# halves; the results are the same (no fast-math either way), only slower to run.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0")

import jax  # noqa: E402
import pytest  # noqa: E402

_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache")
jax.config.update("jax_compilation_cache_dir", _CACHE)
# Only programs worth sharing between the workers are written: XLA:CPU has (rarely)
# segfaulted serialising an executable, and the tiny eager-op programs are most of the writes.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

from paged_jax.cache import set_debug_checks  # noqa: E402
from paged_jax.compilation_cache import memory_mappings  # noqa: E402

# A worker compiles hundreds of programs over the suite and XLA:CPU maps memory for each
# (~430 mappings per model step); at the kernel's per-process limit (vm.max_map_count)
# XLA segfaults while compiling. Dropping JAX's caches unmaps the programs; the next test
# that needs one recompiles it (or reads it from the persistent cache).
_CLEAR_CACHES_AT = 0.45  # of the limit: below LLM's warning (compilation_cache.MAPPINGS_WARNING_FRACTION)


@pytest.fixture(autouse=True)
def _unmap_compiled_programs_near_the_limit():
    yield
    usage = memory_mappings()
    if usage is not None and usage[0] > _CLEAR_CACHES_AT * usage[1]:
        jax.clear_caches()


@pytest.fixture(autouse=True)
def _invariants_after_every_op():
    """Every cache state a test makes (unless it says otherwise) checks its invariants
    after every block-manager op: the process default for new states is on."""
    previous = set_debug_checks(True)
    yield
    set_debug_checks(previous)
