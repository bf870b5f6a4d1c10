#!/usr/bin/env bash
# vLLM's own benchmark client (what `vllm bench serve` runs; the side venv's `vllm` console
# script fails with PackageNotFoundError, so its module is called directly) against any
# OpenAI-compatible server, e.g. ours:
#   python -m paged_jax.serve ~/.cache/paged_jax/models/SmolLM2-135M-Instruct --served-model-name served &
#   scripts/vllm_bench_serve.sh http://127.0.0.1:8000 ~/.cache/paged_jax/models/SmolLM2-135M-Instruct [extra args]
# Default dataset: random tokens (no network); pass e.g. --dataset-name custom --dataset-path F.jsonl
# (needs pandas in the venv, scripts/side_venv.sh vllm installs it). experiments/serving.py
# (vllm_bench_command) runs the same client on the study's workload.
set -euo pipefail
url=${1:?usage: scripts/vllm_bench_serve.sh BASE_URL TOKENIZER_DIR [vllm bench serve args]}
tok=${2:?usage: scripts/vllm_bench_serve.sh BASE_URL TOKENIZER_DIR [vllm bench serve args]}
shift 2
py=${VLLM_PYTHON:-${PAGED_JAX_SIDE_VENVS:-$HOME/.cache/paged_jax/venvs}/vllm/bin/python}
exec "$py" -c "import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))" \
  --base-url "$url" --tokenizer "$tok" --dataset-name random --random-input-len 64 --random-output-len 32 \
  --num-prompts 32 --request-rate 1 --ignore-eos --temperature 0 \
  --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 "$@"
