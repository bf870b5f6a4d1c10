"""Record Hugging Face's RoPE for every scaling type paged_jax implements, as a test fixture.

Run by hand in a side venv with torch and transformers (they are NOT test dependencies;
the tests read only the JSON written here):

    python -m venv /tmp/hf && /tmp/hf/bin/pip install torch==2.13.0 transformers safetensors numpy
    HF_HUB_OFFLINE=1 /tmp/hf/bin/python scripts/make_rope_fixture.py [--out tests/fixtures/rope.json]

For each case (a Llama ``config.json`` as transformers writes it, and the same settings
in transformers 4's ``rope_scaling`` keys) it stores HF's inverse frequencies and
attention scaling (``ROPE_INIT_FUNCTIONS``) and, for random queries at positions inside
and far past the original context, ``apply_rotary_pos_emb`` with ``LlamaRotaryEmbedding``'s
cos/sin: the whole rotation the model applies, in float32.

It also writes ``tests/fixtures/llama_yarn/``: a tiny Llama checkpoint with yarn scaling
(factor 4 over an original context of 32, GQA) and its ``expected.npz`` in the schema of
``scripts/make_hf_fixtures.py`` (prompt, full-forward logits, greedy tokens and their
logits), so the whole model's parity with transformers is tested under yarn.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POSITIONS = [0, 1, 5, 31, 32, 33, 63, 64, 65, 127, 200, 1000, 4095]
HEADS = 2

# name -> (head_dim, max_position_embeddings, transformers 4 keys: rope_theta + rope_scaling, config-level extras)
CASES = {
    "default": (16, 128, {"rope_theta": 10000.0, "rope_scaling": None}, {}),
    "linear": (16, 256, {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}, {}),
    "llama3": (16, 512, {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}, {}),
    "yarn": (32, 128, {"rope_theta": 1000000.0, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}, {}),
    "yarn_mscale": (16, 256, {"rope_theta": 10000.0, "rope_scaling": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 1.0,
        "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2}}, {}),
    "yarn_attention_factor": (16, 256, {"rope_theta": 10000.0, "rope_scaling": {
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "attention_factor": 1.5,
        "truncate": False}}, {}),
    "yarn_no_original": (16, 64, {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "yarn", "factor": 3.0}}, {}),
}


def record(name: str, head_dim: int, max_pos: int, rope: dict, extras: dict, rng: np.random.Generator) -> dict:
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    v4 = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64, hidden_size=HEADS * head_dim,
              intermediate_size=32, num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=HEADS,
              head_dim=head_dim, max_position_embeddings=max_pos, rms_norm_eps=1e-5, **rope, **extras)
    config = LlamaConfig(**{k: v for k, v in v4.items() if k not in ("architectures", "model_type")})
    kind = config.rope_parameters.get("rope_type", "default")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, None) if kind != "default" else (None, 1.0)
    rotary = LlamaRotaryEmbedding(config)
    q = rng.standard_normal((1, HEADS, len(POSITIONS), head_dim)).astype(np.float32)
    pos = torch.tensor([POSITIONS])
    x = torch.from_numpy(q)
    cos, sin = rotary(x, pos)
    rotated, _ = apply_rotary_pos_emb(x, x, cos, sin)
    saved = config.to_dict()
    return {
        "config_v4": v4,
        "config": {k: saved[k] for k in ("architectures", "model_type", "head_dim", "hidden_size",
                                         "max_position_embeddings", "rope_parameters") if k in saved}
        | {k: v for k, v in v4.items() if k not in ("rope_theta", "rope_scaling")},
        "rope_type": kind,
        "inv_freq": (rotary.inv_freq if inv_freq is None else inv_freq).float().tolist(),
        "attention_scaling": float(scaling),
        "positions": POSITIONS,
        "q": q[0].transpose(1, 0, 2).tolist(),  # [T, H, D], the model's layout
        "rotated": rotated[0].float().numpy().transpose(1, 0, 2).tolist(),
    }


def write_yarn_checkpoint(target: str) -> None:
    """A random Llama with yarn RoPE and transformers' outputs for it (fp32)."""
    import sys

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from make_hf_fixtures import COMMON, _expected, _perturb

    torch.manual_seed(7)
    config = LlamaConfig(vocab_size=256, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0,
                         rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
                         **COMMON)
    model = LlamaForCausalLM(config).eval()
    _perturb(model, torch, 7)
    os.makedirs(target, exist_ok=True)
    for old in os.listdir(target):
        os.remove(os.path.join(target, old))
    model.save_pretrained(target)
    os.remove(os.path.join(target, "generation_config.json"))  # generation defaults: not ours to read
    reloaded = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    reloaded.generation_config.eos_token_id = None
    reloaded.generation_config.pad_token_id = 0
    np.savez_compressed(os.path.join(target, "expected.npz"), **_expected(reloaded, torch, 256, seed=107))
    for file in os.listdir(target):
        os.chmod(os.path.join(target, file), 0o644)


def main(argv=None) -> None:
    import torch
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "rope.json"))
    parser.add_argument("--checkpoint", default=os.path.join(ROOT, "tests", "fixtures", "llama_yarn"))
    args = parser.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    write_yarn_checkpoint(args.checkpoint)
    rng = np.random.default_rng(0)
    cases = {name: record(name, *spec, rng) for name, spec in CASES.items()}
    with open(args.out, "w") as f:
        json.dump({"transformers": transformers.__version__, "torch": torch.__version__, "cases": cases}, f)
        f.write("\n")
    summary = ", ".join(f"{n} ({c['rope_type']}, x{c['attention_scaling']:.4f})" for n, c in cases.items())
    print(f"wrote {args.out}: {summary}")


if __name__ == "__main__":
    main()
