use crate::model_path;
use anyhow::{Context, Result};
use clap::Args;
use quiver_engine::{BaseOnly, GenerateOptions, Generator, SamplingParams, StepLora};
use quiver_lora::{AdapterKey, LoraConfig, LoraHook, LoraManager, LoraModule};
use quiver_model::ForwardBatch;
use quiver_kernels::{open_device, DType, DeviceKind};
use quiver_model::chat::ChatMessage;
use quiver_model::loader::load_model_tp;
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
    /// Split the model over N tensor-parallel ranks (alias --tp-size); on --device cpu the
    /// ranks are threads of this process: a correctness mode, not faster than 1.
    #[arg(long = "tensor-parallel-size", visible_alias = "tp-size", default_value_t = 1, value_name = "N")]
    pub tensor_parallel_size: usize,
    /// Print token ids instead of text (one line, space separated).
    #[arg(long)]
    pub ids: bool,
    /// Context window to allocate (default: prompt + max_tokens).
    #[arg(long)]
    pub max_context: Option<usize>,
    /// Load a PEFT LoRA adapter: NAME=PATH (repeatable).
    #[arg(long = "lora", value_name = "NAME=PATH")]
    pub loras: Vec<String>,
    /// The adapter to generate with (one of the --lora names; default: the base model).
    #[arg(long)]
    pub adapter: Option<String>,
    #[arg(long, default_value_t = 64)]
    pub max_lora_rank: usize,
    /// LoRA backend (see `quiver serve --help`): auto, segmented, chunked, reference.
    #[arg(long, default_value = "auto")]
    pub lora_backend: String,
    /// The prompt.
    pub prompt: String,
}

/// The CLI's single adapter, prepared per step for the generator.
struct CliLora {
    mgr: LoraManager,
    key: AdapterKey,
}

impl StepLora for CliLora {
    fn with_hook(&mut self, batch: &ForwardBatch, f: &mut dyn FnMut(&dyn LoraHook)) {
        match self.mgr.prepare_batch(&[Some(self.key)], &batch.seq_starts, &batch.logits_rows) {
            Ok(hook) => f(&hook),
            // One adapter in an otherwise empty pool always fits; anything else is a bug.
            Err(e) => panic!("preparing the LoRA batch: {e}"),
        }
    }
}

fn setup_lora(a: &GenerateArgs, lm: &quiver_model::LlamaModel) -> Result<Option<CliLora>> {
    let (model, dims, device) = (&lm.config, lm.lora_dims(), lm.device.clone());
    quiver_lora::validate_backend(&a.lora_backend, device.kind()).map_err(anyhow::Error::msg)?;
    let Some(name) = &a.adapter else {
        anyhow::ensure!(a.loras.is_empty() || a.adapter.is_some(), "--lora given without --adapter");
        return Ok(None);
    };
    let cfg = LoraConfig { max_lora_rank: a.max_lora_rank, backend: a.lora_backend.clone(), target_modules: LoraModule::ALL.to_vec(), ..Default::default() };
    let mut mgr = LoraManager::new(dims, cfg, device)?;
    if let Some(ranks) = lm.tp_ranks() {
        mgr.shard_pool(&ranks)?;
    }
    let mut key = None;
    for spec in &a.loras {
        let (n, p) = spec.split_once('=').with_context(|| format!("--lora `{spec}`: expected NAME=PATH"))?;
        quiver_model::check_adapter(model, &quiver_lora::LoraAdapter::load(n, std::path::Path::new(p), &dims)?)?;
        let k = mgr.load_adapter(n, p).with_context(|| format!("loading adapter `{n}` from {p}"))?;
        if n == name {
            key = Some(k);
        }
    }
    let key = key.with_context(|| format!("--adapter `{name}` is not one of the --lora names"))?;
    Ok(Some(CliLora { mgr, key }))
}

pub fn run(a: GenerateArgs) -> Result<()> {
    let path = model_path::resolve(a.model.clone())?;
    let device = open_device(a.device)?;
    let t0 = Instant::now();
    let lm = load_model_tp(&path, device, a.dtype, a.tensor_parallel_size).with_context(|| format!("loading {}", path.display()))?;
    eprintln!("loaded {} in {:.2}s", path.display(), t0.elapsed().as_secs_f64());
    let tok = &lm.tokenizer;
    let prompt_ids = if a.chat {
        let tpl = tok.chat_template().context("--chat: this model has no chat template")?;
        let text = tpl.render(&[ChatMessage::new("user", a.prompt.clone())], true)?;
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
    let mut lora = setup_lora(&a, &lm.model)?;
    let mut base = BaseOnly;
    let step_lora: &mut dyn StepLora = match lora.as_mut() {
        Some(l) => l,
        None => &mut base,
    };
    let mut g = Generator::new(&lm.model, max_ctx);
    let mut out = std::io::stdout().lock();
    let mut stream = tok.decode_stream(true);
    let mut ids = Vec::new();
    let stats = g.generate(&prompt_ids, &opts, step_lora, |t| {
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
