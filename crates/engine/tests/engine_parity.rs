//! ≥32 concurrent greedy requests over 4 adapters plus base rows, mixed prompt lengths,
//! chunked prefill interleaved with decode: every output is token-identical to the request run
//! alone through `Generator` with the same adapter.

mod common;

use common::*;
use quiver_engine::{Engine, EngineConfig, FinishReason, GenerateRequest};
use quiver_kernels::DType;

#[test]
fn concurrent_mixed_adapters_match_generate_alone() {
    let lm = load(&smollm2_gguf(), DType::F32);
    let oracle_lm = load(&smollm2_gguf(), DType::F32);
    let dims = lm.model.lora_dims();
    let vocab = lm.model.config.vocab_size;
    let paths = make_adapters("parity", &dims, 4, 16, 0.02, 7);
    let (mut oracle, keys) = oracle_manager(&oracle_lm.model, &paths);

    let cfg = EngineConfig {
        max_running_requests: 40,
        max_loras_per_batch: 4,
        max_lora_rank: 16,
        max_num_batched_tokens: 96,
        chunked_prefill_size: 24,
        kv_cache_memory: Some(512 << 20),
        ..Default::default()
    };
    let h = Engine::start(lm, cfg).unwrap();
    for (i, p) in paths.iter().enumerate() {
        h.load_adapter_blocking(&format!("a{i}"), p, false, false, None).unwrap();
    }
    let n = 36;
    let max_tokens = 6;
    let cases: Vec<(Vec<u32>, Option<usize>)> = (0..n)
        .map(|i| {
            let len = [3usize, 9, 17, 30, 41, 64][i % 6] + i % 5;
            (prompt(i as u64, len, vocab), if i % 5 == 4 { None } else { Some(i % 4) })
        })
        .collect();
    let streams: Vec<_> = cases
        .iter()
        .map(|(p, a)| {
            h.submit(GenerateRequest { prompt: p.clone(), adapter: a.map(|a| format!("a{a}")), max_tokens, ignore_eos: true, ..Default::default() }).unwrap()
        })
        .collect();
    let got: Vec<_> = streams.into_iter().map(|s| s.collect_blocking()).collect();
    let stats = h.stats();
    assert!(stats.prefill_tokens > 0);
    h.shutdown_and_join();

    let mut distinct_outputs = std::collections::HashSet::new();
    for (i, ((p, a), c)) in cases.iter().zip(&got).enumerate() {
        assert!(c.error.is_none(), "request {i}: {:?}", c.error);
        assert_eq!(c.finish[0], Some(FinishReason::Length));
        let want = alone(&oracle_lm.model, a.map(|a| (&mut oracle, keys[a])), p, max_tokens, &[]);
        assert_eq!(c.tokens[0], want, "request {i} (adapter {a:?}, prompt {} tokens) differs from running alone", p.len());
        distinct_outputs.insert(c.tokens[0].clone());
    }
    // The adapters must actually change outputs, or the test proves nothing about routing.
    let p = &cases[0].0;
    let base = alone(&oracle_lm.model, None, p, max_tokens, &[]);
    let differing = (0..4).filter(|&a| alone(&oracle_lm.model, Some((&mut oracle, keys[a])), p, max_tokens, &[]) != base).count();
    assert!(differing >= 3, "only {differing} of 4 adapters change the greedy output of the base model");
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
