"""Registers, spills and shared memory of every Triton kernel on A100 and H100, without a GPU.

    python -m experiments kernel_resources [--quick] [--out DIR]

Each configuration of ``pallas_kernels.offline.grid`` (decode and 16-query chunk kernels;
head_dim 64/128, block 16/32/64, GQA 1/4/8, bf16/fp32, int8 / int8_channel / fp8_e4m3
pages; default tuning per arch) is exported for CUDA, its Triton TTIR compiled for sm_80
and sm_90a with the ``triton`` package, and ``ptxas -v`` read (``pallas_kernels/offline.py``).
Baseline in the same run: the tuning the kernels used before the per-arch defaults (4
warps, 2 stages, ~128 tokens per step, all rows up to 64), compiled the same way, so the
table shows what the defaults fixed. Configurations whose TTIR is identical (decode tiles
pad the group to 16 rows) compile once.

Prints a table and writes DIR/kernel_resources.json. Headline: ``configs``, ``kernels``
(distinct compiles), ``spilling_configs`` and ``over_smem_configs`` (defaults; target 0),
``baseline_spilling_configs`` / ``baseline_over_smem_configs``, ``max_registers``,
``max_shared_kb_sm80`` / ``_sm90``, ``triton``, ``compile_s``. These approximate what XLA's
bundled Triton compiles on a GPU, not equal it. ``--quick``: the representative subset.
"""

from __future__ import annotations

import argparse
import time

from experiments import common


def baseline_tuning(cfg, arch: int) -> dict:
    """The tuning every kernel had before the per-arch defaults (one for every arch)."""
    from pallas_kernels.chunk import default_block_rows
    from pallas_kernels.common import default_blocks_per_step

    tuning = dict(blocks_per_step=default_blocks_per_step(cfg.block_size, cfg.head_dim), num_warps=4, num_stages=2)
    if cfg.kernel == "chunk":
        from pallas_kernels.offline import CHUNK

        tuning["block_rows"] = default_block_rows(CHUNK * cfg.group)
    return tuning


def measure(cfg, arch: int, tuning: dict | None = None) -> dict:
    from pallas_kernels import offline

    fn, args, default = offline.config_call(cfg, arch)
    [k] = offline.resources(fn, *args, arch=arch, **(tuning or {}))
    tuning = default if tuning is None else tuning
    return {"registers": k.registers, "spill_stores": k.spill_stores, "spill_loads": k.spill_loads,
            "shared_kb": k.shared_bytes / 1024, "problems": k.problems(), "tuning": tuning, "kernel": k.name}


def run(quick: bool) -> dict:
    import importlib.metadata

    from pallas_kernels import offline

    start = time.perf_counter()
    rows = []
    for cfg in offline.grid(full=not quick):
        for arch in offline.ARCHS:
            if not offline.applies(cfg, arch):
                continue
            base_tuning = baseline_tuning(cfg, arch)
            row = {"config": cfg.name, **cfg._asdict(), "arch": arch,
                   "default": measure(cfg, arch),
                   "baseline": measure(cfg, arch, base_tuning)}
            rows.append(row)
            d, b = row["default"], row["baseline"]
            print(f"  {cfg.name:<44} sm_{arch}  regs {d['registers']:>3} spills {d['spill_stores']:>5} B "
                  f"smem {d['shared_kb']:>5.0f} KB {'OK ' if not d['problems'] else 'BAD'}  | before: regs "
                  f"{b['registers']:>3} spills {b['spill_stores']:>5} B smem {b['shared_kb']:>5.0f} KB", flush=True)
    distinct = offline._compile.cache_info().currsize
    by_arch = {a: [r for r in rows if r["arch"] == a] for a in offline.ARCHS}
    return {
        "rows": rows,
        "limits": {"registers": offline.MAX_REGISTERS, "shared_kb": {a: v / 1024 for a, v in offline.SMEM_LIMIT.items()}},
        "headline": {
            "configs": len(rows),
            "kernels": distinct,
            "spilling_configs": sum(r["default"]["spill_stores"] > 0 or r["default"]["spill_loads"] > 0 for r in rows),
            "over_smem_configs": sum(any("shared" in p for p in r["default"]["problems"]) for r in rows),
            "bad_configs": sum(bool(r["default"]["problems"]) for r in rows),
            "baseline_spilling_configs": sum(r["baseline"]["spill_stores"] > 0 or r["baseline"]["spill_loads"] > 0
                                             for r in rows),
            "baseline_over_smem_configs": sum(any("shared" in p for p in r["baseline"]["problems"]) for r in rows),
            "max_registers": max(r["default"]["registers"] for r in rows),
            **{f"max_shared_kb_sm{a}": max(r["default"]["shared_kb"] for r in by_arch[a]) for a in offline.ARCHS},
            "triton": importlib.metadata.version("triton"),
            "compile_s": time.perf_counter() - start,
            "quick": quick,
        },
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments kernel_resources",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the representative subset of the grid")
    parser.add_argument("--out", default="out", help="directory for kernel_resources.json")
    args = parser.parse_args(argv)
    from pallas_kernels import offline

    if (why := offline.missing()) is not None:
        raise SystemExit(f"kernel_resources: {why}")
    print(f"kernel_resources: {'the quick subset' if args.quick else 'the whole grid'}, sm_80 and sm_90a", flush=True)
    result = run(args.quick)
    result["machine"] = common.machine_info()
    common.print_headline(result["headline"])
    common.write_json(args.out, "kernel_resources", result)
    return result


if __name__ == "__main__":
    main()
