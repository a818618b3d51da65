#!/usr/bin/env python3
"""Oracle fixtures for Quiver's GGUF parser, produced with the `gguf` Python package.

    gguf_fixtures.py quants OUT_DIR
        OUT_DIR/quants.gguf: one tensor per ggml type (named after the type) holding random
        blocks, plus metadata keys of all 13 value types; OUT_DIR/<TYPE>.f32: the values
        `gguf.quants.dequantize` gives for that tensor, raw little-endian f32.

    gguf_fixtures.py model MODEL.gguf OUT_DIR
        OUT_DIR/model.json: metadata facts and, for the first Q4_1 tensor and token_embd.weight,
        a sample of dequantized values (indices and f32 bit patterns) to compare bit-exactly.

    gguf_fixtures.py from-hf HF_DIR ARCH TOKENIZER.gguf OUT.gguf
        An HF safetensors model (Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE) as a GGUF of F32 tensors
        laid out as llama.cpp's converter writes it: names from gguf-py's own HF -> GGUF map
        (`gguf.TensorNameMap`), experts stacked into one [E, out, in] tensor per projection, q/k
        rows permuted for the `llama` architecture, the tokenizer copied from TOKENIZER.gguf.

Random bytes exercise every bit of the packed layouts, which values produced by a quantizer
would not; only the f16 scales are forced to sane finite values, because random f16 bits give
NaN/inf scales that make comparisons meaningless.
"""
import json
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

ROWS, COLS = 3, 512

# (type, byte offsets of f16 scale fields inside one block)
QUANT_TYPES = [
    (T.Q4_0, [0]),
    (T.Q4_1, [0, 2]),
    (T.Q5_0, [0]),
    (T.Q5_1, [0, 2]),
    (T.Q8_0, [0]),
    (T.Q2_K, [80, 82]),
    (T.Q3_K, [108]),
    (T.Q4_K, [0, 2]),
    (T.Q5_K, [0, 2]),
    (T.Q6_K, [208]),
]


def random_quant(rng, qtype, scale_offsets):
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = ROWS * COLS // block_size
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in scale_offsets:
        d = (rng.uniform(-0.05, 0.05, size=n_blocks)).astype(np.float16)
        blocks[:, off:off + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(ROWS, -1)


def quants(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(1234)
    w = gguf.GGUFWriter(os.path.join(out_dir, "quants.gguf"), "llama")
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4000000000)
    w.add_int32("test.i32", -2000000000)
    w.add_float32("test.f32", 1.5)
    w.add_bool("test.bool", True)
    w.add_string("test.string", "héllo")
    w.add_uint64("test.u64", 2**63 + 5)
    w.add_int64("test.i64", -(2**62))
    w.add_float64("test.f64", 2.25)
    w.add_array("test.array", [1, 2, 3])
    w.add_array("test.strings", ["a", "bc"])
    w.add_array("test.nested", [[1, 2], [3]])

    raw = {}
    x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    raw[T.F32] = x.view(np.uint8)
    raw[T.F16] = x.astype(np.float16).view(np.uint8)
    raw[T.BF16] = (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    for qtype, offs in QUANT_TYPES:
        raw[qtype] = random_quant(rng, qtype, offs)

    for qtype, data in raw.items():
        data = np.ascontiguousarray(data)
        w.add_tensor(qtype.name, data, raw_dtype=qtype)
        expected = np.asarray(dequantize(data, qtype), dtype=np.float32)
        assert expected.shape == (ROWS, COLS), (qtype.name, expected.shape)
        expected.astype("<f4").tofile(os.path.join(out_dir, f"{qtype.name}.f32"))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def sample(reader_tensor, stride):
    values = np.asarray(dequantize(reader_tensor.data, reader_tensor.tensor_type), dtype=np.float32).ravel()
    idx = list(range(0, values.size, stride))
    if idx[-1] != values.size - 1:
        idx.append(values.size - 1)
    return {
        "name": reader_tensor.name,
        "type": reader_tensor.tensor_type.name,
        "shape": [int(d) for d in reader_tensor.shape],  # ggml order
        "n_elements": int(values.size),
        "indices": idx,
        "bits": [int(b) for b in values[idx].view(np.uint32)],
    }


def model(path, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    r = gguf.GGUFReader(path)
    q41 = next(t for t in r.tensors if t.tensor_type == T.Q4_1)
    embd = next(t for t in r.tensors if t.name == "token_embd.weight")
    arch = r.fields["general.architecture"].contents()
    facts = {
        "architecture": arch,
        "block_count": int(r.fields[f"{arch}.block_count"].contents()),
        "embedding_length": int(r.fields[f"{arch}.embedding_length"].contents()),
        "n_tensors": len(r.tensors),
        "samples": [sample(q41, 7), sample(embd, 997)],
    }
    tmp = os.path.join(out_dir, "model.json.tmp")
    with open(tmp, "w") as f:
        json.dump(facts, f)
    os.replace(tmp, os.path.join(out_dir, "model.json"))


def llama_permute(w, n_head):
    """llama.cpp's `LlamaModel.permute`: the two rotary halves of each head interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def from_hf(hf_dir, arch, tokenizer_gguf, out):
    """See the module docs. Reads config.json and model.safetensors of `hf_dir`."""
    from safetensors.numpy import load_file
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    n_layers = cfg["num_hidden_layers"]
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    name_map = gguf.TensorNameMap(arch_enum, n_layers)

    # Stack per-expert tensors as llama.cpp's converter does (`torch.stack(datas, dim=0)`), under
    # the merged HF names its name map knows.
    experts = {}
    for name in list(tensors):
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            merged = ".".join(parts[:i + 1] + parts[i + 2:])
            experts.setdefault(merged, {})[int(parts[i + 1])] = tensors.pop(name)
    for merged, by_e in experts.items():
        tensors[merged] = np.stack([by_e[e] for e in sorted(by_e)], axis=0)

    w = gguf.GGUFWriter(out, arch)
    w.add_name(os.path.basename(hf_dir))
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    n_exp = cfg.get("num_local_experts") or cfg.get("num_experts")
    if n_exp:
        w.add_expert_count(n_exp)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if "shared_expert_intermediate_size" in cfg:
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    tok = gguf.GGUFReader(tokenizer_gguf)
    for key, field in tok.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(key, field.contents(), field.types[0], sub)

    for name, data in tensors.items():
        base = name[:-len(".weight")] if name.endswith(".weight") else name[:-len(".bias")]
        suffix = name[len(base):]
        gname = name_map.get_name(base)
        if gname is None:
            sys.exit(f"{hf_dir}: no GGUF name for tensor {name}")
        data = np.ascontiguousarray(data.astype(np.float32))
        if arch == "llama" and base.endswith("self_attn.q_proj"):
            data = llama_permute(data, n_head)
        elif arch == "llama" and base.endswith("self_attn.k_proj"):
            data = llama_permute(data, n_kv)
        w.add_tensor(gname + suffix, data, raw_dtype=T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    # Read it back: every tensor present once with the data written.
    r = gguf.GGUFReader(out)
    assert len(r.tensors) == len(tensors), (len(r.tensors), len(tensors))
    assert r.fields["general.architecture"].contents() == arch


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "quants":
        quants(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "model":
        model(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 6 and sys.argv[1] == "from-hf":
        from_hf(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5])
    else:
        sys.exit(__doc__)
