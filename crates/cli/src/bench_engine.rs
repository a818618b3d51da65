//! `quiver bench engine`: the serving engine's throughput for concurrent streams — base model,
//! all streams on one adapter, streams spread over distinct adapters, base with half the
//! streams under a structured-output constraint — measured in one run.

use crate::model_path;
use anyhow::Result;
use clap::Args;
use quiver_engine::bench::{bench_engine, BenchOptions};
use quiver_engine::EngineConfig;
use quiver_kernels::{open_device, DType, DeviceKind};
use quiver_model::load_model;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct BenchEngineArgs {
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long, default_value = "f32")]
    pub dtype: DType,
    #[arg(long, default_value_t = 16)]
    pub streams: usize,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    #[arg(long, default_value_t = 16)]
    pub prompt_tokens: usize,
    #[arg(long, default_value_t = 16)]
    pub rank: usize,
    #[arg(long, default_value_t = 4)]
    pub adapters: usize,
    #[arg(long, default_value = "auto")]
    pub lora_backend: String,
    /// Rounds of the three scenarios, alternating; tok/s and ratios to base are medians
    /// (ratios taken within each round).
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    #[arg(long)]
    pub output_json: Option<PathBuf>,
    /// `cpu`, `cuda` or `cuda:N`; a GPU gets the server's GPU limits (`EngineConfig::for_gpu`).
    #[arg(long, default_value = "cpu")]
    pub device: DeviceKind,
    /// Run one scenario alone (base, one, distinct, constrained), e.g. under a device profile.
    #[arg(long)]
    pub only: Option<String>,
}

pub fn run(a: BenchEngineArgs) -> Result<()> {
    if a.adapters == 0 || a.streams == 0 || a.rounds == 0 {
        anyhow::bail!("--adapters, --streams and --rounds must be at least 1 (the base scenario always runs; --adapters is the distinct-adapter count of the last scenario)");
    }
    let path = model_path::resolve(a.model.clone())?;
    let only = match a.only.as_deref() {
        None => None,
        Some(s) => Some(["base", "one", "distinct", "constrained"].iter().position(|&n| n == s).ok_or_else(|| anyhow::anyhow!("--only {s}: expected base, one, distinct or constrained"))?),
    };
    let lm = load_model(&path, open_device(a.device)?, a.dtype)?;
    let base = if a.device == DeviceKind::Cpu { EngineConfig::default() } else { EngineConfig::for_gpu() };
    let cfg = EngineConfig { lora_backend: a.lora_backend.clone(), ..base };
    let o = BenchOptions { streams: a.streams, max_tokens: a.max_tokens, prompt_tokens: a.prompt_tokens, rank: a.rank, num_adapters: a.adapters, rounds: a.rounds, only };
    println!("model {} | dtype {:?} | {} threads | backend {} | cpu gemm {}", path.display(), a.dtype, rayon::current_num_threads(), a.lora_backend, quiver_kernels::cpu::gemm_kind());
    let res = bench_engine(lm, cfg, &o)?;
    for r in &res {
        let rounds: Vec<String> = r.rounds.iter().map(|t| format!("{t:.1}")).collect();
        println!("{r}   ({:.2}x base){}", r.vs_base, if r.rounds.len() > 1 { format!("   rounds: {}", rounds.join(" ")) } else { String::new() });
    }
    if let Some(p) = a.output_json {
        let rows: Vec<_> = res
            .iter()
            .map(|r| serde_json::json!({"scenario": r.scenario, "streams": r.streams, "max_tokens": r.max_tokens, "generated_tokens": r.generated_tokens, "seconds": r.seconds, "tok_s": r.tokens_per_second, "vs_base": r.vs_base, "rounds_tok_s": r.rounds}))
            .collect();
        std::fs::write(p, serde_json::to_string_pretty(&serde_json::json!({"bench": "engine", "results": rows}))?)?;
    }
    Ok(())
}
