#!/usr/bin/env bash
# The LoRA loop on the GPU machine in one call (build here with `scripts/gpu-build.sh`, carry
# .gpu): the CUDA LoRA kernel tests against the CPU reference, the kernels of a whole
# 8B-shaped step (recorded, replayed) against the copy bandwidth with the adapter activation
# time, and the cost of adapters in real 8B decode steps. A subset of scripts/gpu-check.sh for
# iterating on the kernels; GPU_LORA_STEP=0 skips the 8B model and its step costs.
# GPU_LORA_TEST_MODES: settings the kernel tests run again under, space-separated, each a
# comma-separated list of assignments (default: none).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu-step.sh
step lora-tests .gpu/bin/cuda_lora --ignored --test-threads 1 --nocapture
for mode in ${GPU_LORA_TEST_MODES:-}; do
    IFS=, read -ra assigns <<< "$mode"
    step "lora-tests-${mode//[^A-Za-z0-9_]/_}" env "${assigns[@]}" .gpu/bin/cuda_lora --ignored --test-threads 1 --nocapture
done
step bench-lora-kernels .gpu/bin/quiver bench lora --device cuda --part kernels --ranks 16 --kernel-adapters 1,16,64 \
    --kernel-rows 1,16,64,256,2048 --backends chunked --kernel-reps 15 --output-json "$DATA/bench-lora-kernels.json"
step bench-lora-kernels-ranks .gpu/bin/quiver bench lora --device cuda --part kernels --ranks 8,64 --kernel-adapters 1,16 \
    --kernel-rows 1,64,256 --backends chunked --kernel-reps 15 --output-json "$DATA/bench-lora-kernels-ranks.json"
grep -hE "^(chunked|decode|prefill|rank|device)" "$LOGS/bench-lora-kernels.log" "$LOGS/bench-lora-kernels-ranks.log"
if [ "${GPU_LORA_STEP:-1}" = 1 ]; then
    [ -f "$DATA/models/llama8b/config.json" ] || step models python3 scripts/gpu_models.py models "$DATA" .gpu/tok llama8b
    step bench-lora-step .gpu/bin/quiver bench lora --device cuda --dtype bf16 --part step --model "$DATA/models/llama8b" --ranks 16 \
        --adapters 1,16 --rows 1,16,64,256 --prefill 2048 --backends auto --steps 15 --output-json "$DATA/bench-lora-step.json"
    grep -hE "^(auto|CUDA graphs)" "$LOGS/bench-lora-step.log"
fi
# GPU_LORA_SERVE=1: then the served sweep (scripts/gpu-serve-lora.sh, its SERVE_* settings).
if [ "${GPU_LORA_SERVE:-0}" = 1 ]; then
    ls "$DATA"/adapters/lora8b-r16-* >/dev/null 2>&1 || step adapters python3 scripts/gpu_models.py adapters "$DATA" llama8b
    bash scripts/gpu-serve-lora.sh
fi
# Last, so a long run's tail still shows them: the kernel tests' verdicts.
grep -hE "matched the CPU|^test .* (ok|FAILED)$|test result|panicked" "$LOGS/lora-tests.log"
