#!/usr/bin/env python3
"""End-to-end tests of `quiver serve --task embed` with the official `openai` client against the
transformers references of scripts/reference_embed.py (tiny random embedding models, PEFT
adapters on them).

    python tests/server/test_embeddings.py --quiver target/release/quiver [-k NAME]

Needs the reference data (`make test-data`) under $QUIVER_CACHE (default .cache). Starts
servers on ephemeral ports, always kills them, prints `N passed, M failed` last.
"""

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_openai_api import REPO, SERVED, Server, check, error_shape  # noqa: E402

CACHE = os.environ.get("QUIVER_CACHE", os.path.join(REPO, ".cache"))
MIN_COS, MAX_ABS = 0.99999, 1e-4


def ref(name):
    path = os.path.join(CACHE, "ref", "ref", f"embed-{name}.json")
    check(os.path.exists(path), f"{path} is missing: run `make test-data`")
    return json.load(open(path))["cases"]


def close(got, want, what):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    check(got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}")
    cos = got @ want / (np.linalg.norm(got) * np.linalg.norm(want))
    diff = np.abs(got - want).max()
    check(cos >= MIN_COS and diff <= MAX_ABS, f"{what}: cosine {cos:.7f}, max |d| {diff:.2e}")


def embed(c, model, cases, prompts=True, **kw):
    """Embeds the cases in one request per prompt name (inputs of a request are batched); a
    model without prompts gets none (the references prefixed nothing)."""
    out = {}
    name = (lambda x: x["prompt_name"] or "") if prompts else (lambda x: "")
    for pname in sorted({name(x) for x in cases}):
        group = [x for x in cases if name(x) == pname]
        extra = {"prompt_name": pname} if pname else {}
        r = c.embeddings.create(model=model, input=[x["text"] for x in group], extra_body=extra, **kw)
        check([d.index for d in r.data] == list(range(len(group))), r.data)
        check(r.usage.prompt_tokens == sum(len(x["ids"]) for x in group) == r.usage.total_tokens, (r.usage, [len(x["ids"]) for x in group]))
        for x, d in zip(group, r.data):
            out[x["name"]] = d.embedding
    return out


def qwen3_server(S):
    c = S.client()
    base, with_adapter = ref("tiny-qwen3-embed"), ref("tiny-qwen3-embed-r8")
    # The SDK asks for base64 by default and decodes it.
    for model, cases in [(SERVED, base), ("emb", with_adapter)]:
        got = embed(c, model, cases)
        for x in cases:
            close(got[x["name"]], x["embedding"], f"{model} {x['name']}")
    # float and base64 carry the same bits (without encoding_format the SDK asks for base64 and
    # decodes it; with an explicit one it hands back the string).
    r_f = c.embeddings.create(model="emb", input="Hello", encoding_format="float")
    r_b = c.embeddings.create(model="emb", input="Hello")
    check(r_f.data[0].embedding == r_b.data[0].embedding, "float and base64 differ")
    raw = S.post("/v1/embeddings", {"model": SERVED, "input": "Hello", "encoding_format": "base64"}).json()
    check(isinstance(raw["data"][0]["embedding"], str) and raw["object"] == "list" and raw["data"][0]["object"] == "embedding", raw)
    decoded = np.frombuffer(__import__("base64").b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    close(decoded, base[0]["embedding"], "raw base64")
    # Mixed lengths and adapters batched in one request equal one by one, bit for bit.
    texts = [x["text"] for x in base]
    for model in (SERVED, "emb"):
        together = c.embeddings.create(model=model, input=texts, encoding_format="float").data
        for t, d in zip(texts, together):
            alone = c.embeddings.create(model=model, input=t, encoding_format="float").data[0].embedding
            check(alone == d.embedding, f"{model}: batched differs from alone for {t[:30]!r}")
    # Token ids as input, and Matryoshka dimensions.
    q = next(x for x in base if x["prompt_name"] == "query")
    r = c.embeddings.create(model=SERVED, input=[q["ids"]], encoding_format="float")
    close(r.data[0].embedding, q["embedding"], "token-id input")
    r = c.embeddings.create(model=SERVED, input=q["text"], dimensions=32, extra_body={"prompt_name": "query"})
    check(len(r.data[0].embedding) == 32)
    close(r.data[0].embedding, q["embedding_32"], "dimensions=32")
    # Bad input in OpenAI's error shape, naming the field.
    error_shape(S.post("/v1/embeddings", {"model": SERVED, "input": "x", "dimensions": 65}), 400, "dimensions")
    error_shape(S.post("/v1/embeddings", {"model": SERVED, "input": "x", "encoding_format": "int8"}), 400, "encoding_format")
    error_shape(S.post("/v1/embeddings", {"model": SERVED, "input": []}), 400, "input")
    error_shape(S.post("/v1/embeddings", {"model": SERVED, "input": [1.5]}), 400, "input")
    error_shape(S.post("/v1/embeddings", {"model": SERVED, "input": "x", "prompt_name": "nope"}), 400, "prompt_name")
    error_shape(S.post("/v1/embeddings", {"model": "no-such-adapter", "input": "x"}), 404, "no-such-adapter")
    error_shape(S.post("/v1/completions", {"model": SERVED, "prompt": "x", "max_tokens": 2}), 400, "embeddings")


def mean_server(S):
    c = S.client()
    for model, name in [(SERVED, "tiny-qwen2-embed-mean"), ("emb", "tiny-qwen2-embed-mean-r4-rslora")]:
        cases = ref(name)
        got = embed(c, model, cases, prompts=False, encoding_format="float")
        for x in cases:
            close(got[x["name"]], x["embedding"], f"{model} {x['name']}")
    # No Normalize module: not unit length; no matryoshka declared: dimensions refused.
    v = np.asarray(c.embeddings.create(model=SERVED, input="Hello").data[0].embedding)
    check(abs(np.linalg.norm(v) - 1) > 1e-3, np.linalg.norm(v))
    error_shape(S.post("/v1/embeddings", {"model": SERVED, "input": "x", "dimensions": 32}), 400, "matryoshka")


def fallback_server(S):
    """A model without sentence-transformers files: last token, L2 normalised, said once."""
    v = np.asarray(S.client().embeddings.create(model=SERVED, input=["Hello there", "Hi"]).data[0].embedding)
    check(abs(np.linalg.norm(v) - 1) < 1e-5, np.linalg.norm(v))
    log = S.tail(200)
    check(log.count("fall back to last-token pooling") == 1, log)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quiver", default=os.path.join(REPO, "target", "release", "quiver"))
    ap.add_argument("-k", default=None)
    a = ap.parse_args()
    quiver = os.path.abspath(a.quiver)
    models, adapters = os.path.join(CACHE, "ref", "models"), os.path.join(CACHE, "ref", "adapters")
    runs = [
        ("qwen3_last_token_prompts_matryoshka_adapter", qwen3_server, ["--model", f"{models}/tiny-qwen3-embed", "--lora-modules", f"emb={adapters}/tiny-qwen3-embed-r8"]),
        ("qwen2_mean_pooling_adapter", mean_server, ["--model", f"{models}/tiny-qwen2-embed-mean", "--lora-modules", f"emb={adapters}/tiny-qwen2-embed-mean-r4-rslora"]),
        ("no_pooling_info_falls_back_and_says_so_once", fallback_server, ["--model", f"{models}/tiny-qwen3"]),
    ]
    passed = failed = 0
    for name, fn, args in runs:
        if a.k and a.k not in name:
            continue
        S = Server(quiver, args + ["--task", "embed", "--kv-cache-memory", "64M"], name)
        t0 = time.time()
        try:
            S.wait_ready()
            fn(S)
            passed += 1
            print(f"PASS {name} ({time.time() - t0:.1f}s)", flush=True)
        except Exception:
            failed += 1
            print(f"FAIL {name} ({time.time() - t0:.1f}s)\n{traceback.format_exc()}\n--- server log ---\n{S.tail(20)}", flush=True)
        finally:
            S.kill()
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
