#!/usr/bin/env bash
# Builds the Python reference outputs (HF transformers + PEFT, fp32 CPU) under $QUIVER_CACHE/ref
# (default <repo>/.cache/ref): prompts.json, tiny models, smollm2-hf, LoRA adapters, ref/*.json.
# Idempotent: every step skips outputs that already exist (delete a file to regenerate it).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${QUIVER_CACHE:-$here/.cache}
"$here/scripts/setup-venv.sh"
"$here/scripts/fetch-model.sh" >/dev/null
cd "$here"
exec "$cache/venv/bin/python" "$here/scripts/reference.py" all "$cache/ref"
