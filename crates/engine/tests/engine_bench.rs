//! `cargo test --release -p quiver-engine --test engine_bench -- --ignored --nocapture`:
//! 16 concurrent streams × 128 tokens on SmolLM2 (f32): base, one adapter, 4 distinct rank-16
//! adapters, base with every other stream under a regex constraint. (`quiver bench engine` runs
//! the same function.)

mod common;

use common::*;
use quiver_engine::bench::{bench_engine, BenchOptions};
use quiver_engine::EngineConfig;
use quiver_kernels::DType;

#[test]
#[ignore]
fn bench_engine_smollm2() {
    let lm = load(&smollm2_gguf(), DType::F32);
    let o = BenchOptions { max_tokens: std::env::var("QUIVER_BENCH_TOKENS").ok().and_then(|s| s.parse().ok()).unwrap_or(128), ..Default::default() };
    for r in bench_engine(lm, EngineConfig::default(), &o).unwrap() {
        println!("{r}");
    }
}

/// `cargo test --release -p quiver-engine --test engine_bench -- --ignored --nocapture grammar`:
/// what one constrained row adds to a decode step, on SmolLM2's 49k vocabulary: masking the
/// row's logits (llguidance's mask + setting disallowed logits to -inf) and advancing the
/// matcher, per generated token, for a regex and a nested JSON schema.
#[test]
#[ignore]
fn bench_grammar_mask_smollm2() {
    use quiver_engine::structured::Grammars;
    use quiver_engine::Constraint;
    let tok = quiver_model::tokenizer::Tokenizer::from_gguf_path(&smollm2_gguf()).unwrap();
    let vocab = 49152;
    let t0 = std::time::Instant::now();
    let g = Grammars::new(&tok, vocab).unwrap();
    println!("vocabulary trie: {:?}", t0.elapsed());
    let schema = serde_json::json!({"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}, "address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}, "required": ["name", "tags", "address"]});
    // The fastest of 5 runs: the machine is shared, and other load only ever adds time.
    for (name, c) in [("regex [a-z]+( [a-z]+)*", Constraint::Regex("[a-z]+( [a-z]+)*".into())), ("nested JSON schema", Constraint::JsonSchema(schema))] {
        let best = (0..5).map(|_| one_run(&g, &c, vocab)).min_by(|a, b| a.total_cmp(b)).unwrap();
        println!("{name}: mask + advance {best:.1} us per token (best of 5 runs of 400 tokens)");
    }
}

fn one_run(g: &quiver_engine::structured::Grammars, c: &quiver_engine::Constraint, vocab: usize) -> f64 {
    {
        let mut guide = g.compile(c).unwrap();
        let mut logits = vec![0f32; vocab];
        let (mut steps, mut spent) = (0u32, std::time::Duration::ZERO);
        let mut s = 12345u64;
        while steps < 400 && !guide.is_finished() {
            // Pseudo-random logits: which allowed token wins varies step to step.
            for l in logits.iter_mut() {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                *l = (s >> 40) as f32 / 16777216.0;
            }
            let t = std::time::Instant::now();
            guide.mask(&mut logits).unwrap();
            let tok = quiver_engine::sampling::argmax(&logits);
            guide.advance(tok).unwrap();
            spent += t.elapsed();
            steps += 1;
        }
        spent.as_secs_f64() * 1e6 / steps as f64
    }
}
