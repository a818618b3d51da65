//! Tensor parallelism on the CPU: a model split over N simulated ranks (each its own shard, KV
//! heads and LoRA pool cut, its own thread, collectives summing in rank order) gives the
//! unsharded model's logits up to the reordering of the row-parallel dot products, through
//! prefill and decode steps on the paged KV cache, with and without adapters (several in one
//! batch beside base rows), with kv heads split and replicated (n_kv_heads < N); and the
//! engine over two ranks gives the greedy tokens of one.
//!
//! The same checks run on CUDA on the GPU machine (ignored elsewhere; `scripts/gpu-tp.sh`):
//! one `CudaDevice` per rank and the peer collectives of `kernels/src/cuda/collective.rs`,
//! with the ranks sharing the GPUs there are (`QUIVER_CUDA_TP_SHARE_GPUS=1`). The engine and
//! transformers parity at TP > 1 on CUDA are `cuda_parity` under `QUIVER_TEST_TP`.

mod common;

use quiver_engine::testing::{random_hf_weights, temp_dir, tiny_model_tp, write_random_adapter};
use quiver_kernels::{open_device, DType, DeviceKind};
use quiver_lora::{AdapterKey, LoraConfig, LoraManager, LoraModule, NoLora};
use quiver_model::config::{Arch, ModelConfig};
use quiver_model::formats::memory::MemoryWeights;
use quiver_model::loader::load_hf_weights;
use quiver_model::{ForwardBatch, LlamaModel, LogitsFor};
use std::path::PathBuf;

fn config(num_kv_heads: usize, tied: bool, qkv_bias: bool) -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        vocab_size: 256,
        hidden_size: 64,
        intermediate_size: 96,
        num_layers: 2,
        num_heads: 8,
        num_kv_heads,
        head_dim: 8,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        max_position_embeddings: 256,
        tie_word_embeddings: tied,
        qkv_bias,
        qk_norm: None,
        moe: None,
        has_lm_head: true,
    }
}

fn load(weights: &MemoryWeights, c: &ModelConfig, tp: usize, device: DeviceKind) -> LlamaModel {
    load_hf_weights(weights, c.clone(), open_device(device).unwrap(), DType::F32, tp).unwrap_or_else(|e| panic!("TP {tp} on {device}: {e:#}"))
}

/// Prompt lengths of the batch's sequences, and which adapter each uses (None: base rows).
const PROMPTS: [usize; 4] = [6, 13, 1, 9];
const SEQ_ADAPTER: [Option<usize>; 4] = [Some(0), None, Some(1), Some(2)];
const DECODE_STEPS: usize = 3;
const BLOCK: usize = 4;

/// Every step's logits: one prefill step (logits of every row), then decode steps of one token
/// per sequence, through a paged cache whose blocks are interleaved between sequences.
fn run(model: &LlamaModel, adapters: &[PathBuf]) -> Vec<Vec<f32>> {
    run_blocks(model, adapters, BLOCK)
}

/// [`run`] over KV blocks of `block` tokens.
fn run_blocks(model: &LlamaModel, adapters: &[PathBuf], block: usize) -> Vec<Vec<f32>> {
    let vocab = model.config.vocab_size as u32;
    let mut mgr = (!adapters.is_empty()).then(|| {
        let modules: Vec<LoraModule> = LoraModule::PROJECTIONS.iter().copied().chain([LoraModule::EmbedTokens, LoraModule::LmHead]).collect();
        let cfg = LoraConfig { max_loras_per_batch: 4, max_lora_rank: 8, target_modules: modules, max_batch_tokens: 64, ..Default::default() };
        let mut m = LoraManager::new(model.lora_dims(), cfg, model.device.clone()).unwrap();
        if let Some(ranks) = model.tp_ranks() {
            m.shard_pool(&ranks).unwrap();
        }
        m
    });
    let keys: Vec<AdapterKey> = adapters.iter().enumerate().map(|(i, p)| mgr.as_mut().unwrap().load_adapter(&format!("a{i}"), p).unwrap()).collect();
    let seq_keys: Vec<Option<AdapterKey>> = SEQ_ADAPTER.iter().map(|a| a.filter(|_| !keys.is_empty()).map(|i| keys[i])).collect();
    let nb: Vec<usize> = PROMPTS.iter().map(|&n| (n + DECODE_STEPS).div_ceil(block)).collect();
    let stride = *nb.iter().max().unwrap();
    // Sequence s takes every 4th block from s, so its blocks are never adjacent, out of a pool
    // where every residue has `stride` blocks. (Until session 22 the pool held only the blocks'
    // sum: with 4-token blocks sequence 1 got 3 of its 4, its fourth table entry fell back to
    // block 0, sequence 0's, and both wrote it in the same step: deterministic on the CPU, a
    // race on CUDA, which is what the CUDA TP checks kept finding.)
    let total = PROMPTS.len() * stride;
    let tables: Vec<Vec<u32>> = (0..PROMPTS.len()).map(|s| (0..total as u32).filter(|b| *b as usize % PROMPTS.len() == s).take(nb[s]).collect()).collect();
    for (s, t) in tables.iter().enumerate() {
        assert_eq!(t.len(), nb[s], "sequence {s} needs {} KV blocks of {block} tokens", nb[s]);
    }
    let mut kv = model.alloc_kv(total, block);
    let mut ws = model.new_workspace(64, 64);
    let mut batch = ForwardBatch::with_capacity(64, PROMPTS.len(), stride);
    let mut out = Vec::new();
    for step in 0..=DECODE_STEPS {
        batch.clear(stride);
        for (s, &len) in PROMPTS.iter().enumerate() {
            let token = |i: usize| ((i * 7919 + s * 104_729 + step * 31) as u32) % vocab;
            if step == 0 {
                let toks: Vec<u32> = (0..len).map(token).collect();
                batch.push_seq(&toks, 0, &tables[s], LogitsFor::All);
            } else {
                batch.push_seq(&[token(len + step)], len + step - 1, &tables[s], LogitsFor::Last);
            }
        }
        let logits = match mgr.as_mut() {
            Some(m) => {
                let hook = m.prepare_batch(&seq_keys, &batch.seq_starts, &batch.logits_rows).unwrap();
                model.forward(&batch, &mut kv, &mut ws, &hook).to_vec()
            }
            None => model.forward(&batch, &mut kv, &mut ws, &NoLora).to_vec(),
        };
        out.push(logits);
    }
    out
}

/// Largest |Δ| of logits and of log-softmax rows between two runs.
fn max_diffs(a: &[Vec<f32>], b: &[Vec<f32>], vocab: usize) -> (f32, f32) {
    fn log_softmax(row: &[f32]) -> impl Iterator<Item = f32> + '_ {
        let mx = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let lse = mx + row.iter().map(|v| ((v - mx) as f64).exp()).sum::<f64>().ln() as f32;
        row.iter().map(move |v| v - lse)
    }
    let (mut dl, mut dp) = (0f32, 0f32);
    for (sa, sb) in a.iter().zip(b) {
        assert_eq!(sa.len(), sb.len());
        for (ra, rb) in sa.chunks(vocab).zip(sb.chunks(vocab)) {
            dl = ra.iter().zip(rb).map(|(x, y)| (x - y).abs()).fold(dl, f32::max);
            dp = log_softmax(ra).zip(log_softmax(rb)).map(|(x, y)| (x - y).abs()).fold(dp, f32::max);
        }
    }
    (dl, dp)
}

/// Each step's largest |Δlogit| between two runs, for printing.
fn by_step(a: &[Vec<f32>], b: &[Vec<f32>], vocab: usize) -> String {
    a.iter().zip(b).map(|(x, y)| format!("{:.1e}", max_diffs(std::slice::from_ref(x), std::slice::from_ref(y), vocab).0)).collect::<Vec<_>>().join(", ")
}

/// Runs every case of `configs` at TP = 1, 2, 4 on `device` and checks the sharded runs
/// against TP = 1 within `tolerance` (on logits up to 10, relative beyond).
fn check(adapters: bool, device: DeviceKind, tolerance: f32) {
    // kv heads split (2 → 1 per rank at N = 2) and replicated (2 over 4 ranks, 1 over 2 and 4);
    // an untied LM head with q/k/v biases, and a tied one without.
    for (kv_heads, tied, bias) in [(2, false, true), (1, true, false)] {
        let c = config(kv_heads, tied, bias);
        let weights = random_hf_weights(&c, 7 + kv_heads as u64);
        let dir = temp_dir("tp-adapters");
        let paths: Vec<PathBuf> = if adapters {
            let whole = load(&weights, &c, 1, device);
            let modules: Vec<LoraModule> = LoraModule::PROJECTIONS.iter().copied().chain([LoraModule::EmbedTokens, LoraModule::LmHead]).collect();
            (0..3)
                .map(|i| {
                    let p = dir.join(format!("a{i}"));
                    write_random_adapter(&p, &whole.lora_dims(), &modules, 4 + 2 * i, 16.0, 0.05, 100 + i as u64).unwrap();
                    p
                })
                .collect()
        } else {
            Vec::new()
        };
        let reference = run(&load(&weights, &c, 1, device), &paths);
        let repeat = max_diffs(&reference, &run(&load(&weights, &c, 1, device), &paths), c.vocab_size).0;
        assert!(repeat == 0.0, "two TP 1 runs on {device} differ by {repeat}");
        if device != DeviceKind::Cpu {
            // The unsharded model on this device against the CPU's (f32 weights both; a GPU's
            // KV cache and LoRA pool are bf16): a kernel wrong for these small shapes (head_dim
            // 8) shows here, not as a sharding bug. The bound is the GPU parity tests' bf16 one:
            // session 23's H100 run measured 7e-3 to 8.8e-2 (the tied-head case largest).
            let cpu = run(&load(&weights, &c, 1, DeviceKind::Cpu), &paths);
            let (dl, _) = max_diffs(&cpu, &reference, c.vocab_size);
            println!("{device} TP 1 against the CPU: |Δlogit| by step [{}]", by_step(&cpu, &reference, c.vocab_size));
            assert!(dl <= BF16_KV_TOLERANCE, "TP 1 on {device} differs from the CPU by {dl}");
        }
        if adapters {
            // The adapters must move the logits far beyond the tolerance, or the check is empty.
            let (moved, _) = max_diffs(&reference, &run(&load(&weights, &c, 1, device), &[]), c.vocab_size);
            assert!(moved > 0.05, "the adapters change logits by only {moved}");
        }
        for tp in [2, 4] {
            let got = run(&load(&weights, &c, tp, device), &paths);
            let (dl, dp) = max_diffs(&reference, &got, c.vocab_size);
            let scale = reference.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
            // Per step (0 is the prefill) and per row: where a sharded run goes wrong tells a
            // collective's ordering bug (whole rows) from arithmetic (every row a little).
            let per_step = by_step(&reference, &got, c.vocab_size);
            // The collectives sum in rank order, so a sharded run repeats bit for bit.
            let again = run(&load(&weights, &c, tp, device), &paths);
            let repeat = max_diffs(&got, &again, c.vocab_size).0;
            println!("{device}: TP {tp} |Δlogit| by step [{per_step}], between two TP {tp} runs {repeat:.1e}");
            assert!(repeat == 0.0, "two TP {tp} runs on {device} differ by {repeat}");
            println!("{device}: kv_heads {kv_heads} tied {tied} bias {bias} adapters {adapters} TP {tp}: max |logit| {scale:.1}, max |Δlogit| {dl:.3e}, max |Δlogprob| {dp:.3e}");
            // f32 reordering errors scale with the values summed: an absolute bound of 1e-5
            // on logits up to ~10, relative beyond (the tied head's logits reach ~55).
            let bound = tolerance * (scale / 10.0).max(1.0);
            assert!(dl <= bound && dp <= 2.0 * bound, "TP {tp} (kv heads {kv_heads}, adapters {adapters}) differs from TP 1: |Δlogit| {dl}, |Δlogprob| {dp}, bound {bound}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Largest |Δlogit| allowed on logits up to 10 in magnitude (issue 24's 1e-5); the measured
/// differences are printed (about 2e-6 at |logit| ≤ 4, 1.7e-5 at |logit| ≤ 55: a few ulps).
const TOLERANCE: f32 = 1e-5;

#[test]
fn tensor_parallel_equals_unsharded_base() {
    check(false, DeviceKind::Cpu, TOLERANCE);
}

#[test]
fn tensor_parallel_equals_unsharded_with_adapters() {
    check(true, DeviceKind::Cpu, TOLERANCE);
}

/// On CUDA in f32 the GEMMs of different widths (a rank's K is 1/N of the whole) may take
/// other cuBLAS algorithms, and the LoRA pool is bf16 with f32 sums in other orders: the bound
/// is 10× the CPU's, still 500× under what the adapters move (the test checks they do).
#[cfg(feature = "cuda")]
const CUDA_TOLERANCE: f32 = 1e-4;
/// How far a CUDA run of the tests' tiny models may be from the CPU's in logits: CUDA keeps the KV
/// cache (and the LoRA pool) in bf16, the CPU in f32; 0.1 is the GPU parity tests' bf16 bound.
const BF16_KV_TOLERANCE: f32 = 0.1;

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU (QUIVER_CUDA_TP_SHARE_GPUS=1 with fewer than 4): run by scripts/gpu-tp.sh"]
fn cuda_tensor_parallel_equals_unsharded_base() {
    check(false, DeviceKind::Cuda(0), CUDA_TOLERANCE);
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU (QUIVER_CUDA_TP_SHARE_GPUS=1 with fewer than 4): run by scripts/gpu-tp.sh"]
fn cuda_tensor_parallel_equals_unsharded_with_adapters() {
    check(true, DeviceKind::Cuda(0), CUDA_TOLERANCE);
}

/// The unsharded tiny model on the GPU against the CPU, one property of the TP test's model
/// changed at a time. Sessions 21-22 found CUDA's run of that model (f32, head_dim 8, KV blocks
/// of 4 tokens, q/k/v biases) ~3-4 off the CPU's logits and varying between runs; these variants
/// showed it needed 4-token blocks, which led to the cause: `run_blocks` gave one sequence too
/// few blocks, so two sequences shared a KV block (fixed there). It stays as the check that
/// CUDA's small-head, small-block paths agree with the CPU: every variant within
/// `BF16_KV_TOLERANCE`.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-tp.sh"]
fn cuda_unsharded_tiny_models_match_the_cpu() {
    let mut bad = Vec::new();
    // (what changes, head_dim, KV block tokens, q/k/v biases, weights in bf16)
    for (name, hd, block, bias, bf16) in [
        ("as the TP test", 8, 4, true, false),
        ("KV blocks of 16", 8, 16, true, false),
        ("head_dim 16", 16, 4, true, false),
        ("no biases", 8, 4, false, false),
        ("bf16 weights", 8, 4, true, true),
        ("head_dim 16, blocks of 16, no biases", 16, 16, false, false),
    ] {
        let mut c = config(2, false, bias);
        c.head_dim = hd;
        c.num_heads = c.hidden_size / hd;
        let weights = random_hf_weights(&c, 21);
        let dtype = if bf16 { DType::Bf16 } else { DType::F32 };
        let on = |device| load_hf_weights(&weights, c.clone(), open_device(device).unwrap(), dtype, 1).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        let (cpu, gpu) = (run_blocks(&on(DeviceKind::Cpu), &[], block), run_blocks(&on(DeviceKind::Cuda(0)), &[], block));
        let (dl, _) = max_diffs(&cpu, &gpu, c.vocab_size);
        println!("tiny model, {name}: CUDA against the CPU, |Δlogit| by step [{}]", by_step(&cpu, &gpu, c.vocab_size));
        // CUDA's KV cache is bf16 (the CPU's f32), and with bf16 weights its GEMMs round their
        // inputs too: session 23 measured 4e-3 to 1.4e-2 on every variant.
        if dl > BF16_KV_TOLERANCE {
            bad.push(format!("{name}: {dl}"));
        }
    }
    assert!(bad.is_empty(), "CUDA differs from the CPU on: {}", bad.join("; "));
}

#[test]
fn tensor_parallel_refuses_what_does_not_divide() {
    let c = config(2, true, false);
    let weights = random_hf_weights(&c, 1);
    let e = load_hf_weights(&weights, c.clone(), open_device(DeviceKind::Cpu).unwrap(), DType::F32, 3).err().unwrap().to_string();
    assert!(e.contains("--tensor-parallel-size 3") && e.contains("num_attention_heads = 8 is not divisible by 3"), "{e}");
    let e = load_hf_weights(&weights, c, open_device(DeviceKind::Cpu).unwrap(), DType::F32, 16).err().unwrap().to_string();
    assert!(e.contains("num_attention_heads = 8 is not divisible by 16"), "{e}");
}

/// The engine over a model split in two (scheduler, paged KV, adapters in one batch with base
/// rows, overlapped scheduling) gives the greedy tokens of the unsplit model run alone.
#[test]
fn engine_with_two_ranks_matches_one() {
    let gguf = common::smollm2_gguf();
    common::engine_matches_alone(tiny_model_tp(&gguf, 11, 2).unwrap(), tiny_model_tp(&gguf, 11, 1).unwrap(), 10, 8);
}
