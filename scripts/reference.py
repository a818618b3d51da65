#!/usr/bin/env python3
"""Reference generator: Hugging Face transformers + PEFT, float32, CPU, deterministic.

Writes everything under an output dir (default .cache/ref):
  prompts.json                       default prompt set  [{"name", "text", "chat"}]
  models/tiny-{qwen2,llama3,mistral} tiny random-weight HF safetensors models (+ SmolLM2 tokenizer)
  models/tiny-{qwen3,mixtral,qwen3moe,qwen3moe-dense1,qwen2moe,olmoe}  the same for Qwen3 and the MoE families
  models/tiny-*.gguf                 some of those written as GGUF (see TINY_GGUF)
  models/smollm2-hf                  the SmolLM2 GGUF as dequantized by transformers, saved as HF safetensors
  adapters/<name>                    PEFT LoRA adapters (B non-zero, calibrated), save_pretrained layout
  ref/<model>[-<adapter>].json       greedy 32-token continuation + teacher-forced top-20 logprobs

Subcommands: prompts OUT | models OUT | adapters OUT | logprobs --model ... | all OUT.
Every step skips work whose output file already exists (delete it to regenerate).
"""
import argparse
import copy
import json
import os
import sys
import time

import torch

# One intra-op thread by default: on a small, shared CPU box OpenMP thread teams spin against
# other load and run ~20x slower than a single thread. Override with QUIVER_REF_THREADS.
torch.set_num_threads(int(os.environ.get("QUIVER_REF_THREADS", "1")))
torch.use_deterministic_algorithms(True, warn_only=True)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CACHE = os.environ.get("QUIVER_CACHE", os.path.join(REPO, ".cache"))
GGUF_DIR = os.path.join(CACHE, "models")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

N_NEW = 32   # greedy continuation length (EOS is not a stop condition)
TOP_K = 20   # logprobs recorded per position

# Prompts used for the adapter references (subset: keeps `all` fast; has a chat and a long one).
ADAPTER_PROMPTS = ["short-plain", "chat-short", "code-plain", "unicode-plain", "long-plain"]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def rel(p):
    """Path as recorded in outputs: relative to the cwd when below it (no machine paths)."""
    if p is None:
        return None
    ap = os.path.abspath(p)
    try:
        r = os.path.relpath(ap)
        return r if not r.startswith("..") else ap
    except ValueError:
        return ap


def write_json(path, obj):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, ensure_ascii=False, separators=(",", ":"))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# prompts

LONG_PARAGRAPH = (
    "The history of the lighthouse is closely tied to the history of trade by sea. "
    "Long before electric lamps and automatic timers, sailors relied on fires lit on hilltops "
    "to warn them of rocks and to guide them toward safe harbors. The most famous early example "
    "was the Pharos of Alexandria, built in the third century BC on a small island at the "
    "entrance to the harbor. Ancient writers claimed that its light could be seen from many "
    "miles away, although such reports were probably exaggerated. For centuries afterwards, most "
    "lights were simple towers with open fires of wood or coal, and keeping them burning through "
    "a stormy night was hard and dangerous work. In the eighteenth century, engineers began to "
    "experiment with oil lamps and polished metal reflectors, which made the beam brighter and "
    "easier to see. A major improvement came in 1822, when the French physicist Augustin Fresnel "
    "designed a lens made of many concentric rings of glass. His lens captured much more of the "
    "light and bent it into a narrow, powerful beam that could reach the horizon. Within a few "
    "decades, Fresnel lenses were installed in lighthouses around the world. Each lighthouse was "
    "also given its own pattern of flashes, so that a captain who saw a light at night could "
    "count the seconds between flashes, look at a chart, and know exactly which coast he was "
    "approaching. The keepers who lived in these towers trimmed the wicks, wound the clockwork "
    "that turned the lens, cleaned the glass, and wrote down the weather in a logbook every day. "
    "Their lives were often lonely, especially on rocks far from shore, where supplies arrived "
    "only when the sea was calm enough for a boat to land. During the twentieth century, "
    "electricity, radio beacons, and later satellite navigation changed the role of the "
    "lighthouse completely. Today most lights are automatic, and many old towers have become "
    "museums, hotels, or simply landmarks that remind visitors of the long and difficult "
    "struggle to make the sea a little safer."
)

CODE_PROMPT = (
    "def fibonacci(n: int) -> list[int]:\n"
    "    \"\"\"Return the first n Fibonacci numbers.\"\"\"\n"
    "    seq = [0, 1]\n"
    "    while len(seq) < n:\n"
)


def default_prompts():
    return [
        {"name": "short-plain", "text": "The capital of France is", "chat": False},
        {"name": "tiny-plain", "text": "Hello", "chat": False},
        {"name": "chat-short", "text": "What is the capital of France?", "chat": True},
        {"name": "chat-tips", "text": "Give me three tips for staying healthy.", "chat": True},
        {"name": "code-plain", "text": CODE_PROMPT, "chat": False},
        {"name": "numbers-plain", "text": "1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233,", "chat": False},
        {"name": "unicode-plain",
         "text": "Café au lait, naïve résumé, Straße, 日本語のテキスト, emoji 🙂🚀 — and the Greek letter λ means",
         "chat": False},
        {"name": "long-plain", "text": LONG_PARAGRAPH + " In summary,", "chat": False},
        {"name": "long-chat", "text": "Summarize the following text in two sentences.\n\n" + LONG_PARAGRAPH,
         "chat": True},
    ]


def cmd_prompts(out):
    path = os.path.join(out, "prompts.json")
    if os.path.exists(path):
        log(f"skip {rel(path)} (exists)")
        return path
    prompts = default_prompts()
    os.makedirs(out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(prompts, f, ensure_ascii=False, indent=1)
    log(f"wrote {rel(path)} ({len(prompts)} prompts)")
    return path


# ----------------------------------------------------------------------------------------------
# model loading (process-level cache: the GGUF dequantization is slow)

_MODEL_CACHE = {}


def load_tokenizer(model_path, gguf_file=None):
    from transformers import AutoTokenizer
    if gguf_file:
        return AutoTokenizer.from_pretrained(model_path, gguf_file=gguf_file)
    return AutoTokenizer.from_pretrained(model_path)


def load_model(model_path, gguf_file=None):
    """Returns (model, tokenizer); float32, eval mode. Cached per (path, gguf_file)."""
    from transformers import AutoModelForCausalLM
    key = (os.path.abspath(model_path), gguf_file)
    if key not in _MODEL_CACHE:
        t = time.time()
        kw = {"gguf_file": gguf_file} if gguf_file else {}
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, **kw)
        model.eval()
        tok = load_tokenizer(model_path, gguf_file)
        _MODEL_CACHE[key] = (model, tok)
        log(f"loaded {rel(model_path)}{'/' + gguf_file if gguf_file else ''} in {time.time() - t:.1f}s")
    return _MODEL_CACHE[key]


def split_model_arg(model, gguf_file):
    """Accepts --model DIR --gguf-file NAME, or --model path/to/file.gguf."""
    if gguf_file is None and model.endswith(".gguf") and os.path.isfile(model):
        return os.path.dirname(model) or ".", os.path.basename(model)
    return model, gguf_file


def smollm2():
    return load_model(GGUF_DIR, GGUF_NAME)


# ----------------------------------------------------------------------------------------------
# logprobs

def encode(tok, prompt):
    if prompt.get("chat"):
        text = tok.apply_chat_template([{"role": "user", "content": prompt["text"]}],
                                       add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False).input_ids
    return tok(prompt["text"]).input_ids


@torch.no_grad()
def greedy(model, ids, n):
    """Greedy argmax continuation of exactly n tokens (EOS does not stop it), with a KV cache."""
    out = model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    past = out.past_key_values
    nxt = int(out.logits[0, -1].float().argmax())
    cont = [nxt]
    for _ in range(n - 1):
        out = model(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = int(out.logits[0, -1].float().argmax())
        cont.append(nxt)
    return cont


@torch.no_grad()
def teacher_forced(model, ids, k=TOP_K):
    logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    vals, idx = torch.topk(lp, k, dim=-1, sorted=True)
    return idx, vals


@torch.no_grad()
def router_margins(model, ids, device="cpu"):
    """Per position, the smallest gap over the MoE layers between the k-th and the (k+1)-th
    router logit (how far the top-k choice is from picking another expert), or None for a dense
    model. A reduced-precision run (bf16 activations or KV cache) moves router logits of size ~2
    by ~1e-2, so where this gap is smaller it may route the position to another expert than this
    float32 run did, and its logprobs there legitimately differ by more than rounding: the GPU
    parity tests read it to tell such positions from wrong arithmetic."""
    k = getattr(model.config, "num_experts_per_tok", None)
    if not k:
        return None
    out = model(input_ids=torch.tensor([ids], device=device), use_cache=False, output_router_logits=True)
    gaps = []
    for logits in out.router_logits:
        s = torch.sort(logits.float().reshape(len(ids), -1), dim=-1, descending=True).values
        if s.shape[1] > k:
            gaps.append(s[:, k - 1] - s[:, k])
    return [float(x) for x in torch.stack(gaps).min(0).values.tolist()] if gaps else None


def run_case(model, tok, prompt):
    pids = encode(tok, prompt)
    cont = greedy(model, pids, N_NEW)
    idx, vals = teacher_forced(model, pids + cont)
    # The continuation was produced with a KV cache; check it against the teacher-forced argmax.
    tf_arg = idx[len(pids) - 1: len(pids) - 1 + N_NEW, 0].tolist()
    mism = sum(1 for a, b in zip(tf_arg, cont) if a != b)
    if mism:
        log(f"  warning: {prompt['name']}: {mism} continuation tokens differ from teacher-forced argmax")
    case = {
        "name": prompt["name"],
        "prompt_ids": pids,
        "continuation_ids": cont,
        "top_ids": idx.tolist(),
        "top_logprobs": [[float(x) for x in row] for row in vals.tolist()],
        "text": tok.decode(cont),
        "tf_argmax_mismatch": mism,
    }
    margins = router_margins(model, pids + cont)
    if margins is not None:
        case["router_margin"] = margins
    return case


def logprobs(model_path, gguf_file, prompts, out, adapter=None, names=None, model_label=None):
    if os.path.exists(out):
        log(f"skip {rel(out)} (exists)")
        return out
    t = time.time()
    base, tok = load_model(model_path, gguf_file)
    model = base
    if adapter:
        from peft import PeftModel
        model = PeftModel.from_pretrained(copy.deepcopy(base), adapter)
        model.eval()
    if names is not None:
        prompts = [p for p in prompts if p["name"] in names]
    cases = []
    for p in prompts:
        tc = time.time()
        cases.append(run_case(model, tok, p))
        log(f"  {p['name']}: {len(cases[-1]['prompt_ids'])}+{N_NEW} tokens, {time.time() - tc:.1f}s "
            f"-> {cases[-1]['text'][:60]!r}")
    label = model_label or (os.path.join(model_path, gguf_file) if gguf_file else model_path)
    write_json(out, {"model": rel(label) if os.path.exists(label) else label, "adapter": rel(adapter),
                     "cases": cases})
    log(f"wrote {rel(out)} in {time.time() - t:.1f}s")
    return out


# ----------------------------------------------------------------------------------------------
# tiny models

TINY_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def tiny_configs(vocab):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config
    return {
        "tiny-qwen2": (Qwen2Config(vocab_size=vocab, max_position_embeddings=2048, rope_theta=1e6,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
                                   **TINY_COMMON), 1001),
        # head_dim 16, theta 1e4: wavelengths 2*pi*1e4^(i/8) = 6.3 (< 16: kept), 19.9, 62.8 (16..64:
        # smoothed), 199, ... (> 64: divided by 8) with original_max 64, low 1, high 4.
        "tiny-llama3": (LlamaConfig(vocab_size=vocab, max_position_embeddings=2048, rope_theta=1e4,
                                    rms_norm_eps=1e-5, tie_word_embeddings=True,
                                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 64},
                                    **TINY_COMMON), 1002),
        "tiny-mistral": (MistralConfig(vocab_size=vocab, max_position_embeddings=2048, rope_theta=1e4,
                                       rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
                                       **TINY_COMMON), 1003),
        **tiny_family_configs(vocab),
    }


def tiny_family_configs(vocab):
    """Qwen3 (dense) and the mixture-of-experts families. head_dim 32 on tiny-qwen3 makes q wider
    than hidden (o_proj [64, 128]); tiny-qwen3moe has 16 experts, top 4, renormalised;
    tiny-qwen3moe-dense1 a dense middle layer (mlp_only_layers); tiny-qwen2moe a shared expert and
    q/k/v biases; tiny-llama-bias HF Llama's attention_bias (q, k, v and o_proj biases) on heads of 8."""
    from transformers import LlamaConfig, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig
    common = dict(TINY_COMMON, max_position_embeddings=2048, tie_word_embeddings=False)
    return {
        "tiny-qwen3": (Qwen3Config(vocab_size=vocab, rope_theta=1e6, rms_norm_eps=1e-6, head_dim=32,
                                   use_sliding_window=False, **common), 1004),
        "tiny-mixtral": (MixtralConfig(vocab_size=vocab, rope_theta=1e6, rms_norm_eps=1e-5, sliding_window=None,
                                       num_local_experts=8, num_experts_per_tok=2,
                                       **dict(common, intermediate_size=48)), 1005),
        "tiny-qwen3moe": (Qwen3MoeConfig(vocab_size=vocab, rope_theta=1e6, rms_norm_eps=1e-6, head_dim=16,
                                         num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                                         norm_topk_prob=True, use_sliding_window=False, **common), 1006),
        # llama.cpp's qwen3moe has no dense layers, so this one is HF only.
        "tiny-qwen3moe-dense1": (Qwen3MoeConfig(vocab_size=vocab, rope_theta=1e6, rms_norm_eps=1e-6, head_dim=16,
                                                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                norm_topk_prob=False, mlp_only_layers=[1], use_sliding_window=False,
                                                **dict(common, num_hidden_layers=3)), 1009),
        "tiny-qwen2moe": (Qwen2MoeConfig(vocab_size=vocab, rope_theta=1e6, rms_norm_eps=1e-6, num_experts=8,
                                         num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, norm_topk_prob=False,
                                         use_sliding_window=False, **common), 1007),
        # HF Llama's attention_bias: q, k, v and o_proj biases; 8 heads of 8 dims (the smallest
        # head_dim any model here has).
        "tiny-llama-bias": (LlamaConfig(vocab_size=vocab, rope_theta=1e4, rms_norm_eps=1e-5, attention_bias=True,
                                        **dict(common, num_attention_heads=8, head_dim=8)), 1010),
        "tiny-olmoe": (OlmoeConfig(vocab_size=vocab, rope_theta=1e4, rms_norm_eps=1e-5, num_experts=8,
                                   num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=None,
                                   **dict(common, intermediate_size=32)), 1008),
    }

# Tiny models also written as GGUF (F32, llama.cpp's names and layout; scripts/gguf_fixtures.py):
# name -> GGUF architecture. Their reference is the HF model's.
TINY_GGUF = {"tiny-qwen3": "qwen3", "tiny-mixtral": "llama", "tiny-qwen3moe": "qwen3moe", "tiny-qwen2moe": "qwen2moe"}


@torch.no_grad()
def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim == 1 and name.endswith("norm.weight"):
            v = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        elif p.ndim == 1:  # biases (qwen2 q/k/v)
            v = 0.2 * torch.randn(p.shape, generator=g)
        elif "embed_tokens" in name:
            v = 0.5 * torch.randn(p.shape, generator=g)
        elif "lm_head" in name:
            v = 0.3 * torch.randn(p.shape, generator=g)
        else:
            v = 0.15 * torch.randn(p.shape, generator=g)
        p.copy_(v)


def cmd_models(out):
    from transformers import AutoModelForCausalLM
    mdir = os.path.join(out, "models")
    os.makedirs(mdir, exist_ok=True)
    tok = None
    for name, (cfg, seed) in tiny_configs(49152).items():
        d = os.path.join(mdir, name)
        if os.path.exists(os.path.join(d, "model.safetensors")):
            log(f"skip {rel(d)} (exists)")
            continue
        if tok is None:
            tok = load_tokenizer(GGUF_DIR, GGUF_NAME)
        assert len(tok) == cfg.vocab_size, (len(tok), cfg.vocab_size)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        randomize(model, seed)
        if cfg.tie_word_embeddings:
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        model.save_pretrained(d, safe_serialization=True)
        tok.save_pretrained(d)
        log(f"wrote {rel(d)}")

    for name, arch in TINY_GGUF.items():
        path = os.path.join(mdir, f"{name}.gguf")
        if os.path.exists(path):
            log(f"skip {rel(path)} (exists)")
            continue
        import gguf_fixtures
        gguf_fixtures.from_hf(os.path.join(mdir, name), arch, os.path.join(GGUF_DIR, GGUF_NAME), path)
        log(f"wrote {rel(path)}")

    d = os.path.join(mdir, "smollm2-hf")
    if os.path.exists(os.path.join(d, "model.safetensors")):
        log(f"skip {rel(d)} (exists)")
    else:
        t = time.time()
        model, tok = smollm2()
        model.save_pretrained(d, safe_serialization=True)
        tok.save_pretrained(d)
        # The HF copy must reproduce the GGUF logits.
        ids = torch.tensor([encode(tok, default_prompts()[0])])
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            diff = (hf(ids).logits - model(ids).logits).abs().max().item()
        log(f"wrote {rel(d)} in {time.time() - t:.1f}s; max |logit diff| HF copy vs GGUF = {diff:.3g}")
        assert diff < 1e-4, diff
        del hf


# ----------------------------------------------------------------------------------------------
# adapters

# name -> (LoraConfig kwargs, seed, rho = target RMS(delta)/RMS(base output) per site).
# rho was tuned by hand: greedy text changes on most prompts and stays fluent (rho 2-3x larger
# gives gibberish for the q/v and pattern adapters).
SMOL_ADAPTERS = {
    "a-qv-r8": (dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]), 11, 0.2),
    "b-all-r16-rslora": (dict(r=16, lora_alpha=16, target_modules="all-linear", use_rslora=True), 12, 0.08),
    "c-patterns": (dict(r=8, lora_alpha=16,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                        "down_proj"],
                        rank_pattern={"q_proj": 4, "down_proj": 12}, alpha_pattern={"o_proj": 32}), 13, 0.06),
    "d-embed-head": (dict(r=8, lora_alpha=16, target_modules=["embed_tokens", "lm_head", "q_proj", "up_proj"]),
                     14, 0.1),
    "e-qk-r4": (dict(r=4, lora_alpha=8, target_modules=["k_proj", "o_proj", "gate_proj"],
                     layers_to_transform=[0, 1, 2, 10, 29], layers_pattern="layers"), 15, 0.3),
}
TINY_ADAPTERS = {
    "tiny-llama3-r8": ("tiny-llama3", dict(r=8, lora_alpha=16,
                                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"]), 21, 0.15),
}


@torch.no_grad()
def calibrate_lora(model, seed, rho):
    """Random A and B with sigma_B chosen per site so RMS(delta) ~= rho * RMS(base output) (iid inputs).

    Linear: A ~ U(-1/sqrt(in), 1/sqrt(in)) (sigma_A = 1/sqrt(3 in)), B ~ N(0, rho sigma_W sqrt(3 in / r) / s).
    Embedding: A ~ N(0, 1), B ~ N(0, rho sigma_E / (s sqrt(r))).
    """
    from peft.tuners.lora import LoraLayer
    g = torch.Generator().manual_seed(seed)
    n = 0
    for name, m in model.named_modules():
        if not isinstance(m, LoraLayer):
            continue
        for an in m.lora_A.keys():
            r, s = m.r[an], m.scaling[an]
            A, B = m.lora_A[an].weight, m.lora_B[an].weight
            sw = m.get_base_layer().weight.float().std().item()
            fan_in = A.shape[1]
            A.copy_((torch.rand(A.shape, generator=g) * 2 - 1) / fan_in ** 0.5)
            B.copy_(torch.randn(B.shape, generator=g) * (rho * sw * (3 * fan_in / r) ** 0.5 / s))
            n += 1
        for an in m.lora_embedding_A.keys():
            r, s = m.r[an], m.scaling[an]
            A, B = m.lora_embedding_A[an], m.lora_embedding_B[an]
            se = m.get_base_layer().weight.float().std().item()
            A.copy_(torch.randn(A.shape, generator=g))
            B.copy_(torch.randn(B.shape, generator=g) * (rho * se / (s * r ** 0.5)))
            n += 1
    return n


def make_adapter(base, d, cfg_kw, seed, rho, base_name, task_type="CAUSAL_LM", calibrate=None):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    cfg = LoraConfig(task_type=task_type, lora_dropout=0.0, bias="none", init_lora_weights=False, **cfg_kw)
    model = get_peft_model(copy.deepcopy(base), cfg)
    n = (calibrate or calibrate_lora)(model, seed, rho)
    model.peft_config["default"].base_model_name_or_path = base_name
    # Embedding targets: save only the LoRA tensors, never the full base embedding / lm_head.
    model.save_pretrained(d, safe_serialization=True, save_embedding_layers=False)
    # PEFT stores target_modules from a set: sort it so the file is byte-identical across runs.
    cpath = os.path.join(d, "adapter_config.json")
    with open(cpath) as f:
        c = json.load(f)
    if isinstance(c.get("target_modules"), list):
        c["target_modules"] = sorted(c["target_modules"])
    with open(cpath, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
    log(f"wrote {rel(d)} ({n} LoRA sites, rho={rho})")


def cmd_adapters(out):
    adir = os.path.join(out, "adapters")
    for name, (kw, seed, rho) in SMOL_ADAPTERS.items():
        d = os.path.join(adir, name)
        if os.path.exists(os.path.join(d, "adapter_model.safetensors")):
            log(f"skip {rel(d)} (exists)")
            continue
        make_adapter(smollm2()[0], d, kw, seed, rho, "smollm2-hf")
    for name, (mname, kw, seed, rho) in TINY_ADAPTERS.items():
        d = os.path.join(adir, name)
        if os.path.exists(os.path.join(d, "adapter_model.safetensors")):
            log(f"skip {rel(d)} (exists)")
            continue
        mdir = os.path.join(out, "models", mname)
        if not os.path.exists(mdir):
            cmd_models(out)
        make_adapter(load_model(mdir)[0], d, kw, seed, rho, mname)


# ----------------------------------------------------------------------------------------------
# all

def compare(base_path, ad_path):
    """Greedy-text changes and teacher-forced logprob deltas (prompt positions) of adapter vs base."""
    b = {c["name"]: c for c in json.load(open(base_path))["cases"]}
    a = json.load(open(ad_path))["cases"]
    changed, deltas = 0, []
    for c in a:
        bc = b[c["name"]]
        changed += c["continuation_ids"] != bc["continuation_ids"]
        mx = 0.0
        for pos in range(len(c["prompt_ids"])):
            bl = dict(zip(bc["top_ids"][pos], bc["top_logprobs"][pos]))
            al = dict(zip(c["top_ids"][pos], c["top_logprobs"][pos]))
            for t in set(bl) & set(al):
                mx = max(mx, abs(bl[t] - al[t]))
        deltas.append(mx)
    deltas.sort()
    return changed, len(a), deltas[len(deltas) // 2], deltas[-1]


def cmd_all(out):
    t0 = time.time()
    times = {}

    def step(name, fn, *a, **kw):
        t = time.time()
        r = fn(*a, **kw)
        times[name] = time.time() - t
        return r

    ppath = step("prompts", cmd_prompts, out)
    prompts = json.load(open(ppath))
    step("models", cmd_models, out)
    step("adapters", cmd_adapters, out)
    rdir = os.path.join(out, "ref")
    gguf_label = os.path.join(GGUF_DIR, GGUF_NAME)
    step("ref smollm2", logprobs, GGUF_DIR, GGUF_NAME, prompts, os.path.join(rdir, "smollm2.json"),
         model_label=gguf_label)
    for m in ["tiny-qwen2", "tiny-llama3", "tiny-mistral", *tiny_family_configs(49152)]:
        step(f"ref {m}", logprobs, os.path.join(out, "models", m), None, prompts, os.path.join(rdir, f"{m}.json"))
    for name, (mname, *_r) in TINY_ADAPTERS.items():
        step(f"ref {name}", logprobs, os.path.join(out, "models", mname), None, prompts,
             os.path.join(rdir, f"{name}.json"), adapter=os.path.join(out, "adapters", name))
    for name in SMOL_ADAPTERS:
        step(f"ref smollm2-{name}", logprobs, GGUF_DIR, GGUF_NAME, prompts,
             os.path.join(rdir, f"smollm2-{name}.json"), adapter=os.path.join(out, "adapters", name),
             names=ADAPTER_PROMPTS, model_label=gguf_label)
    log("timings:")
    for k, v in times.items():
        log(f"  {k:28s} {v:7.1f}s")
    log(f"  {'total':28s} {time.time() - t0:7.1f}s")
    log("adapter vs base (greedy text changed; max |dlogprob| over prompt positions, median/max over prompts):")
    pairs = [(f"smollm2-{n}", "smollm2") for n in SMOL_ADAPTERS] + [(n, m) for n, (m, *_r) in TINY_ADAPTERS.items()]
    for ad, base in pairs:
        ch, tot, med, mx = compare(os.path.join(rdir, f"{base}.json"), os.path.join(rdir, f"{ad}.json"))
        log(f"  {ad:28s} changed {ch}/{tot}  median {med:.3f}  max {mx:.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for c in ["prompts", "models", "adapters", "all"]:
        s = sub.add_parser(c)
        s.add_argument("out", nargs="?", default=os.path.join(CACHE, "ref"))
    s = sub.add_parser("logprobs")
    s.add_argument("--model", required=True, help="HF model dir, or a .gguf file")
    s.add_argument("--gguf-file", default=None, help="GGUF file name inside --model")
    s.add_argument("--prompts", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--adapter", default=None, help="PEFT adapter dir")
    s.add_argument("--names", default=None, help="comma-separated subset of prompt names")
    a = ap.parse_args()
    if a.cmd == "logprobs":
        model, gguf = split_model_arg(a.model, a.gguf_file)
        prompts = json.load(open(a.prompts))
        logprobs(model, gguf, prompts, a.out, adapter=a.adapter,
                 names=a.names.split(",") if a.names else None)
    else:
        {"prompts": cmd_prompts, "models": cmd_models, "adapters": cmd_adapters, "all": cmd_all}[a.cmd](a.out)


if __name__ == "__main__":
    main()
