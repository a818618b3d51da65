//! LoRA on mixture-of-experts models: adapters whose modules the model does not have are
//! refused, naming the module.

mod common;

use common::*;
use quiver_engine::testing::{temp_dir, write_random_adapter};
use quiver_engine::{Engine, EngineConfig, GenerateRequest};
use quiver_kernels::DType;
use quiver_lora::LoraModule;

#[test]
fn dense_mlp_adapter_on_an_expert_layer_is_refused_naming_the_module() {
    let lm = load(&require("ref/models/tiny-qwen3moe-dense1"), DType::F32);
    let dims = lm.model.lora_dims();
    let dir = temp_dir("moe-dense-adapter");
    // Layer 1 is dense (mlp_only_layers), layers 0 and 2 are experts: an adapter on every
    // layer's gate_proj cannot have been trained for this model.
    write_random_adapter(&dir, &dims, &[LoraModule::QProj, LoraModule::GateProj], 4, 8.0, 0.1, 1).unwrap();
    let h = Engine::start(lm, EngineConfig { kv_cache_memory: Some(16 << 20), ..Default::default() }).unwrap();
    let err = h.load_adapter_blocking("dense", &dir, false, false, None).unwrap_err().to_string();
    assert!(err.contains("model.layers.0.mlp.gate_proj") && err.contains("mixture-of-experts"), "{err}");
    h.shutdown_and_join();
    std::fs::remove_dir_all(dir).unwrap();
}

// ---- PEFT parity on the tiny MoE models (scripts/reference_moe_lora.py) ----------------------

use quiver_engine::Generator;
use quiver_kernels::DeviceKind;
use quiver_lora::{AdapterKey, LoraConfig, LoraManager};
use quiver_model::LlamaModel;

/// (model, its adapters): attention only, experts only (down_proj at rank 4), PEFT's
/// `target_parameters` on the fused experts (transformers 5), attention + experts + shared
/// expert with rsLoRA, Mixtral's w1/w2/w3.
const MODELS: [(&str, &[&str]); 3] = [
    ("tiny-qwen3moe", &["qwen3moe-attn-r8", "qwen3moe-experts-r8", "qwen3moe-params-r8"]),
    ("tiny-qwen2moe", &["qwen2moe-all-r8-rslora"]),
    ("tiny-mixtral", &["mixtral-experts-r4"]),
];

/// A pool of rank 16 (above every adapter's) with expert and shared-expert sites.
fn moe_manager(model: &LlamaModel, adapters: &[&str]) -> (LoraManager, Vec<AdapterKey>) {
    let targets = LoraModule::ALL.iter().chain(&LoraModule::MOE).copied().collect();
    let cfg = LoraConfig { max_loras_per_batch: 4, max_lora_rank: 16, target_modules: targets, ..Default::default() };
    let mut mgr = LoraManager::new(model.lora_dims(), cfg, quiver_kernels::open_device(DeviceKind::Cpu).unwrap()).unwrap();
    let keys = adapters.iter().map(|a| mgr.load_adapter(a, require(&format!("ref/adapters/{a}"))).unwrap()).collect();
    (mgr, keys)
}

/// Every adapter's cases and base rows in one batch: each row within 1e-3 of PEFT running its
/// adapter alone (so a row's expert delta reaches only the rows routed to that expert, weighted
/// like the base expert), bit-identical to the same sequence alone, then every adapter's greedy
/// continuation equal to PEFT's.
#[test]
fn expert_and_attention_adapters_in_one_batch_match_peft() {
    for (model, adapters) in MODELS {
        let lm = load(&require(&format!("ref/models/{model}")), DType::F32);
        let (mut mgr, keys) = moe_manager(&lm.model, adapters);
        let refs: Vec<RefFile> = adapters.iter().map(|a| read_ref(&format!("ref/ref/{a}.json"))).collect();
        let base = read_ref(&format!("ref/ref/{model}.json"));
        let mut seqs = Vec::new();
        for (i, r) in refs.iter().enumerate() {
            for c in r.cases.iter().filter(|c| c.prompt_ids.len() < 200) {
                seqs.push((Some(keys[i]), c, adapters[i]));
            }
            seqs.push((None, &base.cases[i % base.cases.len()], "base"));
        }
        let mixed = check_mixed(&lm.model, &mut mgr, &seqs, TOL);
        // Batched = alone, bit for bit: routing and the experts' LoRA groups do not depend on
        // batch-mates (an adapter's first rows, its second sequence's, and the last base row).
        let len = |c: &RefCase| c.prompt_ids.len() + c.continuation_ids.len();
        let vocab = lm.model.config.vocab_size;
        for i in [0, 1, seqs.len() - 1] {
            let off: usize = seqs[..i].iter().map(|s| len(s.1)).sum();
            let alone = check_mixed(&lm.model, &mut mgr, &seqs[i..=i], TOL);
            assert!(alone == mixed[off * vocab..(off + len(seqs[i].1)) * vocab], "{model}: sequence {i} ({}) differs alone and batched", seqs[i].2);
        }
        let mut g = Generator::new(&lm.model, 512);
        for (i, a) in adapters.iter().enumerate() {
            for c in refs[i].cases.iter().filter(|c| c.prompt_ids.len() < 200) {
                assert_greedy_matches(&mut g, &mut mgr, keys[i], c, &format!("{model} adapter {a}"));
            }
        }
    }
}

/// Expert LoRA on a dense model, and on a pool without expert sites: refused naming the module
/// (dense MLP LoRA on an expert layer: the test above).
#[test]
fn adapters_that_do_not_fit_the_model_are_refused_naming_the_module() {
    let dense = load(&require("ref/models/tiny-qwen3"), DType::F32);
    let targets: Vec<LoraModule> = LoraModule::ALL.iter().chain(&LoraModule::MOE).copied().collect();
    let cfg = LoraConfig { max_loras_per_batch: 2, max_lora_rank: 16, target_modules: targets, ..Default::default() };
    let mut mgr = LoraManager::new(dense.model.lora_dims(), cfg, quiver_kernels::open_device(DeviceKind::Cpu).unwrap()).unwrap();
    let err = mgr.load_adapter("x", require("ref/adapters/qwen3moe-experts-r8")).unwrap_err().to_string();
    assert!(err.contains("model.layers.0.mlp.experts.") && err.contains("dense"), "{err}");

    let moe = load(&require("ref/models/tiny-qwen3moe"), DType::F32);
    let dims = moe.model.lora_dims();

    // A pool without expert sites (the default targets) names the module and the pool's list.
    let cfg = LoraConfig { max_loras_per_batch: 2, max_lora_rank: 16, ..Default::default() };
    let mut mgr = LoraManager::new(dims, cfg, quiver_kernels::open_device(DeviceKind::Cpu).unwrap()).unwrap();
    let err = mgr.load_adapter("x", require("ref/adapters/qwen3moe-experts-r8")).unwrap_err().to_string();
    assert!(err.contains("experts.gate_proj") && err.contains("target modules"), "{err}");
}

/// Through the engine (the loader thread's bounded read, the pool, the scheduler): the
/// attention + experts + shared-expert adapter and base requests at once, each greedy
/// continuation PEFT's.
#[test]
fn engine_serves_expert_adapters_beside_base_requests_like_peft() {
    let lm = load(&require("ref/models/tiny-qwen2moe"), DType::F32);
    let targets = LoraModule::ALL.iter().chain(&LoraModule::MOE).copied().collect();
    let cfg = EngineConfig { kv_cache_memory: Some(32 << 20), max_lora_rank: 16, lora_target_modules: targets, ..Default::default() };
    let h = Engine::start(lm, cfg).unwrap();
    h.load_adapter_blocking("all", &require("ref/adapters/qwen2moe-all-r8-rslora"), false, false, None).unwrap();
    let (ad, base) = (read_ref("ref/ref/qwen2moe-all-r8-rslora.json"), read_ref("ref/ref/tiny-qwen2moe.json"));
    let short = |c: &&RefCase| c.prompt_ids.len() < 200;
    let jobs: Vec<(Option<&str>, &RefCase)> = ad.cases.iter().filter(short).map(|c| (Some("all"), c)).chain(base.cases.iter().filter(short).take(2).map(|c| (None, c))).collect();
    let streams: Vec<_> = jobs
        .iter()
        .map(|(a, c)| h.submit(GenerateRequest { prompt: c.prompt_ids.clone(), adapter: a.map(String::from), max_tokens: c.continuation_ids.len(), ignore_eos: true, ..Default::default() }).unwrap())
        .collect();
    for ((a, c), s) in jobs.iter().zip(streams) {
        assert_eq!(s.collect_blocking().tokens[0], c.continuation_ids, "adapter {a:?} case {}: greedy continuation differs from PEFT", c.name);
    }
    h.shutdown_and_join();
}
