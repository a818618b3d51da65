#!/usr/bin/env bash
# A/B of the CUDA LoRA switches in real 8B-shaped steps, on the GPU machine after
# scripts/gpu-lora.sh made the model (same $QUIVER_GPU_DATA): one `quiver bench lora --part step`
# per setting, each an environment assignment (or "default"), printing the step-cost table of
# each. The ratios compare within a run (base and adapter steps alternate); compare settings by
# their ratios, not their absolute times.
#
#   GPU_AB          settings, space-separated (default: the defaults, each switch off, the LoRA
#                   epilogue off, the opt-in deferred o/down deltas, the one-row GEMV with LoRA on
#                   fewer blocks per SM, the one-launch delta only up to 16 rows, two kernel
#                   tuning constants, LoRA tails (long prompts' deltas inside the base GEMM),
#                   then the defaults again). A setting may also be
#                   QUIVER_CUDA_NVRTC_DEFINES=NAME=VALUE (one kernel tuning constant, no rebuild).
#   GPU_AB_ROWS     decode rows (default "1,16,64,256"); GPU_AB_PREFILL prompt rows (default 2048)
set -uo pipefail
cd "$(dirname "$0")/.."
DATA=${QUIVER_GPU_DATA:-/tmp/quiver-gpu}
LOGS=$DATA/logs
mkdir -p "$LOGS"
. scripts/gpu-env.sh
settings=${GPU_AB:-default QUIVER_CUDA_LORA_AHEAD=0 QUIVER_CUDA_LORA_ROW1=beside QUIVER_CUDA_LORA_GEMM_FIRST=0 QUIVER_CUDA_LORA_EPILOGUE=0 QUIVER_CUDA_LORA_EPILOGUE=2 QUIVER_CUDA_GEMV_LORA_BLOCKS=4 QUIVER_CUDA_GEMV_LORA_BLOCKS=3 QUIVER_CUDA_LORA_ROWS_MAX=16 QUIVER_CUDA_NVRTC_DEFINES=LEP_MIN_BLOCKS=6 QUIVER_CUDA_NVRTC_DEFINES=LRW_MIN_BLOCKS=3 QUIVER_CUDA_LORA_TAIL=0 QUIVER_CUDA_LORA_TAIL=ahead QUIVER_CUDA_LORA_TAIL=rows default}
[ -f "$DATA/models/llama8b/config.json" ] || python3 scripts/gpu_models.py models "$DATA" .gpu/tok llama8b > "$LOGS/ab-models.log" 2>&1
for s in $settings; do
    env=(); [ "$s" = default ] || env=("$s")
    log="$LOGS/ab-${s//[^A-Za-z0-9_]/_}.log"
    env "${env[@]}" .gpu/bin/quiver bench lora --device cuda --dtype bf16 --part step --model "$DATA/models/llama8b" --ranks 16 \
        --adapters 1,16 --rows "${GPU_AB_ROWS:-1,16,64,256}" --prefill "${GPU_AB_PREFILL:-2048}" --backends auto --steps 15 > "$log" 2>&1 \
        || { echo "== $s: FAILED"; tail -n 20 "$log"; continue; }
    echo "== $s"
    grep -hE "^(backend|auto|CUDA graphs)" "$log"
done
