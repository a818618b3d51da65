#!/usr/bin/env python3
"""Device-side data for the CUDA checks (run by scripts/gpu-check.sh on the GPU machine).

  gpu_models.py models   OUT TOKDIR [NAMES]  random-weight HF models (fixed seeds) under OUT/models
  gpu_models.py refs     OUT          transformers float32 references under OUT/ref
  gpu_models.py ceilings OUT          measured copy bandwidth and cuBLAS bf16 GEMM rate
  gpu_models.py summary  OUT          ratios of bench-llama8b.json to those ceilings
  gpu_models.py adapters OUT [NAMES]  PEFT adapters on llama-gpu (the CPU suite's shapes) and
                                      rank-16 all-projection adapters of the Llama-8B shape
  gpu_models.py peft-refs OUT         transformers + PEFT float32 references for the llama-gpu adapters

Models (all share the tokenizer files found in TOKDIR, vocab 49152 unless noted):
  llama-gpu     Llama, hidden 2048, 16 layers, 16 heads / 4 KV heads (GQA), untied, f32 weights
  qwen2-gpu     Qwen2 with q/k/v biases, hidden 1536, 12 layers, 12 / 2 heads, untied, f32
  smollm2-rand  SmolLM2-135M's shape (576 hidden, 30 layers, 9 / 3 heads, tied), f32
  llama8b       Llama-3.1-8B's shape (4096, 32 layers, 32 / 8 heads, FFN 14336, vocab 128256),
                bf16, for benchmarks only
  qwen3moe-gpu  Qwen3-MoE: hidden 1024, 8 layers, 16 / 4 heads of 64, 32 experts top 4 (384
                wide, renormalised), f32
  qwen2moe-gpu  Qwen2-MoE: hidden 1024, 8 layers, 16 experts top 2 (512) + a 1024-wide shared
                expert, q/k/v biases, f32
  qwen3-embed-gpu  a bare Qwen3 decoder (hidden 1024, 12 layers) with sentence-transformers
                files for last-token pooling + L2 normalisation; its reference is embeddings

Weights are drawn so that activations stay O(1) and logits are peaked (std 4), so greedy
decoding is not decided by rounding noise: linear std 1/sqrt(in), embeddings std 1, LM head
std 4/sqrt(hidden), o_proj/down_proj additionally / sqrt(2·layers), norm weights 1 ± 0.1,
biases std 0.1.
"""
import json
import math
import os
import shutil
import sys
import time

import torch

TOK_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
PROMPT_LENS = [7, 19, 33, 64, 100, 150, 230, 300]
CONT = 32
TOP_K = 20


def configs():
    from transformers import LlamaConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig
    common = dict(bos_token_id=1, eos_token_id=2, max_position_embeddings=4096, hidden_act="silu")
    return {
        "llama-gpu": (LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                                  num_attention_heads=16, num_key_value_heads=4, rope_theta=500000.0, rms_norm_eps=1e-5,
                                  tie_word_embeddings=False, **common), 11, torch.float32),
        "qwen2-gpu": (Qwen2Config(vocab_size=49152, hidden_size=1536, intermediate_size=4096, num_hidden_layers=12,
                                  num_attention_heads=12, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
                                  tie_word_embeddings=False, use_sliding_window=False, **common), 12, torch.float32),
        "smollm2-rand": (LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                     num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, rms_norm_eps=1e-5,
                                     tie_word_embeddings=True, **common), 13, torch.float32),
        "qwen3moe-gpu": (Qwen3MoeConfig(vocab_size=49152, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
                                        num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32,
                                        num_experts_per_tok=4, moe_intermediate_size=384, norm_topk_prob=True,
                                        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                        use_sliding_window=False, **common), 15, torch.float32),
        "qwen2moe-gpu": (Qwen2MoeConfig(vocab_size=49152, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
                                        num_attention_heads=16, num_key_value_heads=4, num_experts=16, num_experts_per_tok=2,
                                        moe_intermediate_size=512, shared_expert_intermediate_size=1024,
                                        norm_topk_prob=False, rope_theta=1e6, rms_norm_eps=1e-6,
                                        tie_word_embeddings=False, use_sliding_window=False, **common), 16, torch.float32),
        "qwen3-embed-gpu": (Qwen3Config(vocab_size=49152, hidden_size=1024, intermediate_size=3072, num_hidden_layers=12,
                                        num_attention_heads=16, num_key_value_heads=8, head_dim=64, rope_theta=1e6,
                                        rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
                                        **common), 17, torch.float32),
        "llama8b": (LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5,
                                tie_word_embeddings=False,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                                **{**common, "max_position_embeddings": 131072}), 14, torch.bfloat16),
    }


def log(*a):
    print(*a, flush=True)


@torch.no_grad()
def randomize(model, seed, hidden, layers, tied):
    g = torch.Generator(device="cuda").manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim == 1 and name.endswith("norm.weight"):
            v = 1.0 + 0.1 * torch.randn(p.shape, generator=g, device="cuda")
        elif p.ndim == 1:
            v = 0.1 * torch.randn(p.shape, generator=g, device="cuda")
        elif "embed_tokens" in name and tied:
            # Tied: the table is also the LM head, so it gets the head's scale.
            v = (4.0 / math.sqrt(hidden)) * torch.randn(p.shape, generator=g, device="cuda")
        elif "embed_tokens" in name:
            v = torch.randn(p.shape, generator=g, device="cuda")
        elif "lm_head" in name:
            v = (4.0 / math.sqrt(hidden)) * torch.randn(p.shape, generator=g, device="cuda")
        elif name.endswith("mlp.gate.weight"):
            # MoE routers: logits of std 4 keep the top-k well separated, so bf16 rounding of
            # the router's input rarely swaps an expert (a swap is a jump, not a rounding error).
            v = (4.0 / math.sqrt(hidden)) * torch.randn(p.shape, generator=g, device="cuda")
        elif "o_proj" in name or "down_proj" in name:
            # Residual branches scaled by 1/sqrt(2·layers) keep the stream O(1) and the network
            # well conditioned, like a trained model (a chaotic random net amplifies rounding).
            # (The fan-in is the last dim: transformers 5 keeps experts as [E, out, in].)
            v = torch.randn(p.shape, generator=g, device="cuda") / math.sqrt(p.shape[-1] * 2 * layers)
        else:
            v = torch.randn(p.shape, generator=g, device="cuda") / math.sqrt(p.shape[-1])
        # Rounded to bf16 values even in the float32 models: Quiver loads them as bf16, so the
        # float32 reference and Quiver then run on exactly the same weights and the parity
        # numbers measure compute (bf16 activations at GEMM inputs, bf16 KV), not weight rounding.
        p.copy_(v.to(torch.bfloat16).to(p.dtype))


EMBED_MODELS = ["qwen3-embed-gpu"]


def st_files(d, dim):
    """sentence-transformers files: last-token pooling, then Normalize."""
    mods = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    json.dump(mods, open(os.path.join(d, "modules.json"), "w"))
    os.makedirs(os.path.join(d, "1_Pooling"), exist_ok=True)
    json.dump({"word_embedding_dimension": dim, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False, "include_prompt": True},
              open(os.path.join(d, "1_Pooling", "config.json"), "w"))


def cmd_models(out, tokdir, only=None):
    from transformers import AutoModel, AutoModelForCausalLM
    for name, (cfg, seed, dtype) in configs().items():
        if only and name not in only:
            continue
        d = os.path.join(out, "models", name)
        if os.path.exists(os.path.join(d, "config.json")):
            continue
        t = time.time()
        torch.set_default_dtype(dtype)
        with torch.device("cuda"):
            # An embedding model is a bare decoder (no LM head).
            model = (AutoModel if name in EMBED_MODELS else AutoModelForCausalLM).from_config(cfg)
        torch.set_default_dtype(torch.float32)
        randomize(model, seed, cfg.hidden_size, cfg.num_hidden_layers, cfg.tie_word_embeddings)
        model.save_pretrained(d, safe_serialization=True, max_shard_size="4GB")
        for f in TOK_FILES:
            if os.path.exists(os.path.join(tokdir, f)):
                shutil.copy(os.path.join(tokdir, f), d)
        if name in EMBED_MODELS:
            st_files(d, cfg.hidden_size)
        n = sum(p.numel() for p in model.parameters())
        del model
        torch.cuda.empty_cache()
        log(f"model {name}: {n / 1e6:.0f}M params, {dtype}, {time.time() - t:.1f}s")


@torch.no_grad()
def greedy_cases(model, vocab, seed):
    """One case per PROMPT_LENS entry: random prompt ids (fixed seed), CONT greedy tokens, and
    the top-TOP_K logprobs (f64 log-softmax) at every position of prompt + continuation; for MoE
    models each position's router top-k margin (reference.router_margins)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from reference import router_margins
    g = torch.Generator().manual_seed(seed)
    cases = []
    for i, n in enumerate(PROMPT_LENS):
        ids = torch.randint(100, vocab - 100, (n,), generator=g).tolist()
        seq = list(ids)
        for _ in range(CONT):
            logits = model(input_ids=torch.tensor([seq], device="cuda")).logits[0, -1]
            seq.append(int(torch.argmax(logits)))
        lp = torch.log_softmax(model(input_ids=torch.tensor([seq], device="cuda")).logits[0].double(), dim=-1)
        top = torch.topk(lp, TOP_K, dim=-1)
        case = {"name": f"p{i}-{n}", "prompt_ids": ids, "continuation_ids": seq[n:],
                "top_ids": top.indices.tolist(), "top_logprobs": top.values.float().tolist()}
        margins = router_margins(model, seq, device="cuda")
        if margins is not None:
            case["router_margin"] = margins
        cases.append(case)
    return cases


@torch.no_grad()
def cmd_refs(out):
    from transformers import AutoModelForCausalLM
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    os.makedirs(os.path.join(out, "ref"), exist_ok=True)
    for name in ["llama-gpu", "qwen2-gpu", "smollm2-rand", "qwen3moe-gpu", "qwen2moe-gpu"]:
        path = os.path.join(out, "ref", f"{name}.json")
        # Only the models this run made (`models ... llama-gpu,qwen2-gpu` leaves the MoE ones out).
        if os.path.exists(path) or not os.path.isdir(os.path.join(out, "models", name)):
            continue
        t = time.time()
        model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "models", name), dtype=torch.float32,
                                                     attn_implementation="eager").cuda().eval()
        cases = greedy_cases(model, model.config.vocab_size, 99)
        with open(path, "w") as f:
            json.dump({"model": name, "cases": cases}, f)
        del model
        torch.cuda.empty_cache()
        log(f"ref {name}: {len(cases)} prompts, {time.time() - t:.1f}s")


@torch.no_grad()
def cmd_embed_refs(out):
    """Embeddings of random token inputs (PROMPT_LENS long), transformers float32 on the GPU:
    the last token's final-normed hidden state, L2-normalised."""
    from transformers import AutoModel
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    for name in EMBED_MODELS:
        path = os.path.join(out, "ref", f"{name}.json")
        if os.path.exists(path) or not os.path.isdir(os.path.join(out, "models", name)):
            continue
        model = AutoModel.from_pretrained(os.path.join(out, "models", name), dtype=torch.float32, attn_implementation="eager").cuda().eval()
        g = torch.Generator().manual_seed(98)
        cases = []
        for i, n in enumerate(PROMPT_LENS):
            ids = torch.randint(100, model.config.vocab_size - 100, (n,), generator=g).tolist()
            h = model(torch.tensor([ids], device="cuda")).last_hidden_state[0, -1].double()
            cases.append({"name": f"e{i}-{n}", "ids": ids, "embedding": (h / h.norm()).float().tolist()})
        with open(path, "w") as f:
            json.dump({"model": name, "cases": cases}, f)
        del model
        torch.cuda.empty_cache()
        log(f"ref {name}: {len(cases)} embeddings")


def timed(fn, reps):
    """Median milliseconds of fn() over reps, CUDA events, after two warm-ups."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


@torch.no_grad()
def cmd_ceilings(out):
    nbytes = 4 << 30
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), 20)
    copy_tb_s = 2 * nbytes / (ms / 1e3) / 1e12
    del src, dst
    torch.cuda.empty_cache()
    # The four GEMMs of one Llama-3.1-8B layer at a 2048-token prefill, cuBLAS through PyTorch,
    # random data, several weight sets rotated so the L2 holds none of them.
    m, h, kv, ffn = 2048, 4096, 1024, 14336
    shapes = [(h + 2 * kv, h), (h, h), (2 * ffn, h), (h, ffn)]
    sets = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for (n, k) in shapes] for _ in range(3)]
    xs = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for (_, k) in shapes}
    state = {"i": 0}

    def layer():
        ws = sets[state["i"] % 3]
        state["i"] += 1
        for w in ws:
            torch.matmul(xs[w.shape[1]], w.t())

    ms = timed(layer, 30)
    flops = sum(2 * m * n * k for (n, k) in shapes)
    gemm_tflops = flops / (ms / 1e3) / 1e12
    res = {"copy_tb_s": copy_tb_s, "gemm_bf16_tflops_pp2048_layer": gemm_tflops, "gpu": torch.cuda.get_device_name(0)}
    with open(os.path.join(out, "ceilings.json"), "w") as f:
        json.dump(res, f, indent=1)
    log(f"ceilings: copy {copy_tb_s:.2f} TB/s (read+write), cuBLAS bf16 {gemm_tflops:.0f} TFLOP/s on one 8B layer at pp2048")


def cmd_summary(out):
    """The table gpu-check.sh prints last: our 8B numbers against the ceilings measured above."""
    ceil = json.load(open(os.path.join(out, "ceilings.json")))
    bench = json.load(open(os.path.join(out, "bench-llama8b.json")))
    cfg, _, _ = configs()["llama8b"]
    h, ffn, nl, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    layer = h * (h + 2 * kv) + h * h + 3 * ffn * h
    weight_bytes = 2 * (nl * layer + vocab * h)  # what a decode step must stream (bf16)
    bound_ms = weight_bytes / (ceil["copy_tb_s"] * 1e12) * 1e3
    log("")
    log(f"GPU: {ceil['gpu']}; copy {ceil['copy_tb_s']:.2f} TB/s; cuBLAS bf16 {ceil['gemm_bf16_tflops_pp2048_layer']:.0f} TFLOP/s")
    log(f"Llama-3.1-8B shape, bf16 weights {weight_bytes / 1e9:.2f} GB -> weight-streaming bound {bound_ms:.2f} ms/step")
    log(f"{'measure':<22}{'tok/s':>12}{'ms/step':>10}{'vs bound':>10}")
    for row in bench["decode"]:
        step_ms = row["batch"] / row["tok_s"] * 1e3
        log(f"{'decode batch ' + str(row['batch']):<22}{row['tok_s']:>12.1f}{step_ms:>10.2f}{bound_ms / step_ms:>10.2f}")
    pp = bench["prefill"]
    n = pp["prompt_len"]
    ms = n / pp["tok_s"] * 1e3
    tflops = 2 * nl * layer * n / (ms / 1e3) / 1e12
    log(f"{'prefill pp' + str(n):<22}{pp['tok_s']:>12.1f}{ms:>10.1f}{tflops / ceil['gemm_bf16_tflops_pp2048_layer']:>10.2f}"
        f"  ({tflops:.0f} TFLOP/s in the linears vs cuBLAS)")


# name -> (LoraConfig kwargs, seed, rho = target RMS(delta) / RMS(base output) per site): the
# shapes the CPU parity suite covers (scripts/reference.py SMOL_ADAPTERS), on the 16-layer model.
GPU_ADAPTERS = {
    "a-qv-r8": (dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]), 31, 0.2),
    "b-all-r16-rslora": (dict(r=16, lora_alpha=16, target_modules="all-linear", use_rslora=True), 32, 0.08),
    "c-patterns": (dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                        rank_pattern={"q_proj": 4, "down_proj": 12}, alpha_pattern={"o_proj": 32}), 33, 0.06),
    "d-embed-head": (dict(r=8, lora_alpha=16, target_modules=["embed_tokens", "lm_head", "q_proj", "up_proj"]), 34, 0.1),
    "e-qk-r4": (dict(r=4, lora_alpha=8, target_modules=["k_proj", "o_proj", "gate_proj"], layers_to_transform=[0, 1, 2, 10, 15],
                     layers_pattern="layers"), 35, 0.3),
}
# Rank-16 adapters on all seven projections of the 8B shape, for the serving benchmarks (more
# names than files are served by giving one file several names).
LORA8B_FILES = 4


@torch.no_grad()
def cmd_adapters(out, only=None):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from reference import calibrate_lora  # the CPU suite's calibration, same formulas
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    import copy
    adir = os.path.join(out, "adapters")
    todo = [n for n in GPU_ADAPTERS if not os.path.exists(os.path.join(adir, n, "adapter_model.safetensors")) and (not only or "llama-gpu" in only)]
    if todo:
        base = AutoModelForCausalLM.from_pretrained(os.path.join(out, "models", "llama-gpu"), dtype=torch.float32)
        for name in todo:
            t = time.time()
            kw, seed, rho = GPU_ADAPTERS[name]
            cfg = LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, bias="none", init_lora_weights=False, **kw)
            model = get_peft_model(copy.deepcopy(base), cfg)
            n = calibrate_lora(model, seed, rho)
            # bf16-representable like the base weights: Quiver holds adapters in bf16 on the GPU,
            # so the float32 reference then runs on exactly its values.
            for pn, p in model.named_parameters():
                if "lora_" in pn:
                    p.copy_(p.to(torch.bfloat16).to(p.dtype))
            model.save_pretrained(os.path.join(adir, name), safe_serialization=True, save_embedding_layers=False)
            del model
            log(f"adapter {name}: {n} LoRA sites, {time.time() - t:.1f}s")
    from safetensors.torch import save_file
    cfg8, _, _ = configs()["llama8b"]
    h, ffn, nl = cfg8.hidden_size, cfg8.intermediate_size, cfg8.num_hidden_layers
    kv = cfg8.num_key_value_heads * (h // cfg8.num_attention_heads)
    dims = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h), "gate_proj": (h, ffn), "up_proj": (h, ffn), "down_proj": (ffn, h)}
    for i in range(LORA8B_FILES):
        d = os.path.join(adir, f"lora8b-r16-{i}")
        if os.path.exists(os.path.join(d, "adapter_model.safetensors")):
            continue
        os.makedirs(d, exist_ok=True)
        g = torch.Generator(device="cuda").manual_seed(100 + i)
        tensors = {}
        for layer in range(nl):
            for mname, (din, dout) in dims.items():
                block = "self_attn" if mname in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                p = f"base_model.model.model.layers.{layer}.{block}.{mname}"
                tensors[f"{p}.lora_A.weight"] = ((torch.rand(16, din, generator=g, device="cuda") * 2 - 1) / din ** 0.5).to(torch.bfloat16).cpu()
                tensors[f"{p}.lora_B.weight"] = (0.01 * torch.randn(dout, 16, generator=g, device="cuda")).to(torch.bfloat16).cpu()
        save_file(tensors, os.path.join(d, "adapter_model.safetensors"))
        with open(os.path.join(d, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": list(dims), "bias": "none"}, f)
        log(f"adapter lora8b-r16-{i}: 8B shape, rank 16, all 7 projections")


@torch.no_grad()
def cmd_peft_refs(out):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    for name in GPU_ADAPTERS:
        path = os.path.join(out, "ref", f"llama-gpu-{name}.json")
        if os.path.exists(path):
            continue
        t = time.time()
        base = AutoModelForCausalLM.from_pretrained(os.path.join(out, "models", "llama-gpu"), dtype=torch.float32, attn_implementation="eager")
        model = PeftModel.from_pretrained(base, os.path.join(out, "adapters", name)).cuda().eval()
        cases = greedy_cases(model, base.config.vocab_size, 77)
        with open(path, "w") as f:
            json.dump({"model": "llama-gpu", "adapter": name, "cases": cases}, f)
        del model, base
        torch.cuda.empty_cache()
        log(f"peft ref llama-gpu + {name}: {len(cases)} prompts, {time.time() - t:.1f}s")


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "models":
        cmd_models(sys.argv[2], sys.argv[3], sys.argv[4].split(",") if len(sys.argv) > 4 else None)
    elif cmd == "refs":
        cmd_refs(sys.argv[2])
        cmd_embed_refs(sys.argv[2])
    elif cmd == "ceilings":
        cmd_ceilings(sys.argv[2])
    elif cmd == "summary":
        cmd_summary(sys.argv[2])
    elif cmd == "adapters":
        cmd_adapters(sys.argv[2], sys.argv[3].split(",") if len(sys.argv) > 3 else None)
    elif cmd == "peft-refs":
        cmd_peft_refs(sys.argv[2])
    else:
        sys.exit(__doc__)
