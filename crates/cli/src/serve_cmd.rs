//! `quiver serve`: the HTTP server. Flags come in vLLM's and SGLang's spellings with the same
//! meaning, so existing launch scripts work unchanged.

use crate::model_path;
use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use quiver_kernels::{open_device, DType, DeviceKind};
use quiver_server::{parse_lora_module, parse_lora_path, AppState, ServerConfig, StartupAdapter};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// GGUF file or Hugging Face model directory (default: SmolLM2-135M-Instruct from the cache).
    #[arg(long, alias = "model-path")]
    pub model: Option<PathBuf>,
    /// Name(s) the base model answers to in `model` (default: the model file's stem). No ':'.
    #[arg(long, num_args = 1..)]
    pub served_model_name: Vec<String>,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every route except /health.
    #[arg(long, env = "QUIVER_API_KEY")]
    pub api_key: Option<String>,
    /// Weight storage dtype: f32 or bf16.
    #[arg(long, default_value = "f32")]
    pub dtype: DType,
    #[arg(long, default_value = "cpu")]
    pub device: DeviceKind,
    /// Split the model over N tensor-parallel ranks (SGLang: --tp-size): heads, MLP columns and
    /// vocabulary divided N ways, partial results summed. On --device cpu the ranks are
    /// threads of this process: a correctness mode, not faster than 1. On --device cuda:N the
    /// ranks are GPUs N, N+1, ... of this host, summing through peer memory (GPUs without peer
    /// access between them are refused: NCCL for them is not built).
    #[arg(long = "tensor-parallel-size", visible_alias = "tp-size", default_value_t = 1, value_name = "N")]
    pub tensor_parallel_size: usize,
    /// What to serve: `generate` (text) or `embed` (`/v1/embeddings`, pooled as the model's
    /// sentence-transformers files say).
    #[arg(long, default_value = "generate", value_parser = ["generate", "embed"])]
    pub task: String,
    /// SGLang's spelling of `--task embed`.
    #[arg(long)]
    pub is_embedding: bool,

    // ---- LoRA (vLLM spelling)
    /// Enable LoRA (implied by --lora-modules, --lora-paths or --lora-dir).
    #[arg(long)]
    pub enable_lora: bool,
    /// vLLM: adapters to load at startup, `name=path` or JSON {"name","path","base_model_name"}.
    #[arg(long, num_args = 1.., value_name = "SPEC")]
    pub lora_modules: Vec<String>,
    /// vLLM: distinct adapters in one batch (same as --max-loras-per-batch).
    #[arg(long)]
    pub max_loras: Option<usize>,
    /// Largest adapter rank accepted.
    #[arg(long)]
    pub max_lora_rank: Option<usize>,
    /// vLLM: adapters kept in host memory (same as --max-loaded-loras).
    #[arg(long)]
    pub max_cpu_loras: Option<usize>,

    // ---- LoRA (SGLang spelling)
    /// SGLang: adapters to load at startup, PATH | NAME=PATH | JSON {"lora_name","lora_path","pinned"}.
    #[arg(long, num_args = 1.., value_name = "SPEC")]
    pub lora_paths: Vec<String>,
    /// SGLang: distinct adapters in one batch (same as --max-loras).
    #[arg(long)]
    pub max_loras_per_batch: Option<usize>,
    /// SGLang: adapters kept in host memory (same as --max-cpu-loras).
    #[arg(long)]
    pub max_loaded_loras: Option<usize>,
    /// LoRA kernel backend.
    #[arg(long)]
    pub lora_backend: Option<String>,
    /// Slot eviction policy: lru or fifo.
    #[arg(long)]
    pub lora_eviction_policy: Option<String>,
    /// SGLang: modules the LoRA pool has buffers for (comma-separated: q_proj, …, qkv_proj,
    /// gate_up_proj, embed_tokens, lm_head, all-linear; on MoE models `experts` and
    /// `shared_expert`). Default: the seven dense projections; LoRA on experts must be asked
    /// for, since its pool grows with the expert count.
    #[arg(long)]
    pub lora_target_modules: Option<String>,
    /// Root for adapters loaded at run time (load endpoints and on-demand loading by name);
    /// load paths must resolve inside it.
    #[arg(long)]
    pub lora_dir: Option<PathBuf>,

    // ---- engine limits
    #[arg(long)]
    pub max_running_requests: Option<usize>,
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    #[arg(long)]
    pub chunked_prefill_size: Option<usize>,
    /// A step's token budget, decode rows included, whenever its decode rows leave room in it
    /// for at least 64 prompt tokens (else --max-num-batched-tokens): prompts ride on decode
    /// steps a few at a time instead of arriving in waves of all-prefill steps: lower tail TPOT
    /// under mixed loads, a little less throughput on equal ones (512 is a start). 0: off
    /// (default).
    #[arg(long, value_name = "N")]
    pub mixed_step_tokens: Option<usize>,
    /// KV cache size, bytes (suffixes K, M, G accepted).
    #[arg(long)]
    pub kv_cache_memory: Option<String>,
    /// On a GPU without --kv-cache-memory: fraction of the device's memory Quiver may hold once
    /// the KV pool is allocated (default 0.9).
    #[arg(long)]
    pub gpu_memory_utilization: Option<f64>,
    #[arg(long)]
    pub max_queued_requests: Option<usize>,
    /// fcfs or lpm.
    #[arg(long)]
    pub schedule_policy: Option<String>,
    #[arg(long)]
    pub disable_prefix_cache: bool,
    /// Finish each step before scheduling the next (SGLang's flag). By default the next step is
    /// queued on the device before the last one's tokens are collected, so scheduling and
    /// streaming overlap the forward pass.
    #[arg(long)]
    pub disable_overlap_schedule: bool,
    #[arg(long, alias = "context-length")]
    pub max_model_len: Option<usize>,

    // ---- tool calling (vLLM spelling)
    /// Serve `tool_choice: auto`: the model decides when to call tools, and its calls are read
    /// from its output by --tool-call-parser.
    #[arg(long)]
    pub enable_auto_tool_choice: bool,
    /// How the model writes tool calls: hermes (Hermes, Qwen2.5), llama3_json (Llama 3.1 / 3.2
    /// JSON), mistral. Forced calls (`tool_choice` required or named) are written in it too.
    #[arg(long, value_name = "NAME")]
    pub tool_call_parser: Option<quiver_server::tools::ToolParser>,

    // ---- server
    /// Seconds running requests get to finish after SIGTERM/SIGINT.
    #[arg(long, default_value_t = 30.0)]
    pub shutdown_grace: f64,
    /// Largest request body, bytes.
    #[arg(long, default_value_t = 32 << 20)]
    pub max_body_bytes: usize,
}

/// `512M`, `4G`, `1048576`.
pub fn parse_bytes(s: &str) -> Result<usize> {
    let s = s.trim();
    let (num, mul) = match s.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&s[..s.len() - 1], 1usize << 10),
        Some('M') => (&s[..s.len() - 1], 1 << 20),
        Some('G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let v: f64 = num.trim().parse().with_context(|| format!("bad byte size `{s}`"))?;
    Ok((v * mul as f64) as usize)
}

fn same(a: Option<usize>, b: Option<usize>, an: &str, bn: &str) -> Result<Option<usize>> {
    match (a, b) {
        (Some(x), Some(y)) if x != y => bail!("--{an} ({x}) and --{bn} ({y}) mean the same thing; give one"),
        (x, y) => Ok(x.or(y)),
    }
}

/// The adapters named by --lora-modules and --lora-paths.
pub fn startup_adapters(a: &ServeArgs) -> Result<Vec<StartupAdapter>> {
    let mut v = Vec::new();
    // Each flag value may itself hold several space-separated specs (as in shell variables).
    for s in &a.lora_modules {
        v.push(parse_lora_module(s).map_err(anyhow::Error::msg)?);
    }
    for s in &a.lora_paths {
        v.push(parse_lora_path(s).map_err(anyhow::Error::msg)?);
    }
    let mut names = std::collections::HashSet::new();
    for s in &v {
        if !names.insert(s.name.clone()) {
            bail!("adapter name `{}` given twice", s.name);
        }
        if let Some(why) = quiver_server::limits::adapter_name_error(&s.name) {
            bail!("adapter name `{}`: {why}", s.name);
        }
    }
    Ok(v)
}

pub fn engine_config(a: &ServeArgs) -> Result<quiver_engine::EngineConfig> {
    let gpu = a.device != DeviceKind::Cpu;
    let mut c = if gpu { quiver_engine::EngineConfig::for_gpu() } else { quiver_engine::EngineConfig::default() };
    if let Some(v) = same(a.max_loras, a.max_loras_per_batch, "max-loras", "max-loras-per-batch")? {
        c.max_loras_per_batch = v;
    }
    if let Some(v) = same(a.max_cpu_loras, a.max_loaded_loras, "max-cpu-loras", "max-loaded-loras")? {
        c.max_loaded_loras = v;
    }
    if let Some(v) = a.max_lora_rank {
        c.max_lora_rank = v;
    }
    if let Some(v) = &a.lora_backend {
        c.lora_backend = v.clone();
    }
    if let Some(v) = &a.lora_target_modules {
        c.lora_target_modules = quiver_lora::LoraModule::parse_list(v).map_err(|e| anyhow::anyhow!("--lora-target-modules: {e}"))?;
    }
    if let Some(v) = &a.lora_eviction_policy {
        c.eviction_policy = v.parse().map_err(|e| anyhow::anyhow!("--lora-eviction-policy: {e}"))?;
    }
    if let Some(v) = a.max_running_requests {
        c.max_running_requests = v;
    }
    if let Some(v) = a.max_num_batched_tokens {
        c.max_num_batched_tokens = v;
    } else {
        c.max_num_batched_tokens = c.max_num_batched_tokens.max(c.max_running_requests);
    }
    if let Some(v) = a.chunked_prefill_size {
        c.chunked_prefill_size = v;
    }
    if let Some(v) = a.mixed_step_tokens {
        c.mixed_step_tokens = v;
    }
    if let Some(v) = a.gpu_memory_utilization {
        c.gpu_memory_utilization = v;
    }
    if let Some(v) = &a.kv_cache_memory {
        c.kv_cache_memory = Some(parse_bytes(v)?);
    }
    if let Some(v) = a.max_queued_requests {
        c.max_queued_requests = v;
    }
    if let Some(v) = &a.schedule_policy {
        c.schedule_policy = v.parse().map_err(|e: String| anyhow::anyhow!("--schedule-policy: {e}"))?;
    }
    c.disable_prefix_cache = a.disable_prefix_cache;
    c.disable_overlap_schedule = a.disable_overlap_schedule;
    if c.disable_overlap_schedule {
        eprintln!("quiver: overlapped scheduling is off (--disable-overlap-schedule): each step finishes before the next is scheduled");
    }
    c.max_model_len = a.max_model_len;
    c.lora_dir = a.lora_dir.clone();
    c.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
    if gpu {
        let set = |v: bool| if v { "set" } else { "GPU default" };
        eprintln!(
            "quiver: batch limits on the GPU: --max-running-requests {} ({}), --max-num-batched-tokens {} ({}), --chunked-prefill-size {} ({}), --mixed-step-tokens {}",
            c.max_running_requests,
            set(a.max_running_requests.is_some()),
            c.max_num_batched_tokens,
            set(a.max_num_batched_tokens.is_some()),
            c.chunked_prefill_size,
            set(a.chunked_prefill_size.is_some()),
            if c.mixed_step_tokens == 0 { "0 (off)".to_string() } else { c.mixed_step_tokens.to_string() }
        );
    }
    Ok(c)
}

pub fn run(a: ServeArgs) -> Result<()> {
    for n in &a.served_model_name {
        if n.contains(':') || n.trim().is_empty() {
            bail!("--served-model-name `{n}`: must be non-empty and contain no ':' (it separates base and adapter in `model`)");
        }
    }
    if a.enable_auto_tool_choice && a.tool_call_parser.is_none() {
        bail!("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json or mistral)");
    }
    let adapters = startup_adapters(&a)?;
    let cfg = engine_config(&a)?;
    if let Some(d) = &a.lora_dir {
        if !d.is_dir() {
            bail!("--lora-dir {} is not a directory", d.display());
        }
    }
    let lora_enabled = a.enable_lora || !adapters.is_empty() || a.lora_dir.is_some();
    let mut cfg = cfg;
    cfg.lora_enabled = lora_enabled;
    let path = model_path::resolve(a.model.clone())?;
    let served = if a.served_model_name.is_empty() {
        vec![path.file_stem().map(|s| s.to_string_lossy().trim_end_matches(".Q4_1").to_string()).unwrap_or_else(|| "model".into()).replace(':', "_")]
    } else {
        a.served_model_name.clone()
    };

    // Bind first so a taken port fails before the (slow) model load.
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let listener = rt.block_on(tokio::net::TcpListener::bind((a.host.as_str(), a.port))).with_context(|| format!("binding {}:{}", a.host, a.port))?;
    let addr = listener.local_addr()?;

    let steps = 2 + adapters.len() as u64;
    let pb = ProgressBar::new(steps);
    pb.set_style(ProgressStyle::with_template("{spinner} [{bar:30}] {pos}/{len} {msg} ({elapsed})").unwrap().progress_chars("=> "));
    pb.enable_steady_tick(Duration::from_millis(120));
    pb.set_message(format!("loading {}", path.display()));
    let device = open_device(a.device)?;
    let lm = quiver_model::loader::load_model_tp(&path, device, a.dtype, a.tensor_parallel_size).with_context(|| format!("loading {}", path.display()))?;
    pb.inc(1);
    if a.task == "embed" || a.is_embedding {
        cfg.task = quiver_engine::Task::Embed(embedding_spec(&path, lm.model.config.hidden_size, &pb)?);
    }
    pb.set_message("starting the engine");
    let engine = quiver_server::engine_backend::EngineBackend::start(lm, cfg.clone())?;
    pb.inc(1);
    for ad in &adapters {
        pb.set_message(format!("loading adapter {}", ad.name));
        engine.load_startup(ad).with_context(|| format!("adapter `{}` from {}", ad.name, ad.path.display()))?;
        pb.inc(1);
    }
    pb.finish_and_clear();

    let scfg = ServerConfig {
        served_model_names: served.clone(),
        model_path: path.display().to_string(),
        api_key: a.api_key.clone(),
        lora_dir: a.lora_dir.clone(),
        lora_enabled,
        max_body_bytes: a.max_body_bytes,
        shutdown_grace: Duration::from_secs_f64(a.shutdown_grace.max(0.0)),
        tool_parser: a.tool_call_parser,
        enable_auto_tool_choice: a.enable_auto_tool_choice,
    };
    let names: Vec<&str> = adapters.iter().map(|s| s.name.as_str()).collect();
    let lora_note = match (names.is_empty(), &a.lora_dir) {
        (true, None) if !lora_enabled => String::new(),
        (true, None) => " with LoRA enabled".into(),
        (_, dir) => format!(
            " with {} adapter{}{}{}",
            names.len(),
            if names.len() == 1 { "" } else { "s" },
            if names.is_empty() { String::new() } else { format!(" ({})", names.join(", ")) },
            dir.as_ref().map(|d| format!(", more from {}", d.display())).unwrap_or_default()
        ),
    };
    let what = if matches!(cfg.task, quiver_engine::Task::Embed(_)) { "embeddings of " } else { "" };
    println!("Quiver serving {what}{}{} on http://{addr} (OpenAI API at http://{addr}/v1)", served[0], lora_note);
    let st = AppState::new(Arc::new(engine), scfg);
    let served = rt.block_on(quiver_server::serve_with_shutdown(st, listener, quiver_server::shutdown_signal()));
    // Dropping a runtime waits for every blocking task; one stuck in a read (an adapter load
    // on a wedged filesystem) must not keep the process from exiting.
    rt.shutdown_timeout(Duration::from_secs(1));
    served?;
    eprintln!("quiver: stopped");
    Ok(())
}

/// The model's pooling for `--task embed`; says once when the model gives none and the default
/// (last token, L2-normalised) applies.
pub fn embedding_spec(path: &std::path::Path, hidden: usize, pb: &ProgressBar) -> Result<quiver_model::EmbeddingSpec> {
    let spec = quiver_model::EmbeddingSpec::for_model(path, hidden).with_context(|| format!("pooling of {}", path.display()))?;
    match &spec.fallback {
        Some(why) => pb.suspend(|| eprintln!("warning: {why}: embeddings fall back to last-token pooling, L2-normalised")),
        None => tracing::info!("embedding pooling from {}", spec.source),
    }
    Ok(spec)
}
