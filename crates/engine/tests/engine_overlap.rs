//! Overlapped scheduling changes when the engine thread does its work, never what a request
//! gets: the same requests through an engine with overlap on (the default) and one with
//! `disable_overlap_schedule` give identical tokens, text, logprobs, prompt logprobs, finish
//! reasons, stop reasons and token counts, on the tiny random model (CPU: batch-invariant, so
//! any difference is the scheduler's). The mix has adapters rotating through two slots,
//! greedy and seeded top-k / top-p / min-p sampling, `n > 1`, stop strings and ids, every
//! `max_tokens` from 1, logprobs, and rows that make their step synchronous (a penalty, a
//! `min_tokens` ban, a grammar, prompt logprobs); then the same under preemption (a tiny KV
//! pool), and requests cancelled mid-stream, which never show a token after their cancel
//! took effect. Each stream is also checked on its own: nothing after `Finished`, and
//! `completion_tokens` equal to the tokens it showed.

mod common;

use common::shown::*;
use common::*;
use quiver_engine::{Constraint, Engine, EngineConfig, EngineHandle, EngineStats, FinishReason, GenerateRequest, SamplingParams, StopReason, StreamEvent};
use std::path::PathBuf;

/// `reqs` through an engine with overlap off, then one with it on (checked idle afterwards):
/// what each showed, and the second's statistics.
fn off_then_on(seed: u64, cfg: &EngineConfig, adapters: &[PathBuf], reqs: &[GenerateRequest]) -> (Vec<Shown>, Vec<Shown>, EngineStats) {
    let no_cancel = vec![None; reqs.len()];
    let off = engine(seed, false, cfg, adapters);
    let want = run(&off, reqs, &no_cancel);
    off.shutdown_and_join();
    let on = engine(seed, true, cfg, adapters);
    let got = run(&on, reqs, &no_cancel);
    assert_idle(&on);
    let st = on.stats();
    on.shutdown_and_join();
    (want, got, st)
}

fn engine(seed: u64, overlap: bool, cfg: &EngineConfig, adapters: &[PathBuf]) -> EngineHandle {
    let h = Engine::start(tiny(seed), EngineConfig { disable_overlap_schedule: !overlap, ..cfg.clone() }).unwrap();
    for (i, p) in adapters.iter().enumerate() {
        h.load_adapter_blocking(&format!("a{i}"), p, false, false, None).unwrap();
    }
    h
}

/// `count` requests over the base model and four adapters, varied in everything the overlap
/// loop treats differently (see the module docs). `stop_ids[i]`, when set, is a token request
/// `i`'s greedy output contains.
fn mix(count: usize, vocab: usize, stop_ids: &[Option<u32>]) -> Vec<GenerateRequest> {
    (0..count)
        .map(|i| {
            let sampling = match i % 4 {
                0 => SamplingParams::default(),
                1 => SamplingParams { temperature: 0.8, top_k: 40, seed: Some(1000 + i as u64), ..Default::default() },
                2 => SamplingParams { temperature: 1.0, top_p: 0.9, seed: Some(2000 + i as u64), ..Default::default() },
                _ => SamplingParams { temperature: 0.7, min_p: 0.05, seed: Some(3000 + i as u64), ..Default::default() },
            };
            let mut r = GenerateRequest {
                prompt: prompt(100 + i as u64, [5usize, 12, 17, 33, 48, 70][i % 6] + i % 3, vocab),
                adapter: (i % 5).checked_sub(1).map(|a| format!("a{a}")),
                sampling,
                max_tokens: [1usize, 2, 5, 9, 16, 24, 31][i % 7],
                ignore_eos: i % 2 == 0,
                logprobs: (i % 4 == 0 || i % 7 == 3).then_some(3),
                stop: match i % 6 {
                    1 => vec!["e".into()],
                    4 => vec!["an".into(), "o".into()],
                    _ => vec![],
                },
                include_stop_str_in_output: i % 12 == 4,
                n: match i % 9 {
                    5 => 2,
                    7 => 3,
                    _ => 1,
                },
                ..Default::default()
            };
            if let Some(Some(t)) = stop_ids.get(i) {
                r.stop_token_ids = vec![*t];
                r.stop.clear();
                r.max_tokens = 24;
            }
            match i {
                6 => r.min_tokens = 3,
                10 => {
                    r.sampling.presence_penalty = 0.5;
                    r.max_tokens = 4;
                }
                11 => r.prompt_logprobs = Some(2),
                13 => {
                    r.constraint = Some(Constraint::Choice(vec!["alpha".into(), "beta gamma".into(), "7".into()]));
                    r.max_tokens = 16;
                }
                _ => {}
            }
            if r.n > 1 {
                r.sampling.seed.get_or_insert(4000 + i as u64);
            }
            r
        })
        .collect()
}

/// For the greedy base-model requests at these indices, their 4th greedy token (a stop id that
/// is sure to come up).
fn stop_ids_for(seed: u64, count: usize, vocab: usize, at: &[usize]) -> Vec<Option<u32>> {
    let lm = tiny(seed);
    (0..count)
        .map(|i| {
            at.contains(&i).then(|| {
                let r = &mix(count, vocab, &[])[i];
                assert!(r.adapter.is_none() && r.sampling.temperature == 0.0, "request {i} is not greedy on the base model");
                alone(&lm.model, None, &r.prompt, 4, &[])[3]
            })
        })
        .collect()
}

#[test]
fn mixed_requests_are_identical_with_and_without_overlap() {
    let seed = 31;
    let lm = tiny(seed);
    let vocab = lm.model.config.vocab_size;
    let adapters = make_adapters("overlap-mix", &lm.model.lora_dims(), 4, 8, 0.5, 70);
    drop(lm);
    let count = 44;
    let stop_ids = stop_ids_for(seed, count, vocab, &[0, 20, 40]);
    let reqs = mix(count, vocab, &stop_ids);
    let cfg = EngineConfig { max_running_requests: 12, max_num_batched_tokens: 64, chunked_prefill_size: 16, max_loras_per_batch: 2, max_lora_rank: 8, ..Default::default() };
    let (want, got, st) = off_then_on(seed, &cfg, &adapters, &reqs);
    assert_same("mix", &got, &want);
    assert_overlapped("mix", &st);
    // The mix must reach what it is meant to test.
    let finished = |r: FinishReason| want.iter().flat_map(|s| &s.samples).filter(|x| x.finish.as_ref().is_some_and(|f| f.0 == r)).count();
    let by_stop = |f: fn(&StopReason) -> bool| want.iter().flat_map(|s| &s.samples).filter(|x| x.finish.as_ref().and_then(|f| f.1.as_ref()).is_some_and(f)).count();
    eprintln!("mix: {} stopped ({} by a stop string, {} by a stop id), {} at max_tokens; slot evictions {}", finished(FinishReason::Stop), by_stop(|r| matches!(r, StopReason::Text(_))), by_stop(|r| matches!(r, StopReason::Token(_))), finished(FinishReason::Length), st.lora_slot_evictions);
    assert!(by_stop(|r| matches!(r, StopReason::Text(_))) >= 3 && by_stop(|r| matches!(r, StopReason::Token(_))) == 3, "the mix must stop on strings and on ids");
    assert!(st.lora_slot_evictions > 0, "the adapters must rotate through the slots: {st:?}");
}

#[test]
fn preempted_requests_are_identical_with_and_without_overlap() {
    let seed = 12;
    let lm = tiny(seed);
    let vocab = lm.model.config.vocab_size;
    let bpb = lm.model.kv_bytes_per_block(16);
    let adapters = make_adapters("overlap-preempt", &lm.model.lora_dims(), 4, 8, 0.5, 90);
    drop(lm);
    let count = 30;
    let reqs: Vec<_> = mix(count, vocab, &[]).into_iter().map(|r| GenerateRequest { max_tokens: r.max_tokens + 20, ..r }).collect();
    // Room for a few sequences at a time: running ones are preempted and recomputed.
    let cfg = EngineConfig { kv_cache_memory: Some(16 * bpb), max_running_requests: 10, max_num_batched_tokens: 48, chunked_prefill_size: 16, max_loras_per_batch: 2, max_lora_rank: 8, ..Default::default() };
    let (want, got, st) = off_then_on(seed, &cfg, &adapters, &reqs);
    eprintln!("preemption: {} preemptions with overlap on", st.preemptions);
    assert!(st.preemptions > 0, "the pool must be small enough to preempt: {st:?}");
    assert_same("preemption", &got, &want);
    assert_overlapped("preemption", &st);
}

#[test]
fn cancelled_requests_show_nothing_after_their_cancel() {
    let seed = 44;
    let lm = tiny(seed);
    let vocab = lm.model.config.vocab_size;
    let adapters = make_adapters("overlap-cancel", &lm.model.lora_dims(), 2, 8, 0.5, 120);
    drop(lm);
    let count = 18;
    let reqs: Vec<_> = (0..count)
        .map(|i| GenerateRequest {
            prompt: prompt(500 + i as u64, 6 + i % 7, vocab),
            adapter: (i % 3).checked_sub(1).map(|a| format!("a{a}")),
            sampling: if i % 2 == 0 { SamplingParams::default() } else { SamplingParams { temperature: 0.9, seed: Some(i as u64), ..Default::default() } },
            // Long enough that a cancel always lands mid-stream.
            max_tokens: if i % 3 == 0 { 160 } else { 40 },
            ignore_eos: true,
            logprobs: (i % 4 == 1).then_some(2),
            ..Default::default()
        })
        .collect();
    // Every third request is cancelled after 1..5 tokens, while the rest keep running.
    let cancel: Vec<_> = (0..count).map(|i| (i % 3 == 0).then_some(1 + i % 5)).collect();
    let cfg = EngineConfig { max_running_requests: 8, max_num_batched_tokens: 32, chunked_prefill_size: 16, max_loras_per_batch: 2, max_lora_rank: 8, ..Default::default() };
    let off = engine(seed, false, &cfg, &adapters);
    let want = run(&off, &reqs, &vec![None; count]);
    off.shutdown_and_join();
    let on = engine(seed, true, &cfg, &adapters);
    let got = run(&on, &reqs, &cancel);
    // Streams dropped after their first token: their sequences end with a draw in flight.
    let dropped: Vec<_> = (0..6).map(|i| on.submit(reqs[i].clone()).unwrap()).collect();
    for mut s in dropped {
        while !matches!(s.blocking_recv(), Some(StreamEvent::Token { .. }) | None) {}
    }
    let after = run(&on, &reqs[..6], &[None; 6]);
    assert_idle(&on);
    assert_overlapped("cancellation", &on.stats());
    on.shutdown_and_join();
    for (i, ((g, w), c)) in got.iter().zip(&want).zip(&cancel).enumerate() {
        let Some(k) = *c else {
            assert_eq!(g, w, "request {i} (not cancelled) differs with overlap on (left) and off (right)");
            continue;
        };
        let (g, w) = (&g.samples[0], &w.samples[0]);
        assert_eq!(g.finish, Some((FinishReason::Abort, None)), "request {i} was cancelled");
        assert!(g.tokens.len() >= k && g.tokens.len() < w.tokens.len(), "request {i}: cancelled after {k} tokens, showed {}", g.tokens.len());
        assert_eq!(g.tokens[..], w.tokens[..g.tokens.len()], "request {i}: what a cancelled request showed is the start of its output");
        assert_eq!(g.logprobs[..], w.logprobs[..g.logprobs.len()], "request {i}: logprobs");
    }
    assert_same("after cancellations", &after, &want[..6]);
}
