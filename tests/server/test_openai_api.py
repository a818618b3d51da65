#!/usr/bin/env python3
"""End-to-end tests of `quiver serve` with real clients (the official `openai` package,
prometheus_client's text parser, raw HTTP for the non-OpenAI routes).

    python tests/server/test_openai_api.py --quiver target/release/quiver [--model PATH] [-k NAME]

Starts servers on ephemeral ports on 127.0.0.1, always kills them at the end, and prints
`N passed, M failed` as its last line (exit status non-zero on any failure).
"""

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import httpx
import numpy as np
import openai
from prometheus_client.parser import text_string_to_metric_families
from safetensors.numpy import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
API_KEY = "test-key-123"
SERVED = "smol"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]

# ----------------------------------------------------------------------------------------------
# adapters


def smollm2_dims():
    # SmolLM2-135M: hidden 576, 30 layers, 9 heads / 3 kv heads of 64, FFN 1536.
    return dict(hidden=576, layers=30, q=576, kv=192, inter=1536)


def make_random_adapter(d, seed, rank=8, targets=("q_proj", "v_proj", "o_proj", "down_proj"), scale=0.35):
    """A PEFT-layout LoRA adapter with random A/B strong enough to change greedy text."""
    dims = smollm2_dims()
    shapes = {"q_proj": (dims["hidden"], dims["q"]), "k_proj": (dims["hidden"], dims["kv"]),
              "v_proj": (dims["hidden"], dims["kv"]), "o_proj": (dims["q"], dims["hidden"]),
              "gate_proj": (dims["hidden"], dims["inter"]), "up_proj": (dims["hidden"], dims["inter"]),
              "down_proj": (dims["inter"], dims["hidden"])}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(dims["layers"]):
        for t in targets:
            fin, fout = shapes[t]
            part = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            pre = f"base_model.model.model.layers.{layer}.{part}.{t}"
            tensors[f"{pre}.lora_A.weight"] = (rng.uniform(-1, 1, (rank, fin)) / np.sqrt(fin)).astype(np.float32)
            tensors[f"{pre}.lora_B.weight"] = (rng.standard_normal((fout, rank)) * scale / np.sqrt(rank)).astype(np.float32)
    os.makedirs(d, exist_ok=True)
    save_file(tensors, os.path.join(d, "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
           "target_modules": list(targets), "bias": "none", "use_rslora": False, "fan_in_fan_out": False,
           "base_model_name_or_path": "smollm2"}
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)


CACHE = os.environ.get("QUIVER_CACHE", os.path.join(REPO, ".cache"))


def prepare_adapters(lora_dir):
    """Four adapters a..d under lora_dir: the reference PEFT adapters if present, else random."""
    ref = os.path.join(CACHE, "ref", "adapters")
    names = ["a", "b", "c", "d"]
    src = ["a-qv-r8", "b-all-r16-rslora", "c-patterns", "e-qk-r4"]
    for i, (n, s) in enumerate(zip(names, src)):
        p = os.path.join(ref, s)
        if os.path.exists(os.path.join(p, "adapter_model.safetensors")):
            shutil.copytree(p, os.path.join(lora_dir, n))
        else:
            make_random_adapter(os.path.join(lora_dir, n), seed=100 + i, rank=8 if i % 2 == 0 else 16)
    return names


# ----------------------------------------------------------------------------------------------
# server process


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, quiver, args, name, api_key=None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = os.path.join(tempfile.gettempdir(), f"quiver-test-{name}-{os.getpid()}.log")
        self.log = open(self.log_path, "w")
        cmd = [quiver, "serve", "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", SERVED] + args
        if api_key:
            cmd += ["--api-key", api_key]
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout=300):
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.tail()}")

    def tail(self, n=40):
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])

    def headers(self):
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw):
        return openai.OpenAI(base_url=self.base + "/v1", api_key=self.api_key or "none", max_retries=0, timeout=120, **kw)

    def aclient(self):
        return openai.AsyncOpenAI(base_url=self.base + "/v1", api_key=self.api_key or "none", max_retries=0, timeout=300)

    def post(self, path, body=None, raw=None, headers=None):
        h = self.headers() if headers is None else headers
        if raw is not None:
            return httpx.post(self.base + path, content=raw, headers={**h, "content-type": "application/json"}, timeout=120)
        return httpx.post(self.base + path, json=body, headers=h, timeout=120)

    def get(self, path, headers=None):
        return httpx.get(self.base + path, headers=self.headers() if headers is None else headers, timeout=60)

    def kill(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)
        self.log.close()


# ----------------------------------------------------------------------------------------------
# test harness

class Runner:
    """Runs named tests (those whose name contains `only`, when given), printing PASS/FAIL
    with the time and the traceback; `finish` prints the `N passed, M failed` line and exits."""

    def __init__(self, only=None):
        self.only, self.passed, self.failed = only, 0, 0

    def run(self, name, fn, *args):
        if self.only and self.only not in name:
            return
        t0 = time.time()
        try:
            fn(*args)
            self.passed += 1
            print(f"PASS {name} ({time.time() - t0:.1f}s)", flush=True)
        except Exception:
            self.failed += 1
            print(f"FAIL {name} ({time.time() - t0:.1f}s)\n{traceback.format_exc()}", flush=True)

    def finish(self):
        print(f"{self.passed} passed, {self.failed} failed")
        sys.exit(1 if self.failed else 0)


TESTS = []


def test(fn):
    TESTS.append(fn)
    return fn


def check(cond, msg=""):
    if not cond:
        raise AssertionError(msg)


def error_shape(resp, status, field=None):
    check(resp.status_code == status, f"status {resp.status_code} != {status}: {resp.text[:400]}")
    e = resp.json().get("error")
    check(isinstance(e, dict) and {"message", "type", "param", "code"} <= set(e), f"not an OpenAI error: {resp.text[:400]}")
    if field:
        check(field in e["message"], f"message does not name `{field}`: {e['message']}")
    return e


def greedy(c, model, prompt=PROMPT, n_tok=12, **kw):
    r = c.completions.create(model=model, prompt=prompt, max_tokens=n_tok, temperature=0, **kw)
    return r.choices[0].text


# ----------------------------------------------------------------------------------------------
# tests on the main server (API key, four adapters, --lora-dir)


@test
def models_list(S):
    c = S.client()
    ids = {m.id: m for m in c.models.list().data}
    check(SERVED in ids, ids.keys())
    for a in ["a", "b", "c"]:
        check(a in ids, f"{a} missing: {list(ids)}")
        m = ids[a].model_dump()
        check(m["parent"] == SERVED, m)
        check(m["root"] == a, m)  # relative to --lora-dir: no server path is shown


@test
def completion_nonstream_and_stream_agree(S):
    c = S.client()
    r = c.completions.create(model=SERVED, prompt=PROMPT, max_tokens=10, temperature=0)
    ch = r.choices[0]
    check(ch.finish_reason in ("length", "stop"), ch.finish_reason)
    check(r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0, r.usage)
    check(r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens)
    text = "".join(x.choices[0].text for x in c.completions.create(model=SERVED, prompt=PROMPT, max_tokens=10, temperature=0, stream=True) if x.choices)
    check(text == ch.text, f"{text!r} != {ch.text!r}")
    # Token-id prompt and list-of-strings prompt.
    ids = S.post("/v1/completions", {"model": SERVED, "prompt": [1, 2, 3, 4], "max_tokens": 3, "temperature": 0})
    check(ids.status_code == 200, ids.text)
    r2 = c.completions.create(model=SERVED, prompt=[PROMPT, "Once upon a time"], max_tokens=4, temperature=0)
    check(len(r2.choices) == 2 and r2.choices[0].text == greedy(c, SERVED, n_tok=4), r2)


@test
def chat_nonstream_stream_usage(S):
    c = S.client()
    r = c.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=12, temperature=0)
    text = r.choices[0].message.content
    check(r.choices[0].message.role == "assistant" and text, r)
    chunks = list(c.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    st = "".join(x.choices[0].delta.content or "" for x in chunks if x.choices)
    check(st == text, f"{st!r} != {text!r}")
    check(chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == r.usage.completion_tokens, chunks[-1])
    check(any(x.choices and x.choices[0].finish_reason for x in chunks), "no finish_reason chunk")
    r2 = c.chat.completions.create(model=SERVED, messages=CHAT, max_completion_tokens=3, temperature=0)
    check(r2.usage.completion_tokens <= 3, r2.usage)


@test
def n_and_seed(S):
    c = S.client()
    r = c.completions.create(model=SERVED, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=7)
    check(sorted(ch.index for ch in r.choices) == [0, 1, 2], r.choices)
    r2 = c.completions.create(model=SERVED, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=7)
    check([x.text for x in r.choices] == [x.text for x in r2.choices], "seeded sampling not reproducible")
    r3 = c.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=6, temperature=0.9, n=2, stream=False)
    check(len(r3.choices) == 2)
    got = {}
    for x in c.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=6, temperature=0.9, n=2, stream=True):
        for ch in x.choices:
            got[ch.index] = got.get(ch.index, "") + (ch.delta.content or "")
    check(sorted(got) == [0, 1], got)


@test
def logprobs(S):
    c = S.client()
    r = c.completions.create(model=SERVED, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    check(len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens, lp)
    check(all(x <= 0 for x in lp.token_logprobs), lp.token_logprobs)
    check(all(1 <= len(t) <= 4 for t in lp.top_logprobs), lp.top_logprobs)
    # Greedy: the chosen token is the best alternative.
    check(all(abs(max(t.values()) - v) < 1e-4 for t, v in zip(lp.top_logprobs, lp.token_logprobs)), lp)
    r = c.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    check(len(content) == r.usage.completion_tokens, content)
    check(all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content), content)


@test
def stop_sequences(S):
    c = S.client()
    full = greedy(c, SERVED, n_tok=24)
    words = [w for w in full.split(" ") if len(w) >= 3]
    check(len(words) >= 2, f"text too short to pick a stop word: {full!r}")
    stop = words[1]
    r = c.completions.create(model=SERVED, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "zzzzqq"])
    want = full[:full.index(stop)]
    check(r.choices[0].text == want, f"{r.choices[0].text!r} != {want!r} (stop {stop!r})")
    check(r.choices[0].finish_reason == "stop", r.choices[0].finish_reason)
    r = c.completions.create(model=SERVED, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop)
    check(r.choices[0].text == want)


@test
def adapters_change_output_and_naming_forms(S):
    c = S.client()
    base = greedy(c, SERVED, n_tok=16)
    outs = {a: greedy(c, a, n_tok=16) for a in ["a", "b", "c"]}
    check(any(o != base for o in outs.values()), f"no adapter changed the output: {outs} vs {base!r}")
    check(greedy(c, f"{SERVED}:a", n_tok=16) == outs["a"], "base:adapter form")
    check(greedy(c, "anything: a ", n_tok=16) == outs["a"], "base:adapter with spaces")
    check(greedy(c, SERVED, n_tok=16, extra_body={"lora_path": "a"}) == outs["a"], "lora_path field")
    check(greedy(c, f"{SERVED}:", n_tok=16, extra_body={"lora_path": "a"}) == base, "`base:` = base")
    r = S.post("/generate", {"text": PROMPT, "lora_path": "a", "sampling_params": {"max_new_tokens": 16, "temperature": 0}})
    check(r.status_code == 200 and r.json()["text"] == outs["a"], r.text[:300])
    r = S.post("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 16, "temperature": 0}})
    check(r.status_code == 200 and r.json()["text"] == base, r.text[:300])
    check(r.json()["meta_info"]["completion_tokens"] == 16 or r.json()["meta_info"]["finish_reason"]["type"] == "stop", r.text)


@test
def concurrent_streams_equal_alone(S):
    c = S.client()
    adapters = ["a", "b", "c", "d"]  # d is loaded on demand from --lora-dir
    prompts = [PROMPT, "Once upon a time", "def fib(n):", "The best way to learn"]
    alone = {}
    for i in range(16):
        m, p = adapters[i % 4], prompts[i // 4]
        alone[i] = greedy(c, m, prompt=p, n_tok=16)

    async def one(ac, i):
        m, p = adapters[i % 4], prompts[i // 4]
        s = await ac.completions.create(model=m, prompt=p, max_tokens=16, temperature=0, stream=True)
        out = ""
        async for ch in s:
            if ch.choices:
                out += ch.choices[0].text
        return out

    async def all_():
        ac = S.aclient()
        return await asyncio.gather(*[one(ac, i) for i in range(16)])

    got = asyncio.run(all_())
    bad = [(i, got[i], alone[i]) for i in range(16) if got[i] != alone[i]]
    check(not bad, f"{len(bad)} of 16 differ, e.g. {bad[:2]}")
    check(len({alone[i] for i in range(4)}) > 1, "adapters gave identical outputs")


@test
def on_demand_loading(S):
    c = S.client()
    ids = [m.id for m in c.models.list().data]
    check("d" in ids, f"d should be loaded by now (concurrent test): {ids}")


@test
def load_unload_replace_while_running(S, lora_dir):
    c = S.client()
    ref_b, ref_c = greedy(c, "b", n_tok=16), greedy(c, "c", n_tok=16)
    # A long stream on `a` runs through all of this.
    result = {}

    def long_run():
        try:
            s = c.completions.create(model="a", prompt=PROMPT, max_tokens=64, temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})
            result["text"] = "".join(x.choices[0].text for x in s if x.choices)
        except Exception as e:  # noqa
            result["err"] = repr(e)

    t = threading.Thread(target=long_run)
    t.start()
    r = S.post("/v1/load_lora_adapter", {"lora_name": "e", "lora_path": os.path.join(lora_dir, "b")})
    check(r.status_code == 200, r.text)
    check(greedy(c, "e", n_tok=16) == ref_b, "e (=b) differs from b")
    # Same name again without load_inplace: 400.
    error_shape(S.post("/v1/load_lora_adapter", {"lora_name": "e", "lora_path": "b"}), 400)
    # Replace in place with compare-and-swap.
    ver = [a for a in S.get("/v1/lora_adapters").json() if a["name"] == "e"][0]["version"]
    r = S.post("/v1/load_lora_adapter", {"lora_name": "e", "lora_path": "c", "load_inplace": True, "expected_version": ver})
    check(r.status_code == 200, r.text)
    check(greedy(c, "e", n_tok=16) == ref_c, "replaced e should equal c")
    error_shape(S.post("/v1/load_lora_adapter", {"lora_name": "e", "lora_path": "b", "load_inplace": True, "expected_version": ver}), 409)
    # A stream on `e` while `e` is unloaded finishes on the weights it started with.
    s = c.completions.create(model="e", prompt=PROMPT, max_tokens=16, temperature=0, stream=True)
    first = next(iter(s))
    r = S.post("/v1/unload_lora_adapter", {"lora_name": "e"})
    check(r.status_code == 200, r.text)
    rest = "".join(x.choices[0].text for x in s if x.choices)
    check(first.choices[0].text + rest == ref_c, f"stream across unload: {first.choices[0].text + rest!r} != {ref_c!r}")
    try:
        greedy(c, "e")
        check(False, "e should be gone")
    except openai.NotFoundError:
        pass
    error_shape(S.post("/v1/unload_lora_adapter", {"lora_name": "e"}), 404)
    # SGLang's endpoints and JSON.
    r = S.post("/load_lora_adapter", {"lora_name": "f", "lora_path": "b", "pinned": True})
    check(r.status_code == 200 and r.json()["success"] is True and "f" in r.json()["loaded_adapters"], r.text)
    r = S.post("/unload_lora_adapter", {"lora_name": "f"})
    check(r.status_code == 200 and r.json()["success"] is True and "f" not in r.json()["loaded_adapters"], r.text)
    r = S.post("/unload_lora_adapter", {"lora_name": "f"})
    check(r.status_code == 400 and r.json()["success"] is False and "does not exist" in r.json()["error_message"], r.text)
    t.join(timeout=300)
    check("text" in result, f"long stream failed: {result}")
    check(result["text"] == greedy(c, "a", n_tok=64, extra_body={"ignore_eos": True}), "long stream during load/unload changed")


@test
def unknown_adapter_404(S):
    c = S.client()
    try:
        greedy(c, "no-such-adapter")
        check(False, "expected 404")
    except openai.NotFoundError as e:
        check("no-such-adapter" in str(e), str(e))
    error_shape(S.post("/v1/chat/completions", {"model": "nope", "messages": CHAT}), 404)
    error_shape(S.post("/v1/completions", {"model": f"{SERVED}:nope", "prompt": "x"}), 404)


@test
def path_sandbox_400(S, lora_dir):
    outside = tempfile.mkdtemp(prefix="quiver-outside-")
    try:
        make_random_adapter(outside, seed=5)
        for p in [outside, "../" + os.path.basename(outside), os.path.join(lora_dir, "..", os.path.basename(outside)), "/etc"]:
            e = error_shape(S.post("/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": p}), 400)
            check(e["param"] == "lora_path", e)
        # Symlink inside the dir pointing out.
        link = os.path.join(lora_dir, "sneaky")
        os.symlink(outside, link)
        try:
            error_shape(S.post("/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": "sneaky"}), 400)
            error_shape(S.post("/v1/completions", {"model": "sneaky", "prompt": "x"}), 404)
        finally:
            os.unlink(link)
        r = S.post("/load_lora_adapter", {"lora_name": "evil", "lora_path": outside})
        check(r.status_code == 400 and r.json()["success"] is False, r.text)
        check("evil" not in [a["name"] for a in S.get("/v1/lora_adapters").json()], "evil got loaded")
    finally:
        shutil.rmtree(outside, ignore_errors=True)


@test
def api_key_401(S):
    check(httpx.get(S.base + "/health").status_code == 200, "/health must not need the key")
    error_shape(S.get("/v1/models", headers={}), 401)
    error_shape(S.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    error_shape(S.get("/metrics", headers={}), 401)
    bad = openai.OpenAI(base_url=S.base + "/v1", api_key="wrong", max_retries=0)
    try:
        bad.models.list()
        check(False, "expected 401")
    except openai.AuthenticationError:
        pass


@test
def bad_requests_400(S):
    error_shape(S.post("/v1/completions", raw=b'{"model": "smol", "prompt": '), 400)
    error_shape(S.post("/v1/chat/completions", raw=b"not json"), 400)
    cases = [
        ({"prompt": PROMPT, "max_tokens": "ten"}, "max_tokens"),
        ({"prompt": PROMPT, "max_tokens": -5}, "max_tokens"),
        ({"prompt": PROMPT, "temperature": -0.1}, "temperature"),
        ({"prompt": PROMPT, "n": 10 ** 9}, "n"),
        ({"prompt": PROMPT, "top_p": "x"}, "top_p"),
        ({"prompt": 12.5}, "prompt"),
        ({"prompt": PROMPT, "stop": 3}, "stop"),
        ({"prompt": PROMPT, "logprobs": 100}, "logprobs"),
    ]
    for body, field in cases:
        e = error_shape(S.post("/v1/completions", {"model": SERVED, **body}), 400, field)
        check(e["param"] == field, e)
    e = error_shape(S.post("/v1/chat/completions", {"model": SERVED, "messages": "hi"}), 400, "messages")
    c = S.client()
    for kw, field in [(dict(max_tokens=-1), "max_tokens"), (dict(temperature=-1), "temperature"), (dict(n=100000), "n")]:
        try:
            c.chat.completions.create(model=SERVED, messages=CHAT, **kw)
            check(False, f"expected 400 for {kw}")
        except openai.BadRequestError as ex:
            check(field in str(ex), str(ex))
    # Too long for the context window.
    e = error_shape(S.post("/v1/completions", {"model": SERVED, "prompt": "hello " * 10000, "max_tokens": 10}), 400)
    check("context length" in e["message"], e)


@test
def metrics_parse(S):
    text = S.get("/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    untyped = [n for n, f in fams.items() if f.type == "unknown"]
    check(not untyped, f"families without a usable TYPE line: {untyped}")
    check("vllm:lora_requests_info" in fams, sorted(fams))
    s = fams["vllm:lora_requests_info"].samples[0]
    check({"running_lora_adapters", "waiting_lora_adapters", "max_lora"} <= set(s.labels), s.labels)
    for name in ["vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits", "quiver:adapter_loads", "quiver:adapter_evictions"]:
        check(name in fams, f"{name} missing")
    adapters_seen = {x.labels.get("adapter") for x in fams["vllm:generation_tokens"].samples}
    check({"a", "b"} <= adapters_seen, adapters_seen)


@test
def sglang_native(S):
    r = S.get("/get_model_info")
    check(r.status_code == 200 and r.json()["is_generation"] is True, r.text)
    r = S.post("/generate", {"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    check(r.status_code == 200 and len(r.json()) == 2, r.text)
    with httpx.stream("POST", S.base + "/generate", json={"text": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 5, "temperature": 0}},
                      headers=S.headers(), timeout=60) as resp:
        lines = [l[6:] for l in resp.iter_lines() if l.startswith("data: ")]
    check(lines[-1] == "[DONE]", lines[-3:])
    last = json.loads(lines[-2])
    check(last["meta_info"]["finish_reason"] is not None, last)
    e = error_shape(S.post("/generate", {"text": "x", "sampling_params": {"temperature": -2}}), 400, "temperature")


@test
def bench_serve_counts_match_server(S):
    """`quiver bench serve` against this server: the report has every field, and its request and
    token counts equal what the server accounted from the same requests (its /metrics counters,
    which are fed by the `usage` it returned)."""
    def counters():
        fams = {f.name: f for f in text_string_to_metric_families(S.get("/metrics").text)}
        return {k: sum(x.value for x in fams[k].samples if x.name.endswith("_total"))
                for k in ["vllm:prompt_tokens", "vllm:generation_tokens"]}
    before = counters()
    out = os.path.join(tempfile.mkdtemp(prefix="quiver-bench-"), "report.json")
    n, in_len, out_len = 8, 24, 10
    cmd = [S.cmd[0], "bench", "serve", "--base-url", S.base, "--api-key", API_KEY, "--lora-names", "a", "c",
           "--lora-distribution", "uniform", "--random-input-len", str(in_len), "--random-output-len", str(out_len), "--random-range-ratio", "1",
           "--num-prompts", str(n), "--max-concurrency", "4", "--ignore-eos", "--seed", "5", "--no-progress",
           "--output-json", out]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    check(r.returncode == 0, r.stderr[-2000:])
    check("Serving Benchmark Result" in r.stdout, r.stdout[-1000:])
    rep = json.load(open(out))
    s = rep  # the metrics are flattened into the top level
    for k in ["num_requests", "completed", "failed", "errors", "duration_s", "total_input_tokens", "total_output_tokens",
              "request_throughput", "input_throughput", "output_throughput", "total_token_throughput",
              "peak_output_throughput", "concurrency", "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "per_adapter"]:
        check(k in s, f"summary lacks {k}: {sorted(s)}")
    for k in ["mean", "median", "p90", "p99"]:
        check(k in s["ttft_ms"] and k in s["e2el_ms"], s["ttft_ms"])
    check(s["num_requests"] == n and s["completed"] == n and s["failed"] == 0, s)
    after = counters()
    gen = after["vllm:generation_tokens"] - before["vllm:generation_tokens"]
    pre = after["vllm:prompt_tokens"] - before["vllm:prompt_tokens"]
    check(s["total_output_tokens"] == gen == n * out_len, (s["total_output_tokens"], gen))
    check(s["total_input_tokens"] == pre == n * in_len, (s["total_input_tokens"], pre))
    per = {a["adapter"]: a for a in s["per_adapter"]}
    check(sum(a["completed"] for a in per.values()) == n and {"a", "c"} <= set(per), per.keys())
    check(s["ttft_ms"]["median"] > 0 and s["output_throughput"] > 0, s["ttft_ms"])


@test
def bench_lora_reports_kernels_and_step(S):
    """`quiver bench lora` end to end on the real model, small: the kernel part reports a point
    per (shape, layout, rank, adapters, rows, backend) with finite positive rates next to the
    machine's measured peaks, and the step part a base and a LoRA time per backend and the
    activation time of an adapter. Bad sizes
    are refused with a message."""
    model = S.cmd[S.cmd.index("--model") + 1:][:1] if "--model" in S.cmd else []
    out = os.path.join(tempfile.mkdtemp(prefix="quiver-bench-lora-"), "lora.json")
    cmd = [S.cmd[0], "bench", "lora"] + (["--model"] + model if model else []) + [
        "--shapes", "smollm2", "--ranks", "4", "--kernel-rows", "4,16", "--kernel-adapters", "1,2", "--kernel-reps", "1",
        "--rows", "4", "--adapters", "2", "--steps", "3", "--backends", "chunked,auto", "--output-json", out]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    check(r.returncode == 0, r.stderr[-2000:])
    rep = json.load(open(out))
    k = rep["kernels"]
    # rows 4: decode for 1 and 2 adapters; rows 16: decode and prefill for both; per backend.
    check(len(k) == 2 * (2 + 4), [(x["rows"], x["adapters"], x["layout"], x["backend"]) for x in k])
    for x in k:
        check(x["us_per_layer"] > 0 and 0 < x["gflops"] < 10 * x["peak_gflops"] and x["gbps"] > 0 and x["bandwidth_gbps"] > 0, x)
    st = rep["results"]
    check(sorted(x["backend"] for x in st) == ["auto", "chunked"] and all(x["base_ms"] > 0 and x["lora_ms"] > 0 for x in st), st)
    # The step part also times an adapter's activation into a pool, per rank.
    act = rep["activation"]
    check(len(act) == 1 and act[0]["rank"] == 4 and act[0]["slots"] == 2 and 0 < act[0]["again_ms"] < 10_000, act)
    bad = subprocess.run([S.cmd[0], "bench", "lora", "--kernel-rows", "0"], capture_output=True, text=True, timeout=60)
    check(bad.returncode != 0 and "at least 1" in bad.stderr, bad.stderr[-500:])


@test
def client_disconnect_cancels(S):
    # Start a long stream, read one chunk, drop the connection; the server must stay healthy and
    # the request must leave the running set.
    with httpx.stream("POST", S.base + "/v1/completions", json={"model": SERVED, "prompt": PROMPT, "max_tokens": 2000, "stream": True,
                                                                "ignore_eos": True, "temperature": 0}, headers=S.headers(), timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                break
    deadline = time.time() + 20
    while time.time() < deadline:
        fams = {f.name: f for f in text_string_to_metric_families(S.get("/metrics").text)}
        if fams["vllm:num_requests_running"].samples[0].value == 0 and fams["vllm:num_requests_waiting"].samples[0].value == 0:
            break
        time.sleep(0.2)
    else:
        check(False, "cancelled request still running after 20 s")


@test
def prompt_logprobs_match_transformers(S):
    """Prompt scoring through HTTP against transformers / PEFT (f32 teacher-forced top-20 from
    scripts/reference.py): every prompt token's logprob and its top alternatives, base and
    adapter `a` (= a-qv-r8), each request alone, then all together with a generating request
    in the same batches, then again with the prompts in the prefix cache."""
    refs = {SERVED: os.path.join(CACHE, "ref", "ref", "smollm2.json"), "a": os.path.join(CACHE, "ref", "ref", "smollm2-a-qv-r8.json")}
    check(os.path.exists(os.path.join(CACHE, "ref", "adapters", "a-qv-r8")), "reference adapters missing: run make test-data")
    cases = [(m, c) for m, path in refs.items() for c in json.load(open(path))["cases"][:3]]

    def body(model, c):
        return {"model": model, "prompt": c["prompt_ids"] + c["continuation_ids"], "echo": True, "logprobs": 2, "max_tokens": 0, "prompt_logprobs": 5}

    def compare(model, c, r):
        check(r.status_code == 200, r.text[:300])
        ch = r.json()["choices"][0]
        ids = c["prompt_ids"] + c["continuation_ids"]
        tl, plp = ch["logprobs"]["token_logprobs"], ch["prompt_logprobs"]
        check(len(tl) == len(ids) == len(plp) and tl[0] is None and plp[0] is None, (len(tl), len(ids)))
        compared, worst = 0, 0.0
        for j in range(1, len(ids)):
            ref = dict(zip(c["top_ids"][j - 1], c["top_logprobs"][j - 1]))
            got = {int(k): v["logprob"] for k, v in plp[j].items()}
            check(abs(got[ids[j]] - tl[j]) < 1e-6, "echo logprobs and prompt_logprobs disagree")
            for t, lp in got.items():
                if t in ref:
                    worst = max(worst, abs(lp - ref[t]))
                    compared += 1
        check(compared >= 5 * (len(ids) - 1) * 0.8, f"{model} {c['name']}: only {compared} logprobs overlap the reference")
        check(worst <= 1e-3, f"{model} {c['name']}: max |dlogprob| {worst:.2e} > 1e-3")

    for m, c in cases:
        compare(m, c, S.post("/v1/completions", body(m, c)))

    async def together():
        async with httpx.AsyncClient(base_url=S.base, headers=S.headers(), timeout=300) as h:
            gen = h.post("/v1/completions", json={"model": "b", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
            return await asyncio.gather(gen, *[h.post("/v1/completions", json=body(m, c)) for m, c in cases])
    for _ in range(2):  # the second round finds every prompt in the prefix cache
        got = asyncio.run(together())
        for (m, c), r in zip(cases, got[1:]):
            compare(m, c, r)
        check(got[0].json()["choices"][0]["text"] == greedy(S.client(), "b", n_tok=24, extra_body={"ignore_eos": True}), "generating row changed by scoring rows")


@test
def lm_eval_multiple_choice_matches_transformers(S, lora_dir):
    """lm-eval (local-completions against this server) on a 20-item multiple-choice task it
    reads from files this test writes, against lm-eval's own transformers backend (f32) on
    the same items: the same accuracy and every choice's loglikelihood within 1e-3, for the
    base model and for adapter `a` through PEFT."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    hf_dir = os.path.join(CACHE, "ref", "models", "smollm2-hf")
    check(os.path.isdir(hf_dir), f"{hf_dir} missing: run make test-data")
    d = tempfile.mkdtemp(prefix="quiver-lmeval-")
    items = [
        ("What is the capital of France?", ["Paris", "Berlin", "Madrid", "Rome"], 0),
        ("How many legs does a spider have?", ["Six", "Eight", "Ten", "Four"], 1),
        ("Which planet is known as the red planet?", ["Venus", "Jupiter", "Mars", "Saturn"], 2),
        ("What is the largest ocean on Earth?", ["Atlantic", "Indian", "Arctic", "Pacific"], 3),
        ("What do bees make?", ["Honey", "Milk", "Silk", "Wax paper"], 0),
        ("Water freezes at how many degrees Celsius?", ["100", "0", "50", "-40"], 1),
        ("Which animal is known as the king of the jungle?", ["Elephant", "Tiger", "Lion", "Wolf"], 2),
        ("What color is the sky on a clear day?", ["Green", "Red", "Yellow", "Blue"], 3),
        ("Who wrote Romeo and Juliet?", ["William Shakespeare", "Charles Dickens", "Mark Twain", "Jane Austen"], 0),
        ("What is two plus two?", ["Three", "Four", "Five", "Six"], 1),
        ("Which gas do plants absorb from the air?", ["Oxygen", "Helium", "Carbon dioxide", "Neon"], 2),
        ("What is the opposite of hot?", ["Warm", "Wet", "Loud", "Cold"], 3),
        ("Which fruit is yellow and curved?", ["Banana", "Apple", "Grape", "Cherry"], 0),
        ("How many days are in a week?", ["Five", "Seven", "Nine", "Twelve"], 1),
        ("What is the capital of Japan?", ["Beijing", "Seoul", "Tokyo", "Bangkok"], 2),
        ("Which organ pumps blood through the body?", ["Lung", "Liver", "Kidney", "Heart"], 3),
        ("What is the boiling point of water at sea level in Celsius?", ["100", "90", "80", "120"], 0),
        ("Which is the fastest land animal?", ["Horse", "Cheetah", "Turtle", "Dog"], 1),
        ("What do you call frozen water?", ["Steam", "Fog", "Ice", "Rain"], 2),
        ("Which continent is Egypt in?", ["Asia", "Europe", "South America", "Africa"], 3),
    ]
    data = os.path.join(d, "items.jsonl")
    with open(data, "w") as f:
        for q, ch, a in items:
            f.write(json.dumps({"question": q, "choices": ch, "answer": a}) + "\n")
    with open(os.path.join(d, "quiver_mc.yaml"), "w") as f:
        f.write("task: quiver_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: " + json.dumps(data) + "\n"
                "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
                "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n")
    # lm-eval's hf backend encodes with the tokenizer's special tokens (this tokenizer.json
    # prepends <|im_start|> as BOS), its API backends without unless add_bos_token is set:
    # the same flag on both makes them score the same token sequences.
    tm = TaskManager(include_path=d)
    os.environ["OPENAI_API_KEY"] = S.api_key or ""

    def run(model, model_args, **kw):
        r = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["quiver_mc"], task_manager=tm, log_samples=True, **kw)
        lls = {s["doc_id"]: [x[0] for x in s["filtered_resps"]] for s in r["samples"]["quiver_mc"]}
        return r["results"]["quiver_mc"]["acc,none"], lls

    try:
        for name, peft in [(SERVED, None), ("a", os.path.join(lora_dir, "a"))]:
            acc_q, ll_q = run("local-completions", f"model={name},base_url={S.base}/v1/completions,tokenizer={hf_dir},tokenizer_backend=huggingface,"
                              "tokenized_requests=True,add_bos_token=True,num_concurrent=4,max_retries=1", batch_size=1)
            acc_hf, ll_hf = run("hf", f"pretrained={hf_dir},dtype=float32,device=cpu" + (f",peft={peft}" if peft else ""), batch_size=8)
            check(len(ll_q) == len(items) == len(ll_hf), (len(ll_q), len(ll_hf)))
            worst = max(abs(a - b) for i in ll_q for a, b in zip(ll_q[i], ll_hf[i]))
            check(all(x < 0 for v in ll_q.values() for x in v), "a choice scored 0: prompt logprobs missing")
            check(worst <= 1e-3, f"{name}: max |dloglikelihood| {worst:.2e} vs transformers")
            check(acc_q == acc_hf, f"{name}: accuracy {acc_q} != transformers {acc_hf}")
            print(f"  lm-eval {name}: acc {acc_q:.2f} (transformers {acc_hf:.2f}), max |dll| {worst:.1e}", flush=True)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@test
def chat_continue_final_message_matches_transformers(S):
    """continue_final_message renders the prompt as transformers does (ids recovered from
    prompt_logprobs with k = 0, which lists only the prompt token at each position)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.join(CACHE, "ref", "models", "smollm2-hf"))
    msgs = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "My favourite color is"}]
    want = tok(tok.apply_chat_template(msgs, tokenize=False, continue_final_message=True), add_special_tokens=False).input_ids
    r = S.post("/v1/chat/completions", {"model": SERVED, "messages": msgs, "continue_final_message": True, "add_generation_prompt": False,
                                        "echo": True, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 0})
    check(r.status_code == 200, r.text[:300])
    v = r.json()
    got = [int(next(iter(p))) for p in v["prompt_logprobs"][1:]]
    check(got == want[1:] and v["usage"]["prompt_tokens"] == len(want), f"prompt differs from transformers: {got[-5:]} vs {want[-5:]}")
    check(v["choices"][0]["message"]["content"].startswith("My favourite color is"), v["choices"][0]["message"])


@test
def accepted_fields_do_what_vllm_does(S):
    c = S.client()
    full = greedy(c, SERVED, n_tok=24)
    words = [w for w in full.split(" ") if len(w) >= 3]
    stop = words[1]
    r = c.completions.create(model=SERVED, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], extra_body={"include_stop_str_in_output": True})
    check(r.choices[0].text == full[:full.index(stop) + len(stop)], r.choices[0].text)
    check(r.model_dump()["choices"][0]["stop_reason"] == stop, r.model_dump()["choices"][0])
    # logit_bias: a +100 bias forces the token; an id outside the vocabulary is a 400 naming it.
    r = S.post("/v1/completions", {"model": SERVED, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logit_bias": {"28": 100},
                                   "logprobs": 0, "return_tokens_as_token_ids": True}).json()
    check(r["choices"][0]["logprobs"]["tokens"] == ["token_id:28"] * 3, r["choices"][0]["logprobs"])
    error_shape(S.post("/v1/completions", {"model": SERVED, "prompt": PROMPT, "logit_bias": {"999999": 1}}), 400, "logit_bias")
    # min_tokens keeps EOS away: the chat answer runs to max_tokens.
    r = c.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=40, temperature=0)
    n = r.usage.completion_tokens
    if r.choices[0].finish_reason == "stop" and n + 3 < 40:
        r2 = c.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=n + 3, temperature=0, extra_body={"min_tokens": n + 3})
        check(r2.usage.completion_tokens == n + 3 and r2.choices[0].finish_reason == "length", r2)
    # continuous usage stats on every chunk.
    chunks = list(c.completions.create(model=SERVED, prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True}))
    check(all(x.usage is not None for x in chunks), "usage missing from a chunk")
    check(S.get(f"/v1/models/{SERVED}").json()["id"] == SERVED and S.get("/v1/models/a").json()["parent"] == SERVED, "model card")
    error_shape(S.get("/v1/models/nope"), 404)
    for body, field in [({"prompt": PROMPT, "use_beam_search": True}, "use_beam_search"), ({"prompt": PROMPT, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
                        ({"prompt": PROMPT, "cache_salt": "x"}, "cache_salt")]:
        error_shape(S.post("/v1/completions", {"model": SERVED, **body}), 400, field)
    # Tools without tool_choice mean `auto`: vLLM's 400 on a server started without its tool
    # flags (this one); tests/server/test_tools.py serves tools with them.
    e = error_shape(S.post("/v1/chat/completions", {"model": SERVED, "messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}), 400, "--enable-auto-tool-choice")
    check(e["param"] == "tool_choice", e)


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
     "required": ["color", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
                                              "required": ["name", "population"], "additionalProperties": False},
                                     "capital": {"type": "boolean"}}, "required": ["city", "capital"], "additionalProperties": False},
]


@test
def structured_output_holds(S):
    """Every json_schema response parses and validates (jsonschema) over nested objects,
    arrays, enums and required fields, on the base model and adapters, streaming and not;
    regex and choice hold; an unconstrained request batched with them is unchanged; bad
    constraints are 400s naming their field; a dead end ends only its own request."""
    import jsonschema
    import re as re_mod
    c = S.client()
    ask = [{"role": "user", "content": "Describe a person, a color and a city as JSON."}]
    for i, schema in enumerate(SCHEMAS):
        for model in [SERVED, "a", "c"]:
            rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
            r = c.chat.completions.create(model=model, messages=ask, max_tokens=120, temperature=0, response_format=rf)
            check(r.choices[0].finish_reason == "stop", (model, i, r.choices[0]))
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)
            text = "".join(x.choices[0].delta.content or "" for x in c.chat.completions.create(
                model=model, messages=ask, max_tokens=120, temperature=0.8, seed=i, stream=True, response_format=rf) if x.choices)
            jsonschema.validate(json.loads(text), schema)
        r = c.completions.create(model="b", prompt="A JSON record:", max_tokens=120, temperature=0, extra_body={"guided_json": schema})
        jsonschema.validate(json.loads(r.choices[0].text), schema)
    r = c.chat.completions.create(model=SERVED, messages=ask, max_tokens=100, temperature=0, response_format={"type": "json_object"})
    check(isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content)
    # Regex and choice, each batched with an unconstrained request that must equal its lone run.
    plain = greedy(c, "b", n_tok=24, extra_body={"ignore_eos": True})

    async def batch():
        ac = S.aclient()
        reqs = [ac.completions.create(model="b", prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})]
        reqs += [ac.completions.create(model=m, prompt="Phone:", max_tokens=20, temperature=0.9, seed=k, extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"}) for k, m in enumerate([SERVED, "a"])]
        reqs += [ac.chat.completions.create(model=m, messages=[{"role": "user", "content": "Pick one."}], max_tokens=10, temperature=1.0, seed=k,
                                            extra_body={"guided_choice": ["left", "right", "straight on"]}) for k, m in enumerate(["c", SERVED])]
        return await asyncio.gather(*reqs)
    got = asyncio.run(batch())
    check(got[0].choices[0].text == plain, "unconstrained row changed by constrained ones")
    for r in got[1:3]:
        check(re_mod.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", r.choices[0].text), r.choices[0].text)
    for r in got[3:]:
        check(r.choices[0].message.content in ["left", "right", "straight on"], r.choices[0].message.content)
    # Bad constraints: 400 naming the field.
    for body, field in [({"guided_regex": "([0-9]"}, "guided_regex"), ({"guided_json": {"type": "no-such-type"}}, "guided_json"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}}}}, "response_format"),
                        ({"guided_grammar": "start: ("}, "guided_grammar"), ({"guided_choice": []}, "guided_choice")]:
        error_shape(S.post("/v1/completions", {"model": SERVED, "prompt": PROMPT, **body}), 400, field)
    # A dead end (only a letter may be drawn, the grammar wants a digit) ends its own request.
    r = S.post("/v1/completions", {"model": SERVED, "prompt": PROMPT, "max_tokens": 5, "guided_regex": "[0-9]+", "allowed_token_ids": [64]}).json()
    check(r["choices"][0]["finish_reason"] == "abort" and "dead end" in (r["choices"][0]["stop_reason"] or ""), r)


# ----------------------------------------------------------------------------------------------
# tests that need their own server


def queue_overflow_429(quiver, model_args):
    S = Server(quiver, model_args + ["--max-queued-requests", "1", "--max-running-requests", "1"], "queue").wait_ready()
    try:
        async def go():
            ac = S.aclient()

            async def one():
                try:
                    await ac.completions.create(model=SERVED, prompt=PROMPT, max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
                    return "ok"
                except openai.RateLimitError as e:
                    check(e.status_code == 429)
                    return "429"
            return await asyncio.gather(*[one() for _ in range(6)])
        got = asyncio.run(go())
        check("429" in got and "ok" in got, got)
        r = S.post("/v1/completions", {"model": SERVED, "prompt": PROMPT, "max_tokens": 2})
        check(r.status_code == 200, r.text)
    finally:
        S.kill()


def graceful_shutdown(quiver, model_args):
    S = Server(quiver, model_args, "shutdown").wait_ready()
    try:
        c = S.client()
        want = greedy(c, SERVED, n_tok=48, extra_body={"ignore_eos": True})
        s = c.completions.create(model=SERVED, prompt=PROMPT, max_tokens=48, temperature=0, stream=True, extra_body={"ignore_eos": True})
        it = iter(s)
        text = next(it).choices[0].text
        os.kill(S.proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        # New work is refused while draining (503), or the listener is already closed.
        try:
            r = S.post("/v1/completions", {"model": SERVED, "prompt": "x", "max_tokens": 2})
            check(r.status_code == 503, f"during drain: {r.status_code} {r.text[:200]}")
        except httpx.HTTPError:
            pass
        finish = None
        for ch in it:
            if ch.choices:
                text += ch.choices[0].text
                finish = ch.choices[0].finish_reason or finish
        check(text == want, f"stream cut by shutdown: {text!r} != {want!r}")
        check(finish == "length", finish)
        rc = S.proc.wait(timeout=30)
        check(rc == 0, f"exit status {rc}: {S.tail()}")
    finally:
        S.kill()


# ----------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quiver", default=os.path.join(REPO, "target", "release", "quiver"))
    ap.add_argument("--model", default=None, help="model path (default: quiver's default model)")
    ap.add_argument("-k", default=None, help="run only tests whose name contains this")
    a = ap.parse_args()
    quiver = os.path.abspath(a.quiver)
    model_args = ["--model", a.model] if a.model else []
    R = Runner(a.k)
    lora_dir = tempfile.mkdtemp(prefix="quiver-loras-")
    servers = []

    try:
        names = prepare_adapters(lora_dir)
        args = model_args + ["--lora-dir", lora_dir, "--max-loras", "4", "--max-lora-rank", "64",
                             "--lora-modules", f"a={lora_dir}/a", json.dumps({"name": "b", "path": f"{lora_dir}/b", "base_model_name": SERVED}),
                             "--lora-paths", f"c={lora_dir}/c"]
        S = Server(quiver, args, "main", api_key=API_KEY)
        servers.append(S)
        try:
            S.wait_ready()
        except Exception:
            R.failed += 1
            print(f"FAIL server start\n{traceback.format_exc()}")
            raise SystemExit
        for fn in TESTS:
            params = fn.__code__.co_varnames[:fn.__code__.co_argcount]
            extra = [lora_dir] if "lora_dir" in params else []
            R.run(fn.__name__, fn, S, *extra)
        S.kill()
        R.run("queue_overflow_429", queue_overflow_429, quiver, model_args)
        R.run("graceful_shutdown", graceful_shutdown, quiver, model_args)
    except SystemExit:
        pass
    finally:
        for s in servers:
            if s.proc.poll() is None or R.failed:
                if R.failed:
                    print(f"--- server log tail ({s.log_path}) ---\n{s.tail(20)}")
            s.kill()
        shutil.rmtree(lora_dir, ignore_errors=True)
    R.finish()


if __name__ == "__main__":
    main()
