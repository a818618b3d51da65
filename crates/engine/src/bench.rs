//! Engine throughput benchmark: `streams` concurrent requests × `max_tokens` generated tokens,
//! for the base model, all requests on one adapter, requests spread over 4 distinct
//! adapters (random rank-`rank` PEFT adapters on every projection, written to a temp dir), and
//! the base model with every other request under a structured-output constraint (the cost of
//! grammar masks in a decode step).
//! With several rounds the three scenarios alternate, and each scenario's ratio to base is the
//! median of per-round ratios: a shared machine's speed drifts over seconds, so a base run and
//! an adapter run minutes apart would compare two machines.

use crate::api::GenerateRequest;
use crate::structured::Constraint;
use crate::config::EngineConfig;
use crate::engine::{Engine, EngineHandle};
use crate::testing::{temp_dir, write_random_adapter};
use anyhow::Result;
use quiver_lora::LoraModule;
use quiver_model::LoadedModel;
use std::time::Instant;

#[derive(Clone, Debug)]
pub struct BenchResult {
    pub scenario: String,
    pub streams: usize,
    pub max_tokens: usize,
    pub generated_tokens: usize,
    /// Median over rounds.
    pub seconds: f64,
    /// Median over rounds.
    pub tokens_per_second: f64,
    /// Median over rounds of this scenario's tok/s over the same round's base tok/s.
    pub vs_base: f64,
    /// Every round's tok/s, in order.
    pub rounds: Vec<f64>,
}

impl std::fmt::Display for BenchResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:<22} {:>3} streams x {:>4} tokens: {:>6} tokens in {:>7.2} s = {:>8.1} tok/s",
            self.scenario, self.streams, self.max_tokens, self.generated_tokens, self.seconds, self.tokens_per_second
        )
    }
}

#[derive(Clone, Debug)]
pub struct BenchOptions {
    pub streams: usize,
    pub max_tokens: usize,
    pub prompt_tokens: usize,
    pub rank: usize,
    /// Adapters for the multi-adapter scenario.
    pub num_adapters: usize,
    /// Times the three scenarios run, alternating.
    pub rounds: usize,
    /// Run this scenario alone (0 base, 1 one adapter, 2 distinct adapters, 3 constrained):
    /// a device profile of the process then covers it only. Its ratio to base is then NaN.
    pub only: Option<usize>,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions { streams: 16, max_tokens: 128, prompt_tokens: 16, rank: 16, num_adapters: 4, rounds: 1, only: None }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// One run of a scenario: (generated tokens, seconds).
/// A constraint that holds for any length of lowercase words: the grammar never ends the
/// output, so constrained and free rows generate the same number of tokens.
const BENCH_REGEX: &str = "[a-z]+( [a-z]+)*";

fn run_scenario(h: &EngineHandle, name: &str, o: &BenchOptions, adapters: &[Option<String>], constrained_every: Option<usize>, vocab: usize) -> Result<(usize, f64)> {
    let t0 = Instant::now();
    let mut streams = Vec::new();
    for i in 0..o.streams {
        // Distinct prompts (no prefix-cache sharing between streams).
        let prompt: Vec<u32> = (0..o.prompt_tokens).map(|j| ((i * 7919 + j * 104729 + 17) % (vocab - 100) + 50) as u32).collect();
        let constraint = constrained_every.filter(|k| i % k == 0).map(|_| Constraint::Regex(BENCH_REGEX.into()));
        // EOS is masked (min_tokens) on constrained rows so none ends its grammar early.
        let min_tokens = if constraint.is_some() { o.max_tokens } else { 0 };
        let req = GenerateRequest { prompt, adapter: adapters[i % adapters.len()].clone(), max_tokens: o.max_tokens, min_tokens, ignore_eos: true, constraint, ..Default::default() };
        streams.push(h.submit(req).map_err(|e| anyhow::anyhow!("submit: {e}"))?);
    }
    let mut generated = 0;
    for s in streams {
        let c = s.collect_blocking();
        if let Some(e) = c.error {
            anyhow::bail!("{name}: request failed: {e}");
        }
        generated += c.tokens.iter().map(|t| t.len()).sum::<usize>();
    }
    Ok((generated, t0.elapsed().as_secs_f64()))
}

/// Runs the three scenarios on one engine. `cfg` is adjusted so all streams run at once.
pub fn bench_engine(model: LoadedModel, mut cfg: EngineConfig, o: &BenchOptions) -> Result<Vec<BenchResult>> {
    let dims = model.model.lora_dims();
    let vocab = model.model.config.vocab_size;
    cfg.max_running_requests = cfg.max_running_requests.max(o.streams);
    cfg.max_num_batched_tokens = cfg.max_num_batched_tokens.max(o.streams);
    cfg.max_loras_per_batch = cfg.max_loras_per_batch.max(o.num_adapters);
    cfg.max_loaded_loras = cfg.max_loaded_loras.max(cfg.max_loras_per_batch);
    cfg.max_lora_rank = cfg.max_lora_rank.max(o.rank);
    let dir = temp_dir("bench-adapters");
    let modules = LoraModule::PROJECTIONS.to_vec();
    let h = Engine::start(model, cfg)?;
    let mut names = Vec::new();
    for a in 0..o.num_adapters.max(1) {
        let p = dir.join(format!("a{a}"));
        write_random_adapter(&p, &dims, &modules, o.rank, 2.0 * o.rank as f32, 0.01, 1000 + a as u64)?;
        let name = format!("bench-{a}");
        h.load_adapter_blocking(&name, &p, false, false, None).map_err(|e| anyhow::anyhow!("{e}"))?;
        names.push(Some(name));
    }
    // Warm-up (workspace growth, page faults, slot loads).
    let warm = BenchOptions { streams: o.streams, max_tokens: 4, ..o.clone() };
    run_scenario(&h, "warmup", &warm, &names, Some(2), vocab)?;
    let multi = format!("{} distinct adapters", names.len());
    // (name, adapters cycled over the streams, every k-th stream constrained)
    type Scenario<'a> = (&'a str, &'a [Option<String>], Option<usize>);
    let scenarios: [Scenario; 4] = [("base", &[None], None), ("1 adapter", &names[..1], None), (&multi, &names, None), ("base, 50% constrained", &[None], Some(2))];
    // runs[s][round] = (tokens, seconds)
    let mut runs = vec![Vec::new(); scenarios.len()];
    for _ in 0..o.rounds.max(1) {
        for (s, (name, ads, every)) in scenarios.iter().enumerate() {
            if o.only.is_none_or(|only| only == s) {
                runs[s].push(run_scenario(&h, name, o, ads, *every, vocab)?);
            }
        }
    }
    h.shutdown_and_join();
    let tps = |r: &(usize, f64)| r.0 as f64 / r.1;
    let out = scenarios
        .iter()
        .zip(&runs)
        .filter(|(_, rs)| !rs.is_empty())
        .map(|((name, _, _), rs)| BenchResult {
            scenario: name.to_string(),
            streams: o.streams,
            max_tokens: o.max_tokens,
            generated_tokens: rs[0].0,
            seconds: median(rs.iter().map(|r| r.1).collect()),
            tokens_per_second: median(rs.iter().map(tps).collect()),
            vs_base: median(rs.iter().zip(&runs[0]).map(|(r, b)| tps(r) / tps(b)).collect()),
            rounds: rs.iter().map(tps).collect(),
        })
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    Ok(out)
}
