#!/usr/bin/env python3
"""Oracle fixtures for Quiver's GGUF parser, produced with the `gguf` Python package.

    gguf_fixtures.py quants OUT_DIR
        OUT_DIR/quants.gguf: one tensor per ggml type (named after the type) holding random
        blocks, plus metadata keys of all 13 value types; OUT_DIR/<TYPE>.f32: the values
        `gguf.quants.dequantize` gives for that tensor, raw little-endian f32.

    gguf_fixtures.py model MODEL.gguf OUT_DIR
        OUT_DIR/model.json: metadata facts and, for the first Q4_1 tensor and token_embd.weight,
        a sample of dequantized values (indices and f32 bit patterns) to compare bit-exactly.

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


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "quants":
        quants(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "model":
        model(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
