#!/usr/bin/env bash
# Tensor parallelism on CUDA (issue 24) on the GPU machine, after `scripts/gpu-build.sh` here
# (run this there with .gpu carried). On a machine with fewer GPUs than ranks the ranks share
# GPUs (QUIVER_CUDA_TP_SHARE_GPUS=1): that checks the sharded path and the collectives, not
# speed.
#
# Steps: the random llama-gpu / qwen2-gpu models, their float32 references and llama-gpu's PEFT
# adapters (scripts/gpu_models.py); the peer collectives alone (cuda_kernels); the tiny models
# unsharded on CUDA against the CPU, then the sharded forward against one rank in f32
# (tensor_parallel); then cuda_parity's dense tests with every model split over TP_SIZES ranks:
# bf16 against transformers + PEFT in float32, the engine (4 adapters + base, 40 concurrent
# requests; slot churn) against the whole model run alone. A summary is printed last. The data
# steps skip what exists, so a second call on the same machine may run other TP_SIZES.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
DATA=${QUIVER_GPU_DATA:-/tmp/quiver-gpu}
# Logs go straight to $OUT, so a call cut short still brings back what ran.
LOGS=$OUT/tp-logs
mkdir -p "$OUT" "$LOGS"
export QUIVER_GPU_DATA=$DATA PYTHONUNBUFFERED=1 QUIVER_CUDA_TP_SHARE_GPUS=1
. scripts/gpu-env.sh
status=0
summary=()
step() { # name, command...
    local name=$1; shift
    local t0=$SECONDS
    if "$@" >"$LOGS/$name.log" 2>&1; then r=ok; else r=FAILED; status=1; fi
    summary+=("[$r] $name ($((SECONDS - t0)) s)")
    echo "[$r] $name ($((SECONDS - t0)) s)"
    [ $r = ok ] || tail -n 30 "$LOGS/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$LOGS/nvidia-smi.log" 2>&1
step models python3 scripts/gpu_models.py models "$DATA" .gpu/tok llama-gpu,qwen2-gpu${GPU_TP_MORE_MODELS:+,$GPU_TP_MORE_MODELS}
step refs python3 scripts/gpu_models.py refs "$DATA"
step adapters python3 scripts/gpu_models.py adapters "$DATA" llama-gpu
step peft-refs python3 scripts/gpu_models.py peft-refs "$DATA"
step cuda-collectives .gpu/bin/cuda_kernels --ignored collectives_sum_in_rank_order_on_every_rank --test-threads 1 --nocapture
step tiny-vs-cpu .gpu/bin/tensor_parallel --ignored cuda_unsharded_tiny_models_match_the_cpu --test-threads 1 --nocapture
step tp-tiny-f32 .gpu/bin/tensor_parallel --ignored cuda_tensor_parallel --test-threads 1 --nocapture
for tp in ${TP_SIZES:-2 4 8}; do
    tests="random_llama_gqa_bf16_matches_transformers peft_adapters_mixed_batch_on_cuda_match_transformers engine_batched_equals_alone_on_cuda engine_slot_churn_on_cuda"
    # qwen2-gpu has 12 query heads: 8 ranks do not divide them.
    [ "$tp" -le 4 ] && tests="$tests random_qwen2_biases_bf16_matches_transformers"
    QUIVER_TEST_TP=$tp step "parity-tp$tp" .gpu/bin/cuda_parity --ignored --exact $tests --test-threads 1 --nocapture
done
echo "== summary"
cat "$LOGS/nvidia-smi.log"
grep -hE "ranks, .* elements" "$LOGS/cuda-collectives.log"
grep -hE "against the CPU|TP [0-9]+: max|by step" "$LOGS/tiny-vs-cpu.log" "$LOGS/tp-tiny-f32.log"
for tp in ${TP_SIZES:-2 4 8}; do
    echo "-- TP $tp"
    grep -hE "median|over every position|greedy identical|requests identical" "$LOGS/parity-tp$tp.log"
done
printf '%s\n' "${summary[@]}"
exit $status
