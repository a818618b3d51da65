//! `quiver bench lora`, in two parts:
//! - `kernels` (bench_lora_kernels.rs): shrink + expand per backend over rows × adapters × ranks
//!   on SmolLM2- and Llama-8B-shaped layers, against this machine's peaks;
//! - `step`: what LoRA costs in a batched decode step of the real model. For each backend and
//!   rank, times the same decode step with N rows spread over D distinct adapters on all seven
//!   projections, against the base model alone, in one run (ratios, medians).

use crate::bench_generate::median;
use crate::model_path;
use anyhow::Result;
use clap::Args;
use quiver_engine::testing::{temp_dir, write_random_adapter};
use quiver_kernels::{open_device, DType, DeviceKind};
use quiver_lora::{AdapterKey, LoraConfig, LoraHook, LoraManager, LoraModule, NoLora};
use quiver_model::{load_model, ForwardBatch, LlamaModel, LogitsFor};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct BenchLoraArgs {
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long, default_value = "f32")]
    pub dtype: DType,
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
    /// Distinct adapters among the rows.
    #[arg(long, default_value_t = 4)]
    pub adapters: usize,
    #[arg(long, value_delimiter = ',', default_value = "8,16,64")]
    pub ranks: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "segmented,chunked,auto")]
    pub backends: Vec<String>,
    /// Timed (base, LoRA) step pairs; medians of the times and of the per-pair ratios.
    #[arg(long, default_value_t = 31)]
    pub steps: usize,
    #[arg(long)]
    pub output_json: Option<PathBuf>,
}

struct Step {
    kv: quiver_kernels::KvStorage,
    ws: quiver_model::Workspace,
    batch: ForwardBatch,
}

fn setup(m: &LlamaModel, n: usize) -> Step {
    let bs = 16;
    let per = 4;
    let mut kv = m.alloc_kv(per * n, bs);
    let mut ws = m.new_workspace(32 * n, n);
    let mut batch = ForwardBatch::with_capacity(32 * n, n, per);
    let prompt: Vec<u32> = (0..32).map(|i| (i * 17 % 500 + 50) as u32).collect();
    for s in 0..n {
        let t: Vec<u32> = ((s * per) as u32..((s + 1) * per) as u32).collect();
        batch.push_seq(&prompt, 0, &t, LogitsFor::Last);
    }
    m.forward(&batch, &mut kv, &mut ws, &NoLora);
    batch.clear(per);
    for s in 0..n {
        let t: Vec<u32> = ((s * per) as u32..((s + 1) * per) as u32).collect();
        batch.push_seq(&[77], 32, &t, LogitsFor::Last);
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
    if a.adapters == 0 || a.steps == 0 || a.kernel_reps == 0 || zero(&a.ranks) || zero(&a.rows) || zero(&a.kernel_rows) || zero(&a.kernel_adapters) {
        anyhow::bail!("--adapters, --steps, --kernel-reps and every value of --ranks, --rows, --kernel-rows and --kernel-adapters must be at least 1");
    }
    let mut kernels = Vec::new();
    if a.part != "step" {
        let ka = crate::bench_lora_kernels::KernelArgs { shapes: &a.shapes, rows: &a.kernel_rows, adapters: &a.kernel_adapters, ranks: &a.ranks, backends: &a.backends, reps: a.kernel_reps };
        kernels = crate::bench_lora_kernels::run(&ka)?;
    }
    let mut out = Vec::new();
    if a.part != "kernels" {
        out = run_step(&a)?;
    }
    if let Some(p) = &a.output_json {
        std::fs::write(p, serde_json::to_string_pretty(&serde_json::json!({"bench": "lora", "kernels": kernels, "results": out}))?)?;
    }
    Ok(())
}

fn run_step(a: &BenchLoraArgs) -> Result<Vec<serde_json::Value>> {
    let path = model_path::resolve(a.model.clone())?;
    let lm = load_model(&path, open_device(DeviceKind::Cpu)?, a.dtype)?;
    let m = &lm.model;
    let dims = m.lora_dims();
    let dir = temp_dir("bench-lora");
    println!("model {} | dtype {:?} | {} threads | {} distinct adapters on all 7 projections", path.display(), a.dtype, rayon::current_num_threads(), a.adapters);
    println!("{:<10} {:>5} {:>5} {:>10} {:>10} {:>8}", "backend", "rank", "rows", "base ms", "lora ms", "cost");
    let mut out = Vec::new();
    for &rank in &a.ranks {
        let paths: Vec<PathBuf> = (0..a.adapters)
            .map(|i| {
                let p = dir.join(format!("r{rank}-{i}"));
                write_random_adapter(&p, &dims, &LoraModule::PROJECTIONS, rank, 2.0 * rank as f32, 0.01, 1000 + i as u64)?;
                Ok(p)
            })
            .collect::<Result<_>>()?;
        for backend in &a.backends {
            let cfg = LoraConfig { max_loras_per_batch: a.adapters.max(1), max_lora_rank: rank, max_loaded_loras: a.adapters.max(1), backend: backend.clone(), ..Default::default() };
            let mut mgr = LoraManager::new(dims, cfg, DeviceKind::Cpu)?;
            let keys: Vec<AdapterKey> = paths.iter().enumerate().map(|(i, p)| mgr.load_adapter(&format!("a{i}"), p)).collect::<Result<_, _>>()?;
            for &n in &a.rows {
                let mut st = setup(m, n);
                let seq: Vec<Option<AdapterKey>> = (0..n).map(|i| Some(keys[i % keys.len()])).collect();
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
                println!("{:<10} {:>5} {:>5} {:>10.2} {:>10.2} {:>+7.1}%", backend, rank, n, b, l, (r - 1.0) * 100.0);
                out.push(serde_json::json!({"backend": backend, "rank": rank, "rows": n, "adapters": a.adapters, "base_ms": b, "lora_ms": l, "cost_pct": (r - 1.0) * 100.0}));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(out)
}
