"""paged_jax.text: the fixture checkpoint's tokenizer, chat templates, incremental detokenisation, stop strings.

Uses ``tests/fixtures/llama_text`` (``scripts/make_text_fixture.py``): a byte-level BPE of
400 ids (special tokens 395..399) in front of a 448-row Llama.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_jax.text import (
    ChatTemplateError,
    IncrementalDetokenizer,
    StopStrings,
    Tokenizer,
    render_chat,
    stop_holdback,
)

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
TEXT_DIR = os.path.join(FIXTURES, "llama_text")
BOS, END_OF_TEXT, EOT, START_HEADER, END_HEADER = 395, 396, 397, 398, 399
MODEL_VOCAB = 448

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(TEXT_DIR)


@pytest.fixture(scope="module")
def corpus() -> str:
    with open(os.path.join(TEXT_DIR, "corpus.txt"), encoding="utf-8") as f:
        return f.read()


def _copy_fixture(tmp_path, **config_changes) -> str:
    """The fixture's tokenizer files in tmp_path, tokenizer_config.json keys replaced (None deletes)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TEXT_DIR, name), tmp_path / name)
    path = tmp_path / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return str(tmp_path)


def _without_post_processor(tmp_path) -> None:
    path = tmp_path / "tokenizer.json"
    spec = json.loads(path.read_text())
    spec["post_processor"] = None
    path.write_text(json.dumps(spec))


# --------------------------------------------------------------------------- the fixture


def test_fixture_files_agree(tok):
    with open(os.path.join(TEXT_DIR, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(TEXT_DIR, "generation_config.json")) as f:
        generation = json.load(f)
    assert len(tok) == tok.vocab_size == 400
    assert config["vocab_size"] == MODEL_VOCAB and config["vocab_size"] % 64 == 0
    assert config["bos_token_id"] == BOS and config["eos_token_id"] == END_OF_TEXT
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert generation["eos_token_id"] == [END_OF_TEXT, EOT] and generation["bos_token_id"] == BOS
    names = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
    assert tok.convert_tokens_to_ids(names) == [BOS, END_OF_TEXT, EOT, START_HEADER, END_HEADER]
    assert tok.convert_ids_to_tokens([BOS, EOT, 10_000]) == [names[0], names[2], ""]
    assert tok.bos_token_id == BOS and tok.eos_token_id == EOT
    assert tok.all_special_ids == frozenset(range(395, 400))
    assert tok.model_max_length == 256 and tok.chat_template is not None
    assert os.path.getsize(os.path.join(TEXT_DIR, "tokenizer.json")) < 100_000
    assert os.path.getsize(os.path.join(TEXT_DIR, "model.safetensors")) < 500_000


def test_fixture_checkpoint_loads(tok):
    from safetensors import safe_open

    from paged_jax.model import load_model

    config, _, params = load_model(TEXT_DIR)
    assert config.vocab_size == MODEL_VOCAB and config.dtype == "bfloat16" and not config.tie_word_embeddings
    assert params["embed_tokens"]["embedding"][...].shape == (MODEL_VOCAB, 64)
    with safe_open(os.path.join(TEXT_DIR, "model.safetensors"), framework="numpy") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
    assert len(tok) <= config.vocab_size


def test_round_trip_and_bos(tok, corpus):
    ids = tok.encode(corpus)
    assert ids[0] == BOS and ids.count(BOS) == 1 and max(ids) < len(tok) <= MODEL_VOCAB
    assert ids[1:] == tok.encode(corpus, add_special_tokens=False)
    assert tok.decode(ids) == corpus
    assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + corpus
    for line in corpus.splitlines():
        assert tok.decode(tok.encode(line)) == line
    # Multi-byte characters are split over byte-level tokens: decoding a lone piece is U+FFFD.
    emoji = tok.encode("👋", add_special_tokens=False)
    assert len(emoji) > 1 and "\ufffd" in tok.decode(emoji[:1])
    # Special tokens in text are recognised as such (one id), as HF does by default.
    assert tok.encode("a<|eot_id|>b", add_special_tokens=False)[1:2] == [EOT]
    # Ids past the tokenizer (the model's padded rows) decode to nothing.
    assert tok.decode([MODEL_VOCAB - 1, *tok.encode("hi", add_special_tokens=False)]) == "hi"


def test_from_dir_without_tokenizer_is_none():
    assert Tokenizer.from_dir(os.path.join(FIXTURES, "llama")) is None


def test_bos_from_config_when_post_processor_adds_nothing(tmp_path):
    _copy_fixture(tmp_path)
    _without_post_processor(tmp_path)
    assert Tokenizer.from_dir(tmp_path).encode("hi")[0] == BOS
    _copy_fixture(tmp_path, add_bos_token=False)
    _without_post_processor(tmp_path)
    plain = Tokenizer.from_dir(tmp_path)
    assert plain.encode("hi") == plain.encode("hi", add_special_tokens=False) and not plain.add_bos_token


def test_llama_tokenizer_class_follows_the_flags(tmp_path):
    # LlamaTokenizerFast rebuilds its post-processor from add_bos_token/add_eos_token.
    path = _copy_fixture(tmp_path, tokenizer_class="LlamaTokenizerFast", add_bos_token=False,
                         add_eos_token=True)
    t = Tokenizer.from_dir(path)
    assert t.encode("hi") == [*t.encode("hi", add_special_tokens=False), EOT]


def test_config_variants(tmp_path):
    path = _copy_fixture(tmp_path, bos_token={"content": "<|begin_of_text|>", "special": True},
                         chat_template=[{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}])
    t = Tokenizer.from_dir(path)
    assert t.bos_token_id == BOS and t.chat_template == "D" and t.chat_templates["tool_use"] == "T"
    assert t.apply_chat_template([], chat_template="tool_use") == "T"
    assert t.apply_chat_template([], chat_template="{{ messages | length }}x") == "0x"
    (tmp_path / "chat_template.jinja").write_text("J{{ bos_token }}")
    assert Tokenizer.from_dir(path).apply_chat_template([]) == "J<|begin_of_text|>"
    path = _copy_fixture(tmp_path, chat_template=None)
    os.remove(tmp_path / "chat_template.jinja")
    with pytest.raises(ValueError, match="no chat_template"):
        Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("name, content, match", [
    ("tokenizer_config.json", "{not json", "not valid JSON"),
    ("tokenizer_config.json", "[1, 2]", "expected a JSON object"),
    ("tokenizer_config.json", json.dumps({"bos_token": 3}), "bos_token"),
    ("tokenizer_config.json", json.dumps({"chat_template": 3}), "chat_template"),
    ("tokenizer_config.json", json.dumps({"add_bos_token": "yes"}), "add_bos_token"),
    ("tokenizer.json", "{}", "not a valid tokenizers"),
    ("tokenizer.json", "garbage", "not a valid tokenizers"),
])
def test_malformed_files_name_the_file(tmp_path, name, content, match):
    _copy_fixture(tmp_path)
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=match) as info:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path / name) in str(info.value)


# --------------------------------------------------------------------------- detokenisation

# Text that exercises 1-4 byte UTF-8, merged tokens and leading-space merges.
TEXTS = st.lists(st.sampled_from([*"ab eéèçñüßø東京山川你好，👋🐈🙂.!\n", "the ", " café", "hello"]),
                 max_size=16).map("".join)


def _chunks(draw, items: list) -> list[list]:
    cuts = sorted(draw(st.lists(st.integers(0, len(items)), max_size=6)))
    bounds = [0, *cuts, len(items)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:])]


def _check_stream(tok, prompt, output, chunks, skip_special_tokens=True):
    """Run the detokenizer and check the invariant of paged_jax.text.detokenize."""
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
    full = tok.decode(prompt + output, skip_special_tokens=skip_special_tokens)
    context = tok.decode(prompt, skip_special_tokens=skip_special_tokens)
    assert full.startswith(context)
    expected = full[len(context):]
    seen = []
    for chunk in chunks:
        delta = detok.step(chunk)
        seen.append(delta)
        # Never emits anything that later ids change (a U+FFFD they complete, in particular).
        assert expected.startswith(detok.text)
    seen.append(detok.flush())
    assert "".join(seen) == detok.text == expected
    assert detok.token_ids == output
    return detok


@SETTINGS
@given(data=st.data(), prompt_text=TEXTS, output_text=TEXTS)
def test_detokenize_encoded_strings(tok, data, prompt_text, output_text):
    prompt = tok.encode(prompt_text)
    output = tok.encode(output_text, add_special_tokens=False)
    chunks = _chunks(data.draw, output)
    detok = _check_stream(tok, prompt, output, chunks)
    # Byte-level decoding splits at character boundaries: the output's own text, exactly.
    assert detok.text == output_text
    # One id at a time (the engine's usual case) gives the same text.
    assert _check_stream(tok, prompt, output, [[i] for i in output]).text == detok.text


@SETTINGS
@given(data=st.data(), prompt_text=TEXTS, skip=st.booleans(),
       output=st.lists(st.integers(0, MODEL_VOCAB - 1) | st.sampled_from([BOS, EOT, END_HEADER]) |
                       st.integers(128, 255), max_size=20))
def test_detokenize_random_ids(tok, data, prompt_text, skip, output):
    # Random ids split and mangle multi-byte characters, hit special tokens and the
    # padded ids (>= 400) that the tokenizer does not know.
    prompt = tok.encode(prompt_text)
    _check_stream(tok, prompt, output, _chunks(data.draw, output), skip_special_tokens=skip)


@SETTINGS
@given(data=st.data(), prompt=st.lists(st.integers(0, 399), max_size=8),
       output=st.lists(st.integers(0, 399), max_size=16))
def test_detokenize_random_prompt(tok, data, prompt, output):
    # The invariant needs a prompt whose text does not end mid-character.
    if tok.decode(prompt).endswith("\ufffd"):
        detok = IncrementalDetokenizer(tok, prompt)
        for chunk in _chunks(data.draw, output):
            detok.step(chunk)
        detok.flush()  # still well defined: the straddling character belongs to the prompt
        return
    _check_stream(tok, prompt, output, _chunks(data.draw, output))


def _sentencepiece_style() -> Tokenizer:
    """A Llama-2 style tokenizer: "▁" word marks, byte fallback, and a decoder that strips
    the first token's leading space, so decoding a window depends on where it starts."""
    from tokenizers import AddedToken, decoders, models, normalizers, processors
    from tokenizers import Tokenizer as Backend

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("▁", "a", "b", "▁a", "▁b", "ab", "▁ab"):
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("▁", "b"), ("a", "b"), ("▁a", "b")]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                               "tokenizer_class": "LlamaTokenizerFast"})


SP_TOK = _sentencepiece_style()


def test_sentencepiece_style_tokenizer():
    assert SP_TOK.encode("ab ba") == [1, 265, 263, 260]  # BOS from the Llama class's default
    assert SP_TOK.decode(SP_TOK.encode("ab ba é€")) == "ab ba é€"
    assert SP_TOK.decode([262]) == "a" and SP_TOK.decode([262, 263]) == "a b"  # leading space stripped
    detok = IncrementalDetokenizer(SP_TOK, SP_TOK.encode("a"))
    assert detok.step([263]) == " b"  # the prompt's context keeps the space
    # The prompt's last 5 ids start inside a byte-fallback "€": the window must start earlier.
    detok = IncrementalDetokenizer(SP_TOK, SP_TOK.encode("€€"))
    assert detok.step([3 + 0xC3]) == "" and detok.step([3 + 0xA9]) == "é" and detok.flush() == ""


_SP_PIECES = st.sampled_from([[259], [260], [261], [262], [263], [264], [265], [0], [1], [2],
                              [3 + 0xC3, 3 + 0xA9], [3 + 0xE2, 3 + 0x82, 3 + 0xAC]])


@SETTINGS
@given(data=st.data(), prompt_text=st.text(alphabet="ab é€😀", max_size=8), skip=st.booleans(),
       pieces=st.lists(_SP_PIECES | st.lists(st.integers(0, 270), max_size=2), max_size=10))
def test_detokenize_sentencepiece_style(data, prompt_text, skip, pieces):
    prompt = SP_TOK.encode(prompt_text)
    output = [i for piece in pieces for i in piece]
    chunks = _chunks(data.draw, output)
    if "\ufffd" in SP_TOK.decode(prompt + output, skip_special_tokens=skip):
        # tokenizers' ByteFallback decodes a run of byte tokens with any invalid byte as one
        # U+FFFD per byte, rewriting characters already final; only well-defined here.
        detok = IncrementalDetokenizer(SP_TOK, prompt, skip_special_tokens=skip)
        for chunk in chunks:
            detok.step(chunk)
        detok.flush()
        return
    _check_stream(SP_TOK, prompt, output, chunks, skip_special_tokens=skip)


def test_detokenize_split_character_is_held_back(tok):
    ids = tok.encode("é👋!", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [BOS])
    deltas = [detok.step([i]) for i in ids]
    assert "".join(deltas) == "é👋!" and all("\ufffd" not in d for d in deltas)
    assert deltas.count("") >= 2  # the emoji's pieces waited for its last byte
    # A truncated character is emitted as U+FFFD only by flush, as decode() would.
    detok = IncrementalDetokenizer(tok, [BOS])
    assert detok.step(tok.encode("a👋", add_special_tokens=False)[:-1]) == "a"
    assert detok.flush() == "\ufffd" and detok.text == "a\ufffd"


def test_detokenize_special_tokens(tok):
    out = [*tok.encode("Hi", add_special_tokens=False), EOT]
    assert IncrementalDetokenizer(tok, [BOS]).step(out) == "Hi"
    kept = IncrementalDetokenizer(tok, [BOS], skip_special_tokens=False)
    assert kept.step(out) + kept.flush() == "Hi<|eot_id|>"


def test_detokenize_window_is_bounded(tok, corpus):
    """Each step decodes O(new ids) ids, not the whole sequence (the constructor decodes the prompt once)."""
    sizes = []

    class Recorder:
        def __init__(self, backend):
            self.backend = backend

        def decode(self, ids, **kw):
            sizes.append(len(ids))
            return self.backend.decode(ids, **kw)

    class Shim:
        backend = Recorder(tok.backend)

    ids = tok.encode(corpus, add_special_tokens=False)
    detok = IncrementalDetokenizer(Shim(), tok.encode(corpus))
    sizes.clear()
    for i in ids:
        detok.step([i])
    detok.flush()
    assert detok.text == corpus and len(ids) > 1000
    assert max(sizes) <= 12, max(sizes)


# --------------------------------------------------------------------------- stop strings


def _reference_stop(text: str, stop: tuple[str, ...], include: bool):
    """Brute force: the first prefix of ``text`` that ends with a stop string (the longest)."""
    for i in range(1, len(text) + 1):
        ends = [s for s in stop if text[:i].endswith(s)]
        if ends:
            s = max(ends, key=len)
            return s, i if include else i - len(s)
    return None, None


@settings(max_examples=300, deadline=None)
@given(data=st.data(), text=st.text(alphabet="abc ", max_size=30),
       stop=st.lists(st.text(alphabet="abc ", min_size=1, max_size=4), min_size=1, max_size=3),
       include=st.booleans())
def test_stop_strings_match_brute_force(data, text, stop, include):
    stop = tuple(stop)
    checker = StopStrings(stop, include_stop_str_in_output=include)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    found = (None, None)
    for a, b in zip(bounds, bounds[1:]):
        found = checker.check(text[:b], b - a)
        if found[0] is not None:
            break
    assert found == _reference_stop(text, stop, include)
    if found[0] is not None and include:
        assert text[:found[1]].endswith(found[0])


def test_stop_strings_examples():
    s = StopStrings(("STOP", "\n\n"))
    assert s.check("hello", 5) == (None, None)
    assert s.check("hello ST", 3) == (None, None)
    assert s.check("hello STOP there", 8) == ("STOP", 6)  # spans two steps
    assert s.check("hello STOP", 0) == (None, None)
    assert StopStrings(("STOP",), include_stop_str_in_output=True).check("hi STOP!", 5) == ("STOP", 7)
    # The first completed match wins, whatever the list order.
    assert StopStrings(("bcd", "c")).check("abcd", 4) == ("c", 2)
    assert StopStrings(("c", "bc")).check("abc", 3) == ("bc", 1)
    assert stop_holdback(("STOP", "\n\n")) == 3 and stop_holdback(()) == 0 and s.holdback == 3
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings(("",))


# --------------------------------------------------------------------------- chat templates

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi there! "}]


def test_chat_template_exact(tok):
    head = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi there!<|eot_id|>")
    assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=False) == head
    prompt = tok.apply_chat_template(CONVERSATION)
    assert prompt == head + "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ids = tok.apply_chat_template(CONVERSATION, tokenize=True)
    assert ids == tok.encode(prompt, add_special_tokens=False)
    assert ids[0] == BOS and ids.count(BOS) == 1 and ids[-3:-2] == [END_HEADER] and EOT in ids
    assert tok.decode(ids, skip_special_tokens=False) == prompt


def test_chat_template_raise_exception(tok):
    with pytest.raises(ChatTemplateError, match="Unknown role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])
    assert issubclass(ChatTemplateError, ValueError)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__ }}",
    "{% set x = messages.append(1) %}",  # immutable sandbox: no mutating methods
])
def test_chat_template_sandbox(template):
    with pytest.raises(ChatTemplateError, match="sandbox|unsafe"):
        render_chat(template, [], add_generation_prompt=False, bos_token=None, eos_token=None)


@pytest.mark.parametrize("messages, match", [
    ("hello", "must be a list"),
    ({"role": "user", "content": "x"}, "must be a list"),
    (["hello"], r"messages\[0\] must be a dict"),
    ([{"content": "x"}], "lacks 'role'"),
    ([{"role": "user"}], "lacks 'content'"),
    ([{"role": "", "content": "x"}], "non-empty str"),
    ([{"role": "user", "content": 3}], "content"),
])
def test_bad_messages(tok, messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        tok.apply_chat_template(messages)


def test_render_chat_environment():
    kw = dict(add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    msgs = [{"role": "user", "content": "café <b>"}]
    assert render_chat("{{ messages | tojson }}", msgs, **kw) == '[{"role": "user", "content": "café <b>"}]'
    assert render_chat("{{ {'a': 1} | tojson(indent=2) }}", [], **kw) == '{\n  "a": 1\n}'
    assert render_chat("{{ {'a': 1, 'b': 2} | tojson(separators=(',', ':')) }}", [], **kw) == '{"a":1,"b":2}'
    assert render_chat("{{ bos_token }}{{ add_generation_prompt }}{{ tools }}{{ x }}", [], x=7, **kw) \
        == "<s>TrueNone7"
    assert len(render_chat("{{ strftime_now('%Y') }}", [], **kw)) == 4
    # trim_blocks / lstrip_blocks, and loop controls.
    template = "{% for m in messages %}\n  {% if loop.index > 1 %}{% break %}{% endif %}\n{{ m.role }}\n{% endfor %}"
    assert render_chat(template, msgs * 3, **kw) == "user\n"
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat("{% for %}", [], **kw)
