//! A warm decode step allocates little beyond its outputs: eight greedy streams decoding on the
//! CPU, counted over 800 generated tokens, make at most 3 host allocations per token (each
//! token event's text, and amortized: the event channel's blocks, a prefix-cache entry per
//! full KV block). Streaming detokenization through the tokenizer's decoder made ~20. The only
//! test in this binary, so no other test thread allocates while counting.

mod common;

use common::*;
use quiver_engine::{Engine, EngineConfig, GenerateRequest, SamplingParams, StreamEvent};
use quiver_kernels::alloc_count::{count_allocations, CountingAlloc};

#[global_allocator]
static A: CountingAlloc = CountingAlloc;

#[test]
fn warm_decode_allocates_little_beyond_its_outputs() {
    let lm = tiny(2);
    assert!(lm.tokenizer.token_bytes().is_some(), "the test model's tokenizer is byte-level");
    let vocab = lm.model.config.vocab_size;
    let h = Engine::start(lm, EngineConfig { max_running_requests: 8, ..Default::default() }).unwrap();
    let greedy = SamplingParams { temperature: 0.0, ..Default::default() };
    let mut streams: Vec<_> = (0..8)
        .map(|i| h.submit(GenerateRequest { prompt: prompt(i, 10, vocab), max_tokens: 400, ignore_eos: true, sampling: greedy.clone(), ..Default::default() }).unwrap())
        .collect();
    let take = |streams: &mut Vec<quiver_engine::RequestStream>, per: usize| {
        for s in streams.iter_mut() {
            let mut k = 0;
            while k < per {
                match s.blocking_recv() {
                    Some(StreamEvent::Token { .. }) => k += 1,
                    Some(_) => {}
                    None => panic!("stream ended early"),
                }
            }
        }
    };
    take(&mut streams, 20);
    let n = count_allocations(|| take(&mut streams, 100));
    let per_token = n as f64 / 800.0;
    eprintln!("{n} allocations over 800 generated tokens: {per_token:.2} per token");
    assert!(per_token <= 3.0, "{per_token:.2} allocations per generated token in steady decode");
}
