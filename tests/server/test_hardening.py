#!/usr/bin/env python3
"""Regression tests for issue 20 (a hostile-input and churn probe of `quiver serve`), end to end
against real server processes, plus the soak: thousands of requests over base and four adapters
with random disconnects and concurrent load / replace / unload.

    python tests/server/test_hardening.py --quiver target/release/quiver [--model PATH] [-k NAME]

Each test reproduces one defect of the probe; the comment above it says what used to happen.
Servers listen on ephemeral ports on 127.0.0.1 and are always killed at the end; the last line
is `N passed, M failed`.
"""

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
import traceback

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from safetensors.numpy import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_openai_api import (PROMPT, SERVED, Server, check, error_shape, make_random_adapter,  # noqa: E402
                             prepare_adapters, smollm2_dims)

API_KEY = "hardening-key"

# ----------------------------------------------------------------------------------------------
# fixtures


def write_config(d, **kw):
    cfg = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "bias": "none"}
    cfg.update(kw)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)


def nan_adapter(d, alpha, fill):
    """q_proj of layer 0 only, every element `fill`, scaled by `alpha`/8."""
    dims = smollm2_dims()
    t = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.full((8, dims["hidden"]), fill, np.float32),
         "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": np.full((dims["q"], 8), fill, np.float32)}
    write_config(d, lora_alpha=alpha, target_modules=["q_proj"], layers_to_transform=[0])
    save_file(t, os.path.join(d, "adapter_model.safetensors"))


def sparse_adapter(d, gb=2):
    """A valid safetensors header promising `gb` GB of lora_A (rank far above the config's 8),
    the data a hole: nothing is written to disk."""
    dims = smollm2_dims()
    rows = (gb << 30) // (4 * dims["hidden"])
    header = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": {"dtype": "F32", "shape": [rows, dims["hidden"]], "data_offsets": [0, rows * dims["hidden"] * 4]}}
    end = rows * dims["hidden"] * 4
    header["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"] = {"dtype": "F32", "shape": [dims["q"], 8], "data_offsets": [end, end + dims["q"] * 32]}
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    write_config(d, target_modules=["q_proj"])
    p = os.path.join(d, "adapter_model.safetensors")
    with open(p, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h)
        f.truncate(8 + len(h) + end + dims["q"] * 32)


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def metrics(S):
    return {f.name: f for f in text_string_to_metric_families(S.get("/metrics").text)}


def sse_lines(resp):
    return [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]


def error_text(r):
    try:
        e = r.json()
        return json.dumps(e)
    except ValueError:
        return r.text


# ----------------------------------------------------------------------------------------------
# tests on one server (API key, --lora-dir with hostile entries)

TESTS = []


def test(fn):
    TESTS.append(fn)
    return fn


@test
def health_stays_responsive_under_huge_prompts(S, d):
    """Two 31 MB prompts (under the 32 MiB body limit) were tokenized inline on the two tokio
    workers: /health froze 53 s, RSS peaked at 6.3 GB and 4.6 GB stayed resident."""
    rss0 = rss_mb(S.proc.pid)
    body = json.dumps({"model": SERVED, "prompt": "hello world " * (31 * (1 << 20) // 12), "max_tokens": 4}).encode()
    results = []

    def big():
        r = httpx.post(S.base + "/v1/completions", content=body, headers={**S.headers(), "content-type": "application/json"}, timeout=120)
        results.append(r)

    threads = [threading.Thread(target=big) for _ in range(2)]
    for t in threads:
        t.start()
    worst = 0.0
    while any(t.is_alive() for t in threads):
        t0 = time.time()
        check(httpx.get(S.base + "/health", timeout=30).status_code == 200)
        worst = max(worst, time.time() - t0)
        time.sleep(0.05)
    for t in threads:
        t.join()
    for r in results:
        e = error_shape(r, 400)
        check("maximum context length" in e["message"] and len(r.content) < 2000, e)
    check(worst < 1.0, f"/health took {worst:.2f} s while two huge prompts were refused")
    # The refused bodies are not kept: resident memory returns near where it was.
    time.sleep(0.5)
    rss1 = rss_mb(S.proc.pid)
    check(rss1 < rss0 + 256, f"RSS {rss0:.0f} MB -> {rss1:.0f} MB after refusing two huge prompts")
    # A prompt near the bound is tokenized (off the workers) and refused by its token count.
    r = S.post("/v1/completions", {"model": SERVED, "prompt": "hello world " * 40000, "max_tokens": 4})
    check("context length" in error_shape(r, 400)["message"], r.text[:300])


@test
def adapter_rewritten_while_it_loads(S, d):
    """`cp` over adapter_model.safetensors (it truncates first) while `load_inplace` loops:
    through the memory map the server died of SIGBUS in 0.6 s, taking every tenant with it."""
    live = os.path.join(d, "live")
    shutil.copytree(os.path.join(d, "v1"), live)
    r = S.post("/v1/load_lora_adapter", {"lora_name": "live", "lora_path": "live"})
    check(r.status_code == 200, r.text)
    stop = time.time() + 4
    statuses = {}
    writes = [0]

    def writer():
        i = 0
        while time.time() < stop:
            shutil.copyfile(os.path.join(d, "v1" if i % 2 else "v2", "adapter_model.safetensors"), os.path.join(live, "adapter_model.safetensors"))
            i += 1
            writes[0] = i
            time.sleep(0.05)

    def loader():
        while time.time() < stop:
            r = S.post("/v1/load_lora_adapter", {"lora_name": "live", "lora_path": "live", "load_inplace": True})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code != 200:
                check(r.status_code in (400, 429), r.text)
                check("live" in r.text and not r.text.count(d), r.text[:300])

    ts = [threading.Thread(target=writer), threading.Thread(target=loader)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    check(S.proc.poll() is None, f"server died (exit {S.proc.returncode}) after {writes[0]} rewrites: {S.tail()}")
    check(sum(statuses.values()) >= 3, statuses)
    r = S.post("/v1/load_lora_adapter", {"lora_name": "live", "lora_path": "live", "load_inplace": True})
    check(r.status_code == 200, r.text)
    r = S.post("/v1/completions", {"model": "live", "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    check(r.status_code == 200, r.text)
    check(S.post("/v1/unload_lora_adapter", {"lora_name": "live"}).status_code == 200)


@test
def symlinked_files_do_not_escape_the_lora_dir(S, d):
    """A directory of symlinks to files outside --lora-dir loaded (200), and errors quoted the
    outside file's content ("SECRET-TOKEN-123" is not a positive integer)."""
    e = error_shape(S.post("/v1/load_lora_adapter", {"lora_name": "links", "lora_path": "links"}), 400)
    check("symbolic link" in e["message"], e)
    check("SECRET" not in json.dumps(e), e)
    check("links" not in [a["name"] for a in S.get("/v1/lora_adapters").json()])
    e = error_shape(S.post("/v1/completions", {"model": "links", "prompt": "x"}), 400)
    check("SECRET" not in json.dumps(e), e)
    # A config symlinked to /dev/zero once read 2.3 GB.
    e = error_shape(S.post("/v1/load_lora_adapter", {"lora_name": "zero", "lora_path": "zero"}), 400)
    check("adapter_config.json" in e["message"], e)


@test
def one_megabyte_adapter_name(S, d):
    """A 1 MB adapter name was accepted; /metrics was then 134 MB, and stayed so after unload."""
    big = "n" * (1 << 20)
    for path, body in [("/v1/load_lora_adapter", {"lora_name": big, "lora_path": "a"}),
                       ("/v1/completions", {"model": big, "prompt": "x"}),
                       ("/generate", {"text": "x", "lora_path": big})]:
        r = S.post(path, body)
        error_shape(r, 400)
        check(len(r.content) < 2000, f"{path}: {len(r.content)} bytes")
    # Series of an unloaded adapter go with it.
    check(S.post("/v1/load_lora_adapter", {"lora_name": "temp", "lora_path": "a"}).status_code == 200)
    check(S.post("/v1/completions", {"model": "temp", "prompt": PROMPT, "max_tokens": 2}).status_code == 200)
    check('adapter="temp"' in S.get("/metrics").text)
    check(S.post("/v1/unload_lora_adapter", {"lora_name": "temp"}).status_code == 200)
    text = S.get("/metrics").text
    check('adapter="temp"' not in text and len(text) < 200_000, len(text))


@test
def adapters_producing_nan_are_refused(S, d):
    """lora_alpha 1e39 or huge weights loaded, and the adapter's output was all <|endoftext|>
    with null logprobs."""
    e = error_shape(S.post("/v1/load_lora_adapter", {"lora_name": "nan1", "lora_path": "nan1"}), 400)
    check("lora_alpha" in e["message"], e)
    e = error_shape(S.post("/v1/load_lora_adapter", {"lora_name": "nan2", "lora_path": "nan2"}), 400)
    check("model.layers.0.self_attn.q_proj" in e["message"] and "effective weights" in e["message"], e)


@test
def sparse_two_gigabyte_adapter(S, d):
    """A 2 GB sparse adapter cost 4 GB of memory before its shapes were rejected."""
    rss0 = rss_mb(S.proc.pid)
    t0 = time.time()
    e = error_shape(S.post("/v1/load_lora_adapter", {"lora_name": "sparse", "lora_path": "sparse"}), 400)
    check("adapter_model.safetensors" in e["message"], e)
    check(time.time() - t0 < 5, f"refusal took {time.time() - t0:.1f} s")
    check(rss_mb(S.proc.pid) < rss0 + 128, f"RSS {rss0:.0f} -> {rss_mb(S.proc.pid):.0f} MB")


@test
def unauthorized_big_post_keeps_the_client_working(S, d):
    """A 401 on a POST with an unread body over ~64 KB closed the connection silently; the
    client's next keep-alive request on it failed."""
    with httpx.Client(base_url=S.base, timeout=30) as c:
        for _ in range(3):
            r = c.post("/v1/completions", content=b"x" * 200_000, headers={"content-type": "application/json", "authorization": "Bearer wrong"})
            check(r.status_code == 401, r.status_code)
            check(r.headers.get("connection", "").lower() == "close", r.headers)
            r = c.get("/v1/models", headers=S.headers())
            check(r.status_code == 200, r.status_code)


@test
def minor_api_items(S, d):
    """429 without Retry-After; lower-case `bearer` refused; /generate took input_ids as a
    string; errors and /v1/models showed absolute server paths."""
    r = httpx.get(S.base + "/v1/models", headers={"Authorization": f"bearer {API_KEY}"})
    check(r.status_code == 200, r.text)
    error_shape(S.post("/generate", {"input_ids": "1 2 3"}), 400, "input_ids")
    for m in r.json()["data"][1:]:
        check(not os.path.isabs(m["root"]) and d not in m["root"], m)
    for a in S.get("/v1/lora_adapters").json():
        check(not os.path.isabs(a["path"]), a)
    e = error_shape(S.post("/v1/load_lora_adapter", {"lora_name": "zz", "lora_path": "missing-dir"}), 404)
    check(d not in e["message"], e)
    # A load that is refused names the file relative to the adapter, never the server path.
    e = error_shape(S.post("/v1/load_lora_adapter", {"lora_name": "nan1", "lora_path": "nan1"}), 400)
    check(d not in e["message"], e)


@test
def fifo_config_then_sigterm(S, d):
    """A FIFO named adapter_config.json hung every generation (base included) and SIGTERM,
    twice, never exited: only SIGKILL did. Runs last: it stops the server."""
    result = {}

    def load():
        result["r"] = S.post("/v1/load_lora_adapter", {"lora_name": "fifo", "lora_path": "fifo"})

    t = threading.Thread(target=load)
    t.start()
    t.join(timeout=30)
    check(not t.is_alive(), "a load of a FIFO config never answered")
    e = error_shape(result["r"], 400)
    check("adapter_config.json" in e["message"] and "regular file" in e["message"], e)
    r = S.post("/v1/completions", {"model": SERVED, "prompt": PROMPT, "max_tokens": 4})
    check(r.status_code == 200, r.text)
    os.kill(S.proc.pid, signal.SIGTERM)
    try:
        rc = S.proc.wait(timeout=20)
    except Exception:
        check(False, "SIGTERM did not stop the server within 20 s")
    check(rc == 0, f"exit status {rc}")


def hostile_lora_dir(d):
    """Adapters a..d, two rank-32 versions for the rewrite race, and the hostile entries."""
    prepare_adapters(d)
    make_random_adapter(os.path.join(d, "v1"), seed=1, rank=32, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    make_random_adapter(os.path.join(d, "v2"), seed=2, rank=32, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    outside = tempfile.mkdtemp(prefix="quiver-outside-")
    make_random_adapter(outside, seed=3)
    with open(os.path.join(outside, "secret.json"), "w") as f:
        f.write('{"r": "SECRET-TOKEN-123", "target_modules": ["q_proj"]}')
    links = os.path.join(d, "links")
    os.makedirs(links)
    os.symlink(os.path.join(outside, "secret.json"), os.path.join(links, "adapter_config.json"))
    os.symlink(os.path.join(outside, "adapter_model.safetensors"), os.path.join(links, "adapter_model.safetensors"))
    os.makedirs(os.path.join(d, "zero"))
    os.symlink("/dev/zero", os.path.join(d, "zero", "adapter_config.json"))
    shutil.copy(os.path.join(d, "a", "adapter_model.safetensors"), os.path.join(d, "zero"))
    os.makedirs(os.path.join(d, "fifo"))
    os.mkfifo(os.path.join(d, "fifo", "adapter_config.json"))
    shutil.copy(os.path.join(d, "a", "adapter_model.safetensors"), os.path.join(d, "fifo"))
    nan_adapter(os.path.join(d, "nan1"), 1e39, 0.01)
    nan_adapter(os.path.join(d, "nan2"), 16, 1e18)
    sparse_adapter(os.path.join(d, "sparse"))
    return outside


# ----------------------------------------------------------------------------------------------
# own servers


def stream_cut_by_shutdown(quiver, model_args):
    """When the shutdown grace ran out, streams were cut with no final chunk, no error event
    and no [DONE] (exit code still 0)."""
    S = Server(quiver, model_args + ["--shutdown-grace", "1"], "cut").wait_ready()
    try:
        got = {}

        def run(kind):
            body = {"model": SERVED, "max_tokens": 4000, "stream": True, "ignore_eos": True, "temperature": 0}
            path = "/v1/completions" if kind == "cmpl" else "/v1/chat/completions"
            body.update({"prompt": PROMPT} if kind == "cmpl" else {"messages": [{"role": "user", "content": "Hi"}]})
            with httpx.stream("POST", S.base + path, json=body, timeout=60) as r:
                got[kind] = sse_lines(r)

        def plain():
            got["plain"] = httpx.post(S.base + "/v1/completions", json={"model": SERVED, "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True}, timeout=60)

        ts = [threading.Thread(target=run, args=(k,)) for k in ("cmpl", "chat")] + [threading.Thread(target=plain)]
        for t in ts:
            t.start()
        time.sleep(1.5)
        os.kill(S.proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        r = S.post("/v1/completions", {"model": SERVED, "prompt": "x", "max_tokens": 2})
        check(r.status_code == 503 and r.headers.get("retry-after"), (r.status_code, r.headers))
        for t in ts:
            t.join(timeout=30)
        for k in ("cmpl", "chat"):
            lines = got.get(k, [])
            check(len(lines) >= 3 and lines[-1] == "[DONE]", f"{k}: stream ended without [DONE]: {lines[-3:]}")
            last = json.loads(lines[-2])
            check("error" in last and last["error"]["code"] == 503, f"{k}: no error event before [DONE]: {last}")
        error_shape(got["plain"], 503)
        rc = S.proc.wait(timeout=20)
        check(rc == 0, f"exit status {rc}")
    finally:
        S.kill()


def queue_429_retry_after(quiver, model_args):
    """A 429 for a full queue carries Retry-After; more prompts than the queue holds is a 400."""
    S = Server(quiver, model_args + ["--max-queued-requests", "2", "--max-running-requests", "1"], "q").wait_ready()
    try:
        e = error_shape(S.post("/v1/completions", {"model": SERVED, "prompt": ["a", "b", "c"], "max_tokens": 1}), 400)
        check("at most 2" in e["message"], e)

        async def go():
            async with httpx.AsyncClient(base_url=S.base, timeout=120) as c:
                rs = await asyncio.gather(*[c.post("/v1/completions", json={"model": SERVED, "prompt": PROMPT, "max_tokens": 32, "ignore_eos": True}) for _ in range(8)])
            return rs
        rs = asyncio.run(go())
        busy = [r for r in rs if r.status_code == 429]
        check(busy and all(r.headers.get("retry-after") for r in busy), [(r.status_code, dict(r.headers)) for r in rs])
    finally:
        S.kill()


# ----------------------------------------------------------------------------------------------
# soak

STABLE = [SERVED, "a", "b", "c", "d"]
PROMPTS = [PROMPT, "Once upon a time", "def fib(n):", "The best way to learn", "List of colors:", "In 1492,"]


def validate_completion(v, max_tokens):
    check(v.get("object") == "text_completion" and len(v["choices"]) == 1, v)
    ch = v["choices"][0]
    check(isinstance(ch["text"], str) and ch["finish_reason"] in ("stop", "length"), v)
    u = v["usage"]
    check(u["completion_tokens"] <= max_tokens and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and u["prompt_tokens"] > 0, u)


def validate_stream(lines, disconnected):
    if not disconnected:
        check(lines and lines[-1] == "[DONE]", lines[-2:])
    text, finish = "", None
    for data in lines:
        if data == "[DONE]":
            continue
        v = json.loads(data)
        check("error" not in v, v)
        check(v.get("object") == "text_completion", v)
        for ch in v["choices"]:
            text += ch["text"]
            finish = ch["finish_reason"] or finish
    if not disconnected:
        check(finish in ("stop", "length"), lines[-3:])
    return text


async def soak_requests(S, total, refs, stats):
    """`total` requests, 16 at a time: greedy probes (must equal their alone reference), sampled
    ones, streaming or not, 10% disconnected after the first chunk; some on churned adapters."""
    rng = random.Random(20)
    sem = asyncio.Semaphore(16)
    churned = ["e1", "e2"]

    async def one(c, i):
        async with sem:
            probe = rng.random() < 0.3
            model = rng.choice(STABLE + churned if rng.random() < 0.1 else STABLE)
            p = rng.randrange(len(PROMPTS))
            max_tokens = 6 if probe else rng.randint(1, 6)
            body = {"model": model, "prompt": PROMPTS[p], "max_tokens": max_tokens,
                    "temperature": 0 if probe else rng.choice([0, 0.8]), "seed": i}
            stream = rng.random() < 0.5
            disconnect = stream and rng.random() < 0.2
            if stream:
                body["stream"] = True
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    if model in churned and r.status_code in (404, 400):
                        stats["churn_refused"] += 1
                        return
                    check(r.status_code == 200, (r.status_code, await r.aread()))
                    if model in STABLE:
                        stats["ok"][model] += 1
                    lines = []
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line[6:])
                            if disconnect:
                                break
                    stats["disconnects"] += disconnect
                    text = validate_stream(lines, disconnect)
            else:
                r = await c.post("/v1/completions", json=body)
                if model in churned and r.status_code in (404, 400):
                    stats["churn_refused"] += 1
                    return
                check(r.status_code == 200, (r.status_code, r.text[:300]))
                if model in STABLE:
                    stats["ok"][model] += 1
                v = r.json()
                validate_completion(v, max_tokens)
                text = v["choices"][0]["text"]
            stats["done"] += 1
            if probe and model in STABLE and not disconnect:
                stats["probes"] += 1
                check(text == refs[(model, p)], f"probe {model} {PROMPTS[p]!r}: {text!r} != alone {refs[(model, p)]!r}")

    async with httpx.AsyncClient(base_url=S.base, timeout=300, limits=httpx.Limits(max_connections=32)) as c:
        await asyncio.gather(*[one(c, i) for i in range(total)])


def churn(S, stop, log):
    """Load, replace and unload e1/e2 (copies of b and c) until `stop`."""
    rng = random.Random(7)
    loaded = {"e1": False, "e2": False}
    while not stop.is_set():
        name = rng.choice(["e1", "e2"])
        src = rng.choice(["b", "c"])
        if not loaded[name]:
            r = S.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": src})
            loaded[name] = r.status_code == 200
        elif rng.random() < 0.5:
            r = S.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": src, "load_inplace": True})
        else:
            r = S.post("/v1/unload_lora_adapter", {"lora_name": name})
            loaded[name] = r.status_code != 200
        check(r.status_code in (200, 429), r.text)
        log.append(r.status_code)
        time.sleep(0.02)
    for name, on in loaded.items():
        if on:
            S.post("/v1/unload_lora_adapter", {"lora_name": name})


def max_gap(S, n_tok, during=None):
    """Two base streams of `n_tok` tokens; the longest gap between their chunks (seconds),
    with `during()` running meanwhile if given."""
    gaps = []

    def stream():
        body = {"model": SERVED, "prompt": PROMPT, "max_tokens": n_tok, "stream": True, "ignore_eos": True, "temperature": 0}
        with httpx.stream("POST", S.base + "/v1/completions", json=body, timeout=120) as r:
            last = None
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    now = time.time()
                    if last is not None:
                        gaps.append(now - last)
                    last = now

    ts = [threading.Thread(target=stream) for _ in range(2)]
    for t in ts:
        t.start()
    time.sleep(0.3)
    if during:
        during()
    for t in ts:
        t.join()
    gaps.sort()
    return gaps[-1], gaps[len(gaps) // 2]


def back_to_baseline(S, timeout=30):
    """Waits until no request runs or waits (overall and per adapter) and no KV block is held
    by a sequence; returns the metric families then."""
    deadline = time.time() + timeout
    while True:
        fams = metrics(S)
        running = fams["vllm:num_requests_running"].samples[0].value
        waiting = fams["vllm:num_requests_waiting"].samples[0].value
        kv = fams["vllm:kv_cache_usage_perc"].samples[0].value
        per = [s.value for n in ("quiver:adapter_requests_running", "quiver:adapter_requests_waiting") for s in fams[n].samples]
        if (running, waiting, kv) == (0, 0, 0) and not any(per):
            return fams
        check(time.time() < deadline, f"not back to baseline: running {running} waiting {waiting} kv {kv} per-adapter {per}")
        time.sleep(0.2)


def soak(quiver, model_args, total=2000):
    d = tempfile.mkdtemp(prefix="quiver-soak-")
    prepare_adapters(d)
    # 78 MB rank-64 adapter on every projection: the probe's 0.52 s stall.
    make_random_adapter(os.path.join(d, "big"), seed=64, rank=64, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    S = Server(quiver, model_args + ["--lora-dir", d, "--max-loras", "4", "--max-lora-rank", "64", "--max-loaded-loras", "5",
                                     "--max-running-requests", "16", "--lora-modules"] + [f"{a}={d}/{a}" for a in "abcd"], "soak").wait_ready()
    try:
        refs = {}
        with httpx.Client(base_url=S.base, timeout=120) as c:
            for m in STABLE:
                for p in range(len(PROMPTS)):
                    r = c.post("/v1/completions", json={"model": m, "prompt": PROMPTS[p], "max_tokens": 6, "temperature": 0})
                    check(r.status_code == 200, r.text)
                    refs[(m, p)] = r.json()["choices"][0]["text"]
        check(len({refs[(m, 0)] for m in STABLE}) > 2, "adapters do not change the output")
        before = metrics(S)

        def ok_counts(fams):
            out = {}
            for s in fams["vllm:request_success"].samples:
                if s.name.endswith("_total"):
                    a = s.labels["adapter"] or SERVED
                    out[a] = out.get(a, 0) + s.value
            return out

        stats = {"ok": {m: 0 for m in STABLE}, "done": 0, "probes": 0, "disconnects": 0, "churn_refused": 0}
        stop = threading.Event()
        log = []
        ct = threading.Thread(target=churn, args=(S, stop, log))
        t0 = time.time()
        ct.start()
        try:
            asyncio.run(soak_requests(S, total, refs, stats))
        finally:
            stop.set()
            ct.join()
        took = time.time() - t0

        # Everything returns to baseline.
        fams = back_to_baseline(S)
        # Counters: every accepted request on a stable model is counted once, by the server too.
        b, a = ok_counts(before), ok_counts(fams)
        for m in STABLE:
            delta = a.get(m, 0) - b.get(m, 0)
            check(delta == stats["ok"][m], f"{m}: server counted {delta} finished requests, client had {stats['ok'][m]} accepted")
        # Loads of the 78 MB adapter must not stall unaffected streams. The machine is shared,
        # so rounds without and with loads alternate and the medians of their longest gaps are
        # compared: noise hits both alike, a stall on the engine thread hits every load round.
        loaded = [False]

        def loads():
            for _ in range(2):
                r = S.post("/v1/load_lora_adapter", {"lora_name": "big", "lora_path": "big", "load_inplace": loaded[0]})
                check(r.status_code == 200, r.text)
                loaded[0] = True

        rounds = [(max_gap(S, 100), max_gap(S, 100, loads)) for _ in range(3)]
        base_gap = sorted(r[0][0] for r in rounds)[1]
        load_gap = sorted(r[1][0] for r in rounds)[1]
        base_med, load_med = rounds[1][0][1], rounds[1][1][1]
        limit = max(0.1, 1.5 * base_gap)
        check(load_gap < limit, f"longest inter-token gap {load_gap:.3f} s during 78 MB loads (baseline {base_gap:.3f} s, limit {limit:.3f} s; rounds {rounds})")

        back_to_baseline(S)

        check(fams["quiver:adapter_load_failures"].samples[0].value == 0, "a load failed during the soak")
        # Greedy outputs unchanged after the abuse.
        with httpx.Client(base_url=S.base, timeout=120) as c:
            for m in STABLE:
                r = c.post("/v1/completions", json={"model": m, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0})
                check(r.json()["choices"][0]["text"] == refs[(m, 0)], f"{m} changed after the soak")
        check(stats["done"] + stats["churn_refused"] >= total and stats["probes"] > 300 and stats["disconnects"] > 50, stats)
        check(len(log) > 20, f"only {len(log)} churn operations")
        print(f"  soak: {total} requests in {took:.0f} s ({stats['probes']} probes, {stats['disconnects']} disconnects, "
              f"{len(log)} load/replace/unload ops, {stats['churn_refused']} refused on churned names); "
              f"longest inter-token gap (median of 3 rounds) {base_gap * 1000:.0f} ms without loads (median gap {base_med * 1000:.0f}), "
              f"{load_gap * 1000:.0f} ms during 78 MB loads (median gap {load_med * 1000:.0f})", flush=True)
    finally:
        S.kill()
        shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quiver", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("-k", default=None, help="run only tests whose name contains this")
    ap.add_argument("--soak-requests", type=int, default=2000)
    a = ap.parse_args()
    quiver = os.path.abspath(a.quiver)
    model_args = ["--model", a.model] if a.model else []
    passed, failed = 0, 0

    def run(name, fn, *args):
        nonlocal passed, failed
        if a.k and a.k not in name:
            return
        t0 = time.time()
        try:
            fn(*args)
            passed += 1
            print(f"PASS {name} ({time.time() - t0:.1f}s)", flush=True)
        except Exception:
            failed += 1
            print(f"FAIL {name} ({time.time() - t0:.1f}s)\n{traceback.format_exc()}", flush=True)

    d = tempfile.mkdtemp(prefix="quiver-hostile-")
    outside = None
    S = None
    try:
        outside = hostile_lora_dir(d)
        if not a.k or any(a.k in fn.__name__ for fn in TESTS):
            S = Server(quiver, model_args + ["--lora-dir", d, "--max-loras", "4", "--max-lora-rank", "64"], "hostile", api_key=API_KEY).wait_ready()
            for fn in TESTS:
                run(fn.__name__, fn, S, d)
            if S.proc.poll() is not None or failed:
                print(f"--- server log tail ---\n{S.tail(20)}")
            S.kill()
        run("stream_cut_by_shutdown", stream_cut_by_shutdown, quiver, model_args)
        run("queue_429_retry_after", queue_429_retry_after, quiver, model_args)
        run("soak", soak, quiver, model_args, a.soak_requests)
    finally:
        if S:
            S.kill()
        shutil.rmtree(d, ignore_errors=True)
        if outside:
            shutil.rmtree(outside, ignore_errors=True)
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
