//! `quiver bench lora [--device cpu|cuda]`, in two parts:
//! - `kernels`: on CPU (bench_lora_kernels.rs) shrink + expand per backend over rows × adapters ×
//!   ranks on SmolLM2- and Llama-8B-shaped layers, against this machine's peaks; on CUDA
//!   (bench_lora_gpu.rs) the LoRA kernels of a whole 8B-shaped step, recorded and replayed, against
//!   the device's copy bandwidth;
//! - `step`: what LoRA costs in a batched decode step of the real model on the device. For each
//!   backend, rank and adapter count, times the same decode step with N rows spread over D
//!   distinct adapters (all seven projections by default, `--modules experts` on an MoE
//!   `--shape`), against the base model alone, in one run (ratios, medians).

use crate::bench_generate::median;
use anyhow::Result;
use clap::Args;
use quiver_kernels::{DType, Device, DeviceKind};
use quiver_lora::mem_pool::LoraMemoryPool;
use quiver_lora::{AdapterId, AdapterKey, EvictionPolicy, LoraAdapter, LoraConfig, LoraHook, LoraManager, LoraModule, NoLora};
use rayon::prelude::*;
use quiver_model::{ForwardBatch, LlamaModel, LogitsFor};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct BenchLoraArgs {
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long, default_value = "f32")]
    pub dtype: DType,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceKind,
    /// Kernel part on CUDA: layers of the 8B-shaped step (the peers were measured on 32).
    #[arg(long, default_value_t = 32)]
    pub kernel_layers: usize,
    /// Which parts to run: kernels, step, or all.
    #[arg(long, default_value = "all")]
    pub part: String,
    /// Kernel part: layer shapes (smollm2, llama8b).
    #[arg(long, value_delimiter = ',', default_value = "smollm2,llama8b")]
    pub shapes: Vec<String>,
    /// Kernel part: rows in the batch.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64,256,512")]
    pub kernel_rows: Vec<usize>,
    /// Kernel part: distinct adapters among the rows.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8")]
    pub kernel_adapters: Vec<usize>,
    /// Kernel part: timed repetitions per point (median reported).
    #[arg(long, default_value_t = 7)]
    pub kernel_reps: usize,
    /// Step part: decode rows in the step.
    #[arg(long, value_delimiter = ',', default_value = "16,64")]
    pub rows: Vec<usize>,
    /// Step part: prefill steps of this many prompt tokens too (one prompt per adapter, the
    /// tokens split evenly), e.g. `--prefill 2048`.
    #[arg(long, value_delimiter = ',')]
    pub prefill: Vec<usize>,
    /// Step part: distinct adapters among the rows (each value its own runs).
    #[arg(long, value_delimiter = ',', default_value = "4")]
    pub adapters: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "8,16,64")]
    pub ranks: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "segmented,chunked,auto")]
    pub backends: Vec<String>,
    /// Timed (base, LoRA) step pairs; medians of the times and of the per-pair ratios.
    #[arg(long, default_value_t = 31)]
    pub steps: usize,
    #[arg(long)]
    pub output_json: Option<PathBuf>,
    /// Step part: the adapters' modules (as --lora-target-modules: `all-linear`, `experts`,
    /// `shared_expert`, names).
    #[arg(long, default_value = "all-linear")]
    pub modules: String,
    #[command(flatten)]
    pub shape: crate::bench_shapes::ShapeArgs,
}

struct Step {
    kv: quiver_model::KvCache,
    ws: quiver_model::Workspace,
    batch: ForwardBatch,
}

fn setup(m: &LlamaModel, n: usize) -> Step {
    let bs = 16;
    let per = 4;
    let mut kv = m.alloc_kv(per * n, bs);
    let mut ws = m.new_workspace(32 * n, n);
    let mut batch = ForwardBatch::with_capacity(32 * n, n, per);
    // Each sequence its own tokens: an MoE model's rows then route apart, as real requests do
    // (identical rows would all read the same few experts); a dense model computes the same.
    for s in 0..n {
        let prompt: Vec<u32> = (0..32).map(|i| ((i * 17 + s * 29) % 500 + 50) as u32).collect();
        let t: Vec<u32> = ((s * per) as u32..((s + 1) * per) as u32).collect();
        batch.push_seq(&prompt, 0, &t, LogitsFor::Last);
    }
    m.forward(&batch, &mut kv, &mut ws, &NoLora);
    batch.clear(per);
    for s in 0..n {
        let t: Vec<u32> = ((s * per) as u32..((s + 1) * per) as u32).collect();
        batch.push_seq(&[(77 + 13 * s % 400) as u32], 32, &t, LogitsFor::Last);
    }
    Step { kv, ws, batch }
}

/// A prefill step of `tokens` prompt tokens split over `prompts` prompts from position 0.
fn setup_prefill(m: &LlamaModel, tokens: usize, prompts: usize) -> Step {
    let bs = 16;
    let len = tokens / prompts;
    let per = len.div_ceil(bs);
    let kv = m.alloc_kv(per * prompts, bs);
    let ws = m.new_workspace(tokens, prompts);
    let mut batch = ForwardBatch::with_capacity(tokens, prompts, per);
    for s in 0..prompts {
        let prompt: Vec<u32> = (0..len).map(|i| ((i * 17 + s * 29) % 500 + 50) as u32).collect();
        let t: Vec<u32> = ((s * per) as u32..((s + 1) * per) as u32).collect();
        batch.push_seq(&prompt, 0, &t, LogitsFor::Last);
    }
    Step { kv, ws, batch }
}

fn step_ms(m: &LlamaModel, st: &mut Step, hook: &dyn LoraHook) -> f64 {
    let t0 = Instant::now();
    m.forward(&st.batch, &mut st.kv, &mut st.ws, hook);
    t0.elapsed().as_secs_f64() * 1e3
}

pub fn run(a: BenchLoraArgs) -> Result<()> {
    if !["all", "kernels", "step"].contains(&a.part.as_str()) {
        anyhow::bail!("--part must be kernels, step or all (got `{}`)", a.part);
    }
    let zero = |v: &[usize]| v.is_empty() || v.contains(&0);
    if zero(&a.adapters) || a.steps == 0 || a.kernel_reps == 0 || zero(&a.ranks) || zero(&a.rows) || zero(&a.kernel_rows) || zero(&a.kernel_adapters) {
        anyhow::bail!("--adapters, --steps, --kernel-reps and every value of --ranks, --rows, --kernel-rows and --kernel-adapters must be at least 1");
    }
    let mut kernels = Vec::new();
    if a.part != "step" {
        kernels = match a.device {
            DeviceKind::Cpu => {
                let ka = crate::bench_lora_kernels::KernelArgs { shapes: &a.shapes, rows: &a.kernel_rows, adapters: &a.kernel_adapters, ranks: &a.ranks, backends: &a.backends, reps: a.kernel_reps };
                crate::bench_lora_kernels::run(&ka)?
            }
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda(ordinal) => {
                let ka = crate::bench_lora_gpu::GpuKernelArgs { ordinal, rows: &a.kernel_rows, adapters: &a.kernel_adapters, ranks: &a.ranks, backends: &a.backends, reps: a.kernel_reps, layers: a.kernel_layers };
                crate::bench_lora_gpu::run(&ka)?
            }
            #[cfg(not(feature = "cuda"))]
            DeviceKind::Cuda(_) => anyhow::bail!("--device cuda: this build has no CUDA support (rebuild with `--features cuda`)"),
            DeviceKind::Xpu(_) | DeviceKind::OpenCl(_) => anyhow::bail!("--device {}: the kernel part has no OpenCL version yet; run --part step", a.device),
        };
    }
    let (mut out, mut activation) = (Vec::new(), Vec::new());
    if a.part != "kernels" {
        (out, activation) = run_step(&a)?;
    }
    if let Some(p) = &a.output_json {
        std::fs::write(p, serde_json::to_string_pretty(&serde_json::json!({"bench": "lora", "kernels": kernels, "results": out, "activation": activation}))?)?;
    }
    Ok(())
}

/// Activation as served: one adapter into a slot of a pool the model's LoRA tails are attached
/// to, as the engine's are (on CUDA each slot write also writes its B into the tails, on the
/// compute stream), until the device is done; the median of the loads after the first (which
/// makes the adapter's image).
fn activation(model: &mut LlamaModel, adapter: &LoraAdapter, slots: usize, rank: usize, modules: &[LoraModule]) -> Result<serde_json::Value> {
    let mut pool = LoraMemoryPool::new(model.device.clone(), model.lora_dims(), slots, rank, modules, EvictionPolicy::Lru)?;
    model.attach_lora_tails(&pool);
    let times: Vec<f64> = activation_times(&mut pool, adapter, 8, &*model.device)?.into_iter().map(|t| t.1).collect();
    let (first, again) = (times[0], median(times[1..].to_vec()));
    println!("activation, rank {rank}, a pool of {slots} as served (with the device's LoRA tails where it keeps them): {again:.2} ms (median of {}; the first {first:.2} ms, its image made)", times.len() - 1);
    Ok(serde_json::json!({"rank": rank, "slots": slots, "device": model.device.kind().to_string(), "first_ms": first, "again_ms": again}))
}

/// Loads `adapter` `loads` times into `pool`'s slots in turn (each freed first), each until
/// `dev` is done: per load, the host's ms (queuing the copies) and the whole ms. The first load
/// of an adapter makes its image (bf16, page-locked); the next ones copy from it.
pub(crate) fn activation_times(pool: &mut LoraMemoryPool, adapter: &LoraAdapter, loads: usize, dev: &dyn Device) -> Result<Vec<(f64, f64)>> {
    let slots = pool.num_slots();
    let mut times = Vec::with_capacity(loads);
    for i in 0..loads {
        let slot = i % slots;
        if pool.owner(slot).is_some() {
            pool.free_slot(slot);
        }
        let t0 = Instant::now();
        pool.load(slot, AdapterKey { id: AdapterId(i as u32 + 1), version: i as u64 + 1 }, adapter)?;
        let host = t0.elapsed().as_secs_f64() * 1e3;
        dev.wait();
        times.push((host, t0.elapsed().as_secs_f64() * 1e3));
    }
    Ok(times)
}

/// The step part's points, and the activation time per rank.
fn run_step(a: &BenchLoraArgs) -> Result<(Vec<serde_json::Value>, Vec<serde_json::Value>)> {
    let (mut lm, label) = a.shape.model_or_file(a.model.clone(), a.device, a.dtype)?;
    let m = &lm.model;
    let dims = m.lora_dims();
    let modules = LoraModule::parse_list(&a.modules).map_err(anyhow::Error::msg)?;
    println!("model {label} | dtype {:?} | device {} | adapters on {}", a.dtype, a.device, a.modules);
    // OpenCL devices report the adapters' bytes per unit of the LoRA time against what the device
    // sustains (issue #23); the pool is f32 there.
    let ceilings = matches!(a.device, DeviceKind::Xpu(_) | DeviceKind::OpenCl(_)).then(|| crate::bench_generate::measure_ceilings(&*m.device, a.dtype));
    if let Some(c) = &ceilings {
        println!("device ceilings: copy {:.1} GB/s (add_inplace), GEMM {:.1} GFLOP/s", c.copy_gb_s, c.gemm_gflop_s);
    }
    let (h, q, kv, inter) = (dims.hidden, dims.q_out, dims.kv_out, dims.intermediate);
    // A and B elements of one rank step over every projection of every layer (the GB/s figure
    // assumes all seven are targeted).
    let per_rank = (dims.num_layers * ((h + q) + 2 * (h + kv) + (q + h) + 3 * (h + inter))) as f64;
    println!("{:<10} {:>5} {:>4} {:>5} {:>10} {:>10} {:>8}", "backend", "rank", "ads", "rows", "base ms", "lora ms", "cost");
    let (mut out, mut activations) = (Vec::new(), Vec::new());
    let max_ads = a.adapters.iter().copied().max().unwrap_or(1);
    // One prompt per adapter, at least one token each.
    if let Some(&p) = a.prefill.iter().find(|&&p| p < max_ads) {
        anyhow::bail!("--prefill {p}: a prefill step splits its tokens into one prompt per adapter, so it needs at least --adapters ({max_ads}) tokens");
    }
    for &rank in &a.ranks {
        // In memory (an 8B rank-16 adapter is 168 MB of f32): no files to write or parse.
        let adapters: Vec<LoraAdapter> = (0..max_ads)
            .into_par_iter()
            .map(|i| LoraAdapter::synthetic(&format!("a{i}"), &dims, &modules, rank, 2.0 * rank as f32, 0.01, 1000 + i as u64))
            .collect::<Result<_, _>>()?;
        for backend in &a.backends {
            let cfg = LoraConfig {
                max_loras_per_batch: max_ads,
                max_lora_rank: rank,
                max_loaded_loras: max_ads,
                backend: backend.clone(),
                max_batch_tokens: a.rows.iter().chain(&a.prefill).copied().max().unwrap_or(1),
                target_modules: modules.clone(),
                ..Default::default()
            };
            let mut mgr = LoraManager::new(dims, cfg, lm.model.device.clone())?;
            // As the engine does: the base weights get their LoRA tails where the device adds
            // deltas that way (CUDA: long prompts; re-attached for each pool).
            lm.model.attach_lora_tails(mgr.pool());
            let m = &lm.model;
            let mut keys: Vec<AdapterKey> = Vec::new();
            for ad in &adapters {
                keys.push(mgr.install_adapter(&ad.name, ad.clone(), false)?);
            }
            for &ads in &a.adapters {
                // Decode steps of n rows, then prefill steps of n tokens (printed as "<n>p").
                let steps = a.rows.iter().map(|&n| (n, false)).chain(a.prefill.iter().map(|&n| (n, true)));
                for (n, prefill) in steps {
                    let mut st = if prefill { setup_prefill(m, n, ads) } else { setup(m, n) };
                    let seqs = st.batch.seq_starts.len() - 1;
                    let seq: Vec<Option<AdapterKey>> = (0..seqs).map(|i| Some(keys[i % ads])).collect();
                    let (starts, rows) = (st.batch.seq_starts.clone(), st.batch.logits_rows.clone());
                    let hook = mgr.prepare_batch(&seq, &starts, &rows)?;
                    // Base and LoRA steps alternate, and the cost is the median of the per-pair
                    // ratios: load from other processes (this machine is shared) drifts slowly
                    // compared with one step, so each pair sees nearly the same machine.
                    step_ms(m, &mut st, &NoLora);
                    step_ms(m, &mut st, &hook);
                    let (mut base, mut lora, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
                    for _ in 0..a.steps {
                        let b = step_ms(m, &mut st, &NoLora);
                        let l = step_ms(m, &mut st, &hook);
                        base.push(b);
                        lora.push(l);
                        ratio.push(l / b);
                    }
                    let (b, l, r) = (median(base), median(lora), median(ratio));
                    let label = if prefill { format!("{n}p") } else { n.to_string() };
                    print!("{:<10} {:>5} {:>4} {:>5} {:>10.2} {:>10.2} {:>+7.1}%", backend, rank, ads, label, b, l, (r - 1.0) * 100.0);
                    if let Some(c) = &ceilings {
                        // Each distinct adapter of the step is read once: its A and B over the LoRA time.
                        // and every row does one multiply-add per element of its adapter.
                        let lora_s = (l - b).max(1e-6) * 1e-3;
                        let gb = per_rank * rank as f64 * 4.0 * ads.min(n) as f64 / lora_s / 1e9;
                        let gf = 2.0 * per_rank * rank as f64 * n as f64 / lora_s / 1e9;
                        print!("  adapters {gb:.1} GB/s = {:.2} of copy, {gf:.1} GFLOP/s = {:.3} of GEMM", gb / c.copy_gb_s, gf / c.gemm_gflop_s);
                    }
                    println!();
                    out.push(serde_json::json!({"backend": backend, "rank": rank, "rows": n, "prefill": prefill, "adapters": ads, "device": a.device.to_string(), "base_ms": b, "lora_ms": l, "cost_pct": (r - 1.0) * 100.0}));
                }
            }
        }
        activations.push(activation(&mut lm.model, &adapters[0], max_ads, rank, &modules)?);
    }
    if let Some(s) = lm.model.device.stats() {
        println!("{s}");
    }
    Ok((out, activations))
}
