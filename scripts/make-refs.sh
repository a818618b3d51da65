#!/usr/bin/env bash
# Builds the Python reference outputs (HF transformers + PEFT, fp32 CPU) under $QUIVER_CACHE/ref
# (default <repo>/.cache/ref): prompts.json, tiny models, smollm2-hf, LoRA adapters, ref/*.json,
# the embedding models with their references (scripts/reference_embed.py; the
# sentence-transformers cross-check runs in the second venv of scripts/setup-venv5.sh), and LoRA
# on the tiny MoE models (scripts/reference_moe_lora.py: per-expert modules with transformers 4,
# PEFT's target_parameters on fused experts with transformers 5 in the second venv).
# Idempotent: every step skips outputs that already exist (delete a file to regenerate it).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${QUIVER_CACHE:-$here/.cache}
"$here/scripts/setup-venv.sh"
"$here/scripts/fetch-model.sh" >/dev/null
cd "$here"
"$cache/venv/bin/python" "$here/scripts/reference.py" all "$cache/ref"
"$cache/venv/bin/python" "$here/scripts/reference_embed.py" all "$cache/ref"
"$cache/venv/bin/python" "$here/scripts/reference_moe_lora.py" all "$cache/ref"
"$here/scripts/setup-venv5.sh"
"$cache/venv5/bin/python" "$here/scripts/reference_embed.py" st "$cache/ref"
"$cache/venv5/bin/python" "$here/scripts/reference_moe_lora.py" params "$cache/ref"
