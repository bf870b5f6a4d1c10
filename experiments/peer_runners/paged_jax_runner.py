"""paged_jax as a peer (the project's own venv; see common.py for the protocol)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import common  # noqa: E402


def load(w):
    from paged_jax import LLM

    return LLM(w["model"], dtype=w["dtype"], kv_cache_memory_bytes=w["kv_cache_bytes"], seed=0,
               enable_prefix_caching=w["enable_prefix_caching"])


def run_pass(llm, w):
    from paged_jax import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=w["max_tokens"], ignore_eos=True)

    def add_all(prefix):
        for i, ids in enumerate(w["prompts"]):
            llm.add_request({"prompt_token_ids": ids}, params, request_id=f"{prefix}{i}")

    def step():
        return [(o.request_id, o.outputs[0].token_ids, o.finished) for o in llm.step()]

    return common.drive(add_all, step, llm.has_unfinished_requests, len(w["prompts"]))


if __name__ == "__main__":
    import jax

    import paged_jax

    common.main("paged_jax", load, run_pass,
                {"paged_jax": getattr(paged_jax, "__version__", "?"), "jax": jax.__version__})
