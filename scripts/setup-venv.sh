#!/usr/bin/env bash
# Creates the Python reference environment (HF transformers + PEFT on CPU torch) used by tests.
# Idempotent: a stamp file records the pinned set; re-running with the same pins does nothing.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${QUIVER_CACHE:-$here/.cache}
venv=$cache/venv
pins="torch==2.9.1 transformers==4.57.3 peft==0.17.1 gguf==0.17.1 safetensors==0.6.2 numpy==2.2.6 sentencepiece==0.2.1 openai==2.8.1 prometheus_client==0.23.1 jinja2==3.1.6 lm-eval==0.4.13 tenacity==9.1.2 datasets==4.8.5 huggingface_hub==0.36.2 jsonschema==4.26.0"
stamp=$venv/.quiver-pins
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$pins" ]; then exit 0; fi
mkdir -p "$cache"
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip >/dev/null
# lm-eval's API models need tenacity (its `api` extra); datasets and huggingface_hub are
# pinned because lm-eval alone would pull a hub that transformers 4.57 refuses.
# CPU wheels of torch from PyPI pull CUDA libraries on Linux; try the small CPU build's local
# version first, fall back to the plain one.
"$venv/bin/pip" install -q $pins
echo "$pins" > "$stamp"
