#!/usr/bin/env bash
# LoRA tails on the GPU machine in one call (docs/lora-in-the-gemm.md; on by default for long
# prompts, QUIVER_CUDA_LORA_TAIL=0 off, =rows decode steps too; build here with
# `scripts/gpu-build.sh`, carry .gpu-pack), most telling first (a machine can be taken back
# mid-call): the LoRA kernel checks (cuda_lora_tails_match_cpu among them) with the opt-in
# single shrink GEMM (QUIVER_CUDA_LORA_TAIL_ONE_SHRINK=1); the step cost of one adapter (a
# one-slot pool: recorded decode steps can take the tails) with the default, with that option
# (one 2048-token prompt: one run through the tail) and with decode rows through the tails of
# qkv and gate_up (QUIVER_CUDA_LORA_TAIL=ahead); PEFT parity with both options; then the step
# costs with tails off and with 16 adapters (16 prompts of 128 rows: shorter than the tails
# take), in one process each (base and adapter steps alternate, so compare the cost columns);
# the overlapped engine, every kernel check, and parity with room on weights and GEMM inputs.
#
#   GPU_TAIL_PARITY=0  skip the parity models and tests (kernel checks and step costs only)
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu-step.sh
one=QUIVER_CUDA_LORA_TAIL_ONE_SHRINK=1
step lora-tests env $one .gpu/bin/cuda_lora --ignored --test-threads 1 --nocapture
step models python3 scripts/gpu_models.py models "$DATA" .gpu/tok llama8b
step_cost() { # name, adapters, env settings...
    local name=$1 ads=$2; shift 2
    step "step-a$ads-$name" env "$@" .gpu/bin/quiver bench lora --device cuda --dtype bf16 --part step \
        --model "$DATA/models/llama8b" --ranks 16 --adapters $ads --rows 1,16,64,256 --prefill 2048 --backends auto --steps 15
    echo "-- $ads adapter(s), $*"
    grep -hE "^(auto|CUDA graphs)" "$LOGS/step-a$ads-$name.log"
}
step_cost default 1 QUIVER_CUDA_LORA_TAIL=1
step_cost one-shrink 1 $one
step_cost ahead 1 QUIVER_CUDA_LORA_TAIL=ahead
parity=${GPU_TAIL_PARITY:-1}
if [ "$parity" = 1 ]; then
    step models-all python3 scripts/gpu_models.py models "$DATA" .gpu/tok
    step refs python3 scripts/gpu_models.py refs "$DATA"
    step adapters python3 scripts/gpu_models.py adapters "$DATA"
    step peft-refs python3 scripts/gpu_models.py peft-refs "$DATA"
    step parity env $one QUIVER_CUDA_LORA_TAIL=ahead .gpu/bin/cuda_parity --ignored --skip moe_expert_adapters_on_cuda --test-threads 1 --nocapture
fi
step_cost tails-off 1 QUIVER_CUDA_LORA_TAIL=0
step_cost default 16 QUIVER_CUDA_LORA_TAIL=1
step_cost ahead 16 QUIVER_CUDA_LORA_TAIL=ahead
step_cost tails-off 16 QUIVER_CUDA_LORA_TAIL=0
[ "$parity" = 1 ] && step overlap env QUIVER_CUDA_LORA_TAIL=ahead .gpu/bin/cuda_overlap --ignored --test-threads 1 --nocapture
step kernel-tests .gpu/bin/cuda_kernels --ignored --skip gemv_bandwidth_vs_copy --skip collectives --test-threads 1
[ "$parity" = 1 ] && step parity-room env QUIVER_CUDA_WEIGHT_ROOM=24 QUIVER_CUDA_INPUT_ROOM=40 .gpu/bin/cuda_parity --ignored --skip moe_expert_adapters_on_cuda --test-threads 1
exit $status
