#!/usr/bin/env bash
# LoRA tails on the GPU machine in one call (docs/lora-in-the-gemm.md; opt-in with
# QUIVER_CUDA_LORA_TAIL=1; build here with `scripts/gpu-build.sh`, carry .gpu-pack), most
# telling first (a machine can be taken back mid-call): the LoRA kernel checks
# (cuda_lora_tails_match_cpu among them); the step cost of adapters with tails against without,
# in one process each (base and adapter steps alternate, so compare the cost columns): 1 adapter
# (a one-slot pool, which the tails hold whole, so recorded decode steps take them) and 16 (a
# 16-slot pool: qkv's tail holds 10, so decode steps keep the kernels and the 2048-token
# prefill's 128-row runs show the prompts' path); every kernel check; then PEFT parity as it is,
# with tails on and with room on weights and GEMM inputs, and the overlapped engine with tails.
#
#   GPU_TAIL_PARITY=0  skip the parity models and tests (kernel checks and step costs only)
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu-step.sh
step lora-tests .gpu/bin/cuda_lora --ignored --test-threads 1 --nocapture
# The step costs first: the machine may be taken back mid-call, and they say whether tails pay.
step models python3 scripts/gpu_models.py models "$DATA" .gpu/tok llama8b
for ads in 1 16; do
    for tail in 0 1; do
        step "step-a$ads-tail$tail" env QUIVER_CUDA_LORA_TAIL=$tail .gpu/bin/quiver bench lora --device cuda --dtype bf16 --part step \
            --model "$DATA/models/llama8b" --ranks 16 --adapters $ads --rows 1,16,64,256 --prefill 2048 --backends auto --steps 15
        echo "-- $ads adapter(s), tails $tail"
        grep -hE "^(auto|CUDA graphs)" "$LOGS/step-a$ads-tail$tail.log"
    done
done
step kernel-tests .gpu/bin/cuda_kernels --ignored --skip gemv_bandwidth_vs_copy --skip collectives --test-threads 1
if [ "${GPU_TAIL_PARITY:-1}" = 1 ]; then
    step models-all python3 scripts/gpu_models.py models "$DATA" .gpu/tok
    step refs python3 scripts/gpu_models.py refs "$DATA"
    step adapters python3 scripts/gpu_models.py adapters "$DATA"
    step peft-refs python3 scripts/gpu_models.py peft-refs "$DATA"
    step parity .gpu/bin/cuda_parity --ignored --skip moe_expert_adapters_on_cuda --test-threads 1 --nocapture
    step parity-tail env QUIVER_CUDA_LORA_TAIL=1 .gpu/bin/cuda_parity --ignored --skip moe_expert_adapters_on_cuda --test-threads 1 --nocapture
    step overlap-tail env QUIVER_CUDA_LORA_TAIL=1 .gpu/bin/cuda_overlap --ignored --test-threads 1 --nocapture
    step parity-room env QUIVER_CUDA_WEIGHT_ROOM=24 QUIVER_CUDA_INPUT_ROOM=40 .gpu/bin/cuda_parity --ignored --skip moe_expert_adapters_on_cuda --test-threads 1
fi
exit $status
