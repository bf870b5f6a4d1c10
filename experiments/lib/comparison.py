"""Engines compared side by side on one request stream (the throughput study's method;
memory, block_size and gpu's throughput part use it too).

- ``make_engine``: the throughput comparison's engine (paged or static, decode rows in
  multiples of 8); the memory study's three engines are made by it too.
- ``run_interleaved``: the same requests through several engines, stepped in turn.
- ``plot_timelines``: running batch and KV utilisation over time, paged and static.
"""

from __future__ import annotations

import time

import numpy as np

from experiments.common import pyplot

BLOCK_SIZE = 16  # every engine made here (vLLM's default)


def make_engine(kind: str, config, *, max_model_len: int, num_blocks: int, max_num_seqs: int,
                max_num_batched_tokens: int, admission_lookahead: int, attention_impl: str = "xla"):
    from paged_jax.buckets import multiples_of
    from paged_jax.engine import LLM

    return LLM(
        config,
        block_size=BLOCK_SIZE,
        num_gpu_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        # Decode rows in multiples of 8: on a CPU a padding row costs a real row's compute,
        # and a throughput figure should not carry up to 2x padding of the default buckets.
        decode_buckets=multiples_of(8, max_num_seqs),
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        admission_lookahead=admission_lookahead,
        kv_cache=kind,
        attention_impl=attention_impl,
        seed=0,
    )


def run_interleaved(engines: dict, requests) -> dict[str, list[list[int]]]:
    """Run the same requests through every engine (``LLM``s by name), stepping them in turn.

    Each step goes to the engine that is furthest behind (smallest fraction of its
    tokens generated), so all engines progress through the workload together and meet
    the same machine load (other processes on a shared machine come and go): a slow
    patch slows both, instead of whichever happened to run then. Each engine's time is
    its own steps' wall time; nothing else counts. Returns each engine's output token ids
    per request, in request order.
    """
    from paged_jax.engine import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    prompts = [list(r.prompt_token_ids) for r in requests]
    total = sum(r.max_tokens for r in requests)
    seqs = {name: llm.add_requests(prompts, params) for name, llm in engines.items()}
    progress = {name: 0 for name in engines}
    live = [name for name in engines]
    start, shown = time.perf_counter(), 0.0
    while live:
        name = min(live, key=lambda n: progress[n])
        llm = engines[name]
        llm.step()
        progress[name] = llm.engine.stats.generated_tokens / total
        if min(progress.values()) >= shown + 0.1:
            shown = min(progress.values())
            print(f"  {shown:4.0%} of the tokens generated ({time.perf_counter() - start:.0f} s)", flush=True)
        if not llm.has_unfinished_requests():
            live.remove(name)
    return {name: [o.outputs[0].token_ids for o in engines[name].outputs(seqs[name])] for name in engines}


def plot_timelines(path: str, results: dict, title: str) -> None:
    """Running batch and KV utilisation over (each engine's own) time: ``results`` holds,
    for "paged" and "static", an engine's stats with its timeline as columns
    (``{"end_seconds": [...], "batch": [...], ...}``)."""
    plt = pyplot()

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for kind, color in (("paged", "tab:blue"), ("static", "tab:orange")):
        timeline = results[kind]["timeline"]
        t, batch, held, charged = (np.asarray(timeline[name], float)
                                   for name in ("end_seconds", "batch", "tokens_held", "charged_blocks"))
        util = np.divide(held, charged * BLOCK_SIZE, out=np.zeros_like(held), where=charged > 0)
        ax1.plot(t, batch, color=color, lw=0.8, label=f"{kind} (mean {results[kind]['mean_running_batch']:.1f})")
        ax2.plot(t, util, color=color, lw=0.8, label=f"{kind} (time-avg {results[kind]['kv_utilization']:.3f})")
    ax1.set_ylabel("running batch")
    ax2.set_ylabel("KV utilisation\n(tokens held / slots charged)")
    ax2.set_xlabel("engine time, s (steps' wall time, compile included)")
    ax2.set_ylim(0, 1.02)
    ax1.legend(loc="upper right")
    ax2.legend(loc="lower right")
    ax1.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
