"""The "add a model family" example of docs/EXTENDING.md runs as written: it registers a
family, ``LLM(ModelConfig(...))`` builds that family's module with random weights and
generates; its greedy tokens are the dense model's argmax, and its per-head transform
changes the logits (the layer hook is really used)."""

import functools
import os
import re

import jax
import numpy as np

from paged_jax.model import FAMILIES, dense_forward, init_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "<!-- example: model family -->"
DOCS = ("docs/EXTENDING.md",)


def _example() -> str:
    for doc in DOCS:
        path = os.path.join(ROOT, doc)
        if os.path.exists(path):
            with open(path) as f:
                text = f.read()
            if MARKER in text:
                block = re.search(r"```python\n(.*?)```", text[text.index(MARKER):], re.S)
                return block.group(1)
    raise AssertionError(f"no {MARKER!r} block in {DOCS}")


def test_model_family_example_runs_as_documented():
    code = _example()
    assert len(code.splitlines()) <= 25
    scope = {"__name__": "extending_example"}
    before = dict(FAMILIES)
    try:
        exec(compile(code, "EXTENDING.md", "exec"), scope)
        config, out = scope["config"], scope["out"]
        family = FAMILIES[config.architecture]
        assert config.architecture not in before and family.module is scope["UnitQKForCausalLM"]
        tokens = out[0].outputs[0].token_ids
        assert len(tokens) == 8

        # The engine's greedy tokens are the dense (no-cache) model's argmax, step by step.
        graphdef, params = init_params(config, seed=0)  # what LLM(config) ran (seed 0)
        forward = jax.jit(functools.partial(dense_forward, graphdef))
        seq = np.zeros((1, 16), np.int32)
        prompt = [1, 2, 3]
        seq[0, : len(prompt)] = prompt
        for i, token in enumerate(tokens):
            n = len(prompt) + i
            assert int(np.asarray(forward(params, seq))[0, n - 1].argmax()) == token
            seq[0, n] = token

        # The same weights as a plain Llama: the transform changes every row that attends to
        # more than one key (row 0's softmax over one key ignores q and k).
        llama_graphdef, llama_params = init_params(config.replace(architecture="LlamaForCausalLM"), seed=0)
        plain = np.asarray(dense_forward(llama_graphdef, llama_params, seq))
        ours = np.asarray(forward(params, seq))
        assert np.abs(plain - ours)[:, 1:].max(axis=-1).min() > 1e-3
    finally:
        FAMILIES.clear()
        FAMILIES.update(before)
