use crate::model_path;
use anyhow::{Context, Result};
use clap::Args;
use quiver_engine::{BaseOnly, GenerateOptions, Generator, SamplingParams};
use quiver_kernels::{open_device, DType, DeviceKind};
use quiver_model::chat::ChatMessage;
use quiver_model::load_model;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// GGUF file or Hugging Face model directory (default: SmolLM2-135M-Instruct from the cache).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// 0 = greedy (default).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: i32,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Weight storage dtype: f32 or bf16.
    #[arg(long, default_value = "f32")]
    pub dtype: DType,
    #[arg(long, default_value = "cpu")]
    pub device: DeviceKind,
    /// Print token ids instead of text (one line, space separated).
    #[arg(long)]
    pub ids: bool,
    /// Context window to allocate (default: prompt + max_tokens).
    #[arg(long)]
    pub max_context: Option<usize>,
    /// The prompt.
    pub prompt: String,
}

pub fn run(a: GenerateArgs) -> Result<()> {
    let path = model_path::resolve(a.model.clone())?;
    let device = open_device(a.device)?;
    let t0 = Instant::now();
    let lm = load_model(&path, device, a.dtype).with_context(|| format!("loading {}", path.display()))?;
    eprintln!("loaded {} in {:.2}s", path.display(), t0.elapsed().as_secs_f64());
    let tok = &lm.tokenizer;
    let prompt_ids = if a.chat {
        let tpl = tok.chat_template().context("--chat: this model has no chat template")?;
        let text = tpl.render(&[ChatMessage { role: "user".into(), content: a.prompt.clone() }], true)?;
        tok.encode(&text, false)?
    } else {
        tok.encode(&a.prompt, true)?
    };
    let sampling = SamplingParams { temperature: a.temperature, top_p: a.top_p, top_k: a.top_k, min_p: a.min_p, seed: a.seed, ..Default::default() };
    sampling.validate().map_err(anyhow::Error::msg)?;
    let opts = GenerateOptions {
        max_tokens: a.max_tokens,
        sampling,
        stop_ids: if a.ignore_eos { vec![] } else { tok.eos_token_ids().to_vec() },
        prefill_chunk: 512,
    };
    let max_ctx = a.max_context.unwrap_or(prompt_ids.len() + a.max_tokens).min(lm.model.config.max_position_embeddings);
    let mut g = Generator::new(&lm.model, max_ctx);
    let mut out = std::io::stdout().lock();
    let mut stream = tok.decode_stream(true);
    let mut ids = Vec::new();
    let stats = g.generate(&prompt_ids, &opts, &mut BaseOnly, |t| {
        if a.ids {
            ids.push(t.to_string());
        } else if let Some(s) = stream.step(t) {
            let _ = out.write_all(s.as_bytes());
            let _ = out.flush();
        }
        true
    })?;
    if a.ids {
        writeln!(out, "{}", ids.join(" "))?;
    } else {
        writeln!(out)?;
    }
    eprintln!(
        "prompt: {} tokens, {:.1} tok/s | decode: {} tokens, {:.1} tok/s",
        stats.prompt_tokens,
        stats.prefill_tok_s(),
        stats.generated_tokens,
        stats.decode_tok_s()
    );
    Ok(())
}
