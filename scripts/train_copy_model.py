"""Train the tiny copy model of tests/fixtures/copy_llama: a Llama that continues a text by
copying what came before it, the behaviour prompt-lookup (n-gram) speculation exploits.

    python scripts/train_copy_model.py [--out DIR] [--steps N]

A random-weight model never copies, so on it n-gram proposals are right only by accident;
an edit or a summary over a document, the workload prompt lookup is for, needs a model
that does copy. This one is trained here, on CPU (12 minutes on 2 cores for 1500 steps;
the copy skill appears abruptly near step 500, held-out copy accuracy 0.958 with the 4%
edits counted as misses): sequences are ``BOS doc SEP doc' SEP doc'' ...`` where every
``doc'`` is the previous document with a few tokens replaced (edits), and the loss counts only the copies' tokens, so the model
learns to continue any text by copying its earlier occurrence (an induction head). It is
then what ``experiments/speculative.py`` serves for its copy workload: the prompt is a
document and the first tokens of its copy.

Needs only this repository's dependencies (JAX, Flax, optax, safetensors). Writes
``config.json``, ``generation_config.json`` and ``model.safetensors`` (float32), and
prints the copy accuracy on held-out sequences (greedy next token = the document's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "tests", "fixtures", "copy_llama")
BOS, SEP = 1, 2
FIRST_WORD = 3  # ids below are special
VOCAB = 256
SEQ_LEN = 192
DOC_LENS = (16, 64)  # a document's length range
EDIT_RATE = 0.04  # fraction of a copy's tokens replaced
SEED = 0

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": BOS,
    "eos_token_id": None,
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": 128,
    "intermediate_size": 256,
    "max_position_embeddings": 1024,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "vocab_size": VOCAB,
}


def copy_sequence(rng: np.random.Generator, length: int = SEQ_LEN) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens int32[length], loss mask bool[length])``: ``BOS doc SEP doc' SEP ...``; the
    mask marks the tokens to predict inside copies (each edited copy of the document)."""
    doc = rng.integers(FIRST_WORD, VOCAB, int(rng.integers(*DOC_LENS)))
    tokens, mask = [BOS, *doc.tolist(), SEP], [False] * (len(doc) + 2)
    while len(tokens) < length:
        doc = doc.copy()
        edits = rng.random(len(doc)) < EDIT_RATE
        doc[edits] = rng.integers(FIRST_WORD, VOCAB, int(edits.sum()))
        tokens += [*doc.tolist(), SEP]
        mask += [True] * (len(doc) + 1)
    return np.asarray(tokens[:length], np.int32), np.asarray(mask[:length], bool)


def batch(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
    pairs = [copy_sequence(rng) for _ in range(size)]
    return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


def train(steps: int, batch_size: int = 32, lr: float = 3e-3, log_every: int = 100):
    """Adam on the masked next-token loss; returns (config, graphdef, params)."""
    import jax
    import jax.numpy as jnp
    import optax

    from paged_jax.model import ModelConfig, init_params
    from paged_jax.model.llama import dense_forward

    config = ModelConfig.from_hf(CONFIG)
    graphdef, params = init_params(config, seed=SEED)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps=min(100, steps // 10), decay_steps=steps)
    optimizer = optax.adamw(schedule, weight_decay=0.01)
    opt_state = optimizer.init(params)

    def loss_fn(params, tokens, mask):
        logits = dense_forward(graphdef, params, tokens[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        m = mask[:, 1:]
        return (nll * m).sum() / m.sum()

    @jax.jit
    def update(params, opt_state, tokens, mask):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, mask)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(SEED)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        tokens, mask = batch(rng, batch_size)
        params, opt_state, loss = update(params, opt_state, tokens, mask)
        if step % log_every == 0 or step == steps:
            print(f"step {step:5d}  copy loss {float(loss):.4f}  ({time.perf_counter() - start:.0f} s)", flush=True)
    return config, graphdef, params


def copy_accuracy(graphdef, params, num: int = 64) -> float:
    """Greedy next-token accuracy on held-out sequences' copy tokens, edits excluded
    (an edit is unpredictable by design)."""
    import jax.numpy as jnp

    from paged_jax.model.llama import dense_forward

    rng = np.random.default_rng(SEED + 1)
    tokens, mask = batch(rng, num)
    pred = np.asarray(jnp.argmax(dense_forward(graphdef, params, jnp.asarray(tokens[:, :-1])), axis=-1))
    target, m = tokens[:, 1:], mask[:, 1:]
    return float((pred == target)[m].mean())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=1500)
    args = parser.parse_args(argv)
    sys.path.insert(0, ROOT)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from paged_jax.model import load_model, save_params

    config, graphdef, params = train(args.steps)
    accuracy = copy_accuracy(graphdef, params)
    print(f"held-out copy accuracy (greedy, edits included as misses): {accuracy:.3f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
        f.write("\n")
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": BOS, "do_sample": False}, f, indent=2)
        f.write("\n")
    save_params(args.out, params)
    loaded_config, loaded_graphdef, loaded = load_model(args.out)
    assert loaded_config == config, (loaded_config, config)
    assert abs(copy_accuracy(loaded_graphdef, loaded) - accuracy) < 1e-6
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
