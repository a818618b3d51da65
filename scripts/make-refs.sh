#!/usr/bin/env bash
# Builds the Python reference outputs (HF transformers + PEFT, fp32 CPU) under $QUIVER_CACHE/ref
# (default <repo>/.cache/ref): prompts.json, tiny models, smollm2-hf, LoRA adapters, ref/*.json,
# and the embedding models with their references (scripts/reference_embed.py; the
# sentence-transformers cross-check runs in the second venv of scripts/setup-venv5.sh).
# Idempotent: every step skips outputs that already exist (delete a file to regenerate it).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${QUIVER_CACHE:-$here/.cache}
"$here/scripts/setup-venv.sh"
"$here/scripts/fetch-model.sh" >/dev/null
cd "$here"
"$cache/venv/bin/python" "$here/scripts/reference.py" all "$cache/ref"
"$cache/venv/bin/python" "$here/scripts/reference_embed.py" all "$cache/ref"
"$here/scripts/setup-venv5.sh"
"$cache/venv5/bin/python" "$here/scripts/reference_embed.py" st "$cache/ref"
