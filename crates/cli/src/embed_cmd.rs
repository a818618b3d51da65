//! `quiver embed`: embeddings of texts on the command line (or stdin lines) through the same
//! engine as `quiver serve --task embed`, one JSON object per input on stdout.

use crate::{model_path, serve_cmd};
use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::ProgressBar;
use quiver_engine::{EmbedRequest, Engine, EngineConfig, Task};
use quiver_kernels::{open_device, DType, DeviceKind};
use std::io::BufRead;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct EmbedArgs {
    /// GGUF file or Hugging Face model directory of a decoder embedding model.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Texts to embed; none = one per line of stdin.
    pub texts: Vec<String>,
    /// An instruction prefix from the model's sentence-transformers `prompts` (e.g. `query`).
    #[arg(long)]
    pub prompt_name: Option<String>,
    /// Matryoshka truncation (where the model declares it).
    #[arg(long)]
    pub dimensions: Option<usize>,
    /// Load a PEFT LoRA adapter: NAME=PATH (repeatable).
    #[arg(long = "lora", value_name = "NAME=PATH")]
    pub loras: Vec<String>,
    /// The adapter to embed with (one of the --lora names; default: the base model).
    #[arg(long)]
    pub adapter: Option<String>,
    #[arg(long, default_value = "f32")]
    pub dtype: DType,
    #[arg(long, default_value = "cpu")]
    pub device: DeviceKind,
}

pub fn run(a: EmbedArgs) -> Result<()> {
    let path = model_path::resolve(a.model.clone())?;
    let texts: Vec<String> = if a.texts.is_empty() { std::io::stdin().lock().lines().collect::<Result<_, _>>()? } else { a.texts.clone() };
    let lm = quiver_model::load_model(&path, open_device(a.device)?, a.dtype).with_context(|| format!("loading {}", path.display()))?;
    let spec = serve_cmd::embedding_spec(&path, lm.model.config.hidden_size, &ProgressBar::hidden())?;
    let prefix = match a.prompt_name.as_deref().or(spec.default_prompt.as_deref()) {
        None => String::new(),
        Some(n) => spec.prompt(n).with_context(|| format!("--prompt-name `{n}` is not one of the model's prompts {:?}", spec.prompts.iter().map(|p| &p.0).collect::<Vec<_>>()))?.to_string(),
    };
    let h = Engine::start(lm, EngineConfig { task: Task::Embed(spec), ..Default::default() })?;
    for spec in &a.loras {
        let (n, p) = spec.split_once('=').with_context(|| format!("--lora `{spec}`: expected NAME=PATH"))?;
        h.load_adapter_blocking(n, std::path::Path::new(p), false, false, None).map_err(|e| anyhow::anyhow!("loading adapter `{n}` from {p}: {e}"))?;
    }
    if let Some(ad) = &a.adapter {
        if !a.loras.iter().any(|s| s.split_once('=').is_some_and(|(n, _)| n == ad)) {
            bail!("--adapter `{ad}` is not one of the --lora names");
        }
    }
    // Submitted together: they share forward passes.
    let mut streams = Vec::with_capacity(texts.len());
    for t in &texts {
        let input = h.tokenizer().encode(&format!("{prefix}{t}"), true)?;
        streams.push(h.submit_embed(EmbedRequest { input, adapter: a.adapter.clone(), dimensions: a.dimensions, normalize: None }).map_err(|e| anyhow::anyhow!("{e}"))?);
    }
    for (i, s) in streams.into_iter().enumerate() {
        let v = s.blocking_result().map_err(anyhow::Error::msg)?;
        println!("{}", serde_json::json!({"index": i, "embedding": v}));
    }
    h.shutdown_and_join();
    Ok(())
}
