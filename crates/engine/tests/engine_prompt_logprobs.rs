//! Prompt scoring (`prompt_logprobs`, what `echo` and lm-eval read) in the batched engine
//! against the single-sequence oracle (`Generator::score`, itself checked against
//! transformers and PEFT in parity_hf / parity_peft): alone, in one batch with generating and
//! scoring requests on other adapters, split over prefill chunks, and with the prompt's blocks
//! already in the prefix cache. Rows that ask for no scores must be unchanged by rows that do.

mod common;

use common::*;
use quiver_engine::{AdapterLora, BaseOnly, Engine, EngineConfig, FinishReason, GenerateRequest, Generator, StreamEvent, TokenLogprob};
use quiver_lora::{AdapterKey, LoraManager};
use quiver_model::LlamaModel;

const K: usize = 3;

/// The oracle: logprob, rank and top-K of every prompt token after the first.
fn oracle(model: &LlamaModel, lora: Option<(&mut LoraManager, AdapterKey)>, p: &[u32]) -> Vec<TokenLogprob> {
    let vocab = model.config.vocab_size;
    let mut g = Generator::new(model, p.len() + 1);
    let logits = match lora {
        Some((manager, key)) => g.score(p, &mut AdapterLora { manager, key: Some(key) }),
        None => g.score(p, &mut BaseOnly),
    }
    .unwrap();
    (1..p.len()).map(|j| quiver_engine::sampling::token_logprob(&logits[(j - 1) * vocab..j * vocab], p[j], K)).collect()
}

fn scoring(p: &[u32], adapter: Option<&str>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest { prompt: p.to_vec(), adapter: adapter.map(str::to_string), max_tokens, prompt_logprobs: Some(K), ignore_eos: true, ..Default::default() }
}

fn assert_same(got: &[TokenLogprob], want: &[TokenLogprob], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: one logprob per prompt token after the first");
    for (j, (g, w)) in got.iter().zip(want).enumerate() {
        // Batch invariance: the same row gives the same logits whatever shares the step.
        assert_eq!(g, w, "{what}: prompt token {}", j + 1);
    }
}

#[test]
fn prompt_logprobs_equal_the_oracle_alone_batched_chunked_and_cached() {
    let lm = tiny(11);
    let vocab = lm.model.config.vocab_size;
    let paths = make_adapters("prompt-lp", &lm.model.lora_dims(), 2, 8, 0.05, 300);
    let (mut mgr, keys) = oracle_manager(&lm.model, &paths);
    let p_base = prompt(1, 45, vocab);
    let p_a0 = prompt(2, 37, vocab);
    let p_gen = prompt(3, 20, vocab);
    let want_base = oracle(&lm.model, None, &p_base);
    let want_a0 = oracle(&lm.model, Some((&mut mgr, keys[0])), &p_a0);
    let gen_alone = alone(&lm.model, Some((&mut mgr, keys[1])), &p_gen, 10, &[]);
    // Chunks of 16 rows: a prompt is scored over several steps, next to other rows.
    let cfg = EngineConfig { chunked_prefill_size: 16, max_num_batched_tokens: 64, ..Default::default() };
    let h = Engine::start(lm, cfg).unwrap();
    for (i, p) in paths.iter().enumerate() {
        h.load_adapter_blocking(&format!("a{i}"), p, false, false, None).unwrap();
    }

    // Alone, scoring only (max_tokens 0): no token is generated.
    let c = h.submit(scoring(&p_base, None, 0)).unwrap().collect_blocking();
    assert_eq!((c.finish[0], c.tokens[0].len()), (Some(FinishReason::Length), 0));
    assert_same(c.prompt_logprobs.as_deref().unwrap(), &want_base, "base alone");

    // The same prompt again: its full blocks are now cached, and must still be scored.
    let before = h.stats().prefix_cache_hits;
    let c = h.submit(scoring(&p_base, None, 0)).unwrap().collect_blocking();
    assert_same(c.prompt_logprobs.as_deref().unwrap(), &want_base, "base, prompt in the prefix cache");
    assert_eq!(h.stats().prefix_cache_hits, before, "a scoring request read no cached block");
    // A generating request on that prompt does read the cache the scoring one filled.
    let g = h.submit(GenerateRequest { prompt: p_base.clone(), max_tokens: 2, ignore_eos: true, ..Default::default() }).unwrap().collect_blocking();
    assert_eq!(g.finish[0], Some(FinishReason::Length));
    assert!(h.stats().prefix_cache_hits > before, "the scored prompt's blocks serve later requests");

    // Batched: a scoring request on a0 that also generates, a scoring-only base request and a
    // plain generating request on a1, submitted together.
    let s_a0 = h.submit(GenerateRequest { logprobs: Some(1), ..scoring(&p_a0, Some("a0"), 4) }).unwrap();
    let s_base = h.submit(scoring(&p_base, None, 0)).unwrap();
    let s_gen = h.submit(GenerateRequest { prompt: p_gen.clone(), adapter: Some("a1".into()), max_tokens: 10, ignore_eos: true, ..Default::default() }).unwrap();
    let mut s_a0 = s_a0;
    let mut events = Vec::new();
    while let Some(ev) = s_a0.blocking_recv() {
        let done = matches!(ev, StreamEvent::Finished { .. });
        events.push(ev);
        if done {
            break;
        }
    }
    assert!(matches!(events[0], StreamEvent::PromptLogprobs(_)), "prompt logprobs come before the first token");
    let StreamEvent::PromptLogprobs(got) = &events[0] else { unreachable!() };
    assert_same(got, &want_a0, "adapter a0 batched");
    assert_eq!(events.iter().filter(|e| matches!(e, StreamEvent::Token { .. })).count(), 4);
    assert_same(s_base.collect_blocking().prompt_logprobs.as_deref().unwrap(), &want_base, "base batched");
    assert_eq!(s_gen.collect_blocking().tokens[0], gen_alone, "a row without scoring is unchanged by scoring rows");

    // Bad requests.
    assert!(h.submit(GenerateRequest { prompt: p_base.clone(), max_tokens: 0, ..Default::default() }).is_err(), "max_tokens 0 without scoring");
    assert!(h.submit(GenerateRequest { prompt_logprobs: Some(21), ..scoring(&p_base, None, 1) }).is_err());
    h.shutdown_and_join();
}
