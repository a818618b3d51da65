#!/usr/bin/env bash
# A second reference environment with current transformers (5.x), PEFT and sentence-transformers,
# for what the main one (transformers 4.57, scripts/setup-venv.sh) cannot produce: PEFT's
# `target_parameters` LoRA on the fused 3-D expert tensors transformers >= 5 keeps in memory, and
# sentence-transformers' own pooling of the embedding test models.
#
# Lean: torch is not installed twice. The venv sees the main venv's site-packages after its own
# (a .pth file), so torch 2.9.1 and everything else pinned there is shared, and pip installs here
# only what the pins below need in other versions. Idempotent like setup-venv.sh.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${QUIVER_CACHE:-$here/.cache}
"$here/scripts/setup-venv.sh"
main=$cache/venv
venv=$cache/venv5
pins="transformers==5.24.0 peft==0.21.2 sentence-transformers==6.2.0 huggingface-hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0"
stamp=$venv/.quiver-pins
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$pins" ]; then exit 0; fi
python3 -m venv "$venv"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
main_site=$("$main/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$main_site" > "$site/zz-quiver-main-venv.pth"
"$venv/bin/pip" install -q $pins
echo "$pins" > "$stamp"
