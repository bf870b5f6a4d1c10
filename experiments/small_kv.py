"""Small KV (claim C11): when paging does not pay, and where it starts to.

    python -m experiments small_kv [--quick] [--out DIR]

The seed's claim C11: paging does not pay for models with tiny per-token KV, for
memory-starved edge devices, or for ~10-token prompts (a whole block for a few tokens).
Four measurements:

1. **Per-step overhead, tiny KV.** A Llama-shaped model with 2 layers, 1 kv head of
   head_dim 16 (256 KV bytes per token in fp32), rows holding a 10-token prompt: the paged
   decode step vs the same model over a contiguous cache sized to the sequence's own
   length (the best case for contiguous: each timing round restarts at the context, so
   rows grow by at most ``reps`` tokens), and the block management alone (append_slots +
   copy-on-write copies), with decode_step's pieces (``experiments.lib.steps``), timed in turn.
   The contiguous baseline is decode_step's; on XLA:CPU its scatter into the scanned
   cache may copy the cache, which favours paging as the model grows, so the block
   management share (pure paging bookkeeping) is reported beside the ratio.
2. **Memory waste of a block per 10-token prompt** at block sizes 8..64: the share of the
   allocated slots left empty, after the prompt and at the end of a 16-token answer
   (``blocks_for``, checked against rows opened and filled on the block manager at block
   size 16).
3. **Crossovers.** (a) Step time: the same overhead measured for models of growing
   per-token KV (256 B to 8 KB) at a 10-token context, and for the tiny model at growing
   prompt lengths; the crossover is the first point from which paging's step-time overhead
   is below ``OVERHEAD_THRESHOLD`` (10%), or block management below ``MGMT_THRESHOLD``
   (5%) of the step. (b) Memory: the per-token KV size above which the
   memory paging saves by not reserving ``max_model_len`` per sequence exceeds what it
   adds (the last block's empty slots, the block-table row and the reference counts).
4. **Edge device, end to end.** The tiny model through ``LLM(kv_cache="paged")`` and
   ``LLM(kv_cache="static")``, 10-token prompts with 16-token answers, a pool barely
   larger than the batch (blocks for 16 such sequences, plus 2), with ``max_model_len``
   tight (32: the static reservation is what the sequence uses) and loose (256):
   tokens/s and running batch.

Headlines: ``paged_step_overhead_tiny_kv`` (paged / contiguous - 1, batch 32),
``block_mgmt_share_tiny_kv``, ``waste_per_10_token_prompt_bs{8,16,32,64}``,
``crossover_kv_bytes_per_token`` and ``crossover_prompt_len`` (step time; None if no
measured point is below the threshold), the same with ``_mgmt`` (block management below
5% of the step, decode_step's target), ``crossover_kv_bytes_per_token_memory``,
``paged_over_static_tokens_per_s_tight`` / ``_loose``, ``paged_over_static_batch_loose``.

Timings come from a shared 2-core CPU machine: expect +-20% per cell. Full run ~50 s on an idle
2-core machine with no compilation cache (~4 min under load); ``--quick`` (~25 s: batch 32 only, two models, no prompt-length sweep, the tight engine
only) leaves the headlines it does not measure None. Writes DIR/small_kv.json and DIR/small_kv.png.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import machine_info, print_headline, pyplot, write_json
from experiments.lib import models, steps
from paged_jax.cache import (
    NO_BLOCK,
    append_slots,
    init_state,
    num_free_blocks,
    open_sequences,
    raise_for_status,
)
from paged_jax.compilation_cache import enable_compilation_cache
from paged_jax.config import CacheConfig, blocks_for
from paged_jax.model import ModelConfig, init_contiguous_kv, init_params
from paged_jax.steps import init_pages_for, make_step_fns

PROMPT_LEN = 10
ANSWER_LEN = 16
BLOCK_SIZE = 16
BLOCK_SIZES = (8, 16, 32, 64)
OVERHEAD_THRESHOLD = 0.10  # paged step time over contiguous, minus 1
MGMT_THRESHOLD = steps.MGMT_TARGET_SHARE  # block management's share of the paged step
HEADLINE_BATCH = 32
TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=1, head_dim=16, max_position_embeddings=2048)
# Growing per-token KV (fp32): 256 B, 1 KB, 4 KB (decode_step's model), 8 KB (throughput's).
KV_MODELS = (
    TINY,
    ModelConfig(vocab_size=1024, hidden_size=128, intermediate_size=352, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=32, max_position_embeddings=2048),
    models.DECODE_STEP_MODEL,
    models.llama_33m(2048),
)
FULL = dict(batches=(1, 8, 32), kv_models=4, contexts=(10, 64, 256, 1024), reps=10, rounds=9,
            engine_requests=64, engine_lens=(32, 256), engine_repeats=2)
QUICK = dict(batches=(32,), kv_models=2, contexts=(10,), reps=8, rounds=4,
             engine_requests=24, engine_lens=(32,), engine_repeats=1)
ENGINE_BATCH = 16  # the edge device's batch; the pool holds this many 26-token sequences + 2 blocks


# --------------------------------------------------------------------------- 1, 3a: step overhead


def step_overhead(cfg: ModelConfig, batches, context: int, reps: int, rounds: int, seed: int = 0) -> list[dict]:
    """Paged vs contiguous decode step and block management at ``context`` tokens per row,
    with decode_step's pieces (``experiments.lib.steps``: its filled state, contiguous decode and
    block-management program). Every round starts from rows holding ``context`` tokens,
    so a row grows by at most ``reps`` tokens and the contiguous cache is sized to that
    (the best case for contiguous). The three are timed in turn within each round (noise
    falls on all three alike); each figure is the best round's mean over ``reps`` calls."""
    per_seq = blocks_for(context + reps + 1, BLOCK_SIZE)
    cc = CacheConfig(num_blocks=max(batches) * per_seq + 8, block_size=BLOCK_SIZE, max_seqs=max(batches),
                     max_blocks_per_seq=per_seq)
    _, params = init_params(cfg, seed=seed)
    fns = make_step_fns(cfg, attention_impl="xla")
    contiguous = steps.make_contiguous_decode(cfg)
    mgmt = steps.mgmt_fn()
    rng = np.random.default_rng(seed)
    rows = []
    for b in batches:
        calls, reset = _step_calls(cfg, params, fns, contiguous, mgmt, cc, b, context, rng)
        ms = _time_in_turn(calls, reset, reps, rounds)
        row = {"batch": b, "context": context, "paged_ms": ms["paged"], "contiguous_ms": ms["contiguous"],
               "block_mgmt_ms": ms["block_mgmt"], "block_mgmt_share": ms["block_mgmt"] / ms["paged"],
               "paged_over_contiguous": ms["paged"] / ms["contiguous"],
               "overhead": ms["paged"] / ms["contiguous"] - 1, "kv_bytes_per_token": cfg.kv_bytes_per_token(),
               "num_params": cfg.num_params, "contiguous_len": cc.max_tokens_per_seq}
        rows.append(row)
        print(f"  {cfg.kv_bytes_per_token():>6} B/token, {cfg.num_params / 1e6:5.2f}M params, batch {b:>3}, context "
              f"{context:>5}: paged {row['paged_ms']:.3f} ms, contiguous {row['contiguous_ms']:.3f} ms "
              f"(overhead {row['overhead']:+.1%}), block mgmt {row['block_mgmt_ms']:.3f} ms "
              f"({row['block_mgmt_share']:.1%})", flush=True)
    return rows


def _step_calls(cfg, params, fns, contiguous, mgmt, cc, batch, context, rng):
    """(calls, reset): zero-argument calls (each returns what to block on) of one paged
    decode step, one contiguous decode step and one block-management update, each on its
    own state (donated and threaded through), and ``reset()``, which puts every row back
    at ``context`` tokens."""
    ids = jnp.arange(batch, dtype=jnp.int32)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, batch), jnp.int32)
    state = steps.filled_state(cc, "lifo", batch, context)
    pages = init_pages_for(cfg, cc)
    pages = pages.replace(k=pages.k + 0.1, v=pages.v + 0.1)
    kv = init_contiguous_kv(cfg, batch, cc.max_tokens_per_seq)
    kv = kv._replace(k=kv.k + 0.1, v=kv.v + 0.1)
    lengths = jnp.full((batch,), context, jnp.int32)
    ones = jnp.ones((batch,), jnp.int32)
    paged, managed, dense = {}, {}, {}

    def reset():
        copy = steps.copy_tree
        paged.update(state=copy(state), pages=copy(pages))
        managed.update(state=copy(state), pages=copy(pages))
        dense.update(kv=copy(kv), lengths=lengths)
        jax.block_until_ready((paged, managed, dense))

    def paged_call():
        logits, paged["state"], paged["pages"], status = fns.decode(params, paged["state"], paged["pages"], tokens,
                                                                    ids)
        return logits, status

    def contiguous_call():
        logits, dense["kv"], dense["lengths"] = contiguous(params, dense["kv"], tokens, dense["lengths"])
        return logits

    def mgmt_call():
        managed["state"], managed["pages"], slots = mgmt(managed["state"], managed["pages"], ids, ones)
        return slots

    reset()
    _, status = jax.block_until_ready(paged_call())
    raise_for_status("decode", ids, np.asarray(status))
    return {"paged": paged_call, "contiguous": contiguous_call, "block_mgmt": mgmt_call}, reset


def _time_in_turn(calls: dict, reset, reps: int, rounds: int) -> dict:
    """Milliseconds per call of each zero-argument call: each round starts from
    ``reset()`` (untimed), then every call runs ``reps`` times in turn; the figure is the
    best round's mean."""
    reset()
    for call in calls.values():
        jax.block_until_ready(call())  # compile outside the timed rounds
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        reset()
        for name, call in calls.items():
            t0 = time.perf_counter()
            out = None
            for _ in range(reps):
                out = call()
            jax.block_until_ready(out)
            best[name] = min(best[name], (time.perf_counter() - t0) / reps * 1e3)
    return best


def first_below(rows: list[dict], key: str, metric: str = "overhead", threshold: float = OVERHEAD_THRESHOLD):
    """``rows[i][key]`` of the first row (in the given order) from which every
    ``metric`` is below ``threshold``; None if the last is not."""
    found = None
    for r in reversed(rows):
        if r[metric] > threshold:
            break
        found = r[key]
    return found


# --------------------------------------------------------------------------- 2, 3b: memory


def block_waste(block_size: int, lengths: tuple[int, ...]) -> list[dict]:
    """Per length: blocks a sequence holds (``blocks_for``, the block manager's own
    ceil-division) and the share of their slots left empty."""
    return [{"block_size": block_size, "tokens": n, "blocks_per_seq": blocks_for(n, block_size),
             "empty_slot_fraction": 1 - n / (blocks_for(n, block_size) * block_size)} for n in lengths]


def blocks_held_on_block_manager(block_size: int, rows: int, lengths: tuple[int, ...]) -> list[float]:
    """The same count on the block manager itself: ``rows`` sequences of each length
    opened and filled in one pool; mean blocks per sequence of each length (their table
    rows), after checking every block taken from the pool is in a row."""
    width = blocks_for(max(lengths), block_size)
    total = rows * len(lengths)
    cc = CacheConfig(num_blocks=total * width, block_size=block_size, max_seqs=total, max_blocks_per_seq=width)
    ids = jnp.arange(total, dtype=jnp.int32)
    tokens = jnp.asarray(np.repeat(np.asarray(lengths, np.int32), rows))
    state, (s_open, s_append) = _open_and_fill(init_state(cc, "lifo"), ids, tokens, max(lengths))
    raise_for_status("open", ids, s_open)
    raise_for_status("append", ids, s_append)
    held = (np.asarray(state.block_tables) != NO_BLOCK).sum(axis=1)
    if held.sum() != cc.num_blocks - int(num_free_blocks(state)):
        raise AssertionError("blocks taken from the pool but named by no row")
    return [float(held[i * rows:(i + 1) * rows].mean()) for i in range(len(lengths))]


@functools.partial(jax.jit, static_argnums=3)
def _open_and_fill(state, ids, tokens, max_tokens: int):
    """Open rows ``ids`` and append ``tokens[i]`` tokens to each, in one program."""
    state, s_open = open_sequences(state, ids)
    state, out = append_slots(state, ids, tokens, max_tokens=max_tokens)
    return state, (s_open, out.status)


def memory_per_sequence(kv_bytes_per_token: float, length: int, max_model_len: int, block_size: int) -> dict:
    """Bytes one sequence of ``length`` tokens costs: paged (its blocks, its block-table row
    of ``max_model_len / block_size`` int32 entries, a 4-byte reference count per block),
    a static reservation of ``max_model_len`` tokens, and exactly ``length`` tokens."""
    blocks = blocks_for(length, block_size)
    structures = 4 * blocks_for(max_model_len, block_size) + 4 * blocks
    return {
        "paged": blocks * block_size * kv_bytes_per_token + structures,
        "static_reserved": max_model_len * kv_bytes_per_token,
        "exact": length * kv_bytes_per_token,
        "structures": structures,
    }


def memory_crossover_kv_bytes(length: int, max_model_len: int, block_size: int) -> float:
    """Per-token KV bytes above which paging a ``length``-token sequence costs less memory
    than reserving ``max_model_len`` tokens: the structures over the slots not reserved."""
    blocks = blocks_for(length, block_size)
    saved_slots = max_model_len - blocks * block_size
    structures = memory_per_sequence(0.0, length, max_model_len, block_size)["structures"]
    return float("inf") if saved_slots <= 0 else structures / saved_slots


# --------------------------------------------------------------------------- 4: engine


def engine_model():
    """What the edge-device runs serve: the tiny model (tests swap in a fake backend)."""
    return TINY


def engine_run(model, kv_cache: str, max_model_len: int, num_requests: int, repeats: int) -> dict:
    """10-token prompts, 16-token answers (EOS ignored) through ``LLM`` with a pool of
    ``ENGINE_BATCH`` sequences' blocks + 2; median tokens/s (compile excluded) over
    ``repeats`` generates after a compiling one (that one alone if ``repeats`` is 0)."""
    from paged_jax import workloads
    from paged_jax.engine import LLM, SamplingParams

    blocks = ENGINE_BATCH * blocks_for(PROMPT_LEN + ANSWER_LEN, BLOCK_SIZE) + 2
    llm = LLM(model,
              block_size=BLOCK_SIZE, num_gpu_blocks=blocks, max_num_seqs=32, max_model_len=max_model_len,
              kv_cache=kv_cache, attention_impl="xla")
    reqs = workloads.fixed_length(num_requests, prompt_len=PROMPT_LEN, output_len=ANSWER_LEN,
                                  vocab_size=model.vocab_size, seed=3)
    prompts = [list(r.prompt_token_ids) for r in reqs]
    params = SamplingParams(temperature=0, max_tokens=ANSWER_LEN, ignore_eos=True)
    speeds, stats, outputs = [], {}, None
    for rep in range(repeats + 1):  # rep 0 compiles; it counts (compile excluded) only when alone
        llm.reset_stats()
        outs = llm.generate(prompts, params, use_tqdm=False)
        outputs = [o.outputs[0].token_ids for o in outs]
        stats = llm.stats()
        if rep or not repeats:
            speeds.append(stats["tokens_per_s_excl_compile"])
    return {"kv_cache": kv_cache, "max_model_len": max_model_len, "num_gpu_blocks": blocks,
            "tokens_per_s": float(np.median(speeds)), "mean_running_batch": stats["mean_running_batch"],
            "peak_running_batch": stats["peak_running_batch"], "num_preemptions": stats["num_preemptions"],
            "kv_utilization": stats["kv_utilization"], "steps": stats["steps"], "compiles": llm.stats()["compiles"],
            "outputs": outputs}


# --------------------------------------------------------------------------- the study


def claims(result: dict) -> list[dict]:
    """C11's verdict from the saved JSON: which of the claim's cases the figures bear out."""
    h = result["headline"]

    def fmt(x, unit=""):
        return "not measured" if x is None else f"{x:g}{unit}"

    def since(x, unit):
        return "at no measured point" if x is None else f"from {x:g}{unit}"

    tight = h["paged_over_static_tokens_per_s_tight"]
    holds = {
        "tiny KV: paging costs step time": h["paged_step_overhead_tiny_kv"] > h["overhead_threshold"],
        "10-token prompts: most of a block empty": h["waste_per_10_token_prompt_bs16"] >= 0.25,
        "edge pool, tight max_model_len: no gain": tight is not None and tight <= 1.05,
    }
    memory_pays = h["crossover_kv_bytes_per_token_memory"] < 1
    verdict = ("reproduced" if all(holds.values()) and not memory_pays
               else "partly reproduced" if any(holds.values()) else "refuted")
    return [{
        "claim": "C11",
        "seed": "paging does not pay for tiny per-token KV, memory-starved edge devices, ~10-token prompts",
        "ours": (f"tiny KV (256 B/token), 10-token context: paged step {h['paged_step_overhead_tiny_kv']:+.0%} vs "
                 f"contiguous, block management {h['block_mgmt_share_tiny_kv']:.0%} of it; a 10-token prompt leaves "
                 f"{h['waste_per_10_token_prompt_bs16']:.0%} of its 16-slot block empty; step overhead "
                 f"< {h['overhead_threshold']:.0%} {since(h['crossover_kv_bytes_per_token'], ' KV B/token')} (10-token "
                 f"context) and {since(h['crossover_prompt_len'], '-token contexts')} (tiny model); memory pays above "
                 f"{h['crossover_kv_bytes_per_token_memory']:.2g} B/token vs reserving max_model_len; edge pool: "
                 f"paged/static tokens/s {fmt(tight and round(tight, 2))} with max_model_len tight, "
                 f"{fmt(h['paged_over_static_tokens_per_s_loose'] and round(h['paged_over_static_tokens_per_s_loose'], 2))}"
                 f" loose"),
        "verdict": verdict,
        "why": ("Holds: " + (", ".join(k for k, v in holds.items() if v) or "none") + ". "
                + ("But memory-wise paging pays for any KV above a byte per token against a max_model_len "
                   "reservation: whether it pays depends on how far max_model_len is above the real lengths, "
                   "not on the KV size." if memory_pays else "")),
    }]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments small_kv", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches, models and contexts (< 45 s)")
    parser.add_argument("--out", default="out")
    args = parser.parse_args(argv)
    quick = args.quick
    run = QUICK if quick else FULL
    t_start = time.perf_counter()
    # LLM turns JAX's persistent compilation cache on anyway; on from the start, a rerun
    # reads every program of this study back (no figure here is a compile time).
    enable_compilation_cache()
    reps, rounds = run["reps"], run["rounds"]
    head_batch = HEADLINE_BATCH if HEADLINE_BATCH in run["batches"] else max(run["batches"])

    print(f"small_kv study, {'quick' if quick else 'FULL'}: 1. tiny KV model, {PROMPT_LEN}-token context")
    tiny_rows = step_overhead(TINY, run["batches"], PROMPT_LEN, reps, rounds)
    print(f"   ({time.perf_counter() - t_start:.0f} s)")
    print(f"3a. per-token KV sweep at a {PROMPT_LEN}-token context, batch {head_batch}")
    kv_rows = [r for cfg in KV_MODELS[1:run["kv_models"]] for r in step_overhead(cfg, (head_batch,), PROMPT_LEN,
                                                                                   reps, rounds)]
    kv_rows = [r for r in tiny_rows if r["batch"] == head_batch] + kv_rows
    print(f"3a. prompt-length sweep, tiny model, batch {head_batch}")
    ctx_rows = [r for r in tiny_rows if r["batch"] == head_batch]
    for context in run["contexts"]:
        if context != PROMPT_LEN:
            ctx_rows += step_overhead(TINY, (head_batch,), context, reps, rounds)

    print(f"   ({time.perf_counter() - t_start:.0f} s)")
    print(f"2. empty slots after a {PROMPT_LEN}-token prompt and after a {ANSWER_LEN}-token answer")
    lengths = (PROMPT_LEN, PROMPT_LEN + ANSWER_LEN)
    waste = [w for bs in BLOCK_SIZES for w in block_waste(bs, lengths)]
    on_manager = blocks_held_on_block_manager(BLOCK_SIZE, 16, lengths)
    if on_manager != [float(w["blocks_per_seq"]) for w in block_waste(BLOCK_SIZE, lengths)]:
        raise AssertionError(f"block manager holds {on_manager} blocks per sequence, arithmetic says otherwise")
    for w in waste:
        print(f"  block size {w['block_size']:>3}, {w['tokens']:>3} tokens: {w['blocks_per_seq']:.0f} block(s), "
              f"{w['empty_slot_fraction']:.1%} of the slots empty")
    memory = []
    for max_len in (32, 256, 2048):
        for length in (PROMPT_LEN, PROMPT_LEN + ANSWER_LEN):
            per_seq = memory_per_sequence(TINY.kv_bytes_per_token(), length, max_len, BLOCK_SIZE)
            memory.append({"max_model_len": max_len, "length": length, **per_seq,
                           "crossover_kv_bytes_per_token": memory_crossover_kv_bytes(length, max_len, BLOCK_SIZE)})
    mem_head = next(m for m in memory if m["max_model_len"] == 2048 and m["length"] == PROMPT_LEN + ANSWER_LEN)
    print(f"3b. tiny model ({TINY.kv_bytes_per_token()} B/token), {PROMPT_LEN + ANSWER_LEN}-token sequence, "
          f"max_model_len 2048: paged {mem_head['paged']:.0f} B vs reserved {mem_head['static_reserved']:.0f} B; "
          f"paging pays above {mem_head['crossover_kv_bytes_per_token']:.3f} B/token")

    print(f"4. edge device: {run['engine_requests']} requests, {PROMPT_LEN}+{ANSWER_LEN} tokens, pool for "
          f"{ENGINE_BATCH} sequences + 2 blocks")
    engine = []
    for max_len in run["engine_lens"]:
        for kv_cache in ("paged", "static"):
            e = engine_run(engine_model(), kv_cache, max_len, run["engine_requests"], run["engine_repeats"])
            engine.append(e)
            print(f"  max_model_len {max_len:>4} {kv_cache:>6}: {e['tokens_per_s']:8.1f} tokens/s, mean batch "
                  f"{e['mean_running_batch']:.1f} (peak {e['peak_running_batch']}), {e['num_preemptions']} "
                  f"preemptions, {e['compiles']} programs compiled", flush=True)
    print(f"   ({time.perf_counter() - t_start:.0f} s)")
    outputs_identical = all(
        e["outputs"] == next(o for o in engine if o["max_model_len"] == e["max_model_len"])["outputs"] for e in engine)
    for e in engine:
        del e["outputs"]

    def ratio(max_len, key):
        pair = {e["kv_cache"]: e for e in engine if e["max_model_len"] == max_len}
        return pair["paged"][key] / pair["static"][key] if len(pair) == 2 else None

    lens = run["engine_lens"]
    tiny_head = next(r for r in tiny_rows if r["batch"] == head_batch)
    headline = {
        "batch": head_batch,
        "paged_step_overhead_tiny_kv": tiny_head["overhead"],
        "block_mgmt_share_tiny_kv": tiny_head["block_mgmt_share"],
        **{f"waste_per_10_token_prompt_bs{w['block_size']}": w["empty_slot_fraction"] for w in waste
           if w["tokens"] == PROMPT_LEN},
        "crossover_kv_bytes_per_token": first_below(kv_rows, "kv_bytes_per_token"),
        "crossover_prompt_len": first_below(ctx_rows, "context"),
        "crossover_kv_bytes_per_token_mgmt": first_below(kv_rows, "kv_bytes_per_token", "block_mgmt_share",
                                                         MGMT_THRESHOLD),
        "crossover_prompt_len_mgmt": first_below(ctx_rows, "context", "block_mgmt_share", MGMT_THRESHOLD),
        "mgmt_share_threshold": MGMT_THRESHOLD,
        "overhead_threshold": OVERHEAD_THRESHOLD,
        "crossover_kv_bytes_per_token_memory": mem_head["crossover_kv_bytes_per_token"],
        "paged_over_static_tokens_per_s_tight": ratio(min(lens), "tokens_per_s"),
        "paged_over_static_tokens_per_s_loose": ratio(max(lens), "tokens_per_s") if len(lens) > 1 else None,
        "paged_over_static_batch_loose": ratio(max(lens), "mean_running_batch") if len(lens) > 1 else None,
    }
    result = {
        "study": "small_kv", "machine": machine_info(), "quick": quick,
        "config": {**run, "prompt_len": PROMPT_LEN, "answer_len": ANSWER_LEN, "block_size": BLOCK_SIZE,
                   "engine_batch": ENGINE_BATCH, "tiny_model": _describe(TINY),
                   "kv_models": [_describe(c) for c in KV_MODELS[:run["kv_models"]]],
                   "statistic": "best-of-rounds mean, the three calls in turn each round",
                   "note": "shared 2-core CPU machine: timings +-20% per cell"},
        "tiny_kv_steps": tiny_rows, "kv_sweep": kv_rows, "context_sweep": ctx_rows, "block_waste": waste,
        "memory": memory, "engine": engine, "engine_outputs_identical": outputs_identical,
        "headline": headline, "wall_s": time.perf_counter() - t_start,
    }
    print_headline(headline, digits=4)
    write_json(args.out, "small_kv", result)
    _plot(args.out, result)
    return result


def _describe(cfg: ModelConfig) -> dict:
    return {"num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "num_heads": cfg.num_heads,
            "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "num_params": cfg.num_params,
            "kv_bytes_per_token": cfg.kv_bytes_per_token()}


def _plot(out_dir: str, result: dict) -> None:
    import os

    plt = pyplot()

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    a, b, c, d = axes
    kv = result["kv_sweep"]
    a.plot([r["kv_bytes_per_token"] for r in kv], [r["overhead"] for r in kv], "o-", label="paged / contiguous - 1")
    a.plot([r["kv_bytes_per_token"] for r in kv], [r["block_mgmt_share"] for r in kv], "s--", label="block mgmt share")
    a.axhline(result["headline"]["overhead_threshold"], color="gray", ls=":")
    a.set_xscale("log", base=2)
    a.set_xlabel("KV bytes per token (10-token context)")
    a.legend(fontsize=8)
    ctx = result["context_sweep"]
    b.plot([r["context"] for r in ctx], [r["overhead"] for r in ctx], "o-", label="paged / contiguous - 1")
    b.plot([r["context"] for r in ctx], [r["block_mgmt_share"] for r in ctx], "s--", label="block mgmt share")
    b.axhline(result["headline"]["overhead_threshold"], color="gray", ls=":")
    b.set_xscale("log", base=2)
    b.set_xlabel("context tokens (tiny model)")
    b.legend(fontsize=8)
    for tokens in sorted({w["tokens"] for w in result["block_waste"]}):
        rows = [w for w in result["block_waste"] if w["tokens"] == tokens]
        c.plot([w["block_size"] for w in rows], [w["empty_slot_fraction"] for w in rows], "o-", label=f"{tokens} tokens")
    c.set_xscale("log", base=2)
    c.set_xlabel("block size")
    c.set_ylabel("allocated slots left empty")
    c.legend(fontsize=8)
    eng = result["engine"]
    labels = [f"{e['kv_cache']}\nlen {e['max_model_len']}" for e in eng]
    d.bar(range(len(eng)), [e["tokens_per_s"] for e in eng])
    d.set_xticks(range(len(eng)), labels, fontsize=8)
    d.set_ylabel("tokens/s (edge pool)")
    fig.tight_layout()
    path = os.path.join(out_dir, "small_kv.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
