//! The forward pass against Hugging Face transformers (float32, CPU) on the same weights:
//! teacher-forced logprobs on the reference's top-20 tokens at every position, and greedy
//! continuations token for token.

mod common;

use common::*;
use quiver_engine::{BaseOnly, GenerateOptions, Generator, SamplingParams};
use quiver_kernels::DType;

const TOL: f32 = 1e-3;

fn check(model_rel: &str, ref_rel: &str) {
    let path = require(model_rel);
    let lm = load(&path, DType::F32);
    let r = read_ref(ref_rel);
    assert!(!r.cases.is_empty());
    let vocab = lm.model.config.vocab_size;
    let mut g = Generator::new(&lm.model, 2048);
    for case in &r.cases {
        let mut all = case.prompt_ids.clone();
        all.extend(&case.continuation_ids);
        let logits = g.score(&all, &mut BaseOnly).unwrap();
        let (d, pos) = max_logprob_delta(case, &logits, vocab);
        assert!(d <= TOL, "{model_rel} case {}: max |Δlogprob| {d} at position {pos} > {TOL}", case.name);
        let opts = GenerateOptions { max_tokens: case.continuation_ids.len(), sampling: SamplingParams::default(), stop_ids: vec![], prefill_chunk: 64 };
        let mut out = Vec::new();
        g.generate(&case.prompt_ids, &opts, &mut BaseOnly, |t| {
            out.push(t);
            true
        })
        .unwrap();
        // Greedy identical, or going apart only where the reference's two picks are within the
        // logprob tolerance of each other.
        let mut tie = String::new();
        if let Some((p, gap)) = greedy_divergence(case, &out) {
            assert!(gap.is_some_and(|g| g.abs() <= 2.0 * TOL), "{model_rel} case {}: greedy continuation differs at token {p} (reference's logprob gap there {gap:?}, near-tie bound {})\n ours: {out:?}\n want: {:?}", case.name, 2.0 * TOL, case.continuation_ids);
            tie = format!(", greedy goes apart at token {p} at a near-tie ({:.1e})", gap.unwrap());
        }
        eprintln!("{model_rel} {}: {} positions, max |Δlogprob| {d:.2e}{tie}", case.name, all.len());
    }
}

#[test]
fn smollm2_gguf_matches_transformers() {
    check("models/SmolLM2-135M-Instruct.Q4_1.gguf", "ref/ref/smollm2.json");
}

#[test]
fn smollm2_safetensors_dir_matches_transformers() {
    check("ref/models/smollm2-hf", "ref/ref/smollm2.json");
}

#[test]
fn tiny_qwen2_with_biases_untied_matches_transformers() {
    check("ref/models/tiny-qwen2", "ref/ref/tiny-qwen2.json");
}

#[test]
fn tiny_llama3_rope_scaling_tied_matches_transformers() {
    check("ref/models/tiny-llama3", "ref/ref/tiny-llama3.json");
}

#[test]
fn tiny_mistral_matches_transformers() {
    check("ref/models/tiny-mistral", "ref/ref/tiny-mistral.json");
}

/// HF Llama with `attention_bias: true`: q, k, v *and* o_proj biases (o_proj's was dropped
/// silently before session 21), on 8 heads of 8 dims.
#[test]
fn tiny_llama_attention_bias_small_heads_matches_transformers() {
    check("ref/models/tiny-llama-bias", "ref/ref/tiny-llama-bias.json");
}

// ---- Qwen3 and the mixture-of-experts families (tiny random models from scripts/reference.py;
// the GGUF copies hold the same weights in llama.cpp's layout, so they share the reference).

#[test]
fn tiny_qwen3_qk_norm_wide_heads_matches_transformers() {
    check("ref/models/tiny-qwen3", "ref/ref/tiny-qwen3.json");
}

#[test]
fn tiny_qwen3_gguf_matches_transformers() {
    check("ref/models/tiny-qwen3.gguf", "ref/ref/tiny-qwen3.json");
}

#[test]
fn tiny_mixtral_matches_transformers() {
    check("ref/models/tiny-mixtral", "ref/ref/tiny-mixtral.json");
}

#[test]
fn tiny_mixtral_gguf_permuted_stacked_experts_matches_transformers() {
    check("ref/models/tiny-mixtral.gguf", "ref/ref/tiny-mixtral.json");
}

#[test]
fn tiny_qwen3moe_top4_of_16_renormalised_matches_transformers() {
    check("ref/models/tiny-qwen3moe", "ref/ref/tiny-qwen3moe.json");
}

#[test]
fn tiny_qwen3moe_gguf_matches_transformers() {
    check("ref/models/tiny-qwen3moe.gguf", "ref/ref/tiny-qwen3moe.json");
}

#[test]
fn tiny_qwen3moe_with_a_dense_layer_matches_transformers() {
    check("ref/models/tiny-qwen3moe-dense1", "ref/ref/tiny-qwen3moe-dense1.json");
}

#[test]
fn tiny_qwen2moe_shared_expert_matches_transformers() {
    check("ref/models/tiny-qwen2moe", "ref/ref/tiny-qwen2moe.json");
}

#[test]
fn tiny_qwen2moe_gguf_matches_transformers() {
    check("ref/models/tiny-qwen2moe.gguf", "ref/ref/tiny-qwen2moe.json");
}

#[test]
fn tiny_olmoe_whole_projection_qk_norm_matches_transformers() {
    check("ref/models/tiny-olmoe", "ref/ref/tiny-olmoe.json");
}
