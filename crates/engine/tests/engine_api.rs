//! Request-level behaviour on the tiny random model: stop strings and ids, logprobs, seeded
//! sampling independent of the batch, n > 1 sharing the prompt, cancellation, limits, adapter
//! lifecycle (waiting on a load, replace, unload, compare-and-swap), an engine without LoRA.

mod common;

use common::*;
use quiver_engine::{AdapterError, Engine, EngineConfig, FinishReason, GenerateRequest, SamplingParams, StreamEvent, SubmitError};

fn greedy(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest { prompt, max_tokens, ignore_eos: true, ..Default::default() }
}

#[test]
fn stop_strings_and_stop_ids() {
    let lm = tiny(3);
    let vocab = lm.model.config.vocab_size;
    let h = Engine::start(lm, EngineConfig::default()).unwrap();
    let p = prompt(77, 12, vocab);
    let full = h.submit(greedy(p.clone(), 24)).unwrap().collect_blocking();
    let text = full.text[0].clone();
    assert_eq!(text, h.tokenizer().decode(&full.tokens[0], true).unwrap(), "streamed text = full decode");
    // A stop string taken from the middle of the output.
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() > 12, "output too short: {text:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
    let mut s = h.submit(GenerateRequest { stop: vec![stop.clone()], ..greedy(p.clone(), 24) }).unwrap();
    let mut streamed = String::new();
    let mut reason = None;
    while let Some(ev) = s.blocking_recv() {
        match ev {
            StreamEvent::Token { text, .. } => streamed.push_str(&text),
            StreamEvent::Finished { reason: r, .. } => {
                reason = Some(r);
                break;
            }
            StreamEvent::Error(e) => panic!("{e}"),
            StreamEvent::PromptLogprobs(_) => panic!("prompt logprobs that were not asked for"),
        }
    }
    assert_eq!(reason, Some(FinishReason::Stop));
    let cut = text.find(&stop).unwrap();
    assert_eq!(streamed, text[..cut], "text before the stop string, nothing of it");
    // Stop token id: the 5th generated token.
    let sid = full.tokens[0][4];
    let first = full.tokens[0].iter().position(|&t| t == sid).unwrap();
    let c = h.submit(GenerateRequest { stop_token_ids: vec![sid], ..greedy(p.clone(), 24) }).unwrap().collect_blocking();
    assert_eq!(c.finish[0], Some(FinishReason::Stop));
    assert_eq!(c.tokens[0], full.tokens[0][..=first].to_vec());
    h.shutdown_and_join();
}

#[test]
fn logprobs_and_seeded_sampling_independent_of_batch() {
    let lm = tiny(4);
    let vocab = lm.model.config.vocab_size;
    let h = Engine::start(lm, EngineConfig::default()).unwrap();
    let p = prompt(5, 20, vocab);
    let g = h.submit(GenerateRequest { logprobs: Some(3), ..greedy(p.clone(), 6) }).unwrap().collect_blocking();
    for (t, lp) in g.tokens[0].iter().zip(&g.logprobs[0]) {
        assert_eq!(lp.top.len(), 3);
        assert_eq!(lp.top[0].0, *t, "greedy picks the top token");
        assert!(lp.logprob <= 0.0 && (lp.logprob - lp.top[0].1).abs() < 1e-6);
        assert!(lp.top[0].1 >= lp.top[1].1 && lp.top[1].1 >= lp.top[2].1);
    }
    let sampled = |seed: u64| GenerateRequest { sampling: SamplingParams { temperature: 4.0, top_k: 5, seed: Some(seed), ..Default::default() }, ..greedy(p.clone(), 12) };
    let alone = h.submit(sampled(42)).unwrap().collect_blocking();
    // Same request amid a crowd of others.
    let crowd: Vec<_> = (0..10).map(|i| h.submit(greedy(prompt(900 + i, 5 + i as usize * 3, vocab), 10)).unwrap()).collect();
    let amid = h.submit(sampled(42)).unwrap().collect_blocking();
    for c in crowd {
        c.collect_blocking();
    }
    assert_eq!(alone.tokens, amid.tokens, "a seeded request samples the same tokens whatever the batch");
    // n = 3 shares the prompt; sample i equals a single request seeded seed + i.
    let n3 = h.submit(GenerateRequest { n: 3, ..sampled(42) }).unwrap().collect_blocking();
    assert_eq!(n3.tokens[0], alone.tokens[0]);
    for i in 1..3 {
        let single = h.submit(sampled(42 + i as u64)).unwrap().collect_blocking();
        assert_eq!(n3.tokens[i], single.tokens[0], "sample {i}");
        assert_eq!(n3.finish[i], Some(FinishReason::Length));
    }
    assert!(n3.tokens[0] != n3.tokens[1] || n3.tokens[1] != n3.tokens[2], "different seeds should differ");
    // A zero logit bias changes no logit but sends the row through the logit edits op before
    // its draw: the draw is the same.
    for seed in [1u64, 2, 3] {
        let params = SamplingParams { temperature: 1.5, top_k: 20, top_p: 0.9, min_p: 0.02, seed: Some(seed), ..Default::default() };
        let device = h.submit(GenerateRequest { sampling: params.clone(), logprobs: Some(2), ..greedy(p.clone(), 12) }).unwrap().collect_blocking();
        let host = h.submit(GenerateRequest { sampling: SamplingParams { logit_bias: vec![(0, 0.0)], ..params }, logprobs: Some(2), ..greedy(p.clone(), 12) }).unwrap().collect_blocking();
        assert_eq!(device.tokens, host.tokens, "seed {seed}: plain and edited rows' draws");
        for (a, b) in device.logprobs[0].iter().zip(&host.logprobs[0]) {
            assert!((a.logprob - b.logprob).abs() < 1e-6 && a.rank == b.rank && a.top.iter().map(|t| t.0).eq(b.top.iter().map(|t| t.0)), "{a:?} vs {b:?}");
        }
    }
    let d = h.debug_state().unwrap();
    assert_eq!((d.kv_in_use, d.requests), (0, 0));
    h.shutdown_and_join();
}

#[test]
fn cancellation_limits_and_refusals() {
    let lm = tiny(6);
    let vocab = lm.model.config.vocab_size;
    let h = Engine::start(lm, EngineConfig { max_running_requests: 1, max_num_batched_tokens: 64, max_queued_requests: 2, max_model_len: Some(256), ..Default::default() }).unwrap();
    // Cancel after the first token: blocks and the request are freed.
    let mut s = h.submit(greedy(prompt(1, 30, vocab), 200)).unwrap();
    assert!(matches!(s.blocking_recv(), Some(StreamEvent::Token { .. })));
    drop(s);
    let d = h.debug_state().unwrap();
    assert_eq!((d.requests, d.kv_in_use, d.running_seqs, d.queued), (0, 0, 0, 0), "{d:?}");
    // Bounded queue: one runs at a time; beyond two queued, refusal.
    let mut accepted = Vec::new();
    let mut full = 0;
    for i in 0..5 {
        match h.submit(greedy(prompt(10 + i, 10, vocab), 200)) {
            Ok(s) => accepted.push(s),
            Err(SubmitError::QueueFull { max: 2 }) => full += 1,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(full >= 2 && accepted.len() <= 3, "accepted {} refused {full}", accepted.len());
    drop(accepted);
    assert!(matches!(h.submit(greedy(prompt(2, 100, vocab), 157)), Err(SubmitError::PromptTooLong { max_model_len: 256, .. })));
    assert!(matches!(h.submit(GenerateRequest { adapter: Some("nope".into()), ..greedy(vec![5], 2) }), Err(SubmitError::UnknownAdapter(_))));
    assert!(matches!(h.submit(greedy(vec![], 2)), Err(SubmitError::Invalid(_))));
    assert!(matches!(h.submit(greedy(vec![vocab as u32 + 5], 2)), Err(SubmitError::Invalid(_))));
    let d = h.debug_state().unwrap();
    assert_eq!((d.requests, d.kv_in_use, d.queued), (0, 0, 0), "{d:?}");
    h.shutdown();
    assert!(matches!(h.submit(greedy(vec![5], 2)), Err(SubmitError::ShuttingDown)));
}

#[test]
fn adapter_lifecycle_load_wait_replace_unload() {
    let lm = tiny(9);
    let oracle_lm = tiny(9);
    let vocab = lm.model.config.vocab_size;
    let paths = make_adapters("life", &lm.model.lora_dims(), 2, 8, 0.5, 300);
    let (mut oracle, keys) = oracle_manager(&oracle_lm.model, &paths);
    let h = Engine::start(lm, EngineConfig { max_lora_rank: 8, ..Default::default() }).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let p = prompt(11, 9, vocab);
    // A request submitted while its adapter is loading waits for it.
    let load = h.load_adapter("x", &paths[0], false, false, None);
    let waiting = h.submit(GenerateRequest { adapter: Some("x".into()), ..greedy(p.clone(), 6) }).unwrap();
    let v1 = rt.block_on(load).unwrap();
    let c = waiting.collect_blocking();
    assert_eq!(c.tokens[0], alone(&oracle_lm.model, Some((&mut oracle, keys[0])), &p, 6, &[]));
    assert_eq!(h.load_adapter_blocking("x", &paths[1], false, false, None), Err(AdapterError::AlreadyLoaded("x".into())));
    assert!(matches!(h.load_adapter_blocking("x", &paths[1], false, true, Some(v1.version + 100)), Err(AdapterError::VersionMismatch { .. })));
    // A long request on v1, then replace: it keeps v1, new requests get v2.
    let long_p = prompt(12, 9, vocab);
    let mut old = h.submit(GenerateRequest { adapter: Some("x".into()), ..greedy(long_p.clone(), 60) }).unwrap();
    let Some(StreamEvent::Token { token_id: old_first, .. }) = old.blocking_recv() else { panic!("expected a token") };
    let v2 = h.load_adapter_blocking("x", &paths[1], false, true, Some(v1.version)).unwrap();
    assert!(v2.version > v1.version);
    let new = h.submit(GenerateRequest { adapter: Some("x".into()), ..greedy(p.clone(), 6) }).unwrap().collect_blocking();
    assert_eq!(new.tokens[0], alone(&oracle_lm.model, Some((&mut oracle, keys[1])), &p, 6, &[]), "new requests use the new version");
    // Unload while the old one runs: new requests refused at once, the running one finishes.
    h.unload_adapter("x").unwrap();
    assert!(matches!(h.submit(GenerateRequest { adapter: Some("x".into()), ..greedy(p.clone(), 2) }), Err(SubmitError::UnknownAdapter(_))));
    let mut rest = old.collect_blocking();
    assert_eq!(rest.finish[0], Some(FinishReason::Length));
    rest.tokens[0].insert(0, old_first);
    assert_eq!(rest.tokens[0], alone(&oracle_lm.model, Some((&mut oracle, keys[0])), &long_p, 60, &[]), "the running request finished on v1's weights");
    let d = h.debug_state().unwrap();
    assert!(d.lora_versions.is_empty(), "every version freed once unused: {:?}", d.lora_versions);
    assert!(d.lora_resident.is_empty(), "{:?}", d.lora_resident);
    assert!(h.adapters().is_empty());
    let bad = make_adapters("bad", &oracle_lm.model.lora_dims(), 1, 32, 0.5, 1);
    let e = h.load_adapter_blocking("big", &bad[0], false, false, None).unwrap_err();
    assert!(matches!(e, AdapterError::Invalid(ref m) if m.contains("big")), "{e}");
    h.shutdown_and_join();
}

/// An engine without LoRA (`lora_enabled: false`, a server without `--enable-lora`) keeps the
/// smallest pool and refuses adapter loads by name, before any file is read; base requests
/// run as in a LoRA engine.
#[test]
fn an_engine_without_lora_refuses_adapters_and_serves_base() {
    let (lm, ref_lm) = (tiny(21), tiny(21));
    let vocab = lm.model.config.vocab_size;
    let paths = make_adapters("nolora", &lm.model.lora_dims(), 1, 8, 0.5, 31);
    let h = Engine::start(lm, EngineConfig { lora_enabled: false, ..Default::default() }).unwrap();
    let e = h.load_adapter_blocking("a", &paths[0], false, false, None).unwrap_err();
    assert!(matches!(e, AdapterError::Invalid(ref m) if m.contains("`a`") && m.contains("not enabled")), "{e}");
    assert!(h.adapters().is_empty());
    let p = prompt(5, 11, vocab);
    let got = h.submit(greedy(p.clone(), 8)).unwrap().collect_blocking();
    assert_eq!(got.tokens[0], alone(&ref_lm.model, None, &p, 8, &[]));
    h.shutdown_and_join();
}

/// On a device that makes adapter images (CUDA does; here a CPU device told to), the loader
/// thread makes each image as it reads the adapter and every activation copies from it: three
/// adapters rotating through two slots, twice, give what the oracle gives.
#[test]
fn adapters_activated_from_device_images_match_the_oracle() {
    let mut lm = tiny(9);
    lm.model.device = std::sync::Arc::new(quiver_kernels::cpu::CpuDevice::with_lora_images());
    let oracle_lm = tiny(9);
    let vocab = lm.model.config.vocab_size;
    let paths = make_adapters("images", &lm.model.lora_dims(), 3, 8, 0.5, 400);
    let (mut oracle, keys) = oracle_manager(&oracle_lm.model, &paths);
    let h = Engine::start(lm, EngineConfig { max_lora_rank: 8, max_loras_per_batch: 2, ..Default::default() }).unwrap();
    for (i, p) in paths.iter().enumerate() {
        h.load_adapter_blocking(&format!("a{i}"), p, false, false, None).unwrap();
    }
    for round in 0..2 {
        for (i, &key) in keys.iter().enumerate() {
            let p = prompt(30 + i as u64, 7, vocab);
            let got = h.submit(GenerateRequest { adapter: Some(format!("a{i}")), ..greedy(p.clone(), 5) }).unwrap().collect_blocking();
            assert_eq!(got.tokens[0], alone(&oracle_lm.model, Some((&mut oracle, key)), &p, 5, &[]), "round {round}, adapter {i}");
        }
    }
    h.shutdown_and_join();
}
