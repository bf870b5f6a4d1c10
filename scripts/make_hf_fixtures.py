"""Generate tiny random-weight Hugging Face checkpoints and their expected outputs.

Run once, by hand, with torch and transformers installed (they are NOT test
dependencies; the tests read only the files written here):

    python -m venv /tmp/hf && /tmp/hf/bin/pip install torch==2.13.0 transformers safetensors numpy
    HF_HUB_OFFLINE=1 /tmp/hf/bin/python scripts/make_hf_fixtures.py [--out tests/fixtures] [--beam] [--only NAME,...]

(``scripts/side_venv.sh fixtures`` builds such a venv: ``~/.cache/paged_jax/venvs/fixtures``.)

For each architecture it writes ``<out>/<name>/`` (config.json + safetensors) and
``<out>/<name>/expected.npz`` with, per prompt i:

- ``prompt_i``: int32[T] token ids;
- ``logits_i``: float32[T, vocab] logits of a full (no-cache) forward of the prompt;
- ``greedy_i``: int32[STEPS] tokens of HF greedy ``generate`` (EOS disabled);
- ``greedy_logits_i``: float32[STEPS, vocab] the logits that chose each greedy token.

Expected outputs are always computed in float32 from the weights as saved (the bf16
checkpoint is reloaded as float32), so the tests can compare at fp32 tolerance.
``<out>/metadata.json`` records the transformers and torch versions and the settings, and
per fixture its files and transformers' parameter count (``num_parameters``).

``--only NAME,...`` (re)writes just those fixtures (with ``--beam``: just their beam
fixtures) and merges their entries into the existing metadata.json, leaving every other
fixture's files untouched; a fixture written this way records its own transformers/torch
versions in its entry. Each fixture's seed is its position in ``_fixtures()`` (in
``BEAM_MODELS`` for beam), so a new fixture goes at the end and the others stay the same.

``--beam`` (re)writes only the beam-search fixtures, from the checkpoints already in
``<out>`` (the weights are not touched): ``<out>/<name>/beam.json`` for ``BEAM_MODELS``,
one entry per case with the prompt, the ``generate(num_beams=W, num_return_sequences=W,
do_sample=False, ...)`` settings, each returned hypothesis' tokens (prompt + generated, up
to and including the EOS that ended it) and its ``sequences_scores``. The cases cover
widths 1, 2, 4, 8; no EOS and a frequent EOS (the token the model emits most often under
greedy decoding of the prompts, so hypotheses finish early); length_penalty 0.5, 1, 2;
early_stopping True, False, "never".

Fixtures:
- ``llama``: LlamaForCausalLM, GQA (4 q / 2 kv heads), llama3 rope_scaling (all three
  frequency bands in use: head_dim 16, theta 5e5, original context 64), fp32,
  saved *sharded* (model.safetensors.index.json).
- ``qwen2``: Qwen2ForCausalLM, MHA, q/k/v bias, tied embeddings, fp32, one file.
- ``mistral``: MistralForCausalLM, MQA (1 kv head), saved in *bf16*.
- ``qwen3``: Qwen3ForCausalLM, GQA (4 q / 2 kv heads), head_dim 32 != hidden / heads (16),
  per-head q/k RMSNorm (random weights, as every norm here), tied embeddings, fp32.
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
        Qwen3Config,
        Qwen3ForCausalLM,
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
        "qwen3": (
            Qwen3ForCausalLM,
            Qwen3Config(
                vocab_size=256, num_key_value_heads=2, tie_word_embeddings=True,
                rope_theta=1000000.0, use_sliding_window=False,
                **{**COMMON, "head_dim": 32, "rms_norm_eps": 1e-6},
            ),
            dict(dtype="float32", max_shard_size=None),
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


BEAM_MODELS = ("llama", "qwen2", "qwen3")
BEAM_PROMPT_LENS = (3, 6, 11)
BEAM_MAX_NEW = 10


def _beam_cases():
    """(width, eos?, length_penalty, early_stopping): every width with the defaults, and
    every length penalty x early-stopping rule at width 4, each with and without EOS."""
    cases = [(w, eos, 1.0, False) for w in (1, 2, 4, 8) for eos in (False, True)]
    cases += [(4, eos, lp, es) for eos in (False, True) for lp in (0.5, 1.0, 2.0) for es in (True, False, "never")]
    return list(dict.fromkeys(cases))


def _frequent_token(model, torch, prompts) -> int:
    """The token greedy decoding of ``prompts`` emits most often (a good EOS for tests)."""
    counts = {}
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=BEAM_MAX_NEW, do_sample=False, attention_mask=torch.ones_like(ids))
        for t in out[0, len(prompt):].tolist():
            counts[t] = counts.get(t, 0) + 1
    return max(counts, key=lambda t: (counts[t], -t))


def _greedy_as_beam(out, torch, prompt, eos_id, lp):
    """transformers runs ``num_beams=1`` as greedy search, which reports no
    ``sequences_scores``; one beam is greedy (a finished EOS hypothesis always outscores
    the beam that continues without it), so the score is computed the way beam search
    would: the generated tokens' summed log-softmax over the generated length ** lp."""
    tokens = out.sequences[0].tolist()
    generated = tokens[len(prompt):]
    if eos_id is not None and eos_id in generated:
        generated = generated[: generated.index(eos_id) + 1]
    logprobs = [torch.log_softmax(step[0].double(), dim=-1)[t].item() for step, t in zip(out.scores, generated)]
    return [prompt + generated], [sum(logprobs) / len(generated) ** lp]


def _beam_fixture(model, torch, vocab: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, size=n).tolist() for n in BEAM_PROMPT_LENS]
    eos_id = _frequent_token(model, torch, prompts)
    cases = []
    for width, use_eos, lp, es in _beam_cases():
        for prompt in prompts:  # one prompt per generate: no padding, exact positions
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = model.generate(
                    ids, num_beams=width, num_return_sequences=width, do_sample=False, max_new_tokens=BEAM_MAX_NEW,
                    length_penalty=lp, early_stopping=es, eos_token_id=eos_id if use_eos else None,
                    pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                    attention_mask=torch.ones_like(ids),
                )
            if width == 1:
                seqs, scores = _greedy_as_beam(out, torch, prompt, eos_id if use_eos else None, lp)
            else:
                generated = (out.beam_indices != -1).sum(dim=1).tolist()  # each hypothesis' own length
                seqs = [out.sequences[i, : len(prompt) + n].tolist() for i, n in enumerate(generated)]
                scores = out.sequences_scores.tolist()
            cases.append({
                "prompt": prompt, "beam_width": width, "max_new_tokens": BEAM_MAX_NEW, "length_penalty": lp,
                "early_stopping": es, "eos_token_id": eos_id if use_eos else None,
                "sequences": seqs, "scores": scores,
            })
    return {"eos_token_id": eos_id, "cases": cases}


def main_beam(out_dir: str, only: list[str] | None = None) -> int:
    import torch
    import transformers

    torch.use_deterministic_algorithms(True)
    meta_path = os.path.join(out_dir, "metadata.json")
    with open(meta_path) as f:
        meta = json.load(f)
    versions = {"transformers": transformers.__version__, "torch": torch.__version__}
    if only is None:
        meta["beam"] = {**versions, "models": list(BEAM_MODELS), "prompt_lens": list(BEAM_PROMPT_LENS),
                        "max_new_tokens": BEAM_MAX_NEW}
    else:
        beam = meta["beam"]
        beam["models"] = [m for m in BEAM_MODELS if m in beam["models"] or m in only]
        if any(beam[k] != v for k, v in versions.items()):
            beam.setdefault("versions", {}).update({m: versions for m in only})
    for seed, name in enumerate(BEAM_MODELS):
        if only is not None and name not in only:
            continue
        target = os.path.join(out_dir, name)
        model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        fixture = _beam_fixture(model, torch, model.config.vocab_size, seed=200 + seed)
        path = os.path.join(target, "beam.json")
        with open(path, "w") as f:
            json.dump(fixture, f)
        os.chmod(path, 0o644)
        finished_early = sum(len(s) < len(c["prompt"]) + c["max_new_tokens"] for c in fixture["cases"]
                             for s in c["sequences"])
        print(f"{name}: {len(fixture['cases'])} beam cases, eos {fixture['eos_token_id']}, "
              f"{finished_early} hypotheses ended before max_new_tokens")
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures"))
    parser.add_argument("--beam", action="store_true", help="write only the beam-search fixtures (beam.json)")
    parser.add_argument("--only", help="comma-separated fixture names: write only these, merge metadata.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    only = None if args.only is None else args.only.split(",")
    if args.beam:
        if only is not None and not set(only) <= set(BEAM_MODELS):
            parser.error(f"--only {args.only}: beam fixtures are {', '.join(BEAM_MODELS)}")
        return main_beam(args.out, only)

    import torch
    import transformers

    fixtures = _fixtures()
    if only is not None and not set(only) <= set(fixtures):
        parser.error(f"--only {args.only}: fixtures are {', '.join(fixtures)}")

    torch.use_deterministic_algorithms(True)
    versions = {"transformers": transformers.__version__, "torch": torch.__version__, "numpy": np.__version__}
    meta = {**versions, "steps": STEPS, "prompt_lens": list(PROMPT_LENS), "init_scale": INIT_SCALE, "fixtures": {}}
    if only is not None:
        with open(os.path.join(args.out, "metadata.json")) as f:
            meta = json.load(f)
    for seed, (name, (cls, config, save)) in enumerate(fixtures.items()):
        if only is not None and name not in only:
            continue
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
            "num_parameters": reloaded.num_parameters(),  # shared (tied) tensors counted once
            **({} if only is None else versions),
        }
        print(f"{name}: {meta['fixtures'][name]}")
    with open(os.path.join(args.out, "metadata.json"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
