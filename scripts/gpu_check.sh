#!/usr/bin/env bash
# GPU readiness in one command (< 8 minutes on one H200): the machine, JAX and its devices,
# then `python -m experiments gpu` (kernels vs the reference at model shapes, the kernel
# benchmark against copy bandwidth and JAX's shipped kernel, the throughput study on a
# 1B-shaped model) into out/gpu. Without a GPU it runs the CPU smoke instead.
#
#   scripts/gpu_check.sh [--quick] [any other `python -m experiments gpu` flag]
#   GPU_CHECK_OUT=DIR   where the JSON goes (default out/gpu)
#   PYTHON=...          the interpreter to use (default: chosen below)
#
# Interpreter, first that fits: $PYTHON; .venv/bin/python if its JAX sees a GPU; a python3
# whose JAX sees one (a GPU image's own), through a .venv made over its packages
# (--system-site-packages: nothing downloaded) unless .venv exists already; .venv as
# `make` builds it (CPU JAX: the smoke); any python3 with JAX.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_CHECK_OUT:-out/gpu}
mkdir -p "$OUT"

sees_gpu() { "$1" -c 'import jax, sys; sys.exit(0 if jax.default_backend() == "gpu" else 1)' >/dev/null 2>&1; }
has_jax() { "$1" -c 'import jax, flax, numpy' >/dev/null 2>&1; }

pick_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  if [ -x .venv/bin/python ] && sees_gpu .venv/bin/python; then echo .venv/bin/python; return; fi
  if command -v python3 >/dev/null && sees_gpu python3; then
    if [ ! -e .venv ]; then
      python3 -m venv --system-site-packages .venv >&2 && sees_gpu .venv/bin/python && { echo .venv/bin/python; return; }
    fi
    echo python3; return
  fi
  if [ -x .venv/bin/python ] && has_jax .venv/bin/python; then echo .venv/bin/python; return; fi
  if [ ! -e .venv ] && command -v make >/dev/null && make .venv/.installed >&2; then echo .venv/bin/python; return; fi
  if command -v python3 >/dev/null && has_jax python3; then echo python3; return; fi
  echo "gpu_check: no Python with JAX found (make .venv/.installed, or set PYTHON=...)" >&2
  exit 1
}

PY=$(pick_python)
{
  echo "== $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(uname -srm), repo $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "== nvidia-smi"
  if command -v nvidia-smi >/dev/null; then nvidia-smi || echo "(nvidia-smi failed)"; else echo "(nvidia-smi: not found)"; fi
  echo "== python: $PY"
  "$PY" - <<'EOF'
import sys

import jax
import jaxlib

print("python", sys.version.split()[0])
print("jax", jax.__version__, "| jaxlib", jaxlib.__version__)
print("backend", jax.default_backend())
for d in jax.devices():
    print(" ", d, "|", getattr(d, "device_kind", "?"), "| compute capability", getattr(d, "compute_capability", None))
EOF
} 2>&1 | tee "$OUT/gpu_check.log"

export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
set +e
# The study keeps itself under its budget (400 s); the timeout only guards against a hang.
timeout -k 10 450 "$PY" -m experiments gpu --out "$OUT" "$@" 2>&1 | tee -a "$OUT/gpu_check.log"
status=${PIPESTATUS[0]}
set -e
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
  echo "gpu_check: stopped at the 450 s guard; the parts that finished are in $OUT" | tee -a "$OUT/gpu_check.log"
fi
echo "gpu_check: exit $status; results in $OUT (gpu.json has the headline)"
exit "$status"
