"""transformers ``generate`` as a peer, in the fixtures side venv (``scripts/side_venv.sh
fixtures``); see common.py for the protocol. Prompts run in batches (left padded, greedy, no
EOS token, so generation runs its ``max_new_tokens`` as vLLM's ``ignore_eos`` does: EOS may
be generated and generation goes on. ``min_new_tokens`` would not do: it masks EOS out of
the logits, so a step whose argmax is EOS picks the runner-up, which measured 2 of 64 prompts
"differing" from vLLM and us); a stopping criterion stamps every step, so a prompt's first
token is its batch's first step and its finish its batch's last."""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

BATCH = int(os.environ.get("PEERS_HF_BATCH", "16"))


def load(w):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(w["model"], dtype=getattr(torch, w["dtype"]))
    # ignore_eos: no EOS, so nothing stops a row before max_new_tokens. On the model's own
    # generation config: generate() fills a passed config's unset fields from it.
    model.generation_config.eos_token_id = None
    return model.eval()


def run_pass(model, w):
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    prompts, n = w["prompts"], w["max_tokens"]
    pad = model.generation_config.pad_token_id
    pad = 0 if pad is None else (pad[0] if isinstance(pad, list) else pad)
    first, finish, tokens = [None] * len(prompts), [None] * len(prompts), [None] * len(prompts)
    t0, c0 = time.perf_counter(), common.tree_cpu_s(os.getpid())

    class Stamp(StoppingCriteria):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter() - t0)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    for start in range(0, len(prompts), BATCH):
        batch = prompts[start:start + BATCH]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        stamp = Stamp()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                 pad_token_id=pad, stopping_criteria=StoppingCriteriaList([stamp]))
        assert out.shape[1] == width + n, (out.shape, width, n)  # every row ran max_new_tokens
        for j in range(len(batch)):
            first[start + j], finish[start + j] = stamp.times[0], stamp.times[-1]
            tokens[start + j] = out[j, width:].tolist()
    return {"run_s": time.perf_counter() - t0, "cpu_s": common.tree_cpu_s(os.getpid()) - c0,
            "first_token_s": first, "finish_s": finish, "tokens": tokens}


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    common.main("transformers", load, run_pass, {"transformers": transformers.__version__, "torch": torch.__version__})
