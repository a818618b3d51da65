#!/usr/bin/env python3
"""Reference tokenizer and chat-template outputs from HF transformers, for the Rust tests.

Usage: ref_tokenizer.py <gguf path> <out dir>
Writes <out dir>/tokenizer_ref.json and an HF tokenizer directory <out dir>/hf/.

transformers' GGUF tokenizer converter (4.57.3, GGUFLlamaConverter) does not reproduce what the
GGUF metadata says, so the reference corrects three of its quirks before recording anything; the
corrections follow the GGUF keys, which is the contract the Rust side implements:
  * it reads both BOS and EOS from `tokenizer.ggml.bos_token_id` -> set them from the GGUF ids;
  * it adds BOS regardless of `tokenizer.ggml.add_bos_token` -> post-processor follows the key;
  * it ignores `tokenizer.ggml.pre` and always splits with the GPT-2 regex -> use the
    pre-tokenizer the model was trained with (for `smollm`: digits split individually, then the
    GPT-2 byte-level regex, which is exactly the upstream SmolLM2 tokenizer.json).
Decoding never runs the Python-side `clean_up_tokenization_spaces` rewrite (upstream configs of
the supported models disable it; it is not part of the tokenizer itself).
"""
import json
import os
import random
import sys

import gguf
from tokenizers import pre_tokenizers, processors, Regex
from transformers import AutoTokenizer

SEED = 20240611


def gguf_field(reader, key):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def pre_tokenizer_for(pre):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)
    if pre in ("gpt-2", "default", None):
        return byte_level
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3"):
        llama3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(llama3), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    sys.exit(f"ref_tokenizer.py: no reference pre-tokenizer for tokenizer.ggml.pre={pre!r}")


def corrected_tokenizer(gguf_path):
    reader = gguf.GGUFReader(gguf_path)
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    bos_id = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    eos_id = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    add_bos = bool(gguf_field(reader, "tokenizer.ggml.add_bos_token") or False)
    pre = gguf_field(reader, "tokenizer.ggml.pre")

    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(gguf_path)),
                                        gguf_file=os.path.basename(gguf_path))
    bos = tokens[bos_id] if bos_id is not None else None
    eos = tokens[eos_id] if eos_id is not None else None
    backend = tok.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizer_for(pre)
    if add_bos and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    # Re-wrap so the Python-side attributes (bos/eos, add_bos) match the corrected backend.
    from transformers import PreTrainedTokenizerFast
    fixed = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, unk_token=tok.unk_token,
        clean_up_tokenization_spaces=False, chat_template=tok.chat_template)
    return fixed, {"bos_id": bos_id, "eos_id": eos_id, "add_bos": add_bos, "pre": pre}


def test_strings():
    rng = random.Random(SEED)
    fixed = [
        "", " ", "  ", "\n", "\t", "\r\n", "Hello world", "Hello, world!", " leading space",
        "trailing space ", "multiple   spaces   here", "tabs\tand\t\ttabs", "new\nlines\n\n\nmany",
        "mixed \t\n \r\n whitespace", "   \n   ", "a\u00a0b", "caf\u00e9", "cafe\u0301",
        "na\u00efve r\u00e9sum\u00e9", "\u00c5ngstr\u00f6m", "Stra\u00dfe", "\u0130stanbul",
        "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8", "\u4e2d\u6587\u5b57\u7b26\u6d4b\u8bd5",
        "\ud55c\uad6d\uc5b4 \ud14c\uc2a4\ud2b8", "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
        "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd", "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440!",
        "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e", "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35",
        "\U0001f600", "\U0001f600\U0001f601\U0001f602", "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466",
        "\U0001f44d\U0001f3fd", "\U0001f1eb\U0001f1f7 flag", "I \u2764\ufe0f Rust", "z\u0335\u0321\u032a\u0308\u0301algo",
        "0", "1", "12", "123", "1234", "12345", "123456789012345678901234567890", "3.14159", "-42",
        "1,000,000", "x  1", "a1b2c3", "v1.2.3-rc4", "0xDEADBEEF", "1e-10",
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nhi<|im_end|>\n",
        "text<|im_end|>more", "<|im_start|><|im_start|>", "< |im_start| >", "<|im_start", "|im_end|>",
        "fn main() {\n    println!(\"Hello\");\n}\n", "def f(x):\n\treturn x ** 2  # square\n",
        "SELECT * FROM t WHERE id = 42;", "<div class=\"a\">&amp;</div>", "{\"key\": [1, 2, {\"n\": null}]}",
        "https://example.com/path?q=1&r=2#frag", "user@example.com", "C:\\Windows\\System32",
        "it's they're we've I'm you'll he'd", "IT'S THEY'RE", "don't stop", "''' \"\"\" ``` ~~~",
        "!!!???...,,,;;;", "a-b_c.d/e\\f", "\u2018smart\u2019 \u201cquotes\u201d \u2014 dash \u2026",
        "\u00bd \u2153 \u00b2 \u2460 \u0663\u0664\u0665 \u096a\u096b", "\uff11\uff12\uff13 fullwidth",
        "\x00\x01\x1f", "\u200b\u200c\u200d\ufeff", "\ufffd", "\U0010ffff", "\u3000ideographic space",
    ]
    fixed.append("The quick brown fox jumps over the lazy dog. " * 200)
    fixed.append("".join(chr(c) for c in range(0x20, 0x7f)) * 10)

    alphabets = [
        "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", " \t\n\r",
        "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~", "\u00e9\u00e8\u00ea\u00eb\u00e0\u00e2\u00e7\u00f4\u00fb\u00fc\u00f1",
        "\u4e00\u4e8c\u4e09\u4eba\u5927\u5c0f\u5c71\u6c34\u706b\u6728", "\u3042\u3044\u3046\u3048\u304a\u30ab\u30ad\u30af",
        "\u0627\u0628\u062a\u062b\u062c\u062d\u062e\u062f", "\u0430\u0431\u0432\u0433\u0434\u0435\u0436",
        "\u0300\u0301\u0302\u0303\u0308", "\U0001f600\U0001f680\U0001f389\U0001f44d\u2764\ufe0f",
        "\u03b1\u03b2\u03b3\u03b4\u03c0\u03a3", "\u2200\u2203\u2208\u221e\u2248\u2260",
    ]
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    words = ["the", "of", "and", "model", "token", "LoRA", "inference", "Rust", "GPU", "batch",
             "hello", "world", "quiver", "adapter", "tensor", "tokenizer", "2024", "3.5", "x86_64"]
    out = []
    for i in range(300):
        kind = i % 6
        n = rng.randint(1, 60)
        if kind == 0:  # random characters from a few alphabets
            alpha = "".join(rng.sample(alphabets, rng.randint(1, 4)))
            s = "".join(rng.choice(alpha) for _ in range(n))
        elif kind == 1:  # word soup with irregular whitespace
            seps = [" ", "  ", "\t", "\n", "\n\n", " \n", "   "]
            s = "".join(rng.choice(words) + rng.choice(seps) for _ in range(rng.randint(1, 20)))
        elif kind == 2:  # numbers of many lengths
            s = " ".join(str(rng.randint(0, 10 ** rng.randint(1, 25))) for _ in range(rng.randint(1, 6)))
        elif kind == 3:  # special tokens embedded in text
            parts = []
            for _ in range(rng.randint(1, 6)):
                parts.append(rng.choice(words + specials + [" ", "\n"]))
            s = "".join(parts)
        elif kind == 4:  # random code points across planes (no surrogates)
            cps = []
            while len(cps) < n:
                c = rng.choice([rng.randint(0x20, 0x7e), rng.randint(0xa0, 0x2fff),
                                rng.randint(0x3000, 0xd7ff), rng.randint(0xe000, 0xfffd),
                                rng.randint(0x10000, 0x1faff)])
                cps.append(chr(c))
            s = "".join(cps)
        else:  # runs of spaces/tabs/newlines around letters and digits
            s = "".join(rng.choice(["a", "1", " " * rng.randint(1, 8), "\t" * rng.randint(1, 3),
                                     "\n" * rng.randint(1, 4), "\r\n", "Z"]) for _ in range(n))
        out.append(s)
    return fixed + out


CHAT_CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "Hello!"}],
    "system_user": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    "multi_turn": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
                   {"role": "user", "content": "Tell me a joke."}],
    "system_multi_turn": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "caf\u00e9 \U0001f600"},
                          {"role": "assistant", "content": "  spaced\n\ttext  "}, {"role": "user", "content": "<|im_end|> \"quoted\" & <b>"}],
    "empty_content": [{"role": "user", "content": ""}],
}

# Templates that exercise the features model templates rely on, rendered by transformers'
# own Jinja environment; the Rust side must match byte for byte.
EXTRA_TEMPLATES = {
    "tojson": "{% for m in messages %}{{ m | tojson }}\n{{ m.content | tojson }}\n{% endfor %}{{ messages | tojson(indent=2) }}",
    "whitespace": "{% for message in messages %}\n    {% if message.role == 'user' %}\n        U: {{ message.content }}\n    {% else %}\n        A: {{ message.content }}\n    {% endif %}\n{% endfor %}\n{%- if add_generation_prompt %}\n  A:{% endif %}",
    "pycompat": "{% for m in messages %}{{ m.content.strip() | upper }}|{{ m.content.upper() }}|{{ m.role.startswith('us') }}|{{ m.content.split(' ') | length }}|{{ m.content.replace(' ', '_') }}|{{ m.content.lstrip() }}|{{ m.role.title() }}\n{% endfor %}",
    "bos_eos_loop": "{{ bos_token }}{% for m in messages %}{% if loop.index0 == 0 and m.role == 'system' %}{% continue %}{% endif %}[{{ loop.index }}/{{ loop.length }}]{{ m.role }}: {{ m.content | trim }}{{ eos_token }}{% if loop.last %}{% break %}{% endif %}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}",
    "raise_unused": "{% if messages | length == 0 %}{{ raise_exception('no messages') }}{% endif %}{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + m.content | length %}{% endfor %}total={{ ns.n }}{{ messages[-1]['content'][:3] }}",
}


def main():
    gguf_path, out_dir = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    tok, meta = corrected_tokenizer(gguf_path)
    cases = []
    for s in test_strings():
        ids_plain = tok.encode(s, add_special_tokens=False)
        ids_special = tok.encode(s, add_special_tokens=True)
        cases.append({
            "text": s,
            "ids": ids_plain,
            "ids_with_special": ids_special,
            "decoded": tok.decode(ids_plain, skip_special_tokens=False, clean_up_tokenization_spaces=False),
            "decoded_skip_special": tok.decode(ids_plain, skip_special_tokens=True, clean_up_tokenization_spaces=False),
        })
    chats = []
    for name, msgs in CHAT_CONVERSATIONS.items():
        for agp in (False, True):
            chats.append({"name": name, "template": None, "messages": msgs, "add_generation_prompt": agp,
                          "rendered": tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp)})
            for tname, src in EXTRA_TEMPLATES.items():
                chats.append({"name": f"{name}/{tname}", "template": src, "messages": msgs, "add_generation_prompt": agp,
                              "rendered": tok.apply_chat_template(msgs, chat_template=src, tokenize=False,
                                                                 add_generation_prompt=agp)})
    ref = {
        "generator": "scripts/ref_tokenizer.py", "seed": SEED, "gguf": os.path.basename(gguf_path),
        "vocab_size": len(tok), "bos_id": meta["bos_id"], "eos_id": meta["eos_id"], "add_bos": meta["add_bos"],
        "pre": meta["pre"], "bos_token": tok.bos_token, "eos_token": tok.eos_token,
        "chat_template": tok.chat_template, "cases": cases, "chats": chats,
    }
    hf_dir = os.path.join(out_dir, "hf")
    tok.save_pretrained(hf_dir)
    tmp = os.path.join(out_dir, "tokenizer_ref.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(ref, f, ensure_ascii=False)
    os.replace(tmp, os.path.join(out_dir, "tokenizer_ref.json"))
    print(f"wrote {len(cases)} cases, {len(chats)} chat renders to {out_dir}")


if __name__ == "__main__":
    main()
