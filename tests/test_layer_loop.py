"""``layer_loop="unrolled"``: the decoder layers as a loop over per-layer weight arrays
(``llama.unstack_layers``, ``PerLayer``) instead of one ``lax.scan`` over the stacked ones.
Same model, so: the same logits as the scan for every registered family (fp32 tight, bf16
loose), the same engine outputs request for request, one compile per bucket, and the
combinations it cannot run refused before any weight is read."""

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_fakes import assert_drained, fake_backend

from paged_jax.engine import LLM, EngineArgs, SamplingParams
from paged_jax.engine.config import auto_layer_loop
from paged_jax.model import FAMILIES, ModelConfig, dense_forward, init_params
from paged_jax.model.llama import PerLayer, pack_params, unstack_layers

TEXT = os.path.join(os.path.dirname(__file__), "fixtures", "llama_text")
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
            head_dim=16, max_position_embeddings=256)
CONFIGS = [ModelConfig(**TINY, architecture=a) for a in sorted(FAMILIES)] + [
    ModelConfig(**TINY, tie_word_embeddings=True, attention_bias=True, attention_out_bias=True)]


def _ids(config):
    return f"{config.architecture}{'-tied-bias' if config.tie_word_embeddings else ''}"


@pytest.mark.parametrize("dtype,tol", [("float32", 2e-5), ("bfloat16", 0.15)])
@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_unrolled_logits_equal_the_scans(config, dtype, tol):
    """Fresh random weights and tokens; the packed (16-bit as bits) params the engine uses."""
    config = config.replace(dtype=dtype)
    graphdef, params = init_params(config, seed=7)
    packed = pack_params(params)
    unrolled = unstack_layers(packed, config.jnp_dtype)
    stacked_leaves = jax.tree.leaves(packed)
    per_layer = [x for x in jax.tree.leaves(unrolled, is_leaf=lambda x: isinstance(x, PerLayer))
                 if isinstance(x, PerLayer)]
    assert per_layer and all(len(p.arrays) == config.num_layers for p in per_layer)
    # Nothing lost: the same number of elements, the layers' arrays in the model dtype.
    assert sum(x.size for x in jax.tree.leaves(unrolled)) == sum(x.size for x in stacked_leaves)
    assert all(a.dtype == config.jnp_dtype for p in per_layer for a in p.arrays)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, config.vocab_size, (2, 11)), jnp.int32)
    want = np.asarray(dense_forward(graphdef, packed, tokens))
    got = np.asarray(jax.jit(dense_forward, static_argnums=0)(graphdef, unrolled, tokens))
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def _generate(layer_loop: str, **kw):
    llm = LLM(TEXT, dtype="float32", block_size=4, max_num_seqs=6, max_num_batched_tokens=32, max_model_len=96,
              debug_checks=True, seed=3, layer_loop=layer_loop, **kw)
    rng = np.random.default_rng(5)
    prompts = [{"prompt_token_ids": rng.integers(3, 400, int(n)).tolist()} for n in (1, 6, 19, 40, 3, 27)]
    params = [SamplingParams(temperature=0, max_tokens=10, logprobs=2),
              SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=4, n=2)]
    return llm, llm.generate(prompts, [params[i % 2] for i in range(len(prompts))], use_tqdm=False)


@pytest.mark.parametrize("pressure", [None, "recompute"])
def test_the_engine_gives_the_same_outputs_and_compiles_once_per_bucket(pressure):
    kw = {} if pressure is None else {"num_gpu_blocks": 24, "preemption_mode": pressure}
    scan_llm, want = _generate("scan", **kw)
    llm, got = _generate("unrolled", **kw)
    assert "layers unrolled" in llm.engine.runner.backend.name
    for a, b in zip(got, want, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        for oa, ob in zip(a.outputs, b.outputs):
            np.testing.assert_allclose(oa.cumulative_logprob, ob.cumulative_logprob, rtol=1e-4, atol=1e-4)
    assert_drained(llm)
    # The same programs, traced as often as the scan's (once per bucket), and no retrace
    # when a shape comes back.
    assert llm.stats()["traces"] == scan_llm.stats()["traces"]
    for engine in (scan_llm, llm):
        engine.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4), use_tqdm=False)
    traces = llm.stats()["traces"]
    assert traces == scan_llm.stats()["traces"]
    again = llm.generate([{"prompt_token_ids": [8, 9, 10]}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert again[0].outputs[0].token_ids and llm.stats()["traces"] == traces

def test_what_it_cannot_run_is_refused_before_loading():
    with pytest.raises(ValueError, match=r"layer_loop='stacked': unknown; choose one of \['auto', 'scan', 'unrolled'\]"):
        LLM(TEXT, layer_loop="stacked")
    with pytest.raises(ValueError, match="layer_loop='unrolled' .* not with a ModelBackend"):
        LLM(fake_backend(4), layer_loop="unrolled")


def test_a_draft_model_beside_an_unrolled_target_gives_the_plain_outputs():
    """The target unrolled, its draft (a scan model of its own) proposing: greedy tokens are
    the target's alone, as with the scan."""
    kw = dict(dtype="float32", block_size=8, max_num_seqs=4, max_model_len=96, debug_checks=True)
    prompts = [{"prompt_token_ids": list(range(5 + i, 25 + 2 * i))} for i in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    plain_llm = LLM(TEXT, layer_loop="scan", **kw)
    plain = plain_llm.generate(prompts, greedy, use_tqdm=False)
    draft = ModelConfig(vocab_size=plain_llm.config.model.vocab_size, hidden_size=32, intermediate_size=64,
                        num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=2048)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}
    llm = LLM(TEXT, layer_loop="unrolled", speculative_config=spec, **kw)
    got = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert llm.stats()["spec_rounds"] > 0
    assert_drained(llm)


def test_auto_unrolls_on_one_cpu_device_only():
    assert auto_layer_loop("cpu", sharded=False)[0] == "unrolled"
    assert auto_layer_loop("cpu", sharded=True)[0] == "scan"
    assert auto_layer_loop("gpu", sharded=False)[0] == "scan"
    assert auto_layer_loop("tpu", sharded=False)[0] == "scan"


def test_the_default_is_auto_resolved_where_the_model_is_built(caplog):
    """The suite runs on CPU with one device: the default unrolls, and says so; a
    ModelBackend (its own step) takes the default without a refusal; the scan stays one
    argument away."""
    with caplog.at_level(logging.INFO, logger="paged_jax"):
        llm = LLM(TEXT, dtype="float32", max_num_seqs=2, max_model_len=64)
    assert EngineArgs(model=TEXT).layer_loop == "auto"
    assert llm.config.model.layer_loop == "unrolled" and "layers unrolled" in llm.engine.runner.backend.name
    assert "layer_loop='auto': unrolled" in caplog.text
    assert LLM(fake_backend(4)).config.model.layer_loop == "scan"
    scan = LLM(TEXT, dtype="float32", max_num_seqs=2, max_model_len=64, layer_loop="scan")
    assert scan.config.model.layer_loop == "scan" and "layers unrolled" not in scan.engine.runner.backend.name
