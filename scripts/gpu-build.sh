#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh runs on the GPU machine into .gpu/ (gitignored): the quiver
# binary and the GPU test binaries, built with `--features cuda` (no CUDA needed to build),
# plus the tokenizer files the random models share.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu/bin .gpu/tok
cargo build --release -p quiver --features cuda
cp target/release/quiver .gpu/bin/
for t in "quiver-kernels cuda_kernels" "quiver-kernels cuda_sample" "quiver-lora cuda_lora" "quiver-engine cuda_parity" "quiver-engine cuda_overlap" "quiver-engine tensor_parallel"; do
    set -- $t
    exe=$(cargo test --release -p "$1" --features cuda --test "$2" --no-run --message-format=json 2>/dev/null \
        | python3 -c 'import sys,json
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]==sys.argv[1]: print(m["executable"])' "$2" | tail -n 1)
    cp "$exe" ".gpu/bin/$2"
done
strip .gpu/bin/* 2>/dev/null || true
cache=${QUIVER_CACHE:-.cache}
tok=$cache/ref/models/tiny-qwen2
if [ ! -f "$tok/tokenizer.json" ]; then
    # No test data yet (a fresh checkout): the same SmolLM2 tokenizer, saved from the GGUF.
    make -s model venv >/dev/null
    tok=$(mktemp -d)
    "$cache/venv/bin/python" - "$(bash scripts/fetch-model.sh)" "$tok" <<'PY'
import os, sys
from transformers import AutoTokenizer
gguf, out = sys.argv[1], sys.argv[2]
AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf)).save_pretrained(out)
PY
fi
cp "$tok"/tokenizer.json "$tok"/tokenizer_config.json .gpu/tok/
[ -f "$tok/special_tokens_map.json" ] && cp "$tok/special_tokens_map.json" .gpu/tok/
du -sh .gpu
# What the device carries is at most 64 MiB with the working tree: the binaries go packed
# (xz, about a quarter), unpacked there with `tar xJf .gpu-pack/gpu.tar.xz` before the scripts.
mkdir -p .gpu-pack
tar cJf .gpu-pack/gpu.tar.xz .gpu
du -sh .gpu-pack
