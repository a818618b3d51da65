#!/usr/bin/env bash
# The whole CUDA check in one call on the GPU machine (which has CUDA, PyTorch and transformers
# but no Rust): build here first with `scripts/gpu-build.sh`, which puts the binaries and the
# tokenizer files in .gpu/, then run this there with .gpu carried.
#
# Steps: random-weight models and float32 references (scripts/gpu_models.py), the kernel unit
# tests, the parity tests, the Llama-3.1-8B-shaped benchmark, and a summary table printed last.
# Full logs go to $OUT (or ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
# $DATA, $LOGS (packed into one archive at the end), `step`.
. scripts/gpu-step.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$LOGS/nvidia-smi.log" 2>&1
# GPU_CHECK_PARITY=0 skips the parity tests and the models and references only they need
# (a kernel-and-benchmark call: the 8B-shaped model alone).
parity=${GPU_CHECK_PARITY:-1}
only=; [ "$parity" = 1 ] || only=llama8b
step models python3 scripts/gpu_models.py models "$DATA" .gpu/tok $only
[ "$parity" = 1 ] && step refs python3 scripts/gpu_models.py refs "$DATA"
step adapters python3 scripts/gpu_models.py adapters "$DATA" $only
[ "$parity" = 1 ] && step peft-refs python3 scripts/gpu_models.py peft-refs "$DATA"
step ceilings python3 scripts/gpu_models.py ceilings "$DATA"
step kernel-tests .gpu/bin/cuda_kernels --ignored --test-threads 1 --nocapture
step sample-tests .gpu/bin/cuda_sample --ignored --test-threads 1 --nocapture
step lora-tests .gpu/bin/cuda_lora --ignored --test-threads 1 --nocapture
[ "$parity" = 1 ] && step parity-tests .gpu/bin/cuda_parity --ignored --skip moe_expert_adapters_on_cuda --test-threads 1 --nocapture
# Expert LoRA against PEFT on the CPU suite's tiny MoE models: their models, adapters and
# references come from `make test-data` on another machine, carried here under $QUIVER_CACHE/ref
# (the list is in cuda_parity.rs, `moe_expert_adapters_on_cuda`); without them the step says so.
if [ "$parity" = 1 ]; then
    if [ -d "${QUIVER_CACHE:-.cache}/ref/adapters" ]; then
        step moe-lora-parity .gpu/bin/cuda_parity --ignored moe_expert_adapters_on_cuda --test-threads 1 --nocapture
    else
        echo "[NOT RUN] moe-lora-parity: no \$QUIVER_CACHE/ref/adapters (carry the CPU suite's MoE references)"
    fi
fi
# Overlapped scheduling: the engine with overlap on against overlap off, and cancellations.
[ "$parity" = 1 ] && step overlap-tests .gpu/bin/cuda_overlap --ignored --test-threads 1 --nocapture
# LoRA on the GPU: the kernels of a whole 8B-shaped step (recorded and replayed) against the
# copy bandwidth, then the cost of adapters in real 8B decode steps. GPU_CHECK_LORA=0 skips.
if [ "${GPU_CHECK_LORA:-1}" = 1 ]; then
    step bench-lora-kernels .gpu/bin/quiver bench lora --device cuda --part kernels --ranks 16 --kernel-adapters 1,16,64 \
        --kernel-rows 1,16,64,256,2048 --backends chunked,segmented --kernel-reps 15 --output-json "$DATA/bench-lora-kernels.json"
    step bench-lora-kernels-ranks .gpu/bin/quiver bench lora --device cuda --part kernels --ranks 8,64 --kernel-adapters 1,16 \
        --kernel-rows 1,64,256 --backends chunked --kernel-reps 15 --output-json "$DATA/bench-lora-kernels-ranks.json"
    step bench-lora-step .gpu/bin/quiver bench lora --device cuda --dtype bf16 --part step --model "$DATA/models/llama8b" --ranks 16 \
        --adapters 1,16 --rows 1,16,64,256 --prefill 2048 --backends auto --steps 15 --output-json "$DATA/bench-lora-step.json"
    grep -hE "^(decode|prefill|rank|device|CUDA graphs)" "$LOGS/bench-lora-kernels.log" "$LOGS/bench-lora-kernels-ranks.log"
    grep -hE "^(auto|CUDA graphs)" "$LOGS/bench-lora-step.log"
fi
[ "${GPU_CHECK_BENCH:-1}" = 1 ] && step bench-8b .gpu/bin/quiver bench generate --device cuda --dtype bf16 --model "$DATA/models/llama8b" \
    --prompt-len 2048 --batch-sizes 1,4,16,64,256 --decode-steps 32 --reps 3 --output-json "$DATA/bench-llama8b.json"
# Decode steps of several rows replay CUDA graphs by default; the same batches with only
# single-row steps recorded show what the graphs are worth. Set GPU_CHECK_GRAPHS=0 to skip.
if [ "${GPU_CHECK_GRAPHS:-1}" = 1 ]; then
    QUIVER_CUDA_GRAPH_MAX_ROWS=1 step bench-8b-eager-multirow .gpu/bin/quiver bench generate --device cuda --dtype bf16 --model "$DATA/models/llama8b" \
        --prompt-len 128 --batch-sizes 4,16,64,256 --decode-steps 32 --reps 3 --output-json "$DATA/bench-llama8b-eager.json"
    grep -hE "decode batch" "$LOGS/bench-8b-eager-multirow.log"
fi
# What the copy stream costs on the critical path: the same small decode batches with the
# transfers on the compute stream instead (QUIVER_CUDA_COPY_STREAM=0), alternated twice.
# Set GPU_CHECK_COPY_AB=0 to skip.
if [ "${GPU_CHECK_COPY_AB:-1}" = 1 ]; then
    copy_ab() {
        for round in 1 2; do
            for mode in 1 0; do
                echo "copy stream $mode (round $round)"
                QUIVER_CUDA_COPY_STREAM=$mode .gpu/bin/quiver bench generate --device cuda --dtype bf16 --model "$DATA/models/llama8b" \
                    --prompt-len 128 --batch-sizes 1,4 --decode-steps 64 --reps 3 | grep -E "decode batch" || return 1
            done
        done
    }
    step bench-8b-copy-ab copy_ab
    cat "$LOGS/bench-8b-copy-ab.log"
fi
# Batch-1 decode A/B, each mode a set of environment settings (comma-separated), alternated
# GPU_CHECK_AB_ROUNDS times (2); by default single-row GEMVs with and without RoPE and SiLU·mul fused into their epilogue
# (QUIVER_CUDA_FUSE_EPILOGUES). GPU_CHECK_AB_MODES overrides the modes; GPU_CHECK_GEMV_AB=0 skips.
if [ "${GPU_CHECK_GEMV_AB:-1}" = 1 ]; then
    gemv_ab() {
        local modes=${GPU_CHECK_AB_MODES:-"QUIVER_CUDA_FUSE_EPILOGUES=0 QUIVER_CUDA_FUSE_EPILOGUES=1"}
        for round in $(seq "${GPU_CHECK_AB_ROUNDS:-2}"); do
            for mode in $modes; do
                echo "$mode (round $round)"
                env ${mode//,/ } .gpu/bin/quiver bench generate --device cuda --dtype bf16 --model "$DATA/models/llama8b" \
                    --prompt-len 128 --batch-sizes 1 --decode-steps 128 --reps 3 | grep -E "decode batch" || return 1
            done
        done
    }
    step bench-8b-gemv-ab gemv_ab
    cat "$LOGS/bench-8b-gemv-ab.log"
fi
# Where the time goes, per op (GPU time between op ends, so launch gaps show), prefill-heavy.
# Set GPU_CHECK_PROFILE=0 to skip.
if [ "${GPU_CHECK_PROFILE:-1}" = 1 ]; then
    QUIVER_CUDA_PROFILE=1 step profile-prefill .gpu/bin/quiver bench generate --device cuda --dtype bf16 --model "$DATA/models/llama8b" \
        --prompt-len 2048 --batch-sizes 1 --decode-steps 1 --reps 1
    grep -B1 -A12 "CUDA profile" "$LOGS/profile-prefill.log"
fi
# Mixture of experts at full depth: random Qwen3-30B-A3B-shaped bf16 weights built in-process
# (61 GB; no checkpoint needed), decode at 1/16/64 rows; and embedding throughput of a
# Qwen3-Embedding-0.6B-shaped model on 512-token inputs. Set GPU_CHECK_MOE=0 to skip.
if [ "${GPU_CHECK_MOE:-1}" = 1 ]; then
    step bench-qwen3-30b-a3b .gpu/bin/quiver bench generate --device cuda --dtype bf16 --shape qwen3-30b-a3b --tokenizer .gpu/tok \
        --prompt-len 512 --batch-sizes 1,16,64 --decode-steps 32 --reps 3 --output-json "$DATA/bench-qwen3-30b-a3b.json"
    grep -hE "model|pp|decode batch" "$LOGS/bench-qwen3-30b-a3b.log"
    step bench-embed .gpu/bin/quiver bench embed --device cuda --dtype bf16 --shape qwen3-embedding-0.6b --tokenizer .gpu/tok --len 512 --inputs 64 --reps 3
    grep -hE "model|embed " "$LOGS/bench-embed.log"
fi
# The server on the GPU: start, one completion over HTTP, stop.
serve_smoke() {
    .gpu/bin/quiver serve --device cuda --dtype bf16 --model "$DATA/models/llama-gpu" --port 8765 --max-lora-rank 16 \
        --lora-modules qv="$DATA/adapters/a-qv-r8" all="$DATA/adapters/b-all-r16-rslora" > "$LOGS/serve.log" 2>&1 &
    local pid=$!
    for _ in $(seq 120); do curl -sf localhost:8765/health >/dev/null && break; sleep 1; done
    local rc=0
    for m in llama-gpu qv all; do
        curl -sf localhost:8765/v1/completions -H 'content-type: application/json' \
            -d "{\"model\": \"$m\", \"prompt\": [101, 2001, 3001, 4001], \"max_tokens\": 8, \"temperature\": 0}" || rc=1
        echo
    done
    kill $pid; wait $pid
    return $rc
}
[ "${GPU_CHECK_SERVE:-$parity}" = 1 ] && step serve-smoke serve_smoke
tail -n 3 "$LOGS/serve-smoke.log"; echo
cp "$DATA"/bench-llama8b.json "$DATA"/bench-llama8b-eager.json "$DATA"/bench-qwen3-30b-a3b.json "$DATA"/ceilings.json "$DATA"/bench-lora-*.json "$OUT"/ 2>/dev/null
grep -hE "rel err|relative error|max \|Δlogprob\||identical|diverge|matched|cosine" "$LOGS/kernel-tests.log" "$LOGS/lora-tests.log" "$LOGS/parity-tests.log" > "$OUT/accuracy.txt" 2>/dev/null
grep -E "test result|panicked" "$LOGS/kernel-tests.log" "$LOGS/lora-tests.log" "$LOGS/parity-tests.log" "$LOGS/overlap-tests.log"
for f in parity-tests overlap-tests; do echo "--- $f"; grep -hE "max \|Δlogprob\| per prompt|requests identical|identical with overlap|steps overlapped|peft on cuda: .*(over every|greedy identical)" "$LOGS/$f.log"; done
tail -n 8 "$LOGS/bench-8b.log"
grep -h "gemv bandwidth" "$LOGS/kernel-tests.log"
[ -f "$DATA/bench-llama8b.json" ] && python3 scripts/gpu_models.py summary "$DATA" 2>&1 | tee "$OUT/summary.txt"
tar -C "$DATA" -czf "$OUT/logs.tgz" logs
exit $status
