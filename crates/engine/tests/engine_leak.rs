//! Leak check: 1,000 randomized requests (random adapters, lengths, n, sampling, stop strings,
//! cancellations at random points) with loads, unloads and replaces in between, on a small KV
//! pool (preemption) and two LoRA slots (slot churn). Afterwards every block is free or idly
//! cached, no request, sequence or queue entry remains, and every adapter version's in-flight
//! count is zero with superseded versions gone.

mod common;

use common::*;
use quiver_engine::{Engine, EngineConfig, GenerateRequest, SamplingParams, StreamEvent, SubmitError};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[test]
fn thousand_random_requests_leak_nothing() {
    let seed = std::env::var("QUIVER_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed_u64);
    let mut rng = StdRng::seed_from_u64(seed);
    let lm = tiny(2);
    let vocab = lm.model.config.vocab_size;
    let dims = lm.model.lora_dims();
    let paths = make_adapters("leak", &dims, 6, 8, 0.5, 1000);
    let bpb = lm.model.kv_bytes_per_block(16);
    let cfg = EngineConfig {
        kv_cache_memory: Some(20 * bpb),
        max_running_requests: 12,
        max_num_batched_tokens: 48,
        chunked_prefill_size: 16,
        max_loras_per_batch: 2,
        max_loaded_loras: 2,
        max_lora_rank: 8,
        max_queued_requests: 64,
        aging_steps: 8,
        ..Default::default()
    };
    let h = Engine::start(lm, cfg).unwrap();
    let names = ["a", "b", "c", "d"];
    let mut loaded = [false; 4];
    let start = h.debug_state().unwrap();
    let shared_prefix = prompt(1, 40, vocab);
    let mut done = 0;
    let mut cancelled = 0;
    let mut refused = 0;
    while done < 1000 {
        // Adapter churn between waves.
        for (i, name) in names.iter().enumerate() {
            let r: f32 = rng.random();
            let path = &paths[rng.random_range(0..paths.len())];
            if !loaded[i] && r < 0.5 {
                h.load_adapter_blocking(name, path, false, false, None).unwrap();
                loaded[i] = true;
            } else if loaded[i] && r < 0.15 {
                h.unload_adapter(name).unwrap();
                loaded[i] = false;
            } else if loaded[i] && r < 0.35 {
                h.load_adapter_blocking(name, path, false, true, None).unwrap();
            }
        }
        let wave = rng.random_range(5..25);
        let mut streams = Vec::new();
        for _ in 0..wave {
            let ai = rng.random_range(0..5);
            let adapter = (ai < 4).then(|| names[ai].to_string());
            let len = rng.random_range(1..40);
            let mut p = if rng.random_bool(0.3) { shared_prefix[..len.min(40)].to_vec() } else { prompt(rng.random(), len, vocab) };
            p.push(rng.random_range(100..vocab as u32 - 100));
            let temperature = if rng.random_bool(0.5) { 0.0 } else { 0.8 };
            let req = GenerateRequest {
                prompt: p,
                adapter,
                max_tokens: rng.random_range(1..10),
                n: [1, 1, 1, 2, 3][rng.random_range(0..5)],
                sampling: SamplingParams { temperature, seed: Some(rng.random()), presence_penalty: 0.5, ..Default::default() },
                stop: if rng.random_bool(0.2) { vec!["e".into()] } else { vec![] },
                logprobs: rng.random_bool(0.2).then_some(2),
                ignore_eos: rng.random_bool(0.5),
                ..Default::default()
            };
            match h.submit(req) {
                Ok(s) => streams.push((s, rng.random_range(0..10))),
                Err(SubmitError::UnknownAdapter(_)) | Err(SubmitError::QueueFull { .. }) => refused += 1,
                Err(e) => panic!("{e}"),
            }
            done += 1;
        }
        for (mut s, mode) in streams {
            match mode {
                0 => {
                    cancelled += 1;
                    drop(s);
                }
                1 => {
                    cancelled += 1;
                    let _ = s.blocking_recv();
                    drop(s);
                }
                _ => {
                    let n = s.n();
                    let c = s.collect_blocking();
                    assert!(c.error.is_none(), "{:?}", c.error);
                    assert!(c.finish.iter().all(|f| f.is_some()), "every sample of {n} finished");
                }
            }
        }
        let _ = StreamEvent::Error(String::new());
    }
    let end = h.debug_state().unwrap();
    end.kv_invariants.clone().unwrap();
    assert_eq!(end.kv_in_use, 0, "{end:?}");
    assert_eq!(end.kv_free + end.kv_cached_idle, start.kv_free, "{end:?}");
    assert_eq!((end.requests, end.running_seqs, end.waiting_seqs, end.pending_on_load, end.queued), (0, 0, 0, 0, 0), "{end:?}");
    for (name, v, in_flight, current) in &end.lora_versions {
        assert_eq!(*in_flight, 0, "{name} v{v} still in flight");
        assert!(*current, "superseded version {name} v{v} not freed");
    }
    let current: Vec<u64> = end.lora_versions.iter().map(|x| x.1).collect();
    for (slot, v) in &end.lora_resident {
        assert!(current.contains(v), "slot {slot} holds freed version {v}");
    }
    assert_eq!(end.lora_pinned_slots, start.lora_pinned_slots);
    assert_eq!(h.adapters().len(), loaded.iter().filter(|x| **x).count());
    let st = h.stats();
    eprintln!("leak test: {done} requests, {cancelled} cancelled, {refused} refused; preemptions {}, slot loads {}, evictions {}, prefix hits {}/{}", st.preemptions, st.lora_slot_loads, st.lora_slot_evictions, st.prefix_cache_hits, st.prefix_cache_queries);
    assert!(st.preemptions > 0 && st.lora_slot_evictions > 0, "the mix must exercise preemption and slot eviction: {st:?}");
    h.shutdown_and_join();
}
