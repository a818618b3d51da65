#!/usr/bin/env python3
"""Embedding references: tiny random decoder embedding models, PEFT adapters on them, and their
embeddings from transformers (float32, CPU), cross-checked by sentence-transformers.

    reference_embed.py all OUT   (main venv, transformers 4.57 + PEFT)
        OUT/models/tiny-qwen3-embed       Qwen3Model, last-token pooling + Normalize, a query
                                          instruction prompt, matryoshka (sentence-transformers files)
        OUT/models/tiny-qwen2-embed-mean  Qwen2Model, mean pooling, no Normalize
        OUT/adapters/<name>               PEFT LoRA (FEATURE_EXTRACTION) on them
        OUT/ref/embed-<model or adapter>.json
            cases [{name, text, prompt_name, ids, embedding, embedding_32}]: each text alone
            (no padding), the model's prompt prefixed, tokenized with special tokens, pooled
            from `last_hidden_state`, normalized when the model says so; `embedding_32` is the
            first 32 dimensions, renormalized likewise (Matryoshka `dimensions`).
    reference_embed.py st OUT    (scripts/setup-venv5.sh's venv: sentence-transformers)
        OUT/ref/embed-<model or adapter>-st.json: the same cases encoded by
        SentenceTransformer(model dir) (+ load_adapter), which must agree with the above.

Every step skips outputs that exist.
"""
import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import (GGUF_DIR, GGUF_NAME, LONG_PARAGRAPH, TINY_COMMON, load_tokenizer, log, make_adapter,  # noqa: E402
                       randomize, rel, write_json)

torch.set_num_threads(int(os.environ.get("QUIVER_REF_THREADS", "1")))

QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"

# name -> (config factory, seed, pooling, normalize, sentence-transformers prompts, matryoshka)
def embed_models(vocab):
    from transformers import Qwen2Config, Qwen3Config
    common = dict(TINY_COMMON, max_position_embeddings=2048, tie_word_embeddings=False)
    return {
        "tiny-qwen3-embed": (Qwen3Config(vocab_size=vocab, rope_theta=1e6, rms_norm_eps=1e-6, head_dim=16,
                                         use_sliding_window=False, **common), 1101, "lasttoken", True,
                             {"query": QUERY_PROMPT, "document": ""}, True),
        "tiny-qwen2-embed-mean": (Qwen2Config(vocab_size=vocab, rope_theta=1e6, rms_norm_eps=1e-6, use_sliding_window=False,
                                              **common), 1102, "mean", False, {}, False),
    }


EMBED_ADAPTERS = {
    "tiny-qwen3-embed-r8": ("tiny-qwen3-embed", dict(r=8, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]), 31, 0.15),
    "tiny-qwen2-embed-mean-r4-rslora": ("tiny-qwen2-embed-mean", dict(r=4, lora_alpha=8, use_rslora=True,
                                                                     target_modules=["q_proj", "v_proj", "down_proj"]), 32, 0.3),
}

# (name, text, prompt name or None)
EMBED_TEXTS = [
    ("hello", "Hello", None),
    ("query-capital", "What is the capital of France?", "query"),
    ("doc-capital", "Paris is the capital and largest city of France.", "document"),
    ("query-lighthouse", "Who designed the lens that made lighthouse beams visible from far away?", "query"),
    ("code", "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)", None),
    ("unicode", "Café au lait, naïve résumé, Straße, 日本語のテキスト, emoji 🙂🚀", None),
    ("long", LONG_PARAGRAPH, None),
]


def st_files(d, pooling, normalize, prompts, dim):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(d, "2_Normalize"), exist_ok=True)
    json.dump(modules, open(os.path.join(d, "modules.json"), "w"), indent=2)
    os.makedirs(os.path.join(d, "1_Pooling"), exist_ok=True)
    pool = {"word_embedding_dimension": dim, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": pooling == "mean",
            "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
            "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": pooling == "lasttoken", "include_prompt": True}
    json.dump(pool, open(os.path.join(d, "1_Pooling", "config.json"), "w"), indent=2)
    json.dump({"prompts": prompts, "default_prompt_name": None, "similarity_fn_name": "cosine"},
              open(os.path.join(d, "config_sentence_transformers.json"), "w"), indent=2)
    json.dump({"max_seq_length": 2048, "do_lower_case": False}, open(os.path.join(d, "sentence_bert_config.json"), "w"))


def cmd_models(out):
    from transformers import AutoModel
    tok = None
    for name, (cfg, seed, pooling, normalize, prompts, matryoshka) in embed_models(49152).items():
        d = os.path.join(out, "models", name)
        if os.path.exists(os.path.join(d, "model.safetensors")):
            log(f"skip {rel(d)} (exists)")
            continue
        if tok is None:
            tok = load_tokenizer(GGUF_DIR, GGUF_NAME)
            tok.pad_token = tok.eos_token  # sentence-transformers pads every batch
        torch.manual_seed(seed)
        model = AutoModel.from_config(cfg, dtype=torch.float32)  # a bare decoder: no LM head
        randomize(model, seed)
        if matryoshka:
            model.config.is_matryoshka = True
        model.save_pretrained(d, safe_serialization=True)
        tok.save_pretrained(d)
        st_files(d, pooling, normalize, prompts, cfg.hidden_size)
        log(f"wrote {rel(d)} ({type(model).__name__}, {pooling} pooling, normalize={normalize})")


def cmd_adapters(out):
    from transformers import AutoModel
    for name, (mname, kw, seed, rho) in EMBED_ADAPTERS.items():
        d = os.path.join(out, "adapters", name)
        if os.path.exists(os.path.join(d, "adapter_model.safetensors")):
            log(f"skip {rel(d)} (exists)")
            continue
        base = AutoModel.from_pretrained(os.path.join(out, "models", mname), dtype=torch.float32).eval()
        make_adapter(base, d, kw, seed, rho, mname, task_type="FEATURE_EXTRACTION")


def model_spec(d):
    modules = json.load(open(os.path.join(d, "modules.json")))
    pool = json.load(open(os.path.join(d, "1_Pooling", "config.json")))
    st = json.load(open(os.path.join(d, "config_sentence_transformers.json")))
    normalize = any(m["type"].endswith(".Normalize") for m in modules)
    return ("mean" if pool["pooling_mode_mean_tokens"] else "lasttoken"), normalize, st.get("prompts", {})


def input_text(text, prompt_name, prompts):
    """sentence-transformers prepends the named prompt to the text."""
    return prompts.get(prompt_name, "") + text if prompt_name else text


@torch.no_grad()
def embed_one(model, ids, pooling, normalize, dims=None):
    h = model(input_ids=torch.tensor([ids])).last_hidden_state[0].float()
    v = h.mean(dim=0) if pooling == "mean" else h[-1]
    if dims:
        v = v[:dims]
    if normalize:
        v = torch.nn.functional.normalize(v, p=2, dim=0)
    return [float(x) for x in v]


def cases_for(mname):
    pairs = [(mname, None)] + [(m, a) for a, (m, *_r) in EMBED_ADAPTERS.items() if m == mname]
    return pairs


def cmd_refs(out):
    from transformers import AutoModel, AutoTokenizer
    for mname in embed_models(49152):
        d = os.path.join(out, "models", mname)
        pooling, normalize, prompts = model_spec(d)
        tok = AutoTokenizer.from_pretrained(d)
        base = AutoModel.from_pretrained(d, dtype=torch.float32).eval()
        for _, adapter in cases_for(mname):
            path = os.path.join(out, "ref", f"embed-{adapter or mname}.json")
            if os.path.exists(path):
                log(f"skip {rel(path)} (exists)")
                continue
            model = base
            if adapter:
                from peft import PeftModel
                model = PeftModel.from_pretrained(copy.deepcopy(base), os.path.join(out, "adapters", adapter)).eval()
            cases = []
            for name, text, pname in EMBED_TEXTS:
                ids = tok(input_text(text, pname, prompts)).input_ids
                cases.append({"name": name, "text": text, "prompt_name": pname, "ids": ids,
                              "embedding": embed_one(model, ids, pooling, normalize),
                              "embedding_32": embed_one(model, ids, pooling, normalize, dims=32)})
            write_json(path, {"model": mname, "adapter": adapter, "pooling": pooling, "normalize": normalize, "cases": cases})
            log(f"wrote {rel(path)}")
        # The adapters must move the embeddings, or tests with them prove nothing.
        for _, adapter in cases_for(mname)[1:]:
            b = json.load(open(os.path.join(out, "ref", f"embed-{mname}.json")))["cases"]
            a = json.load(open(os.path.join(out, "ref", f"embed-{adapter}.json")))["cases"]
            cos = [torch.nn.functional.cosine_similarity(torch.tensor(x["embedding"]), torch.tensor(y["embedding"]), dim=0).item() for x, y in zip(a, b)]
            log(f"  {adapter}: cosine(adapter, base) over the texts: min {min(cos):.4f} max {max(cos):.4f}")
            assert max(cos) < 0.999, f"{adapter} barely changes the embeddings"


def cmd_st(out):
    """sentence-transformers' own pipeline on the same directories and texts (venv5)."""
    from sentence_transformers import SentenceTransformer
    for mname in embed_models(49152):
        d = os.path.join(out, "models", mname)
        for _, adapter in cases_for(mname):
            tag = f"embed-{adapter or mname}"
            path = os.path.join(out, "ref", f"{tag}-st.json")
            if os.path.exists(path):
                log(f"skip {rel(path)} (exists)")
                continue
            st = SentenceTransformer(d, device="cpu")
            if adapter:
                st.load_adapter(os.path.join(out, "adapters", adapter))
            ref = json.load(open(os.path.join(out, "ref", f"{tag}.json")))["cases"]
            cases = []
            prompts = st.prompts
            for (name, text, pname), r in zip(EMBED_TEXTS, ref):
                own = st.tokenize([input_text(text, pname, prompts)])["input_ids"][0].tolist()
                if own == r["ids"]:
                    # The whole pipeline: prompt, tokenizer, model, pooling, normalization.
                    v = st.encode([text], prompt_name=pname, convert_to_tensor=True, batch_size=1)[0].float()
                else:
                    # transformers 5's tokenizer splits this text differently from 4.57's (whose ids
                    # the tests use): run sentence-transformers' modules on the reference ids.
                    log(f"  {tag} {name}: sentence-transformers tokenizes differently; pooling the reference ids")
                    with torch.no_grad():
                        ids = torch.tensor([r["ids"]])
                        v = st({"input_ids": ids, "attention_mask": torch.ones_like(ids)})["sentence_embedding"][0].float()
                cos = torch.nn.functional.cosine_similarity(v, torch.tensor(r["embedding"]), dim=0).item()
                diff = (v - torch.tensor(r["embedding"])).abs().max().item()
                assert cos >= 0.99999 and diff <= 1e-4, f"{tag} {name}: sentence-transformers vs transformers cos {cos} max|d| {diff}"
                cases.append({"name": name, "embedding": [float(x) for x in v]})
            write_json(path, {"model": mname, "adapter": adapter, "cases": cases})
            log(f"wrote {rel(path)} (agrees with transformers)")


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("all", "st"):
        sys.exit(__doc__)
    out = sys.argv[2]
    if sys.argv[1] == "st":
        return cmd_st(out)
    cmd_models(out)
    cmd_adapters(out)
    cmd_refs(out)


if __name__ == "__main__":
    main()
