//! The model on the OpenCL device against the CPU device and the HF / PEFT references, on the
//! runtime a test run names (`quiver_kernels::opencl::testing`; `make test` runs this on Intel's
//! CPU runtime):
//! - f32 weights, portable kernels: greedy continuations of the SmolLM2 reference prompts
//!   identical to the CPU device's, logprobs within the CPU suite's 1e-3 of transformers;
//! - bf16 weights under every kernel set of the run (DPAS at 16 and 8 lanes): max |Δlogprob| on
//!   the CPU bf16 run's top-20 at every position ≤ 0.05;
//! - the PEFT reference adapters in one mixed batch with base rows, within 1e-3 of PEFT (f32);
//! - the engine: concurrent requests over 4 adapters, token-identical to each alone;
//! - Qwen3 (q/k RMSNorm) and the mixture-of-experts families (Mixtral, Qwen2-MoE with its gated
//!   shared expert, Qwen3-MoE, OLMoE) on the CPU suite's tiny models: f32 as SmolLM2 above
//!   against the CPU device and transformers, bf16 (Qwen2-MoE, Qwen3-MoE) with SmolLM2's under
//!   every kernel set, and the engine on Qwen2-MoE batched = alone.
//!
//! The `#[ignore]`d `gpu_data_*` tests are the same checks on the GPU machine's random-weight
//! models (`scripts/gpu_models.py` under `$QUIVER_GPU_DATA`), run by `scripts/gpu-opencl-check.sh`
//! under NVIDIA's OpenCL driver.

mod common;

use common::*;
use quiver_engine::{BaseOnly, Generator};
use quiver_kernels::opencl::{testing, KernelSet};
use quiver_kernels::{open_device, DType, Device, DeviceKind};
use quiver_lora::{LoraConfig, LoraManager, LoraModule};
use quiver_model::{load_model, LoadedModel};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The bound for bf16 weights against the CPU device's bf16.
const BF16_TOL: f32 = 0.05;
/// The CPU suite's bound against transformers / PEFT in f32.
const F32_TOL: f32 = 1e-3;

/// `opencl:0` under `set`, and the set it runs (DPAS emulated or not). Several models may be
/// loaded on one device: compiling a kernel set takes seconds on a CPU runtime.
fn opencl_device(set: KernelSet) -> (Arc<dyn Device>, KernelSet) {
    let dev = testing::device(set);
    let set = dev.kernel_set();
    (Arc::new(dev), set)
}

fn load_on(p: &Path, dev: &Arc<dyn Device>, dtype: DType) -> LoadedModel {
    load_model(p, dev.clone(), dtype).unwrap_or_else(|e| panic!("loading {} on OpenCL: {e:#}", p.display()))
}

/// The model at `p` on `opencl:0` under `set`, and the set the device runs (DPAS emulated or not).
fn load_opencl_at(p: &Path, set: KernelSet, dtype: DType) -> (LoadedModel, KernelSet) {
    let (dev, set) = opencl_device(set);
    (load_on(p, &dev, dtype), set)
}

fn load_opencl(set: KernelSet, dtype: DType) -> (LoadedModel, KernelSet) {
    load_opencl_at(&smollm2_gguf(), set, dtype)
}

/// f32 on both devices: for every case, the OpenCL device's greedy continuation equals the CPU
/// device's and its logprobs are within `F32_TOL` of the case's reference top-20.
///
/// Greedy decoding emits `t_i = argmax logits(prompt + t_<i)`, so the OpenCL device continues
/// exactly as the CPU when, teacher-forced on the CPU's continuation, its argmax at every
/// position is the CPU's next token: one forward per case instead of one per token (the device
/// computes a row the same whether it is decoded or prefilled, which the engine test checks).
/// The `decoded` shortest cases also decode token by token on the device, the path itself.
fn check_f32_against_cpu(label: &str, ocl: &LoadedModel, cpu: &LoadedModel, cases: &[RefCase], decoded: usize) {
    let vocab = ocl.model.config.vocab_size;
    let mut g = Generator::new(&ocl.model, 2048);
    let mut by_len: Vec<&RefCase> = cases.iter().collect();
    by_len.sort_by_key(|c| c.prompt_ids.len());
    for (i, case) in by_len.into_iter().enumerate() {
        let n = case.continuation_ids.len();
        let want = alone(&cpu.model, None, &case.prompt_ids, n, &[]);
        let mut all = case.prompt_ids.clone();
        all.extend(&want);
        let logits = g.score(&all, &mut BaseOnly).unwrap();
        let p = case.prompt_ids.len();
        let argmax = |row: usize| logits[row * vocab..(row + 1) * vocab].iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32;
        let got: Vec<u32> = (0..n).map(|j| argmax(p + j - 1)).collect();
        assert_eq!(got, want, "{label} case {}: OpenCL's greedy continuation differs from the CPU device's", case.name);
        if i < decoded {
            let dec = alone(&ocl.model, None, &case.prompt_ids, n, &[]);
            assert_eq!(dec, want, "{label} case {}: OpenCL's decoded continuation differs from the CPU device's", case.name);
        }
        // The reference's logprobs are of its own continuation: compare where it is ours.
        let (d, pos) = if want == case.continuation_ids {
            max_logprob_delta(case, &logits, vocab)
        } else {
            let mut forced = case.prompt_ids.clone();
            forced.extend(&case.continuation_ids);
            max_logprob_delta(case, &g.score(&forced, &mut BaseOnly).unwrap(), vocab)
        };
        eprintln!("{label} f32 {}: greedy identical to the CPU{}, max |Δlogprob| vs the reference {d:.2e} at {pos}", case.name, if i < decoded { " (also decoded)" } else { "" });
        assert!(d <= F32_TOL, "{label} case {}: max |Δlogprob| {d} at {pos} > {F32_TOL}", case.name);
    }
}

/// The CPU device's bf16 top-20 at every position of each prompt + its reference continuation,
/// as cases for the OpenCL device's bf16.
fn cpu_bf16_cases(cpu: &LoadedModel, cases: Vec<RefCase>) -> Vec<RefCase> {
    let vocab = cpu.model.config.vocab_size;
    let mut g = Generator::new(&cpu.model, 2048);
    cases
        .into_iter()
        .map(|c| {
            let mut all = c.prompt_ids.clone();
            all.extend(&c.continuation_ids);
            let logits = g.score(&all, &mut BaseOnly).unwrap();
            top20_case(c.name, c.prompt_ids, c.continuation_ids, &logits, vocab)
        })
        .collect()
}

/// Max |Δlogprob| of the OpenCL bf16 model over `cases`, asserted ≤ `BF16_TOL`.
fn check_bf16(label: &str, ocl: &LoadedModel, cases: &[RefCase]) {
    let vocab = ocl.model.config.vocab_size;
    let mut g = Generator::new(&ocl.model, 2048);
    let mut worst = 0.0f32;
    for case in cases {
        let mut all = case.prompt_ids.clone();
        all.extend(&case.continuation_ids);
        let (d, pos) = max_logprob_delta(case, &g.score(&all, &mut BaseOnly).unwrap(), vocab);
        eprintln!("{label} bf16 {}: max |Δlogprob| vs the CPU's bf16 {d:.2e} at {pos}", case.name);
        worst = worst.max(d);
    }
    eprintln!("{label} bf16: max |Δlogprob| {worst:.2e} over {} cases", cases.len());
    assert!(worst <= BF16_TOL, "{label}: max |Δlogprob| {worst} > {BF16_TOL}");
}

#[test]
fn f32_greedy_matches_cpu_and_logprobs_match_transformers() {
    let cpu = load(&smollm2_gguf(), DType::F32);
    let (ocl, _) = load_opencl(KernelSet::Portable, DType::F32);
    check_f32_against_cpu("opencl", &ocl, &cpu, &read_ref("ref/ref/smollm2.json").cases, 2);
}

/// SmolLM2, and the tiny Qwen2-MoE and Qwen3-MoE (the experts' grouped GEMM: on DPAS under a
/// DPAS set), each set's device compiled once for all three.
#[test]
fn bf16_logprobs_match_cpu_bf16() {
    // The long prompts add minutes on a CPU runtime and nothing the short ones do not cover.
    let short = |rel: &str| -> Vec<RefCase> { read_ref(rel).cases.into_iter().filter(|c| c.prompt_ids.len() < 100).collect() };
    let models: Vec<(&str, PathBuf, Vec<RefCase>)> = [("smollm2", smollm2_gguf()), ("tiny-qwen2moe", require("ref/models/tiny-qwen2moe")), ("tiny-qwen3moe", require("ref/models/tiny-qwen3moe"))]
        .into_iter()
        .map(|(name, p)| {
            let cases = cpu_bf16_cases(&load(&p, DType::Bf16), short(&format!("ref/ref/{name}.json")));
            (name, p, cases)
        })
        .collect();
    for set in testing::kernel_sets() {
        let (dev, set) = opencl_device(set);
        for (name, p, cases) in &models {
            let ocl = load_on(p, &dev, DType::Bf16);
            // The emulated matrix builtin is slow on a CPU: two prompts there (the kernel tests
            // cover the DPAS GEMMs' shapes; this checks what a model's layers of them add up to).
            let n = if matches!(set, KernelSet::Dpas { emulated: true, .. }) { 2 } else { cases.len() };
            check_bf16(&format!("opencl {name} {set:?}"), &ocl, &cases[..n]);
        }
    }
}

#[test]
fn peft_adapters_in_a_mixed_batch_match_peft() {
    let (lm, _) = load_opencl(KernelSet::Portable, DType::F32);
    let (mut mgr, keys) = peft_manager(&lm.model, 8);
    let refs: Vec<RefFile> = ADAPTERS.iter().map(|a| read_ref(&format!("ref/ref/smollm2-{a}.json"))).collect();
    let base = read_ref("ref/ref/smollm2.json");
    // Every adapter's two short cases (prompts of 6 and 37 tokens) with base rows: each kind of
    // site (projections, slices, embedding, lm_head, patterns) in one mixed batch. The longer
    // cases run in the CPU suite; on a CPU runtime they would cost a minute and cover nothing
    // new (opencl_lora checks the kernels on random batches of every shape).
    let mut seqs = Vec::new();
    for (i, r) in refs.iter().enumerate() {
        for c in r.cases.iter().filter(|c| c.prompt_ids.len() + c.continuation_ids.len() < 72) {
            seqs.push((Some(keys[i]), c, ADAPTERS[i]));
            if seqs.len() % 3 == 0 {
                seqs.push((None, &base.cases[0], "base"));
            }
        }
    }
    assert!(seqs.iter().any(|s| s.0.is_none()) && seqs.len() >= 2 * ADAPTERS.len());
    check_mixed(&lm.model, &mut mgr, &seqs, F32_TOL);
}

#[test]
fn engine_batched_equals_alone() {
    engine_matches_alone(load_opencl(KernelSet::Portable, DType::F32).0, load_opencl(KernelSet::Portable, DType::F32).0, 16, 6);
}

// ---- Qwen3 and the mixture-of-experts families (the CPU suite's tiny random models) ----------

/// Qwen3 (q/k RMSNorm per head), Mixtral, Qwen2-MoE (sigmoid-gated shared expert), Qwen3-MoE
/// (renormalised top-4 of 16), OLMoE (q/k RMSNorm over the whole projections), f32 on one
/// portable device: each case's greedy continuation the CPU device's (two also decoded token by
/// token), logprobs within the CPU suite's 1e-3 of transformers. The long prompts (400+ tokens:
/// experts with several GEMM tiles) run on Mixtral and Qwen2-MoE only; elsewhere they would add
/// seconds and nothing the short ones do not cover.
#[test]
fn tiny_qwen3_and_moe_f32_greedy_matches_cpu_and_logprobs_match_transformers() {
    let (dev, _) = opencl_device(KernelSet::Portable);
    for (name, long) in [("tiny-qwen3", false), ("tiny-mixtral", true), ("tiny-qwen2moe", true), ("tiny-qwen3moe", false), ("tiny-olmoe", false)] {
        let p = require(&format!("ref/models/{name}"));
        let cases: Vec<RefCase> = read_ref(&format!("ref/ref/{name}.json")).cases.into_iter().filter(|c| long || c.prompt_ids.len() < 100).collect();
        check_f32_against_cpu(&format!("opencl {name}"), &load_on(&p, &dev, DType::F32), &load(&p, DType::F32), &cases, 2);
    }
}

/// Concurrent requests on the tiny Qwen2-MoE (chunked prefill beside decode: every expert sees
/// other rows than alone), each token-identical to the request alone.
#[test]
fn moe_engine_batched_equals_alone() {
    let (dev, _) = opencl_device(KernelSet::Portable);
    let p = require("ref/models/tiny-qwen2moe");
    concurrent_requests_match_alone(load_on(&p, &dev, DType::F32), load_on(&p, &dev, DType::F32));
}

/// Expert LoRA needs the routing on the host, which the OpenCL device keeps in its own memory:
/// a pool with expert sites is refused, saying why and what to drop.
#[test]
fn expert_lora_is_refused_naming_the_reason() {
    let (dev, _) = opencl_device(KernelSet::Portable);
    let lm = load_on(&require("ref/models/tiny-qwen3moe"), &dev, DType::F32);
    let targets = LoraModule::ALL.iter().chain(&LoraModule::MOE).copied().collect();
    let cfg = LoraConfig { max_loras_per_batch: 2, max_lora_rank: 16, target_modules: targets, ..Default::default() };
    let err = LoraManager::new(lm.model.lora_dims(), cfg, dev).err().expect("expert LoRA pool on OpenCL").to_string();
    assert!(err.contains("not on OpenCL") && err.contains("experts"), "{err}");
}

// ---- the GPU machine's run (scripts/gpu-opencl-check.sh) -------------------------------------

fn gpu_data() -> PathBuf {
    let d = std::env::var_os("QUIVER_GPU_DATA").map(PathBuf::from).expect("QUIVER_GPU_DATA must name the directory scripts/gpu_models.py wrote");
    assert!(d.join("models").is_dir() && d.join("ref").is_dir(), "{}: no models/ and ref/ (run scripts/gpu_models.py models and refs first)", d.display());
    d
}

fn gpu_cases(name: &str) -> Vec<RefCase> {
    let p = gpu_data().join("ref").join(format!("{name}.json"));
    let r: RefFile = serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap();
    r.cases
}

fn gpu_model(name: &str) -> PathBuf {
    gpu_data().join("models").join(name)
}

fn cpu_at(p: &Path, dtype: DType) -> LoadedModel {
    load_model(p, open_device(DeviceKind::Cpu).unwrap(), dtype).unwrap_or_else(|e| panic!("loading {}: {e:#}", p.display()))
}

#[test]
#[ignore = "the GPU machine's OpenCL run: scripts/gpu-opencl-check.sh (models and references from scripts/gpu_models.py)"]
fn gpu_data_f32_matches_cpu_and_transformers() {
    for name in ["llama-gpu", "qwen2-gpu"] {
        let p = gpu_model(name);
        let (ocl, _) = load_opencl_at(&p, KernelSet::Portable, DType::F32);
        check_f32_against_cpu(&format!("opencl {name}"), &ocl, &cpu_at(&p, DType::F32), &gpu_cases(name), 2);
    }
}

#[test]
#[ignore = "the GPU machine's OpenCL run: scripts/gpu-opencl-check.sh (models and references from scripts/gpu_models.py)"]
fn gpu_data_bf16_matches_cpu_bf16() {
    let p = gpu_model("smollm2-rand");
    let cases = cpu_bf16_cases(&cpu_at(&p, DType::Bf16), gpu_cases("smollm2-rand"));
    for set in testing::kernel_sets() {
        let (ocl, set) = load_opencl_at(&p, set, DType::Bf16);
        check_bf16(&format!("opencl smollm2-rand {set:?}"), &ocl, &cases);
    }
}

#[test]
#[ignore = "the GPU machine's OpenCL run: scripts/gpu-opencl-check.sh (models and references from scripts/gpu_models.py)"]
fn gpu_data_engine_batched_equals_alone() {
    let p = gpu_model("smollm2-rand");
    engine_matches_alone(load_opencl_at(&p, KernelSet::Portable, DType::F32).0, load_opencl_at(&p, KernelSet::Portable, DType::F32).0, 36, 8);
}
