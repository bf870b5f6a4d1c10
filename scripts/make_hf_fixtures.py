"""Generate tiny random-weight Hugging Face checkpoints and their expected outputs.

Run once, by hand, with torch and transformers installed (they are NOT test
dependencies; the tests read only the files written here):

    .venv/bin/pip install torch==2.13.0 transformers
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/make_hf_fixtures.py [--out tests/fixtures]

For each architecture it writes ``<out>/<name>/`` (config.json + safetensors) and
``<out>/<name>/expected.npz`` with, per prompt i:

- ``prompt_i``: int32[T] token ids;
- ``logits_i``: float32[T, vocab] logits of a full (no-cache) forward of the prompt;
- ``greedy_i``: int32[STEPS] tokens of HF greedy ``generate`` (EOS disabled);
- ``greedy_logits_i``: float32[STEPS, vocab] the logits that chose each greedy token.

Expected outputs are always computed in float32 from the weights as saved (the bf16
checkpoint is reloaded as float32), so the tests can compare at fp32 tolerance.
``<out>/metadata.json`` records the transformers and torch versions and the settings.

Fixtures:
- ``llama``: LlamaForCausalLM, GQA (4 q / 2 kv heads), llama3 rope_scaling (all three
  frequency bands in use: head_dim 16, theta 5e5, original context 64), fp32,
  saved *sharded* (model.safetensors.index.json).
- ``qwen2``: Qwen2ForCausalLM, MHA, q/k/v bias, tied embeddings, fp32, one file.
- ``mistral``: MistralForCausalLM, MQA (1 kv head), saved in *bf16*.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

STEPS = 8
PROMPT_LENS = (5, 11)
INIT_SCALE = 0.15  # large enough that greedy logits are far from ties
COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    head_dim=16,
    max_position_embeddings=128,
    initializer_range=INIT_SCALE,
    rms_norm_eps=1e-5,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def _fixtures():
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    return {
        "llama": (
            LlamaForCausalLM,
            LlamaConfig(
                vocab_size=256, num_key_value_heads=2, tie_word_embeddings=False,
                rope_theta=500000.0,
                rope_scaling={
                    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                },
                **COMMON,
            ),
            dict(dtype="float32", max_shard_size="150KB"),
        ),
        "qwen2": (
            Qwen2ForCausalLM,
            Qwen2Config(
                vocab_size=256, num_key_value_heads=4, tie_word_embeddings=True,
                rope_theta=1000000.0, use_sliding_window=False, **COMMON,
            ),
            dict(dtype="float32", max_shard_size=None),
        ),
        "mistral": (
            MistralForCausalLM,
            MistralConfig(
                vocab_size=128, num_key_value_heads=1, tie_word_embeddings=False,
                sliding_window=4096, **COMMON,
            ),
            dict(dtype="bfloat16", max_shard_size=None),
        ),
    }


def _perturb(model, torch, seed: int) -> None:
    """HF initialises norms to 1 and biases to 0: randomise them so loading is tested."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(INIT_SCALE * torch.randn(param.shape, generator=gen))


def _expected(model, torch, vocab: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for i, n in enumerate(PROMPT_LENS):
        prompt = rng.integers(0, vocab, size=n).astype(np.int32)
        ids = torch.tensor(prompt[None].astype(np.int64))
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float().numpy()
            gen = model.generate(
                ids, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                output_logits=True, return_dict_in_generate=True,
                attention_mask=torch.ones_like(ids),
            )
        tokens = gen.sequences[0, n:].numpy().astype(np.int32)
        step_logits = torch.stack(gen.logits, dim=1)[0].float().numpy()
        assert tokens.shape == (STEPS,), tokens.shape
        assert (step_logits.argmax(-1) == tokens).all()
        out[f"prompt_{i}"] = prompt
        out[f"logits_{i}"] = logits.astype(np.float32)
        out[f"greedy_{i}"] = tokens
        out[f"greedy_logits_{i}"] = step_logits.astype(np.float32)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures"))
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    import transformers

    torch.use_deterministic_algorithms(True)
    meta = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "steps": STEPS,
        "prompt_lens": list(PROMPT_LENS),
        "init_scale": INIT_SCALE,
        "fixtures": {},
    }
    for seed, (name, (cls, config, save)) in enumerate(_fixtures().items()):
        torch.manual_seed(seed)
        model = cls(config).eval()
        _perturb(model, torch, seed)
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        target = os.path.join(args.out, name)
        os.makedirs(target, exist_ok=True)
        for old in os.listdir(target):
            os.remove(os.path.join(target, old))
        model.to(getattr(torch, save["dtype"]))
        kwargs = {} if save["max_shard_size"] is None else {"max_shard_size": save["max_shard_size"]}
        model.save_pretrained(target, **kwargs)
        for file in os.listdir(target):
            if file == "generation_config.json":  # generation defaults: not ours to read
                os.remove(os.path.join(target, file))
            else:
                os.chmod(os.path.join(target, file), 0o644)
        # Expected outputs: fp32 compute on the weights exactly as saved.
        reloaded = cls.from_pretrained(target, dtype=torch.float32).eval()
        reloaded.generation_config.eos_token_id = None
        reloaded.generation_config.pad_token_id = 0
        expected = _expected(reloaded, torch, config.vocab_size, seed=100 + seed)
        np.savez_compressed(os.path.join(target, "expected.npz"), **expected)
        os.chmod(os.path.join(target, "expected.npz"), 0o644)
        meta["fixtures"][name] = {
            "architecture": cls.__name__,
            "saved_dtype": save["dtype"],
            "sharded": save["max_shard_size"] is not None,
            "files": sorted(os.listdir(target)),
        }
        print(f"{name}: {meta['fixtures'][name]}")
    with open(os.path.join(args.out, "metadata.json"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
