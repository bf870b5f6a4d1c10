"""What a vLLM user types: checkpoint defaults (EOS ids, generation_config, dtype), pool
sizing, the compilation cache, and prompts validated before anything runs."""

import json
import os
import shutil
import warnings

import jax
import numpy as np
import pytest
from engine_fakes import fake_backend

from paged_jax import LLM, SamplingParams
from paged_jax.compilation_cache import default_dir, enable_compilation_cache
from paged_jax.engine import memory
from paged_jax.model import HFDirectory

LLAMA = os.path.join(os.path.dirname(__file__), "fixtures", "llama")
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def _checkpoint(tmp_path, config=None, generation=None):
    """A copy of the llama fixture with config.json edits and a generation_config.json."""
    d = tmp_path / "ckpt"
    shutil.copytree(LLAMA, d)
    if config:
        hf = json.loads((d / "config.json").read_text())
        hf.update(config)
        (d / "config.json").write_text(json.dumps(hf))
    if generation is not None:
        (d / "generation_config.json").write_text(json.dumps(generation))
    return d


# ---------------------------------------------------------------- checkpoint defaults


def test_eos_ids_from_config_and_generation_config(tmp_path):
    d = _checkpoint(tmp_path, {"eos_token_id": [7, 9]}, {"eos_token_id": [9, 11], "temperature": 0.6,
                                                        "top_p": 0.9, "do_sample": True, "max_new_tokens": 5})
    defaults = HFDirectory(d).generation_defaults()
    assert defaults.eos_token_ids == (7, 9, 11)
    assert defaults.sampling == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 5}


@pytest.mark.slow
def test_every_eos_id_stops_generation(tmp_path):
    """Greedy from the plain fixture, then the same with one of its output tokens declared
    one of several EOS ids in generation_config.json: generation stops there."""
    prompt = [5, 6, 7, 8]
    plain = LLM(LLAMA, num_gpu_blocks=16, max_num_seqs=2, block_size=8)
    tokens = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    tokens = tokens.outputs[0].token_ids
    k = next(k for k in range(1, len(tokens)) if tokens[k] not in tokens[:k])  # a token new at k
    d = _checkpoint(tmp_path, {"eos_token_id": 250}, {"eos_token_id": [250, tokens[k]]})
    llm = LLM(str(d), num_gpu_blocks=16, max_num_seqs=2, block_size=8, generation_config="vllm")
    assert llm.eos_token_ids == (250, tokens[k])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: k + 1] and out.finish_reason == "stop"


def test_generation_config_defaults_apply_without_sampling_params(tmp_path):
    d = _checkpoint(tmp_path, generation={"temperature": 0.0, "max_new_tokens": 3})
    llm = LLM(str(d), num_gpu_blocks=16, max_num_seqs=2, block_size=8)
    defaults = llm.get_default_sampling_params()
    assert defaults.temperature == 0.0 and defaults.max_tokens == 3
    out = llm.generate([[1, 2, 3]], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3
    # generation_config="vllm": SamplingParams' own defaults.
    assert LLM(str(d), num_gpu_blocks=16, max_num_seqs=2, block_size=8,
               generation_config="vllm").get_default_sampling_params() == SamplingParams()


def test_dtype_auto_is_the_checkpoint_dtype(tmp_path):
    llm = LLM(LLAMA, num_gpu_blocks=8, max_num_seqs=1)
    leaves = jax.tree.leaves(llm.backend.params)
    assert {leaf.dtype for leaf in leaves} == {np.dtype("float32")}
    bf16 = LLM(LLAMA, num_gpu_blocks=8, max_num_seqs=1, dtype="bfloat16", layer_loop="scan")
    # bf16 weights; the stacked layers' held as their uint16 bits (model.llama.pack_params)
    assert {leaf.dtype for leaf in jax.tree.leaves(bf16.backend.params)} == {np.dtype(jax.numpy.bfloat16),
                                                                              np.dtype("uint16")}
    # unrolled (the CPU default), each layer's weights are bf16 arrays of their own
    unrolled = LLM(LLAMA, num_gpu_blocks=8, max_num_seqs=1, dtype="bfloat16")
    assert {leaf.dtype for leaf in jax.tree.leaves(unrolled.backend.params)} == {np.dtype(jax.numpy.bfloat16)}
    assert bf16.config.model.architecture.dtype == "bfloat16"


@pytest.mark.parametrize("content, match", [("{not json", "config.json: not valid JSON"),
                                            ("[1, 2]", "config.json: expected a JSON object")])
def test_malformed_config_names_the_file(tmp_path, content, match):
    d = _checkpoint(tmp_path)
    (d / "config.json").write_text(content)
    with pytest.raises(ValueError, match=match):
        LLM(str(d), num_gpu_blocks=8)


def test_malformed_generation_config_names_the_file(tmp_path):
    d = _checkpoint(tmp_path)
    (d / "generation_config.json").write_text("{")
    with pytest.raises(ValueError, match="generation_config.json: not valid JSON"):
        LLM(str(d), num_gpu_blocks=8)


# ---------------------------------------------------------------- pool sizing


def test_pool_sized_from_the_cpu_budget(monkeypatch):
    backend = fake_backend(4, max_position=256)  # 32 bytes per block
    monkeypatch.setenv(memory.CPU_ENV, str(40 * 32 / 2**30))  # 40 blocks
    with pytest.warns(UserWarning, match="max_model_len capped at 160 tokens"):
        llm = LLM(backend, block_size=4, max_num_seqs=2)
    assert llm.num_gpu_blocks == 40 and llm.max_model_len == 160
    # Never more than max_num_seqs sequences of max_model_len could use.
    monkeypatch.setenv(memory.CPU_ENV, "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        llm = LLM(backend, block_size=4, max_num_seqs=2, max_model_len=64)
    assert llm.num_gpu_blocks == 2 * 16


def test_max_model_len_capped_by_a_given_pool_warns():
    with pytest.warns(UserWarning, match="max_model_len capped at 32 tokens"):
        llm = LLM(fake_backend(4), block_size=4, num_gpu_blocks=8)
    assert llm.max_model_len == 32


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_gpu_blocks=0), "num_gpu_blocks=0"),
    (dict(num_gpu_blocks=2.5), "num_gpu_blocks=2.5"),
    (dict(kv_cache_memory_bytes=0), "kv_cache_memory_bytes=0"),
    (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization=0.0"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization=1.5"),
    (dict(dtype="int8"), "dtype='int8'"),
    (dict(generation_config="hf"), "generation_config='hf'"),
])
def test_bad_sizing_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(fake_backend(4), block_size=4, **kwargs)


def test_bad_cpu_budget(monkeypatch):
    monkeypatch.setenv(memory.CPU_ENV, "lots")
    with pytest.raises(ValueError, match="PAGED_JAX_CPU_KVCACHE_SPACE='lots'"):
        LLM(fake_backend(4), block_size=4)


# ---------------------------------------------------------------- compilation cache


def test_compilation_cache_keeps_a_configured_directory(tmp_path):
    configured = jax.config.jax_compilation_cache_dir  # tests/conftest.py sets one
    assert configured
    assert enable_compilation_cache(tmp_path) == configured


def test_compilation_cache_default_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_dir() == str(tmp_path / "paged_jax" / "jax")


# ---------------------------------------------------------------- prompt validation


@pytest.mark.parametrize("prompt, match", [
    ([1, 2.5, 3], r"prompt 0: token 1 is 2.5"),
    ([1, True], r"prompt 0: token 1 is True"),
    ([[1, 2], [3, "a"]], r"prompt 1: token 1 is 'a'"),
    ([np.array([1.0, 2.0])], r"prompt 0: token 0 is 1.0"),
])
def test_non_integral_token_ids_rejected(prompt, match):
    llm = LLM(fake_backend(4), block_size=4, num_gpu_blocks=16, max_model_len=32)
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()


@pytest.mark.slow
def test_numpy_prompts_accepted():
    llm = LLM(fake_backend(4), block_size=4, num_gpu_blocks=16, max_model_len=32)
    as_lists = llm.generate([[1, 2, 3], [4, 5]], GREEDY, use_tqdm=False)
    for prompts in (np.array([1, 2, 3], np.int64), [np.array([1, 2, 3], np.int32), np.array([4, 5])]):
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        for a, b in zip(outs, as_lists, strict=False):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.prompt_token_ids == b.prompt_token_ids
            assert all(type(t) is int for t in a.prompt_token_ids)


def test_an_untileable_pallas_model_fails_before_its_weights_load(monkeypatch):
    from paged_jax.attention.dispatch import tiling_problem
    from paged_jax.model import checkpoint

    monkeypatch.setattr(checkpoint, "load_params", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(ValueError, match=r"head_dim=16 is not supported .* use attention_impl='xla'"):
        LLM(LLAMA, num_gpu_blocks=8, attention_impl="pallas_interpret")
    shape = dict(head_dim=64, num_heads=8, num_kv_heads=2)
    assert "block_size=4 is not supported" in tiling_problem("pallas", block_size=4, **shape)
    assert tiling_problem("pallas", block_size=16, **shape) is None
    assert tiling_problem("xla", block_size=4, head_dim=16, num_heads=4, num_kv_heads=2) is None


def _nan_on_token(poison: int):
    """The fake model, but a row whose last fed token is ``poison`` gets NaN logits."""
    import jax.numpy as jnp
    from engine_fakes import _append

    from paged_jax.steps import last_positions, packed_rows

    def step(params, state, pages, tokens, seq_ids, num_tokens, *, all_logits=False):
        logits, state, pages, status = _append(params, state, pages, tokens, seq_ids, num_tokens,
                                               all_logits=all_logits)
        packed = tokens.ndim == 1  # every row's tokens one after another
        at = last_positions(num_tokens, tokens.shape[-1], packed=packed)
        last = tokens[at] if packed else tokens[jnp.arange(tokens.shape[0]), at]
        if all_logits:  # every fed position of a row whose last token is the poison (a row is [B, T] or packed)
            row = packed_rows(num_tokens, tokens.shape[0])[1] if packed else None
            bad = (last[row] == poison)[:, None] if packed else (last == poison)[:, None, None]
        else:
            bad = (last == poison)[:, None]
        return jnp.where(bad, jnp.nan, logits), state, pages, status

    return fake_backend(4)._replace(step=step)


@pytest.mark.slow
def test_nan_logits_end_that_request_with_an_error():
    from engine_fakes import assert_drained

    llm = LLM(_nan_on_token(7), block_size=4, num_gpu_blocks=32, max_model_len=32, debug_checks=True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with pytest.warns(UserWarning, match="request 0: the model's logits are NaN after 0 output tokens"):
        bad, good = llm.generate([[1, 2, 7], [1, 2, 3]], params, use_tqdm=False)
    assert bad.outputs[0].finish_reason == "error" and bad.outputs[0].token_ids == []
    plain = LLM(fake_backend(4), block_size=4, num_gpu_blocks=32, max_model_len=32)
    want = plain.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert 7 not in want  # so the other request never feeds the poisoned token
    assert good.outputs[0].token_ids == want and good.outputs[0].finish_reason == "length"
    assert_drained(llm)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_warmup_compiles_what_a_plain_call_needs(layout):
    llm = LLM(fake_backend(4), block_size=4, num_gpu_blocks=32, max_model_len=32, max_num_seqs=8,
              max_num_batched_tokens=32, debug_checks=True, batch_layout=layout)
    shapes = llm.engine.runner.warmup_shapes()
    if layout == "padded":
        assert ("decode", (8, 1)) in shapes and ("prefill", (1, 32)) in shapes
    else:  # every row count at its decode width and at each power of two up to the budget
        assert shapes == [("step", (8, 8)), ("step", (8, 16)), ("step", (8, 32))]
    assert llm.warmup(use_tqdm=False) == len(shapes)
    check_invariants_and_empty(llm)
    before = dict(llm.engine.runner.traces)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 40, int(rng.integers(1, 20))).tolist() for _ in range(8)]
    llm.generate(prompts, [SamplingParams(temperature=t, max_tokens=6, seed=1) for t in (0, 0.7) * 4],
                 use_tqdm=False)
    assert dict(llm.engine.runner.traces) == before  # nothing new compiled by the call


def test_warmup_with_rows_longer_than_the_token_budget():
    """max_model_len above max_num_batched_tokens (chunked prefill): the widest prefill
    shape is the budget, not the row length (warmup used to raise "exceeds the cap")."""
    from paged_jax import buckets

    assert buckets.prefill_shapes(64, 4, max_width=96)[0] == (1, 64)
    assert buckets.prefill_shapes(64, 4, max_width=40)[0] == (1, 64)
    assert buckets.prefill_shapes(64, 4, max_width=20)[0] == (1, 32)
    for layout, name in (("padded", "prefill"), ("packed", "step")):
        llm = LLM(fake_backend(4), block_size=4, num_gpu_blocks=64, max_model_len=96, max_num_seqs=4,
                  max_num_batched_tokens=64, batch_layout=layout)
        shapes = llm.engine.runner.warmup_shapes()
        assert max(w for n, (_, w) in shapes if n == name) == 64
        assert llm.warmup(use_tqdm=False) == len(shapes)


@pytest.mark.slow
def test_a_typical_first_call_compiles_at_most_four_programs():
    """A batch of prompts of mixed lengths, mixed greedy and sampled, outputs of mixed
    lengths (the batch drains): one or two prefill shapes, decode at 32, 16 and 8 rows."""
    import functools

    import engine_fakes

    # A step function of its own, so no program compiled by another test is reused.
    backend = fake_backend(4)._replace(step=functools.partial(engine_fakes._append))
    llm = LLM(backend, block_size=4, num_gpu_blocks=512, max_model_len=64)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 40, int(rng.integers(4, 24))).tolist() for _ in range(32)]
    params = [SamplingParams(temperature=0.8 * (i % 2), max_tokens=int(rng.integers(4, 24)), ignore_eos=True,
                             seed=i) for i in range(32)]
    llm.generate(prompts, params, use_tqdm=False)
    assert sum(llm.engine.runner.traces.values()) <= 4, dict(llm.engine.runner.traces)
    assert llm.stats()["compiles"] == sum(llm.engine.runner.traces.values())


def check_invariants_and_empty(llm):

    assert llm.inspect().num_available == llm.num_gpu_blocks  # inspect() checks the invariants


def test_llm_warns_before_compiled_programs_exhaust_the_memory_mappings(monkeypatch):
    """XLA:CPU maps hundreds of regions per compiled program; past vm.max_map_count it
    crashes while compiling, so an engine built near the limit says so first."""
    from paged_jax import compilation_cache

    usage = compilation_cache.memory_mappings()
    if usage is None:
        pytest.skip("the kernel does not report memory mappings here")
    count, limit = usage
    assert 0 < count < limit and compilation_cache.mappings_pressure() is None  # the suite keeps it low
    monkeypatch.setattr(compilation_cache, "MAPPINGS_WARNING_FRACTION", 0.0)
    with pytest.warns(UserWarning, match=f"of its {limit} memory mappings.*jax.clear_caches"):
        LLM(fake_backend(4), block_size=4, num_gpu_blocks=32, max_model_len=32)
