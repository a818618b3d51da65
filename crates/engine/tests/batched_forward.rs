//! One batched varlen call over sequences of different lengths gives the same logits as each
//! sequence run alone: bit for bit on the CPU, whose GEMM computes every output element in an
//! order that does not depend on the row count (and every other op is row-wise). The same holds
//! for mixture-of-experts models, whose experts see very different row groups batched and alone:
//! routing is per row and each expert's GEMM computes every element the same way at any M.

mod common;

use common::*;
use quiver_kernels::DType;
use quiver_lora::NoLora;
use quiver_model::{ForwardBatch, LogitsFor};

#[test]
fn batched_equals_alone_bit_for_bit_f32() {
    batched_equals_alone(&smollm2_gguf(), DType::F32);
}

#[test]
fn batched_equals_alone_bit_for_bit_bf16() {
    batched_equals_alone(&smollm2_gguf(), DType::Bf16);
}

#[test]
fn moe_batched_equals_alone_bit_for_bit_f32() {
    for m in ["ref/models/tiny-qwen3moe", "ref/models/tiny-qwen2moe", "ref/models/tiny-mixtral"] {
        batched_equals_alone(&require(m), DType::F32);
    }
}

#[test]
fn moe_batched_equals_alone_bit_for_bit_bf16() {
    batched_equals_alone(&require("ref/models/tiny-qwen3moe-dense1"), DType::Bf16);
}

fn batched_equals_alone(path: &std::path::Path, dtype: DType) {
    let lm = load(path, dtype);
    let m = &lm.model;
    let vocab = m.config.vocab_size;
    let seqs: Vec<Vec<u32>> = [37usize, 5, 120, 1]
        .iter()
        .enumerate()
        .map(|(s, &n)| (0..n).map(|i| ((i * 7919 + s * 104729) % (vocab - 10)) as u32 + 3).collect())
        .collect();
    let bs = 16;
    // Alone: each sequence gets blocks 0.. in its own cache.
    let mut alone = Vec::new();
    for s in &seqs {
        let nb = s.len().div_ceil(bs);
        let mut kv = m.alloc_kv(nb, bs);
        let mut ws = m.new_workspace(s.len(), s.len());
        let mut b = ForwardBatch::with_capacity(s.len(), 1, nb);
        let table: Vec<u32> = (0..nb as u32).collect();
        b.push_seq(s, 0, &table, LogitsFor::All);
        alone.push(m.forward(&b, &mut kv, &mut ws, &NoLora).to_vec());
    }
    // Batched: disjoint, deliberately non-contiguous block ranges in one shared cache.
    let total_blocks: usize = seqs.iter().map(|s| s.len().div_ceil(bs)).sum();
    let mut kv = m.alloc_kv(total_blocks, bs);
    let stride = seqs.iter().map(|s| s.len().div_ceil(bs)).max().unwrap();
    let mut b = ForwardBatch::with_capacity(200, 4, stride);
    let mut next = total_blocks as u32;
    for s in &seqs {
        let nb = s.len().div_ceil(bs) as u32;
        let table: Vec<u32> = (next - nb..next).rev().collect();
        next -= nb;
        b.push_seq(s, 0, &table, LogitsFor::All);
    }
    let mut ws = m.new_workspace(200, 200);
    let batched = m.forward(&b, &mut kv, &mut ws, &NoLora).to_vec();
    let mut off = 0;
    for (s, a) in seqs.iter().zip(&alone) {
        let n = s.len() * vocab;
        for (r, (rb, ra)) in batched[off..off + n].chunks(vocab).zip(a.chunks(vocab)).enumerate() {
            let worst = rb.iter().zip(ra).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
            assert!(rb == ra, "{}: sequence of length {}, row {r}: batched and alone differ (max |Δlogit| {worst})", path.display(), s.len());
        }
        off += n;
    }
}
