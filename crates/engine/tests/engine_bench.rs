//! `cargo test --release -p quiver-engine --test engine_bench -- --ignored --nocapture`:
//! 16 concurrent streams × 128 tokens on SmolLM2 (f32): base, one adapter, 4 distinct rank-16
//! adapters. (`quiver bench engine` runs the same function.)

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
