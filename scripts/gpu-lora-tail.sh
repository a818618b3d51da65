#!/usr/bin/env bash
# LoRA tails on the GPU machine in one call (docs/lora-in-the-gemm.md; on by default for long
# prompts, QUIVER_CUDA_LORA_TAIL=0 off, =rows decode steps too; build here with
# `scripts/gpu-build.sh`, carry .gpu-pack), most telling first (a machine can be taken back
# mid-call): the LoRA kernel checks (cuda_lora_tails_match_cpu among them) with the three
# opt-in tail paths on (the single shrink GEMM of a long prompt, QUIVER_CUDA_LORA_TAIL_ONE_SHRINK;
# eager steps of short runs through the tail, QUIVER_CUDA_LORA_TAIL_EAGER; decode rows through
# the tails of qkv and gate_up, QUIVER_CUDA_LORA_TAIL=ahead); the step costs that say whether
# each pays: one adapter (a one-slot pool: recorded decode steps can take the tails; one
# 2048-token prompt, one run through the tail) with the default and with each option, and 16
# adapters (a 2048-token step of 16 prompts of 128 rows) eager against tails off; PEFT parity
# with all three; then the rest of the step costs, the overlapped engine, every kernel check,
# and parity with room on weights and GEMM inputs. Each step cost is one process (base and
# adapter steps alternate, so compare the cost columns).
#
#   GPU_TAIL_PARITY=0  skip the parity models and tests (kernel checks and step costs only)
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu-step.sh
one=QUIVER_CUDA_LORA_TAIL_ONE_SHRINK=1 eager=QUIVER_CUDA_LORA_TAIL_EAGER=1 ahead=QUIVER_CUDA_LORA_TAIL=ahead
step lora-tests env $one $eager $ahead .gpu/bin/cuda_lora --ignored --test-threads 1 --nocapture
step models python3 scripts/gpu_models.py models "$DATA" .gpu/tok llama8b
step_cost() { # name, adapters, env settings...
    local name=$1 ads=$2; shift 2
    step "step-a$ads-$name" env "$@" .gpu/bin/quiver bench lora --device cuda --dtype bf16 --part step \
        --model "$DATA/models/llama8b" --ranks 16 --adapters $ads --rows 1,16,64,256 --prefill 2048 --backends auto --steps 15
    echo "-- $ads adapter(s), $*"
    grep -hE "^(auto|CUDA graphs|activation)" "$LOGS/step-a$ads-$name.log"
}
step_cost default 1 QUIVER_CUDA_LORA_TAIL=1
step_cost one-shrink 1 $one
step_cost ahead 1 $ahead
step_cost eager 16 $eager
step_cost tails-off 16 QUIVER_CUDA_LORA_TAIL=0
parity=${GPU_TAIL_PARITY:-1}
if [ "$parity" = 1 ]; then
    step models-all python3 scripts/gpu_models.py models "$DATA" .gpu/tok
    step refs python3 scripts/gpu_models.py refs "$DATA"
    step adapters python3 scripts/gpu_models.py adapters "$DATA"
    step peft-refs python3 scripts/gpu_models.py peft-refs "$DATA"
    step parity env $one $eager $ahead .gpu/bin/cuda_parity --ignored --skip moe_expert_adapters_on_cuda --test-threads 1 --nocapture
fi
step_cost tails-off 1 QUIVER_CUDA_LORA_TAIL=0
step_cost default 16 QUIVER_CUDA_LORA_TAIL=1
step_cost ahead 16 $ahead
[ "$parity" = 1 ] && step overlap env $one $eager $ahead .gpu/bin/cuda_overlap --ignored --test-threads 1 --nocapture
step kernel-tests .gpu/bin/cuda_kernels --ignored --skip gemv_bandwidth_vs_copy --skip collectives --test-threads 1
[ "$parity" = 1 ] && step parity-room env QUIVER_CUDA_WEIGHT_ROOM=24 QUIVER_CUDA_INPUT_ROOM=40 .gpu/bin/cuda_parity --ignored --skip moe_expert_adapters_on_cuda --test-threads 1
exit $status
