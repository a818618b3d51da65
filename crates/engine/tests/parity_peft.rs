//! Multi-LoRA against HF PEFT on the real model: one batched forward mixing five PEFT adapters
//! (q/v only; all-linear rsLoRA; rank/alpha patterns; embed_tokens + lm_head; layers_to_transform)
//! and base rows gives, for every row, logprobs within 1e-3 of PEFT running that adapter alone,
//! and greedy continuations identical to PEFT's — including when two slots serve five adapters.

mod common;

use common::*;
use quiver_engine::Generator;
use quiver_kernels::DType;

#[test]
fn mixed_batch_of_five_adapters_and_base_matches_peft() {
    let lm = load(&smollm2_gguf(), DType::F32);
    let (mut mgr, keys) = peft_manager(&lm.model, 8);
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
        check_mixed(&lm.model, &mut mgr, &seqs, TOL);
    }
}

#[test]
fn two_slots_serving_five_adapters_in_rotation_match_peft() {
    let lm = load(&smollm2_gguf(), DType::F32);
    let (mut mgr, keys) = peft_manager(&lm.model, 2);
    let refs: Vec<RefFile> = ADAPTERS.iter().map(|a| read_ref(&format!("ref/ref/smollm2-{a}.json"))).collect();
    for round in 0..5 {
        let (i, j) = (round, (round + 1) % 5);
        let ci = refs[i].cases.iter().min_by_key(|c| c.prompt_ids.len()).unwrap();
        let cj = refs[j].cases.iter().find(|c| c.name == "chat-short").unwrap_or(&refs[j].cases[0]);
        check_mixed(&lm.model, &mut mgr, &[(Some(keys[i]), ci, ADAPTERS[i])], TOL);
        check_mixed(&lm.model, &mut mgr, &[(Some(keys[j]), cj, ADAPTERS[j]), (Some(keys[i]), ci, ADAPTERS[i])], TOL);
    }
}

#[test]
fn greedy_continuations_with_each_adapter_match_peft() {
    let lm = load(&smollm2_gguf(), DType::F32);
    let (mut mgr, keys) = peft_manager(&lm.model, 8);
    let mut g = Generator::new(&lm.model, 1024);
    for (i, a) in ADAPTERS.iter().enumerate() {
        let r = read_ref(&format!("ref/ref/smollm2-{a}.json"));
        for c in &r.cases {
            assert_greedy_matches(&mut g, &mut mgr, keys[i], c, &format!("adapter {a}"));
        }
    }
}
