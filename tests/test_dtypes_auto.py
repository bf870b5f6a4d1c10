"""dtype="auto": what it picks per checkpoint dtype and platform, and the engine's one log line."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest

from paged_jax import dtypes
from paged_jax.dtypes import auto_compute_dtype
from paged_jax.engine.config import EngineArgs

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.mark.parametrize(
    "checkpoint, platform, cpu_bf16, want",
    [
        ("float32", "cpu", True, "float32"),  # never a silent downcast
        ("float32", "gpu", True, "float32"),
        ("bfloat16", "cpu", True, "bfloat16"),  # native bf16 dots: faster than fp32
        ("bfloat16", "cpu", False, "float32"),  # emulated: fp32 work plus converts
        ("float16", "cpu", True, "float32"),  # no f16 dot on XLA:CPU
        ("bfloat16", "gpu", False, "bfloat16"),
        ("float16", "gpu", False, "float16"),
        ("bf16", "tpu", False, "bfloat16"),
    ],
)
def test_auto_compute_dtype_table(checkpoint, platform, cpu_bf16, want):
    dtype, why = auto_compute_dtype(checkpoint, platform, cpu_bf16=cpu_bf16)
    assert dtype == want and why


def test_auto_compute_dtype_refuses_non_floats():
    with pytest.raises(ValueError, match="int8"):
        auto_compute_dtype("int8", "cpu")


def _checkpoint(tmp_path, dtype: str) -> str:
    """The bf16 mistral fixture with config.json declaring ``dtype`` (no weight is read)."""
    target = tmp_path / dtype
    shutil.copytree(os.path.join(FIXTURES, "mistral"), target)
    path = target / "config.json"
    config = json.loads(path.read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = dtype
    path.write_text(json.dumps(config))
    return str(target)


@pytest.mark.parametrize(
    "declared, cpu_bf16, want",
    [("bfloat16", True, "bfloat16"), ("bfloat16", False, "float32"), ("float16", True, "float32"),
     ("float32", True, "float32")],
)
def test_engine_resolves_auto_and_logs_it_once(tmp_path, monkeypatch, caplog, declared, cpu_bf16, want):
    monkeypatch.setattr(dtypes, "cpu_has_bf16", lambda: cpu_bf16)
    monkeypatch.setattr("jax.default_backend", lambda: "cpu")
    path = _checkpoint(tmp_path, declared)
    with caplog.at_level(logging.INFO, logger="paged_jax"):
        config = EngineArgs(model=path).create_engine_config()
    assert config.model.architecture.dtype == want
    lines = [r.getMessage() for r in caplog.records if "dtype='auto'" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"dtype='auto': {want} ") and f"checkpoint {declared}" in lines[0]


def test_explicit_dtype_is_kept_and_not_logged(tmp_path, caplog):
    path = _checkpoint(tmp_path, "bfloat16")
    with caplog.at_level(logging.INFO, logger="paged_jax"):
        config = EngineArgs(model=path, dtype="float16").create_engine_config()
    assert config.model.architecture.dtype == "float16"
    assert not [r for r in caplog.records if "dtype='auto'" in r.getMessage()]


def test_this_machine_reads_its_cpu_flags():
    assert isinstance(dtypes.cpu_has_bf16(), bool)
