"""One process of the 2-process tensor-parallel run (``tests/test_multi_device.py``).

``python tests/multi_process_worker.py PROCESS_ID PORT OUT.json``: two simulated CPU
devices in this process, JAX's distributed runtime over localhost (gloo collectives), and
the workload of ``multi_device_checks`` at tensor_parallel_size = 4, i.e. over both
processes' devices: each process runs the same program (one controller per host) and
writes the greedy tokens it got back.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
from parallel_workload import ENGINE, LLAMA, kv_bytes, use_suite_cache, workload  # noqa: E402

use_suite_cache(ROOT)


def main() -> None:
    process_id, port, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=120)
    from paged_jax import LLM

    prompts, params = workload()
    llm = LLM(LLAMA, tensor_parallel_size=4, **dict(ENGINE, enable_prefix_caching=True))
    outs = llm.generate(prompts, params, use_tqdm=False)
    pages = llm.engine.runner.pages
    result = {
        "process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
        "pages_devices": sorted({d.process_index for x in jax.tree.leaves(pages) for d in x.sharding.device_set}),
        "tokens": [o.outputs[0].token_ids for o in outs],
        "kv": kv_bytes(llm),
    }
    with open(path, "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
