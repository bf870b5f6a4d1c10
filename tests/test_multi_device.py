"""Beyond one device (``paged_jax.parallel``): tensor parallelism over kv heads, data-parallel
replicas, and two processes on JAX's distributed runtime.

The suite's processes keep one CPU device (conftest.py), so the multi-device checks run
in subprocesses with their own XLA_FLAGS: ``multi_device_checks.py`` (8 simulated devices,
every check in one process so the engines share compiled programs) and two
``multi_process_worker.py`` processes (2 devices each, t = 4 across them). The tests here
assert on what those wrote. The rest (validation, layouts, policies, the HLO reader) runs
in this process.
"""

import fcntl
import json
import os
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from parallel_workload import GRID, LLAMA, workload

from paged_jax import LLM
from paged_jax.engine.router import Assignment, ReplicaLoad, get_router, least_loaded, round_robin
from paged_jax.model import ModelConfig, dense_forward, init_params
from paged_jax.parallel import KVHeadLayout, check_mesh, hlo, make_mesh
from paged_jax.parallel.backend import resolve_mesh
from paged_jax.parallel.sharding import param_spec, replicate_kv_heads

# Studies and multi-process runs: minutes on 2 cores; `make test-fast` skips them.
pytestmark = pytest.mark.slow


HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 900


def _env() -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # each script sets its own device count
    return env


@pytest.fixture(scope="session")
def checks(tmp_path_factory):
    """Run ``multi_device_checks.py`` once per test session (8 simulated devices) and load
    its JSON. Under pytest-xdist the workers share one run: the first to get here runs it
    under a lock in the session's common directory, the others wait and read it."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # this session's directory, shared by its workers
    path = base / "multi_device_checks.json"
    with open(base / "multi_device_checks.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            proc = subprocess.run([sys.executable, os.path.join(HERE, "multi_device_checks.py"), str(path)],
                                  env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
            assert proc.returncode == 0, proc.stderr[-4000:]
    with open(path) as f:
        return json.load(f)


# --------------------------------------------------------------------------- 8 simulated devices


def test_greedy_tokens_equal_the_one_device_run_for_every_t_and_d(checks):
    """t in {1, 2, 4} x d in {1, 2} on the Llama fixture (2 kv heads: t = 4 replicates
    each twice), float32: every greedy completion token for token as on one device."""
    assert checks["devices"] == 8
    runs = {(g["t"], g["d"]): g for g in checks["grid"]}
    assert sorted(runs) == sorted(GRID)
    for (t, d), g in runs.items():
        assert all(g["greedy_equal"]), (t, d, g["greedy_equal"])
        assert g["replicas"] == d
        assert len(g["invariants"]) == d and all(g["invariants"]), (t, d)


def test_sampled_tokens_do_not_depend_on_the_replica(checks):
    """Seeded sampled requests draw the same tokens wherever they ran (a placement fact
    of these runs, not a guarantee: a sharded reduction may move a logit by ~1e-6)."""
    for g in checks["grid"]:
        assert all(g["sampled_equal"]), (g["t"], g["d"])


def test_each_device_holds_its_share_of_the_pages(checks):
    """At equal blocks a device holds 1/t of a replica's pool when t divides the kv heads
    (Qwen2, 4 kv heads: t = 1, 2, 4), and 1/num_kv_heads when kv heads are replicated
    (Llama, 2 kv heads, t = 4: each kv head stored twice)."""
    split = checks["kv_split"]
    one = split["1"]["total"]
    for t in ("1", "2", "4"):
        assert split[t]["total"] == one
        assert split[t]["per_device"] == [one // int(t)] * int(t)
    runs = {(g["t"], g["d"]): g["kv"] for g in checks["grid"]}
    single = runs[(1, 1)]["total"]
    for (t, d), kv in runs.items():
        per_device = single // min(t, 2)  # llama: 2 kv heads
        assert kv["per_device"] == [per_device] * (t * d), (t, d)
        assert kv["total"] == d * single * max(t // 2, 1), (t, d)


def test_a_decode_step_all_reduces_twice_per_layer_and_never_gathers_pages(checks):
    """The decode step's optimised HLO (t = 2 and t = 4): two all-reduces of [rows, 1,
    hidden] per layer (o_proj and down_proj), nothing else crosses devices, and no
    pool-sized copy or convert (a device's pages stay in place)."""
    for t in ("2", "4"):
        info = checks["hlo"][t]
        summary = info["summary"]
        assert summary["all-reduce"]["ops"] == 2
        assert summary["all-reduce"]["runs"] == 2 * info["layers"]
        assert summary["all-reduce"]["bytes"] == 2 * info["layers"] * 8 * 64 * 4  # rows x hidden x f32
        for kind in ("all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
            assert summary[kind]["ops"] == 0, (t, kind)
        assert info["pool_copies"] == [], info["pool_copies"]


def test_streaming_least_loaded_on_an_explicit_mesh_keeps_every_replica_consistent(checks):
    """A (data=2, model=2) mesh given as ``mesh=``, requests assigned least-loaded and
    stepped one at a time, every replica's block manager and host view checked after
    every step; the same tokens."""
    s = checks["streaming"]
    assert all(s["equal"])
    assert set(s["owners"]) == {0, 1}


def test_tensor_parallel_under_pressure_with_swapping_and_prefix_caching(checks):
    """t = 2 with a 9-block pool: swap preemption moves sharded blocks out and back,
    prefix caching hits, invariants hold after every step, one device fetch per step,
    greedy tokens unchanged."""
    p = checks["pressure"]
    assert all(p["equal"])
    # The runner's one device fetch per step, sharded or not (the last step's call also
    # flushes: the finished rows' release is one more runner step).
    assert set(p["fetches_per_step"][:-1]) == {1} and p["fetches_per_step"][-1] == 2
    assert p["swap_outs"] > 0
    assert p["prefix_hit_tokens"] > 0


def test_pallas_kernels_run_per_shard(checks):
    """The Pallas chunk and decode kernels (interpret mode) under shard_map at t = 2 agree
    with the one-device XLA step."""
    assert checks["pallas"]["status"] == [0, 0]
    assert max(checks["pallas"]["max_abs_diff"]) < 1e-4


# --------------------------------------------------------------------------- two processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_run_tensor_parallel_four_across_them(checks, tmp_path):
    """Two processes x 2 CPU devices on JAX's distributed runtime (gloo), t = 4 across
    both: each process holds the pages of its two devices, and both get the one-device
    run's greedy tokens."""
    port = _free_port()
    paths = [tmp_path / f"process{i}.json" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multi_process_worker.py"), str(i), str(port),
                               str(paths[i])], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    _, params = workload()
    greedy = [i for i, sp in enumerate(params) if sp.temperature == 0]
    for i, path in enumerate(paths):
        with open(path) as f:
            r = json.load(f)
        assert (r["process"], r["processes"], r["devices"], r["local_devices"]) == (i, 2, 4, 2)
        assert r["pages_devices"] == [0, 1]  # the pages span both processes' devices
        assert r["kv"]["per_device"] == [r["kv"]["total"] // 4] * 2  # its two devices, a quarter each
        for j in greedy:
            assert r["tokens"][j] == checks["reference_tokens"][j], (i, j)


# --------------------------------------------------------------------------- this process (one device)


def test_mesh_sizes_must_divide_the_devices():
    n = jax.device_count()
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={n + 1} does not divide the device count \({n}\)"):
        make_mesh(n + 1, 1)
    with pytest.raises(ValueError, match=rf"data_parallel_size={n + 1} does not divide the device count"):
        make_mesh(1, n + 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        make_mesh(0, 1)
    with pytest.raises(ValueError, match="more than the 4 available"):
        make_mesh(4, 4, devices=[jax.devices()[0]] * 4)
    assert dict(make_mesh(1, 1).shape) == {"data": 1, "model": 1}


def test_a_mesh_needs_the_named_axes():
    devices = np.array(jax.devices()[:1]).reshape(1, 1)
    with pytest.raises(ValueError, match=r"need axes named \('data', 'model'\) \(missing \['data', 'model'\]\)"):
        check_mesh(Mesh(devices, ("x", "y")))
    with pytest.raises(ValueError, match="expected a jax.sharding.Mesh"):
        check_mesh("mesh")
    assert check_mesh(Mesh(devices, ("model", "data")))  # any order
    with pytest.raises(ValueError, match=r"data_parallel_size=2 but the mesh's 'data' axis has size 1"):
        resolve_mesh(1, 2, Mesh(devices, ("data", "model")))
    assert resolve_mesh(1, 1, None) is None  # the default path: no mesh at all


def test_llm_rejects_bad_sizes_before_loading_weights():
    n = jax.device_count()
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={n + 1} does not divide the device count \({n}\)"):
        LLM(LLAMA, tensor_parallel_size=n + 1)
    with pytest.raises(ValueError, match=rf"data_parallel_size={n + 1} does not divide"):
        LLM(LLAMA, data_parallel_size=n + 1)
    with pytest.raises(ValueError, match="missing"):
        LLM(LLAMA, mesh=Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("x", "y")))


def test_kv_head_layout_splits_replicates_or_refuses():
    assert (KVHeadLayout(32, 8, 4).replicas, KVHeadLayout(32, 8, 4).stored_kv_heads) == (1, 8)
    assert (KVHeadLayout(32, 8, 8).replicas, KVHeadLayout(32, 8, 8).stored_kv_heads) == (1, 8)
    assert (KVHeadLayout(32, 8, 16).replicas, KVHeadLayout(32, 8, 16).stored_kv_heads) == (2, 16)
    assert KVHeadLayout(4, 1, 4).stored_kv_heads == 4  # MQA: one kv head stored on every device
    with pytest.raises(ValueError, match="num_heads=6 is not divisible by tensor_parallel_size=4"):
        KVHeadLayout(6, 2, 4)
    with pytest.raises(ValueError, match="num_kv_heads=3 and tensor_parallel_size=2: one must divide the other"):
        KVHeadLayout(6, 3, 2)


def test_replicated_kv_heads_compute_the_same_model():
    """Each kv head stored twice (t = 4 over 2 kv heads): the dense forward is the same,
    to the last bit for the columns, so logits agree to float rounding."""
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=64)
    graphdef, params = init_params(cfg, 0)
    wide_cfg, wide = replicate_kv_heads(cfg, params, 2)
    assert wide_cfg.num_kv_heads == 4
    wide_graphdef = init_params(wide_cfg, 0)[0]
    tokens = jnp.arange(12, dtype=jnp.int32)[None] % 64
    a = dense_forward(graphdef, params, tokens)
    b = dense_forward(wide_graphdef, wide, tokens)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_partition_specs_are_megatron_style():
    assert param_spec(("layers", "self_attn", "q_proj", "kernel"), 3) == jax.sharding.PartitionSpec(None, None, "model")
    assert param_spec(("layers", "self_attn", "k_proj", "bias"), 2) == jax.sharding.PartitionSpec(None, "model")
    assert param_spec(("layers", "self_attn", "o_proj", "kernel"), 3) == jax.sharding.PartitionSpec(None, "model", None)
    assert param_spec(("layers", "self_attn", "o_proj", "bias"), 2) == jax.sharding.PartitionSpec()
    assert param_spec(("layers", "mlp", "gate_proj", "kernel"), 3) == jax.sharding.PartitionSpec(None, None, "model")
    assert param_spec(("layers", "mlp", "down_proj", "kernel"), 3) == jax.sharding.PartitionSpec(None, "model", None)
    assert param_spec(("layers", "input_layernorm", "weight"), 2) == jax.sharding.PartitionSpec()
    assert param_spec(("embed_tokens", "embedding"), 2) == jax.sharding.PartitionSpec()
    assert param_spec(("lm_head", "kernel"), 2) == jax.sharding.PartitionSpec()


def test_assignment_policies():
    loads = [ReplicaLoad(3, 300), ReplicaLoad(1, 100), ReplicaLoad(2, 100)]
    assert [round_robin(Assignment(n, 10), loads) for n in range(4)] == [0, 1, 2, 0]
    assert least_loaded(Assignment(0, 10), loads) == 1  # fewest tokens, then fewest requests
    assert get_router("least_loaded") is least_loaded
    assert get_router(round_robin) is round_robin
    with pytest.raises(ValueError, match="data_parallel_policy='busiest'"):
        get_router("busiest")


def test_hlo_reader_counts_collectives_inside_loops():
    text = """HloModule m

%body (p: (s32[], f32[8,64])) -> (s32[], f32[8,64]) {
  %p = (s32[], f32[8,64]) parameter(0)
  %x = f32[8,64]{1,0} get-tuple-element(%p), index=1
  %all-reduce.1 = f32[8,64]{1,0} all-reduce(%x), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  ROOT %t = (s32[], f32[8,64]) tuple(%i, %all-reduce.1)
}

ENTRY %main (a: f32[8,64]) -> f32[8,64] {
  %w = (s32[], f32[8,64]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %all-gather.2 = f32[16,64]{1,0} all-gather(%a), dimensions={0}
  ROOT %r = f32[8,64]{1,0} get-tuple-element(%w), index=1
}
"""
    s = hlo.summary(text)
    assert s["all-reduce"] == {"ops": 1, "runs": 3, "bytes": 3 * 8 * 64 * 4}
    assert s["all-gather"] == {"ops": 1, "runs": 1, "bytes": 16 * 64 * 4}
    assert s["bytes_per_call"] == 3 * 8 * 64 * 4 + 16 * 64 * 4


def test_hlo_reader_finds_copies_of_a_shape_but_not_their_users():
    text = """ENTRY %main (a: f32[2,48,4]) -> f32[2,48,4] {
  %copy.1 = f32[2,48,4]{2,1,0} copy(%a)
  %convert.2 = bf16[2,48,4]{2,1,0} convert(%a)
  %copy_fusion = f32[2,48,4]{2,1,0} fusion(%a), kind=kLoop, calls=%fused_copy
  %fusion.3 = s8[2,48,4]{2,1,0} fusion(%a), kind=kLoop, calls=%wrapped_convert_computation
  %copy.4 = f32[2,8,4]{2,1,0} copy(%b)
  %conditional.5 = (f32[2,48,4]{2,1,0}) conditional(%reduce_convert_fusion.2, %t), branch_computations={%x, %y}
  %fusion.6 = f32[2,48,4]{2,1,0} fusion(%convert.2), kind=kLoop, calls=%fused_add
  ROOT %r = f32[2,48,4]{2,1,0} add(%copy.1, %copy.1)
}
"""
    found = hlo.copies(text, re.escape("[2,48,4]"))
    assert [line.split(" =")[0] for line in found] == ["%copy.1", "%convert.2", "%copy_fusion", "%fusion.3"]
    assert hlo.copies(text, re.escape("[2,9,4]")) == []


# --------------------------------------------------------------------------- the study


def test_scaling_study_smoke(tmp_path):
    """``python -m experiments scaling --quick`` (it re-runs itself in a subprocess with 8
    simulated devices): per-device pages fall as 1/t, the pools and batch grow with t and
    d, the decode step all-reduces and never gathers."""
    from experiments import scaling

    result = scaling.main(["--quick", "--out", str(tmp_path)])
    h = result["headline"]
    assert (tmp_path / "scaling.json").exists() and (tmp_path / "scaling.png").exists()
    assert h["largest_t"] == 4 and h["kv_bytes_per_device_ratio"] == 0.25
    assert h["max_batch_gain_t"] == 4 and h["max_batch_gain_d"] == 2
    assert h["decode_all_gathers"] == 0 and h["decode_other_collectives"] == 0
    assert h["decode_allreduce_bytes_per_layer"] == 2 * scaling.DECODE_ROWS * 64 * 4  # two of [rows, hidden] f32
    rows = {(r["t"], r["d"]): r for r in result["rows"]}
    assert all(r["pages_bytes_per_device"] <= r["budget_per_device"] for r in rows.values())
    assert rows[(1, 1)]["decode_allreduce_ops"] == 0 and rows[(2, 1)]["decode_allreduce_ops"] == 2


def test_what_a_mesh_refuses():
    from engine_fakes import fake_backend

    from paged_jax.parallel.sharding import check_model

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    with pytest.raises(ValueError, match="needs the model as a checkpoint directory or a ModelConfig"):
        LLM(fake_backend(), mesh=mesh)
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                      num_kv_heads=4, head_dim=16)
    with pytest.raises(ValueError, match="intermediate_size=96 is not divisible by tensor_parallel_size=64"):
        check_model(cfg.replace(num_heads=64, num_kv_heads=64, hidden_size=1024), 64)
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by tensor_parallel_size=8"):
        check_model(cfg, 8)
    with pytest.raises(ValueError, match="'draft_model' is not supported on a mesh"):
        LLM(cfg, mesh=mesh, speculative_config={"method": "draft_model", "model": cfg, "num_speculative_tokens": 2})
