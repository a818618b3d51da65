#!/usr/bin/env python3
"""Tool calling end to end: `quiver serve` on a tiny random-weight Qwen2 with Qwen2.5's chat
template, driven by the `openai` SDK and LangChain's `bind_tools`.

    python tests/server/test_tools.py --quiver target/release/quiver [-k NAME]

The model is made here from fixed seeds (SmolLM2's tokenizer from the reference cache, which
has Qwen's <|im_start|>/<|im_end|> markers), so nothing is downloaded. Random weights write no
sensible calls of their own: `auto` is checked for shape and for streaming = whole, while
`required` and named calls are forced by the grammar and must parse and validate against
their schemas. The rendered prompt is compared with transformers' `apply_chat_template(...,
tools=...)`. Prints `N passed, M failed` last.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import traceback

import jsonschema

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_openai_api import SERVED, Runner, Server, check, error_shape  # noqa: E402

CACHE = os.environ.get("QUIVER_CACHE", os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".cache"))

# Qwen2.5-Instruct's chat template (the tool-calling part is what is under test: tools as JSON
# lines in the system turn, history calls in <tool_call> blocks, results in <tool_response>).
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Bounded schemas: a random model under a grammar could otherwise write a string until
# max_tokens, and a call cut short is not a call that validates.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city (°C or °F).",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Zürich", "Tokyo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "maxLength": 12},
        "filters": {"type": "object", "properties": {"lang": {"enum": ["en", "fr"]}, "safe": {"type": "boolean"}},
                    "required": ["lang", "safe"], "additionalProperties": False}},
        "required": ["query", "filters"], "additionalProperties": False}}}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def make_model(d):
    """A 2-layer Qwen2 (random weights from seed 0) with SmolLM2's tokenizer and Qwen2.5's
    template. <|im_end|> is its EOS, as in Qwen2.5-Instruct."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    src = os.path.join(CACHE, "ref", "models", "smollm2-hf")
    check(os.path.isfile(os.path.join(src, "tokenizer.json")), f"{src} missing: run make test-data")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    Qwen2ForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    shutil.copy(os.path.join(src, "tokenizer.json"), d)
    with open(os.path.join(src, "tokenizer_config.json")) as f:
        tc = json.load(f)
    tc.update(eos_token="<|im_end|>", add_bos_token=False, bos_token=None)
    tc.pop("chat_template", None)
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f)
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write(QWEN25_TEMPLATE)


def validate(call):
    """The call's arguments parse as JSON and follow its tool's schema."""
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def streamed_calls(chunks):
    """Calls and content put together from streamed deltas, as a client does by `index`."""
    calls, content, finish = {}, "", None
    for ch in chunks:
        if not ch.choices:
            continue
        c = ch.choices[0]
        finish = c.finish_reason or finish
        content += c.delta.content or ""
        for tc in c.delta.tool_calls or []:
            if tc.index not in calls:
                check(tc.id and tc.type == "function" and tc.function.name, f"a call's first delta lacks id/type/name: {tc}")
                calls[tc.index] = {"name": tc.function.name, "arguments": ""}
            else:
                check(tc.id is None and tc.function.name is None, f"id/name repeated in a later delta: {tc}")
            calls[tc.index]["arguments"] += tc.function.arguments or ""
    return [calls[i] for i in sorted(calls)], content, finish


TESTS = []


def test(fn):
    TESTS.append(fn)
    return fn


@test
def rendered_prompt_matches_transformers(S, model_dir):
    """tools, an assistant turn with calls (arguments a JSON string, as OpenAI sends them) and
    the tool's answers render byte for byte as transformers renders them (with the arguments
    as the dict vLLM parses them into). Token ids come back through prompt_logprobs (k = 0
    lists just the prompt's own token at each position)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    args = {"city": "Zürich", "unit": "celsius", "days": 2}
    msgs = [{"role": "system", "content": "Be brief."}, ASK[0],
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}},
                {"id": "call_2", "type": "function", "function": {"name": "search", "arguments": '{"query": "rain", "filters": {"lang": "fr", "safe": true}}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18°C, sunny"},
            {"role": "tool", "tool_call_id": "call_2", "content": "no results"}]
    hf_msgs = json.loads(json.dumps(msgs))
    for c in hf_msgs[2]["tool_calls"]:
        c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    for tools, m, hm in [(TOOLS, msgs, hf_msgs), (TOOLS, ASK, ASK), (None, ASK, ASK)]:
        text = tok.apply_chat_template(hm, tools=tools, tokenize=False, add_generation_prompt=True)
        want = tok(text, add_special_tokens=False).input_ids
        body = {"model": SERVED, "messages": m, "max_tokens": 1, "prompt_logprobs": 0, "tool_choice": "none"}
        if tools:
            body["tools"] = tools
        else:
            del body["tool_choice"]
        r = S.post("/v1/chat/completions", body)
        check(r.status_code == 200, r.text[:400])
        v = r.json()
        got = [want[0]] + [int(next(iter(p))) for p in v["prompt_logprobs"][1:]]
        check(v["usage"]["prompt_tokens"] == len(want), (v["usage"], len(want)))
        check(tok.decode(got, skip_special_tokens=False) == text, f"prompt differs from transformers:\n{tok.decode(got)!r}\n{text!r}")
        check(got == want, "token ids differ from transformers'")
        check(tools is None or "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) in text, "tools not in the prompt")


@test
def named_choice_forces_a_valid_call(S):
    c = S.client()
    named = {"type": "function", "function": {"name": "search"}}
    r = c.chat.completions.create(model=SERVED, messages=ASK, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=120)
    ch = r.choices[0]
    check(ch.finish_reason == "stop", ch.finish_reason)  # OpenAI and vLLM: `stop` for a named call
    check(len(ch.message.tool_calls) == 1 and ch.message.tool_calls[0].function.name == "search", ch.message)
    validate(ch.message.tool_calls[0])
    check(ch.message.tool_calls[0].id.startswith("chatcmpl-tool-"), ch.message.tool_calls[0].id)
    # Streamed: the same call, built from OpenAI-shaped deltas.
    calls, content, finish = streamed_calls(c.chat.completions.create(model=SERVED, messages=ASK, tools=TOOLS, tool_choice=named, temperature=0,
                                                                      max_tokens=120, stream=True))
    check(calls == [{"name": "search", "arguments": ch.message.tool_calls[0].function.arguments}] and finish == "stop", (calls, finish))
    # Sampled, several seeds: every one a valid call.
    for seed in range(4):
        r = c.chat.completions.create(model=SERVED, messages=ASK, tools=TOOLS, tool_choice=named, temperature=1.0, seed=seed, max_tokens=120)
        validate(r.choices[0].message.tool_calls[0])


@test
def required_choice_forces_valid_calls(S):
    c = S.client()
    for parallel in [False, True]:
        for seed in range(4):
            kw = dict(model=SERVED, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel, temperature=1.0, seed=seed, max_tokens=400)
            r = c.chat.completions.create(**kw)
            ch = r.choices[0]
            if ch.finish_reason == "length":
                continue  # many parallel calls can run out of tokens; the finished ones are checked
            check(ch.finish_reason == "tool_calls", ch)
            check(ch.message.tool_calls and (parallel or len(ch.message.tool_calls) == 1), ch.message)
            for call in ch.message.tool_calls:
                validate(call)
            calls, _, finish = streamed_calls(c.chat.completions.create(**kw, stream=True))
            check(finish == "tool_calls", finish)
            check(calls == [{"name": x.function.name, "arguments": x.function.arguments} for x in ch.message.tool_calls], f"stream {calls} != {ch.message.tool_calls}")
    # The call goes back into the history with its result; the next turn is served.
    call = ch.message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "18°C"}]
    r = c.chat.completions.create(model=SERVED, messages=history, tools=TOOLS, temperature=0, max_tokens=8)
    check(r.choices[0].message.role == "assistant", r)


@test
def auto_choice_reads_the_output(S):
    """Random weights write text, not calls: the reply is content, and streaming it through
    the parser gives the same content."""
    c = S.client()
    r = c.chat.completions.create(model=SERVED, messages=ASK, tools=TOOLS, temperature=0, max_tokens=24)
    ch = r.choices[0]
    calls, content, finish = streamed_calls(c.chat.completions.create(model=SERVED, messages=ASK, tools=TOOLS, temperature=0, max_tokens=24, stream=True))
    want = [{"name": x.function.name, "arguments": x.function.arguments} for x in ch.message.tool_calls or []]
    check((calls, content or None, finish) == (want, ch.message.content or None, ch.finish_reason), f"stream {(calls, content, finish)} != {ch}")


@test
def bad_tools_are_400s_naming_the_field(S):
    for tools, field in [([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}}], "tools[0].function.parameters"),
                         ([WEATHER, {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "required": "a"}}}], "tools[1].function.parameters"),
                         ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "tools[0].function.parameters"),
                         ([{"type": "function", "function": {"description": "no name"}}], "tools[0].function.name")]:
        e = error_shape(S.post("/v1/chat/completions", {"model": SERVED, "messages": ASK, "tools": tools, "max_tokens": 2}), 400, field)
        check(e["param"] == field, e)
    error_shape(S.post("/v1/chat/completions", {"model": SERVED, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}), 400, "tool_choice")


def langchain_bind_tools(S):
    """LangChain's ChatOpenAI with bind_tools: a forced call comes back as AIMessage.tool_calls
    with parsed args, whole and streamed."""
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(model=SERVED, base_url=S.base + "/v1", api_key="none", temperature=0, max_tokens=120, max_retries=0)
    for choice, name in [("search", "search"), ("any", None)]:
        m = llm.bind_tools(TOOLS, tool_choice=choice, parallel_tool_calls=False)
        msg = m.invoke("What is the weather in Paris?")
        check(len(msg.tool_calls) == 1 and msg.tool_calls[0]["name"] in (name or SCHEMAS), msg)
        jsonschema.validate(msg.tool_calls[0]["args"], SCHEMAS[msg.tool_calls[0]["name"]])
        total = None
        for chunk in m.stream("What is the weather in Paris?"):
            total = chunk if total is None else total + chunk
        check([(t["name"], t["args"]) for t in total.tool_calls] == [(t["name"], t["args"]) for t in msg.tool_calls], (total.tool_calls, msg.tool_calls))


def auto_needs_the_flags(quiver, model_dir):
    """Without --enable-auto-tool-choice/--tool-call-parser, `auto` (also implied by tools
    without tool_choice) is vLLM's 400; forced choices still work."""
    S = Server(quiver, ["--model", model_dir], "tools-noflags").wait_ready()
    try:
        for extra in [{}, {"tool_choice": "auto"}]:
            e = error_shape(S.post("/v1/chat/completions", {"model": SERVED, "messages": ASK, "tools": TOOLS, **extra}), 400)
            check(e["message"] == '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set', e)
        r = S.client().chat.completions.create(model=SERVED, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                               temperature=0, max_tokens=60)
        validate(r.choices[0].message.tool_calls[0])
    finally:
        S.kill()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quiver", default="target/release/quiver")
    ap.add_argument("-k", default=None)
    a = ap.parse_args()
    quiver = os.path.abspath(a.quiver)
    R = Runner(a.k)
    model_dir = tempfile.mkdtemp(prefix="quiver-qwen2-tools-")
    S = None

    try:
        make_model(model_dir)
        S = Server(quiver, ["--model", model_dir, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"], "tools").wait_ready()
        for fn in TESTS:
            extra = [model_dir] if "model_dir" in fn.__code__.co_varnames[:fn.__code__.co_argcount] else []
            R.run(fn.__name__, fn, S, *extra)
        R.run("langchain_bind_tools", langchain_bind_tools, S)
        S.kill()
        R.run("auto_needs_the_flags", auto_needs_the_flags, quiver, model_dir)
    except Exception:
        R.failed += 1
        print(f"FAIL setup\n{traceback.format_exc()}", flush=True)
    finally:
        if S is not None:
            if R.failed:
                print(f"--- server log tail ({S.log_path}) ---\n{S.tail(20)}")
            S.kill()
        shutil.rmtree(model_dir, ignore_errors=True)
    R.finish()


if __name__ == "__main__":
    main()
