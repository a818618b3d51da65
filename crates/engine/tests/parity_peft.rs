//! Multi-LoRA against HF PEFT on the real model: one batched forward mixing five PEFT adapters
//! (q/v only; all-linear rsLoRA; rank/alpha patterns; embed_tokens + lm_head; layers_to_transform)
//! and base rows gives, for every row, logprobs within 1e-3 of PEFT running that adapter alone,
//! and greedy continuations identical to PEFT's — including when two slots serve five adapters.

mod common;

use common::*;
use quiver_engine::{GenerateOptions, Generator, SamplingParams, StepLora};
use quiver_kernels::{DType, DeviceKind};
use quiver_lora::{AdapterKey, LoraConfig, LoraHook, LoraManager, LoraModule};
use quiver_model::{ForwardBatch, LlamaModel, LogitsFor};

const TOL: f32 = 1e-3;
const ADAPTERS: [&str; 5] = ["a-qv-r8", "b-all-r16-rslora", "c-patterns", "d-embed-head", "e-qk-r4"];

fn manager(model: &LlamaModel, slots: usize) -> (LoraManager, Vec<AdapterKey>) {
    let cfg = LoraConfig { max_loras_per_batch: slots, max_lora_rank: 16, target_modules: LoraModule::ALL.to_vec(), ..Default::default() };
    let mut mgr = LoraManager::new(model.lora_dims(), cfg, quiver_kernels::open_device(DeviceKind::Cpu).unwrap()).unwrap();
    let keys = ADAPTERS.iter().map(|a| mgr.load_adapter(a, require(&format!("ref/adapters/{a}"))).unwrap()).collect();
    (mgr, keys)
}

/// One sequence per (adapter, case); runs them all in one forward and checks every row against
/// its own adapter's reference.
fn check_mixed(model: &LlamaModel, mgr: &mut LoraManager, seqs: &[(Option<AdapterKey>, &RefCase, &str)]) {
    let vocab = model.config.vocab_size;
    let bs = 16;
    let lens: Vec<usize> = seqs.iter().map(|(_, c, _)| c.prompt_ids.len() + c.continuation_ids.len()).collect();
    let per: Vec<usize> = lens.iter().map(|l| l.div_ceil(bs)).collect();
    let total_tokens: usize = lens.iter().sum();
    let mut kv = model.alloc_kv(per.iter().sum(), bs);
    let mut batch = ForwardBatch::with_capacity(total_tokens, seqs.len(), *per.iter().max().unwrap());
    let mut next = 0u32;
    for ((_, c, _), &nb) in seqs.iter().zip(&per) {
        let mut toks = c.prompt_ids.clone();
        toks.extend(&c.continuation_ids);
        let table: Vec<u32> = (next..next + nb as u32).collect();
        next += nb as u32;
        batch.push_seq(&toks, 0, &table, LogitsFor::All);
    }
    let keys: Vec<Option<AdapterKey>> = seqs.iter().map(|s| s.0).collect();
    let mut ws = model.new_workspace(total_tokens, total_tokens);
    let hook = mgr.prepare_batch(&keys, &batch.seq_starts, &batch.logits_rows).unwrap();
    let logits = model.forward(&batch, &mut kv, &mut ws, &hook);
    let mut off = 0;
    for ((_, c, label), &len) in seqs.iter().zip(&lens) {
        let (d, pos) = max_logprob_delta(c, &logits[off * vocab..(off + len) * vocab], vocab);
        assert!(d <= TOL, "{label} case {}: max |Δlogprob| {d} at position {pos} > {TOL}", c.name);
        eprintln!("{label} {}: max |Δlogprob| {d:.2e}", c.name);
        off += len;
    }
}

#[test]
fn mixed_batch_of_five_adapters_and_base_matches_peft() {
    let lm = load(&smollm2_gguf(), DType::F32);
    let (mut mgr, keys) = manager(&lm.model, 8);
    let refs: Vec<RefFile> = ADAPTERS.iter().map(|a| read_ref(&format!("ref/ref/smollm2-{a}.json"))).collect();
    let base = read_ref("ref/ref/smollm2.json");
    // Short cases of every adapter interleaved with base rows in one batch; long prompts in a
    // second batch (keeps the all-position logits buffer reasonable).
    for long in [false, true] {
        let mut seqs = Vec::new();
        for (i, r) in refs.iter().enumerate() {
            for c in r.cases.iter().filter(|c| (c.prompt_ids.len() > 200) == long) {
                seqs.push((Some(keys[i]), c, ADAPTERS[i]));
                if seqs.len() % 3 == 0 {
                    if let Some(b) = base.cases.iter().find(|b| (b.prompt_ids.len() > 200) == long) {
                        seqs.push((None, b, "base"));
                    }
                }
            }
        }
        assert!(seqs.iter().any(|s| s.0.is_none()) && seqs.len() > 6);
        check_mixed(&lm.model, &mut mgr, &seqs);
    }
}

#[test]
fn two_slots_serving_five_adapters_in_rotation_match_peft() {
    let lm = load(&smollm2_gguf(), DType::F32);
    let (mut mgr, keys) = manager(&lm.model, 2);
    let refs: Vec<RefFile> = ADAPTERS.iter().map(|a| read_ref(&format!("ref/ref/smollm2-{a}.json"))).collect();
    for round in 0..5 {
        let (i, j) = (round, (round + 1) % 5);
        let ci = refs[i].cases.iter().min_by_key(|c| c.prompt_ids.len()).unwrap();
        let cj = refs[j].cases.iter().find(|c| c.name == "chat-short").unwrap_or(&refs[j].cases[0]);
        check_mixed(&lm.model, &mut mgr, &[(Some(keys[i]), ci, ADAPTERS[i])]);
        check_mixed(&lm.model, &mut mgr, &[(Some(keys[j]), cj, ADAPTERS[j]), (Some(keys[i]), ci, ADAPTERS[i])]);
    }
}

/// Runs one adapter through the single-sequence generator.
struct OneAdapter<'a> {
    mgr: &'a mut LoraManager,
    key: AdapterKey,
}

impl StepLora for OneAdapter<'_> {
    fn with_hook(&mut self, batch: &ForwardBatch, f: &mut dyn FnMut(&dyn LoraHook)) {
        let hook = self.mgr.prepare_batch(&[Some(self.key)], &batch.seq_starts, &batch.logits_rows).unwrap();
        f(&hook)
    }
}

#[test]
fn greedy_continuations_with_each_adapter_match_peft() {
    let lm = load(&smollm2_gguf(), DType::F32);
    let (mut mgr, keys) = manager(&lm.model, 8);
    let mut g = Generator::new(&lm.model, 1024);
    for (i, a) in ADAPTERS.iter().enumerate() {
        let r = read_ref(&format!("ref/ref/smollm2-{a}.json"));
        for c in &r.cases {
            let opts = GenerateOptions { max_tokens: c.continuation_ids.len(), sampling: SamplingParams::default(), stop_ids: vec![], prefill_chunk: 128 };
            let mut out = Vec::new();
            g.generate(&c.prompt_ids, &opts, &mut OneAdapter { mgr: &mut mgr, key: keys[i] }, |t| {
                out.push(t);
                true
            })
            .unwrap();
            assert_eq!(out, c.continuation_ids, "adapter {a} case {}: greedy continuation differs from PEFT", c.name);
        }
    }
}
