//! `quiver bench embed`: embedding throughput of the engine in `--task embed` mode — `inputs`
//! inputs of `len` tokens submitted together (they share forward passes), end to end, as
//! sequences/s and tokens/s; the median of `reps` runs.

use crate::bench_generate::median;
use crate::model_path;
use anyhow::Result;
use clap::Args;
use quiver_engine::{EmbedRequest, Engine, EngineConfig, Task};
use quiver_kernels::{open_device, DType, DeviceKind};
use quiver_model::EmbeddingSpec;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct BenchEmbedArgs {
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub shape: crate::bench_shapes::ShapeArgs,
    #[arg(long, default_value = "f32")]
    pub dtype: DType,
    #[arg(long, default_value = "cpu")]
    pub device: DeviceKind,
    /// Tokens per input.
    #[arg(long, default_value_t = 512)]
    pub len: usize,
    /// Inputs per run, submitted together.
    #[arg(long, default_value_t = 8)]
    pub inputs: usize,
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Token rows per forward step.
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
}

pub fn run(a: BenchEmbedArgs) -> Result<()> {
    let (lm, label, spec) = match a.shape.model(a.device, a.dtype)? {
        Some((lm, label)) => {
            // Qwen3-Embedding's recipe: last token, L2-normalised.
            let spec = EmbeddingSpec { pooling: quiver_model::Pooling::LastToken, normalize: true, dim: lm.model.config.hidden_size, prompts: vec![], default_prompt: None, matryoshka: None, source: "bench".into(), fallback: None };
            (lm, label, spec)
        }
        None => {
            let path = model_path::resolve(a.model.clone())?;
            let lm = quiver_model::load_model(&path, open_device(a.device)?, a.dtype)?;
            let spec = EmbeddingSpec::for_model(&path, lm.model.config.hidden_size)?;
            (lm, path.display().to_string(), spec)
        }
    };
    let vocab = lm.model.config.vocab_size;
    println!("model {label} | dtype {:?} | device {} | {} threads | {} inputs x {} tokens | {:?} pooling", a.dtype, a.device, rayon::current_num_threads(), a.inputs, a.len, spec.pooling);
    let cfg = EngineConfig {
        task: Task::Embed(spec),
        max_num_batched_tokens: a.max_num_batched_tokens,
        chunked_prefill_size: a.max_num_batched_tokens,
        max_running_requests: a.inputs.max(1),
        disable_prefix_cache: true,
        ..Default::default()
    };
    let h = Engine::start(lm, cfg)?;
    let input = |i: usize| (0..a.len).map(|t| ((t * 7919 + i * 104729) % (vocab - 200) + 100) as u32).collect::<Vec<u32>>();
    let run = |n: usize| -> Result<f64> {
        let t = Instant::now();
        let streams: Vec<_> = (0..n).map(|i| h.submit_embed(EmbedRequest { input: input(i), ..Default::default() })).collect::<Result<_, _>>()?;
        for s in streams {
            s.blocking_result().map_err(anyhow::Error::msg)?;
        }
        Ok(t.elapsed().as_secs_f64())
    };
    run(1)?; // warm-up: fault in weights, grow buffers
    let secs = median((0..a.reps).map(|_| run(a.inputs)).collect::<Result<Vec<_>>>()?);
    println!("embed {} x {} tokens: {:.2} s = {:.2} sequences/s ({:.0} tokens/s)", a.inputs, a.len, secs, a.inputs as f64 / secs, (a.inputs * a.len) as f64 / secs);
    h.shutdown_and_join();
    Ok(())
}
