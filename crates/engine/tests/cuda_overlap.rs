//! Overlapped scheduling on CUDA, on the GPU machine (ignored elsewhere; `scripts/gpu-check.sh`
//! runs it with `--ignored` after `scripts/gpu_models.py` has written the `llama-gpu` model
//! under `$QUIVER_GPU_DATA`): the draws come down on the copy stream, and the next step's
//! token ids are resolved from the device's draws by the `resolve_drawn` kernel before the host
//! has them.
//! - The same requests (greedy and seeded top-k / top-p, logprobs, `n > 1`, four adapters, every
//!   request admitted in the first step so both engines run the same batch shapes) through an
//!   engine with overlap on and one with it off: identical tokens and logprobs (on CUDA a
//!   different batch shape may round bf16 GEMMs differently, so the mix keeps the shapes equal
//!   rather than tolerating near-ties);
//!   Some rows have logit edits (repetition, presence and frequency penalties, a logit bias,
//!   allowed ids, a `min_tokens` ban on a stop id), applied on the GPU before their draws, none
//!   of which can end a row early (that would change the next step's shape only with overlap);
//! - then, with overlap on, a third of them cancelled mid-stream while the rest run: nothing
//!   after a cancel took effect, token counts equal to what each stream showed, every block
//!   and request freed;
//! - then regex and JSON-schema requests beside plain ones, overlapped: every constrained
//!   output complete and matching its grammar. No step of any of it brought logits to the host.
#![cfg(feature = "cuda")]

mod common;

use common::shown::*;
use common::{gpu_data_dir, prompt};
use quiver_engine::testing::{temp_dir, write_random_adapter};
use quiver_engine::{Engine, EngineConfig, EngineHandle, FinishReason, GenerateRequest, SamplingParams};
use quiver_kernels::{open_device, DType, DeviceKind};
use quiver_lora::LoraModule;
use quiver_model::{load_model, LoadedModel};
use std::path::PathBuf;

fn llama_gpu() -> LoadedModel {
    let p = gpu_data_dir().join("models").join("llama-gpu");
    load_model(&p, open_device(DeviceKind::Cuda(0)).unwrap_or_else(|e| panic!("{e:#}")), DType::Bf16).unwrap_or_else(|e| panic!("loading {}: {e:#}", p.display()))
}

fn start(lm: LoadedModel, overlap: bool, adapters: &[PathBuf]) -> EngineHandle {
    // Room for every request at once: all are admitted in the first step.
    let cfg = EngineConfig {
        max_running_requests: 64,
        max_loras_per_batch: adapters.len(),
        max_lora_rank: 16,
        max_num_batched_tokens: 4096,
        chunked_prefill_size: 4096,
        kv_cache_memory: Some(2 << 30),
        disable_overlap_schedule: !overlap,
        ..Default::default()
    };
    let h = Engine::start(lm, cfg).unwrap();
    for (i, p) in adapters.iter().enumerate() {
        h.load_adapter_blocking(&format!("a{i}"), p, false, false, None).unwrap();
    }
    h
}

#[test]
#[ignore = "needs a CUDA GPU and scripts/gpu_models.py output: run by scripts/gpu-check.sh"]
fn overlap_on_equals_off_on_cuda() {
    let root = temp_dir("cuda-overlap");
    let lm = llama_gpu();
    let (dims, vocab) = (lm.model.lora_dims(), lm.model.config.vocab_size);
    let adapters: Vec<PathBuf> = (0..4)
        .map(|i| {
            let p = root.join(format!("adapter{i}"));
            write_random_adapter(&p, &dims, &LoraModule::PROJECTIONS, [16, 8, 16, 4][i], 32.0, 0.02, 60 + i as u64).unwrap();
            p
        })
        .collect();
    let count = 32;
    let reqs: Vec<GenerateRequest> = (0..count)
        .map(|i| (i, GenerateRequest {
            prompt: prompt(3000 + i as u64, [3usize, 9, 17, 30, 41, 64, 100][i % 7] + i % 5, vocab),
            adapter: (i % 5).checked_sub(1).map(|a| format!("a{a}")),
            sampling: match i % 3 {
                0 => SamplingParams::default(),
                1 => SamplingParams { temperature: 0.8, top_k: 40, seed: Some(i as u64), ..Default::default() },
                _ => SamplingParams { temperature: 1.0, top_p: 0.9, seed: Some(i as u64), ..Default::default() },
            },
            max_tokens: [8usize, 16, 24, 40][i % 4],
            ignore_eos: true,
            logprobs: Some(5),
            n: if i % 11 == 5 { 2 } else { 1 },
            ..Default::default()
        }))
        .map(|(i, mut r)| {
            with_edits(&mut r, i, vocab);
            r
        })
        .collect();
    let off = start(lm, false, &adapters);
    let want = run(&off, &reqs, &vec![None; count]);
    assert_edited_on_device("cuda, overlap off", &off);
    off.shutdown_and_join();
    let on = start(llama_gpu(), true, &adapters);
    let got = run(&on, &reqs, &vec![None; count]);
    assert_overlapped("cuda", &on.stats());
    assert_same("cuda", &got, &want);
    assert_edited_on_device("cuda, overlap on", &on);
    eprintln!("cuda overlap: {count} requests identical with overlap on and off");

    // Cancellations while the rest run (their batch shapes now differ from `want`'s, so only
    // what holds on any device is checked).
    let cancel: Vec<_> = (0..count).map(|i| (i % 3 == 0).then_some(1 + i % 4)).collect();
    let long: Vec<_> = reqs.iter().map(|r| GenerateRequest { max_tokens: 64, ..r.clone() }).collect();
    let got = run(&on, &long, &cancel);
    for (i, (g, c)) in got.iter().zip(&cancel).enumerate() {
        let x = &g.samples[0];
        match c {
            Some(k) => {
                assert_eq!(x.finish.as_ref().map(|f| f.0), Some(FinishReason::Abort), "request {i} was cancelled");
                assert!(x.tokens.len() >= *k && x.tokens.len() < 64, "request {i}: cancelled after {k} tokens, showed {}", x.tokens.len());
            }
            None => assert_eq!(x.finish.as_ref().map(|f| f.0), Some(FinishReason::Length), "request {i}"),
        }
    }
    assert_idle(&on);
    grammars_hold_when_overlapped(&on, vocab);
    assert_edited_on_device("cuda, grammars", &on);
    on.shutdown_and_join();
}

/// Logit edits on request `i` of the mix: none can end it before `max_tokens`.
fn with_edits(r: &mut GenerateRequest, i: usize, vocab: usize) {
    let t = r.prompt[0];
    match i % 6 {
        1 => {
            r.sampling.repetition_penalty = 1.3;
            r.sampling.logit_bias = vec![(t, 2.5), ((t + 1) % vocab as u32, -3.0)];
        }
        3 => (r.sampling.presence_penalty, r.sampling.frequency_penalty) = (0.5, 0.4),
        4 => r.sampling.allowed_token_ids = (100..600).collect(),
        5 => {
            // Banned every step: it never ends the row.
            r.stop_token_ids = vec![t];
            r.min_tokens = r.max_tokens;
        }
        _ => {}
    }
}

/// Every draw of `h` so far happened on the device, edited rows included.
fn assert_edited_on_device(label: &str, h: &EngineHandle) {
    let st = h.stats();
    eprintln!("{label}: {} rows edited on the device, {} steps brought logits to the host", st.edited_rows, st.logits_to_host_steps);
    assert!(st.edited_rows > 0 && st.logits_to_host_steps == 0, "{label}: {st:?}");
}

/// Regex and JSON-schema requests (greedy, seeded, `n > 1`) beside plain ones through `h`
/// (overlap on): each constrained sample completes its grammar within `max_tokens`. The
/// grammar's mask for a step is made once the previous token is known, as the draws overlap.
fn grammars_hold_when_overlapped(h: &EngineHandle, vocab: usize) {
    use quiver_engine::Constraint;
    let re = "[0-9]{3}-[a-z]{4}";
    let schema = serde_json::json!({"type": "object", "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["left", "right"]}}, "required": ["ok", "pick"], "additionalProperties": false});
    let reqs: Vec<GenerateRequest> = (0..16)
        .map(|i| GenerateRequest {
            prompt: prompt(7000 + i as u64, 5 + i % 9, vocab),
            sampling: if i % 2 == 0 { SamplingParams::default() } else { SamplingParams { temperature: 0.9, top_k: 50, seed: Some(i as u64), presence_penalty: 0.3, ..Default::default() } },
            constraint: match i % 4 {
                0 => Some(Constraint::Regex(re.into())),
                1 => Some(Constraint::JsonSchema(schema.clone())),
                2 => None,
                _ => Some(Constraint::Choice(vec!["alpha".into(), "beta gamma".into()])),
            },
            max_tokens: 64,
            ignore_eos: true,
            n: if i == 5 { 3 } else { 1 },
            ..Default::default()
        })
        .collect();
    let got = run(h, &reqs, &vec![None; reqs.len()]);
    let re = regex::Regex::new(&format!("^{re}$")).unwrap();
    for (i, (r, g)) in reqs.iter().zip(&got).enumerate() {
        for x in &g.samples {
            let Some(c) = &r.constraint else { continue };
            assert_eq!(x.finish.as_ref().map(|f| f.0), Some(FinishReason::Stop), "request {i}: the grammar completes: {:?}", x.text);
            match c {
                Constraint::Regex(_) => assert!(re.is_match(&x.text), "request {i}: {:?}", x.text),
                Constraint::JsonSchema(_) => {
                    let v: serde_json::Value = serde_json::from_str(&x.text).unwrap_or_else(|e| panic!("request {i}: {:?}: {e}", x.text));
                    assert!(v["ok"].is_boolean() && (v["pick"] == "left" || v["pick"] == "right"), "request {i}: {v}");
                }
                _ => assert!(x.text == "alpha" || x.text == "beta gamma", "request {i}: {:?}", x.text),
            }
        }
    }
    assert_overlapped("cuda, grammars", &h.stats());
    assert_idle(h);
}
