"""Allocator study: microseconds per block-manager call vs pool size, for every policy.

    python -m experiments allocator [--quick] [--out DIR]

At batch 256, each op is jitted with the state donated and timed call by call (median of
many calls after warm-up) for pools from 1k to 1M blocks. One cycle, repeated:

    fork (256 children of 256 parents) -> append_slots (children, 1 token; half of them
    copy-on-write) -> select_parents (children rebuilt from shuffled parents) ->
    release (children) -> append_slots (parents, 1 token; half need a new block) ->
    truncate (parents, back by one token)

so the state returns to where it started and the pool never drains. Headline:
``max_pool_ratio`` = worst over the default policy's ops of time(largest pool) /
time(smallest pool): a flat cost gives ~1.0. Traces per op per shape are counted.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from paged_jax import CacheConfig
from paged_jax.cache import (
    append_slots,
    fork,
    get_policy,
    init_state,
    open_sequences,
    raise_for_status,
    release,
    select_parents,
    truncate,
)

BATCH = 256
BLOCK_SIZE = 16
OPS = ["fork", "append_cow", "select_parents", "release", "append_decode", "truncate"]


def _make_ops(traces: dict):
    def counted(name, fn):
        def wrapped(*args, **kwargs):
            traces[name] = traces.get(name, 0) + 1  # runs only while tracing
            return fn(*args, **kwargs)

        return jax.jit(wrapped, donate_argnums=0)

    append = functools.partial(append_slots, max_tokens=1)
    return {
        "fork": counted("fork", fork),
        "append_cow": counted("append_cow", append),
        "select_parents": counted("select_parents", select_parents),
        "release": counted("release", release),
        "append_decode": counted("append_decode", append),
        "truncate": counted("truncate", truncate),
    }


def _setup(num_blocks: int, policy_name: str):
    config = CacheConfig(num_blocks, BLOCK_SIZE, max_seqs=2 * BATCH, max_blocks_per_seq=16)
    state = init_state(config, get_policy(policy_name))
    parents = jnp.arange(BATCH, dtype=jnp.int32)
    state, status = open_sequences(state, parents)
    raise_for_status("open", parents, status)
    # Half the rows end mid-block (their forks copy on write), half on a block boundary
    # (their next token takes a new block).
    lens = jnp.where(parents % 2 == 0, 20, 32).astype(jnp.int32)
    state, out = jax.jit(functools.partial(append_slots, max_tokens=32))(state, parents, lens)
    raise_for_status("append", parents, out.status)
    return state, parents, lens


def time_policy(num_blocks: int, policy_name: str, iters: int, seed: int = 0) -> tuple[dict, dict]:
    """Median microseconds per call of each op, and traces per op."""
    traces: dict = {}
    ops = _make_ops(traces)
    state, parents, lens = _setup(num_blocks, policy_name)
    children = parents + BATCH
    ones = jnp.ones((BATCH,), jnp.int32)
    rng = np.random.default_rng(seed)
    shuffled = [jnp.asarray(rng.permutation(BATCH), jnp.int32) for _ in range(8)]
    samples = {op: [] for op in OPS}

    def timed(name, *args):
        nonlocal state
        t0 = time.perf_counter()
        state, out = ops[name](state, *args)
        jax.block_until_ready((state, out))
        samples[name].append(time.perf_counter() - t0)
        status = out.status if hasattr(out, "status") else out
        return status

    for i in range(iters + 3):  # the first 3 cycles are warm-up (compiles)
        statuses = [
            timed("fork", parents, children),
            timed("append_cow", children, ones),
            timed("select_parents", children, shuffled[i % len(shuffled)]),
            timed("release", children),
            timed("append_decode", parents, ones),
            timed("truncate", parents, lens),
        ]
        if i < 3:
            for op, status in zip(OPS, statuses):
                raise_for_status(op, np.arange(BATCH), status)
                samples[op].clear()
    return {op: float(np.median(samples[op]) * 1e6) for op in OPS}, dict(traces)


def run(pools: list[int], policies: list[str], iters: int) -> dict:
    rows = []
    for policy in policies:
        for pool in pools:
            us, traces = time_policy(pool, policy, iters)
            rows.append({"policy": policy, "num_blocks": pool, "us": us, "traces": traces})
            print(f"  {policy:>16} {pool:>9,} blocks: " + "  ".join(f"{op} {us[op]:7.1f}" for op in OPS), flush=True)
    default = [r for r in rows if r["policy"] == "lifo"]
    small, large = default[0], default[-1]
    ratios = {op: large["us"][op] / small["us"][op] for op in OPS}
    worst_op = max(ratios, key=ratios.get)
    return {
        "rows": rows,
        "pool_ratios_default_policy": ratios,
        "headline": {
            "max_pool_ratio": ratios[worst_op],
            "worst_op": worst_op,
            "policy": "lifo",
            "smallest_pool": small["num_blocks"],
            "largest_pool": large["num_blocks"],
            "batch": BATCH,
            "max_traces_per_op_per_shape": max(max(r["traces"].values()) for r in rows),
        },
    }


def format_table(result: dict) -> str:
    lines = ["us per call (median), batch 256, block_size 16", ""]
    header = f"{'policy':>16} {'blocks':>9} " + " ".join(f"{op:>14}" for op in OPS) + "  traces/op"
    lines += [header, "-" * len(header)]
    for r in result["rows"]:
        lines.append(
            f"{r['policy']:>16} {r['num_blocks']:>9,} "
            + " ".join(f"{r['us'][op]:>14.1f}" for op in OPS)
            + f"  {max(r['traces'].values())}"
        )
    h = result["headline"]
    lines += [
        "",
        f"lifo time({h['largest_pool']:,}) / time({h['smallest_pool']:,}) per op: "
        + ", ".join(f"{op} {v:.2f}" for op, v in result["pool_ratios_default_policy"].items()),
        f"headline max_pool_ratio = {h['max_pool_ratio']:.2f} ({h['worst_op']}); target <= 1.3",
    ]
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments allocator", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two pool sizes, fewer calls")
    parser.add_argument("--out", default="out", help="directory for allocator.json")
    parser.add_argument("--policies", default="lifo,fifo,lowest_id_first,random")
    args = parser.parse_args(argv)
    pools = [1024, 1 << 16] if args.quick else [1024, 16384, 262144, 1 << 20]
    iters = 40 if args.quick else 200
    policies = args.policies.split(",")
    if "lifo" not in policies:
        policies.insert(0, "lifo")
    print(f"allocator study: pools {pools}, policies {policies}, {iters} cycles each", flush=True)
    result = run(pools, policies, iters)
    result["machine"] = common.machine_info()
    result["quick"] = args.quick
    table = format_table(result)
    print()
    print(table)
    common.write_json(args.out, "allocator", result)
    return result


if __name__ == "__main__":
    main()
