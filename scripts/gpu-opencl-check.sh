#!/usr/bin/env bash
# The OpenCL device under NVIDIA's OpenCL driver on the GPU machine: a real asynchronous GPU
# driver for the host code (queues, events, buffers) running the portable kernels (NVIDIA's
# OpenCL C 1.2 has no subgroups, so no DPAS; timings say nothing about Intel GPUs).
#
# Here:  scripts/gpu-opencl-check.sh build   -> .gpu-opencl/ (test binaries, quiver, the ICD
#        loader, tokenizer files, this script and gpu_models.py: the folder runs on its own)
# There: bash .gpu-opencl/gpu-opencl-check.sh run   (logs under $OUT or ./gpu-out; summary last)
#
# The GPU machine has no Rust and no network. It needs NVIDIA's libnvidia-opencl.so.1 (its ICD
# list names only PoCL, so this writes its own ICD file) and, for the model checks, Python with
# torch + transformers: scripts/gpu_models.py writes the random-weight models and transformers
# float32 references under $QUIVER_GPU_DATA (default /tmp/quiver-gpu; kept between runs).
set -uo pipefail
case "${1:-}" in
build)
    set -e
    cd "$(dirname "$0")/.."
    rm -rf .gpu-opencl
    mkdir -p .gpu-opencl/bin .gpu-opencl/lib .gpu-opencl/tok
    # Paths of the built executables from cargo's own messages (CARGO_TARGET_DIR may be set).
    exe_of() { python3 -c 'import sys,json
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]==sys.argv[1]: print(m["executable"])' "$1" | tail -n 1; }
    cp "$(cargo build --release -p quiver --message-format=json | exe_of quiver)" .gpu-opencl/bin/quiver
    for t in "quiver-kernels opencl_kernels" "quiver-lora opencl_lora" "quiver-engine opencl_parity"; do
        set -- $t
        cp "$(cargo test --release -p "$1" --test "$2" --no-run --message-format=json | exe_of "$2")" ".gpu-opencl/bin/$2"
    done
    strip .gpu-opencl/bin/*
    cp -L "$(ldconfig -p | awk '/libOpenCL.so.1 /{print $NF; exit}')" .gpu-opencl/lib/libOpenCL.so.1
    tok=${QUIVER_CACHE:-.cache}/ref/models/tiny-qwen2
    for f in tokenizer.json tokenizer_config.json special_tokens_map.json; do [ ! -f "$tok/$f" ] || cp "$tok/$f" .gpu-opencl/tok/; done
    cp scripts/gpu-opencl-check.sh scripts/gpu_models.py .gpu-opencl/
    du -sh .gpu-opencl
    ;;
run)
    # Works from the folder itself, wherever it was carried to.
    here=$(cd "$(dirname "$0")" && pwd)
    [ -x "$here/bin/quiver" ] || here=$here/../.gpu-opencl # called as scripts/gpu-opencl-check.sh
    here=$(cd "$here" && pwd)
    OUT=${OUT:-$PWD/gpu-out}
    DATA=${QUIVER_GPU_DATA:-/tmp/quiver-gpu}
    mkdir -p "$OUT" "$DATA/icd"
    nv=$(find /usr/lib /usr/lib64 /usr/local -name 'libnvidia-opencl.so.1' 2>/dev/null | head -n1)
    [ -n "$nv" ] || { echo "no libnvidia-opencl.so.1 on this machine" >&2; exit 1; }
    echo "$nv" > "$DATA/icd/nvidia.icd"
    export OCL_ICD_VENDORS=$DATA/icd LD_LIBRARY_PATH=$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export QUIVER_TEST_OPENCL_PLATFORM="NVIDIA CUDA" QUIVER_TEST_OPENCL_SETS=portable QUIVER_GPU_DATA=$DATA PYTHONUNBUFFERED=1
    status=0 summary=
    step() { # name, command...
        local name=$1 t0=$SECONDS r
        shift
        if "$@" >"$OUT/$name.log" 2>&1; then r=ok; else r=FAILED; status=1; tail -n 30 "$OUT/$name.log"; fi
        summary+="[$r] $name ($((SECONDS - t0)) s)"$'\n'
        echo "[$r] $name ($((SECONDS - t0)) s)"
    }
    step models python3 "$here/gpu_models.py" models "$DATA" "$here/tok" llama-gpu,qwen2-gpu,smollm2-rand
    step refs python3 "$here/gpu_models.py" refs "$DATA"
    step kernel-tests "$here/bin/opencl_kernels" --test-threads 1 --nocapture
    step lora-tests "$here/bin/opencl_lora" --test-threads 1 --nocapture
    step model-tests "$here/bin/opencl_parity" --ignored --test-threads 1 --nocapture
    step bench-generate "$here/bin/quiver" bench generate --device opencl --dtype f32 --model "$DATA/models/llama-gpu" \
        --prompt-len 128 --batch-sizes 1,16 --decode-steps 8 --reps 2
    step bench-lora "$here/bin/quiver" bench lora --device opencl --dtype f32 --part step --model "$DATA/models/llama-gpu" \
        --ranks 16 --adapters 1,4 --rows 1,16 --backends auto --steps 5
    echo "==== summary (OpenCL on NVIDIA: portable kernels; functional smoke numbers, not Intel's)"
    grep -h "quiver: opencl" "$OUT"/*-tests.log | sort -u | head -n 2
    grep -hE "test result|^opencl (f32|bf16)|engine" "$OUT"/*-tests.log
    grep -hE "^(device ceilings|pp|decode batch|auto)" "$OUT/bench-generate.log" "$OUT/bench-lora.log"
    printf '%s' "$summary"
    exit $status
    ;;
*) echo "usage: $0 build|run" >&2; exit 2 ;;
esac
