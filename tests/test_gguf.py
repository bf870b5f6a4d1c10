"""GGUF files (``paged_jax/model/gguf.py``): every supported tensor type loads and reproduces
transformers' own GGUF path (fixtures by scripts/make_gguf_fixtures.py: logits, greedy tokens,
tokenizer ids), and bad files fail clearly before any tensor is dequantised."""

import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import LLM, SamplingParams
from paged_jax.model import GGUFFile, dense_forward, load_model, open_source
from paged_jax.model import gguf as gguf_source
from paged_jax.text import Tokenizer

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
GGUF = os.path.join(FIXTURES, "gguf")
META = json.load(open(os.path.join(GGUF, "metadata.json")))
MODELS = tuple(sorted(META["files"]))
T = 24  # prompts (<= 11) + 8 greedy tokens, padded: one compiled shape per model config
ATOL = 2e-4


@functools.cache
def _expected():
    return dict(np.load(os.path.join(GGUF, "transformers_outputs.npz")))


@functools.cache
def _load(name):
    return load_model(os.path.join(GGUF, name), dtype=jnp.float32)


@functools.cache
def _forward(graphdef):
    return jax.jit(functools.partial(dense_forward, graphdef))


def test_every_required_type_has_a_fixture():
    types = {f["type"] for f in META["files"].values()}
    assert set(gguf_source.SUPPORTED_TYPES) <= types
    assert set(gguf_source.SUPPORTED_TYPES) <= set(gguf_source.supported_type_names())
    assert {f["arch"] for f in META["files"].values()} == {"llama", "qwen2"}


@pytest.mark.parametrize("name", MODELS)
def test_logits_and_greedy_match_transformers_gguf(name):
    """Dense logits of both prompts, then 8 greedy tokens, vs transformers' GGUF loader."""
    config, graphdef, params = _load(name)
    exp = _expected()
    fwd = _forward(graphdef)
    for i, prompt in enumerate(META["prompts"]):
        tokens = np.zeros((1, T), np.int32)
        tokens[0, : len(prompt)] = prompt
        logits = np.asarray(fwd(params, tokens))[0]
        want = exp[f"{name}/logits_{i}"]
        np.testing.assert_allclose(logits[: len(prompt)], want, atol=ATOL * max(1.0, np.abs(want).max()), rtol=0)
        seq = list(prompt)
        for _ in range(META["greedy"]):
            tokens[0, : len(seq)] = seq
            seq.append(int(np.asarray(fwd(params, tokens))[0, len(seq) - 1].argmax()))
        assert seq[len(prompt):] == exp[f"{name}/greedy_{i}"].tolist(), name


def test_config_from_metadata():
    f = GGUFFile(os.path.join(GGUF, "llama_text.Q4_1.gguf"))
    with open(os.path.join(FIXTURES, "llama_text", "config.json")) as fh:
        hf = json.load(fh)
    cfg = f.model_config()
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (2, 64, 96)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 2, 16, 448)
    assert cfg.rope_theta == hf["rope_theta"] and cfg.max_position_embeddings == hf["max_position_embeddings"]
    assert cfg.rms_norm_eps == pytest.approx(hf["rms_norm_eps"]) and not cfg.tie_word_embeddings
    assert cfg.dtype == "float32" and f.gguf_tensor_type("model.layers.0.self_attn.q_proj.weight") == "Q4_1"
    assert GGUFFile(os.path.join(GGUF, "llama_text.Q8_0.gguf")).model_config().tie_word_embeddings
    qwen2 = GGUFFile(os.path.join(GGUF, "qwen2.Q8_0.gguf")).model_config()
    assert qwen2.architecture == "Qwen2ForCausalLM" and qwen2.attention_bias and not qwen2.attention_out_bias
    assert f.generation_defaults().eos_token_ids == (397,)  # eos = eot = <|eot_id|> (tokenizer_config)


def test_weights_equal_the_dequantised_hf_checkpoint():
    """The F32 file holds the HF checkpoint exactly: un-permuted Q/K equal HF's."""
    from safetensors.numpy import load_file

    hf = load_file(os.path.join(FIXTURES, "llama_text", "model.safetensors"))
    f = GGUFFile(os.path.join(GGUF, "llama_text.F32.gguf"))
    assert set(f.tensor_names()) == set(hf)
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "lm_head.weight"):
        np.testing.assert_array_equal(f.read_tensor(name), hf[name].astype(np.float32))


def test_permutation_round_trip():
    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(64, 3)
    assert np.array_equal(gguf_source.unpermute_rows(gguf_source.permute_rows(w, 4), 4), w)
    assert not np.array_equal(gguf_source.permute_rows(w, 4), w)


def test_llm_generates_from_a_gguf_file():
    path = os.path.join(GGUF, "llama_text.Q4_1.gguf")
    llm = LLM(path, num_gpu_blocks=16, block_size=4, max_model_len=32, max_num_seqs=2)
    out = llm.generate([{"prompt_token_ids": META["prompts"][1]}],
                       SamplingParams(temperature=0, max_tokens=META["greedy"], ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == _expected()["llama_text.Q4_1.gguf/greedy_1"].tolist()
    tok = llm.get_tokenizer()
    assert tok.chat_template and tok.bos_token == "<|begin_of_text|>" and tok.add_bos_token
    text = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(text[0].outputs[0].token_ids) <= 2


# --------------------------------------------------------------------------- tokenizers


def _corpus():
    with open(os.path.join(FIXTURES, "llama_text", "corpus.txt"), encoding="utf-8") as f:
        return [line for line in f.read().splitlines() if line.strip()]


@pytest.mark.parametrize("name", ["llama_text.F16.gguf", "sp_tokenizer.gguf"])
def test_tokenizer_ids_equal_transformers_gguf_tokenizer(name):
    tok = GGUFFile(os.path.join(GGUF, name)).tokenizer()
    exp = _expected()
    lines = _corpus()
    assert len(lines) == META["corpus_lines"]
    for j, line in enumerate(lines):
        ids = tok.encode(line)
        assert ids == exp[f"{name}/tokens_{j}"].tolist(), (name, line)
        assert tok.decode(ids) == line


def test_byte_level_tokenizer_equals_the_checkpoints_own():
    ours = GGUFFile(os.path.join(GGUF, "llama_text.F16.gguf")).tokenizer()
    theirs = Tokenizer.from_dir(os.path.join(FIXTURES, "llama_text"))
    for line in _corpus() + ["héllo wörld 🙂  two  spaces\n<|eot_id|> tail"]:
        assert ours.encode(line) == theirs.encode(line)
        assert ours.decode(ours.encode(line)) == theirs.decode(theirs.encode(line))
    assert ours.eos_token == theirs.eos_token and ours.all_special_ids >= {395, 396, 397}


def test_sentencepiece_tokenizer():
    tok = GGUFFile(os.path.join(GGUF, "sp_tokenizer.gguf")).tokenizer()
    ids = tok.encode("The lighthouse ☃")  # ☃ is not in the vocabulary: byte fallback
    assert ids[0] == 1 and tok.add_bos_token and tok.decode(ids) == "The lighthouse ☃"
    assert tok.convert_ids_to_tokens([ids[1]])[0].startswith("▁")


def test_tokenizer_override(tmp_path):
    path = os.path.join(GGUF, "llama_text.Q4_1.gguf")
    sp = os.path.join(GGUF, "sp_tokenizer.gguf")
    llm = LLM(path, tokenizer=sp, num_gpu_blocks=8, block_size=4, max_model_len=16, max_num_seqs=1)
    assert llm.get_tokenizer().source == sp
    llm = LLM(path, tokenizer=os.path.join(FIXTURES, "llama_text"), num_gpu_blocks=8, block_size=4,
              max_model_len=16, max_num_seqs=1)
    assert llm.get_tokenizer().source == os.path.join(FIXTURES, "llama_text")


# --------------------------------------------------------------------------- bad files


@pytest.fixture
def no_dequantise(monkeypatch):
    """Any error must come before a tensor is dequantised."""
    import gguf.quants

    def boom(*a, **k):
        raise AssertionError("dequantised before the error")

    monkeypatch.setattr(gguf.quants, "dequantize", boom)


def test_bad_magic(tmp_path, no_dequantise):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + open(os.path.join(GGUF, "mistral.Q4_0.gguf"), "rb").read()[4:])
    with pytest.raises(ValueError, match=r"not a GGUF file .*b'GGML'"):
        LLM(str(bad))


@pytest.mark.parametrize("cut", [10, 30, 2000, -100])
def test_truncated_file(tmp_path, cut, no_dequantise):
    data = open(os.path.join(GGUF, "llama_text.Q5_0.gguf"), "rb").read()
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:cut])
    with pytest.raises(gguf_source.GGUFFormatError, match="truncated"):
        open_source(str(short))


def _write(path, arch="llama", tensors=(), **fields):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_vocab_size(8)
    for name, array, raw in tensors:
        w.add_tensor(name, array, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_unknown_architecture(tmp_path, no_dequantise):
    with pytest.raises(ValueError, match=r"architecture 'falcon' is not supported; supported: .*llama.*qwen2"):
        GGUFFile(_write(tmp_path / "f.gguf", arch="falcon"))


def test_unsupported_quant_type(tmp_path, no_dequantise):
    path = _write(tmp_path / "i8.gguf", tensors=[("blk.0.attn_q.weight", np.ones((32, 32), np.int8), None)])
    with pytest.raises(ValueError, match=r"'blk.0.attn_q.weight' has GGML type I8.*supported: .*Q4_K"):
        GGUFFile(path)


def test_unknown_quant_type_id(tmp_path, no_dequantise):
    import gguf

    q = gguf.quants.quantize(np.ones((32, 32), np.float32), gguf.GGMLQuantizationType.Q8_0)
    path = _write(tmp_path / "q.gguf", tensors=[("blk.0.attn_q.weight", q, gguf.GGMLQuantizationType.Q8_0)])
    data = bytearray(open(path, "rb").read())
    at = data.index(b"blk.0.attn_q.weight") + len("blk.0.attn_q.weight")
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    data[type_at:type_at + 4] = (99).to_bytes(4, "little")
    open(path, "wb").write(bytes(data))
    with pytest.raises(ValueError, match=r"'blk.0.attn_q.weight' has GGML type id 99.*supported types: .*Q6_K"):
        GGUFFile(path)


def test_missing_tensor_named(tmp_path):
    path = _write(tmp_path / "empty.gguf")
    with pytest.raises(ValueError, match="missing tensor 'model.embed_tokens.weight'"):
        load_model(path)


def test_revision_with_a_file_is_refused(tmp_path):
    path = shutil.copy(os.path.join(GGUF, "mistral.Q4_0.gguf"), tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="a file has no revisions"):
        open_source(str(path), revision="main")


def _script():
    """scripts/make_gguf_fixtures.py (its writer needs only gguf and numpy)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_gguf_fixtures", os.path.join(os.path.dirname(__file__), "..", "scripts", "make_gguf_fixtures.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _llama3_freqs(factor=8.0, high=4.0):
    cfg = dict(num_attention_heads=2, hidden_size=32, rope_theta=10000.0,
               rope_scaling=dict(rope_type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=high,
                                 original_max_position_embeddings=8192))
    return _script().llama3_rope_freqs(cfg)


@pytest.mark.parametrize("name,arch", [("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3"),
                                       ("mistral", "llama")])
def test_hf_fixture_written_as_f32_gguf_matches_transformers_on_the_hf_checkpoint(tmp_path, name, arch):
    """Each HF fixture written as an F32 GGUF (Q/K permuted for llama, llama3 RoPE as
    rope_freqs) reads back to transformers' logits on the original checkpoint: the name map
    (Qwen3's q/k norms too), the un-permutation and the config, against an independent oracle."""
    from safetensors.numpy import load_file

    src = os.path.join(FIXTURES, name)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    tensors = {}
    for file in sorted(os.listdir(src)):
        if file.endswith(".safetensors"):
            tensors.update({k: np.asarray(v, np.float32) for k, v in load_file(os.path.join(src, file)).items()})
    import gguf

    path = str(tmp_path / f"{name}.gguf")
    _script().write_model(path, config, tensors, gguf.GGMLQuantizationType.F32, arch=arch, name=f"{name}-fixture",
                          tie=bool(config.get("tie_word_embeddings")))
    cfg, graphdef, params = load_model(path, dtype=jnp.float32)
    assert cfg.architecture == config["architectures"][0] or (name, cfg.architecture) == ("mistral",
                                                                                          "LlamaForCausalLM")
    exp = np.load(os.path.join(src, "expected.npz"))
    for i in range(2):
        prompt = exp[f"prompt_{i}"]
        tokens = np.zeros((1, T), np.int32)
        tokens[0, : len(prompt)] = prompt
        logits = np.asarray(_forward(graphdef)(params, tokens))[0, : len(prompt)]
        np.testing.assert_allclose(logits, exp[f"logits_{i}"], atol=1e-4, rtol=0)


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    """Llama-3.x GGUFs carry llama3 RoPE scaling as a ``rope_freqs`` tensor, not metadata."""
    path = _write(tmp_path / "l3.gguf", tensors=[("rope_freqs.weight", _llama3_freqs(factor=32.0), None)])
    scaling = GGUFFile(path).model_config().rope_scaling
    assert (scaling.rope_type, scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor,
            scaling.original_max_position_embeddings) == ("llama3", 32.0, 1.0, 4.0, 8192)
    odd = _write(tmp_path / "odd.gguf", tensors=[("rope_freqs.weight", _llama3_freqs(high=2.0), None)])
    with pytest.raises(ValueError, match="rope_freqs does not match llama3"):
        GGUFFile(odd)


def test_dtype_override_casts_every_parameter():
    cfg, _, params = load_model(os.path.join(GGUF, "kquant.Q4_K.gguf"), dtype=jnp.bfloat16)
    assert cfg.dtype == "bfloat16" and {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
