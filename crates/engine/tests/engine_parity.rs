//! ≥32 concurrent greedy requests over 4 adapters plus base rows, mixed prompt lengths,
//! chunked prefill interleaved with decode: every output is token-identical to the request run
//! alone through `Generator` with the same adapter.

mod common;

use common::*;
use quiver_engine::{Engine, EngineConfig, GenerateRequest};
use quiver_kernels::DType;

#[test]
fn concurrent_mixed_adapters_match_generate_alone() {
    engine_matches_alone(load(&smollm2_gguf(), DType::F32), load(&smollm2_gguf(), DType::F32), 36, 6);
}

/// A mixture-of-experts model through the engine: concurrent requests of mixed lengths, chunked
/// prefill interleaved with decode (so each expert sees different row groups than alone), every
/// output token-identical to the request run alone.
#[test]
fn moe_concurrent_requests_match_generate_alone() {
    let path = require("ref/models/tiny-qwen2moe");
    let (lm, oracle_lm) = (load(&path, DType::F32), load(&path, DType::F32));
    let vocab = lm.model.config.vocab_size;
    let cfg = EngineConfig { max_running_requests: 16, max_num_batched_tokens: 64, chunked_prefill_size: 20, kv_cache_memory: Some(64 << 20), ..Default::default() };
    let h = Engine::start(lm, cfg).unwrap();
    let max_tokens = 8;
    let prompts: Vec<Vec<u32>> = (0..16).map(|i| prompt(100 + i as u64, [2usize, 7, 19, 33, 50][i % 5] + i % 3, vocab)).collect();
    let streams: Vec<_> = prompts.iter().map(|p| h.submit(GenerateRequest { prompt: p.clone(), max_tokens, ignore_eos: true, ..Default::default() }).unwrap()).collect();
    let got: Vec<_> = streams.into_iter().map(|s| s.collect_blocking()).collect();
    h.shutdown_and_join();
    for (i, (p, c)) in prompts.iter().zip(&got).enumerate() {
        assert!(c.error.is_none(), "request {i}: {:?}", c.error);
        assert_eq!(c.tokens[0], alone(&oracle_lm.model, None, p, max_tokens, &[]), "request {i} (prompt {} tokens) differs from running alone", p.len());
    }
}
