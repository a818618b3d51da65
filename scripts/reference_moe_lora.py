#!/usr/bin/env python3
"""LoRA references on the tiny mixture-of-experts models (issue 25 part 3): PEFT adapters on
attention, on the experts and on Qwen2-MoE's shared expert, and their logprobs from transformers
+ PEFT (float32, CPU).

    reference_moe_lora.py all OUT     (main venv, transformers 4.57: experts are nn.Linear modules,
                                      so PEFT writes one LoRA pair per expert and projection)
        OUT/adapters/<name>           see MOE_ADAPTERS
        OUT/ref/<name>.json           same shape as reference.py's (ADAPTER_PROMPTS only)
    reference_moe_lora.py params OUT  (scripts/setup-venv5.sh's venv, transformers 5: experts are
                                      fused 3-D parameters; PEFT's `target_parameters`)
        OUT/adapters/<name>, OUT/ref/<name>.json for PARAM_ADAPTERS

The models are reference.py's (made first if missing). Every step skips outputs that exist.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import (ADAPTER_PROMPTS, cmd_models, cmd_prompts, load_model, log, logprobs, make_adapter, rel)  # noqa: E402

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
# name -> (model, LoraConfig kwargs, seed, rho). Ranks stay below the tests' pool rank (16);
# rho as in reference.py: deltas large enough to move logprobs and greedy text, small enough to
# stay fluent-ish on random weights.
MOE_ADAPTERS = {
    # (a) attention only
    "qwen3moe-attn-r8": ("tiny-qwen3moe", dict(r=8, lora_alpha=16, target_modules=ATTN), 31, 0.2),
    # (b) experts only (the suffix match reaches every `mlp.experts.{e}.*_proj`), a lower rank
    # for down_proj
    "qwen3moe-experts-r8": ("tiny-qwen3moe", dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"],
                                                  rank_pattern={"down_proj": 4}), 32, 0.3),
    # (c) attention + experts + the shared expert, rsLoRA
    "qwen2moe-all-r8-rslora": ("tiny-qwen2moe", dict(r=8, lora_alpha=16, use_rslora=True,
                                                    target_modules=ATTN + ["gate_proj", "up_proj", "down_proj"]), 33, 0.2),
    # Mixtral's names: w1 (gate), w3 (up), w2 (down)
    "mixtral-experts-r4": ("tiny-mixtral", dict(r=4, lora_alpha=8, target_modules=["q_proj", "w1", "w2", "w3"]), 34, 0.3),
}
# transformers 5 keeps experts as `[E, 2·inter, hidden]` / `[E, hidden, inter]` parameters.
PARAM_ADAPTERS = {
    "qwen3moe-params-r8": ("tiny-qwen3moe", dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
                           35, 0.3),
}


@torch.no_grad()
def calibrate(model, seed, rho):
    """Like reference.calibrate_lora (RMS(delta) ~= rho * RMS(base output)), for LoRA layers on
    modules and on parameters (whose base weight is the wrapped parameter)."""
    from peft.tuners.lora import LoraLayer
    g = torch.Generator().manual_seed(seed)
    n = 0
    for _, m in model.named_modules():
        if not isinstance(m, LoraLayer):
            continue
        base = m.get_param() if hasattr(m, "get_param") else m.get_base_layer().weight
        sw = base.float().std().item()
        for an in m.lora_A.keys():
            r, s = m.r[an], m.scaling[an]
            A, B = m.lora_A[an].weight, m.lora_B[an].weight
            fan_in = A.shape[1]
            A.copy_((torch.rand(A.shape, generator=g) * 2 - 1) / fan_in ** 0.5)
            B.copy_(torch.randn(B.shape, generator=g) * (rho * sw * (3 * fan_in / r) ** 0.5 / s))
            # bf16-representable, so a device whose LoRA pool is bf16 (CUDA) holds exactly the
            # adapter PEFT runs here: the GPU test then differs from this reference by its KV
            # cache's rounding alone, which matters on MoE models, where a router near-tie turns
            # small noise into another expert.
            A.copy_(A.bfloat16().float())
            B.copy_(B.bfloat16().float())
            n += 1
    return n


def make(out, name, mname, kw, seed, rho):
    d = os.path.join(out, "adapters", name)
    if os.path.exists(os.path.join(d, "adapter_model.safetensors")):
        log(f"skip {rel(d)} (exists)")
        return
    # target_parameters keeps its order (make_adapter sorts target_modules only): PEFT nests
    # the wrappers in it.
    make_adapter(load_model(os.path.join(out, "models", mname))[0], d, kw, seed, rho, mname, calibrate=calibrate)


def run(out, table):
    ppath = cmd_prompts(out)
    prompts = json.load(open(ppath))
    if any(not os.path.exists(os.path.join(out, "models", m, "model.safetensors")) for m, *_ in table.values()):
        cmd_models(out)
    for name, (mname, kw, seed, rho) in table.items():
        make(out, name, mname, kw, seed, rho)
        logprobs(os.path.join(out, "models", mname), None, prompts, os.path.join(out, "ref", f"{name}.json"),
                 adapter=os.path.join(out, "adapters", name), names=ADAPTER_PROMPTS)


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("all", "params"):
        sys.exit(__doc__)
    run(sys.argv[2], MOE_ADAPTERS if sys.argv[1] == "all" else PARAM_ADAPTERS)


if __name__ == "__main__":
    main()
