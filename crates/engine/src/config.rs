//! Engine settings (the serving CLI flags).

use quiver_lora::{EvictionPolicy, LoraModule};
use quiver_model::EmbeddingSpec;

/// What the engine serves.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Task {
    /// Text generation (`submit`).
    #[default]
    Generate,
    /// Embeddings pooled as the spec says (`submit_embed`): every step returns hidden states.
    Embed(EmbeddingSpec),
}

/// Order in which waiting requests are considered for admission.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SchedulePolicy {
    /// First come, first served.
    #[default]
    Fcfs,
    /// Longest prefix-cache match first (ties keep arrival order).
    Lpm,
}

impl std::str::FromStr for SchedulePolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fcfs" => Ok(SchedulePolicy::Fcfs),
            "lpm" => Ok(SchedulePolicy::Lpm),
            _ => Err(format!("unknown schedule policy `{s}` (expected fcfs or lpm)")),
        }
    }
}

/// Fewest prompt tokens a step's decode rows must leave within `mixed_step_tokens` for that
/// budget to apply; with less room the step takes `max_num_batched_tokens`, so a prompt is never
/// fed a few tokens a step behind a nearly full batch of decode rows.
pub const MIXED_STEP_MIN_PROMPT: usize = 64;

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Sequences (rows of samples, `n > 1` counts n) running at once.
    pub max_running_requests: usize,
    /// LoRA slots `S`: distinct adapters among running sequences (base rows take none).
    pub max_loras_per_batch: usize,
    pub max_lora_rank: usize,
    /// Adapters whose weights stay in host memory.
    pub max_loaded_loras: usize,
    pub lora_backend: String,
    pub lora_target_modules: Vec<LoraModule>,
    /// Adapters may be loaded at all (the server's `--enable-lora` and its kin). Without, the
    /// engine keeps the smallest LoRA pool (one slot of rank 1) and attaches no LoRA tails to
    /// the base weights (on CUDA those take up to 512 columns beside each projection, ~1.3 GB
    /// on an 8B model at the default rank, out of the KV cache's budget).
    pub lora_enabled: bool,
    pub eviction_policy: EvictionPolicy,
    /// Token rows per forward step (decode rows + prefill chunks).
    pub max_num_batched_tokens: usize,
    /// Largest prefill chunk of one sequence in one step.
    pub chunked_prefill_size: usize,
    /// `--mixed-step-tokens`: when a step's decode rows leave room within this many tokens for
    /// at least [`MIXED_STEP_MIN_PROMPT`] prompt tokens, this is the step's budget instead of
    /// `max_num_batched_tokens`, so prompts ride on decode steps a few at a time (on a GPU a
    /// decode step below ~256 rows streams its weights with compute to spare) and a burst of
    /// equal requests does not run in waves of all-prefill then all-decode steps. 0: off.
    pub mixed_step_tokens: usize,
    /// KV pool size in bytes; `None` = 30% of available memory, at most 4 GiB and at most what
    /// `max_running_requests` full-length sequences need.
    pub kv_cache_memory: Option<usize>,
    /// On a device with its own memory (GPU) and no `kv_cache_memory`: the fraction of the
    /// device's total memory Quiver may hold once the KV pool is allocated (vLLM's
    /// `--gpu-memory-utilization`); the pool gets what is free below that line.
    pub gpu_memory_utilization: f64,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Requests accepted but not yet running; beyond it `submit` fails with `QueueFull`.
    pub max_queued_requests: usize,
    pub schedule_policy: SchedulePolicy,
    pub disable_prefix_cache: bool,
    /// Run every step to the end before scheduling the next (SGLang's
    /// `--disable-overlap-schedule`). By default step N+1 is queued on the device before step
    /// N's tokens are collected, so the host's scheduling and streaming overlap the forward.
    pub disable_overlap_schedule: bool,
    /// Context window; `None` = the model's.
    pub max_model_len: Option<usize>,
    /// Aging: once the oldest waiting request has waited this many steps, admission becomes
    /// strictly first-come-first-served until it is admitted (no one may overtake it, e.g. by
    /// having its adapter already resident).
    pub aging_steps: u64,
    /// `--lora-dir`: adapter files under it are read with the file sandbox (no symlinks,
    /// every file resolving inside it).
    pub lora_dir: Option<std::path::PathBuf>,
    pub task: Task,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_running_requests: 64,
            max_loras_per_batch: 8,
            max_lora_rank: 64,
            max_loaded_loras: 64,
            lora_backend: quiver_lora::backend::DEFAULT_BACKEND.to_string(),
            lora_target_modules: LoraModule::PROJECTIONS.to_vec(),
            lora_enabled: true,
            eviction_policy: EvictionPolicy::Lru,
            max_num_batched_tokens: 2048,
            chunked_prefill_size: 512,
            mixed_step_tokens: 0,
            kv_cache_memory: None,
            gpu_memory_utilization: 0.9,
            block_size: 16,
            max_queued_requests: 1024,
            schedule_policy: SchedulePolicy::Fcfs,
            disable_prefix_cache: false,
            disable_overlap_schedule: false,
            max_model_len: None,
            aging_steps: 32,
            lora_dir: None,
            task: Task::Generate,
        }
    }
}

impl EngineConfig {
    /// Defaults for a model on a GPU: the CPU defaults size the batch for a few cores, where a
    /// GPU step costs about the same at 64 rows as at 256 (decode streams the weights once a
    /// step either way), so a GPU runs up to 256 sequences (the largest recorded decode step)
    /// and 8192 batched tokens a step, as vLLM and SGLang do on H100-class GPUs.
    pub fn for_gpu() -> Self {
        EngineConfig { max_running_requests: 256, max_num_batched_tokens: 8192, chunked_prefill_size: 2048, ..Default::default() }
    }

    pub fn validate(&self) -> Result<(), String> {
        let pos = |v: usize, n: &str| if v == 0 { Err(format!("{n} must be > 0")) } else { Ok(()) };
        pos(self.max_running_requests, "max_running_requests")?;
        pos(self.max_loras_per_batch, "max_loras_per_batch")?;
        pos(self.max_num_batched_tokens, "max_num_batched_tokens")?;
        pos(self.chunked_prefill_size, "chunked_prefill_size")?;
        pos(self.block_size, "block_size")?;
        pos(self.max_queued_requests, "max_queued_requests")?;
        if !(self.gpu_memory_utilization > 0.0 && self.gpu_memory_utilization <= 1.0) {
            return Err(format!("gpu_memory_utilization must be in (0, 1], got {}", self.gpu_memory_utilization));
        }
        if self.mixed_step_tokens != 0 && self.mixed_step_tokens <= MIXED_STEP_MIN_PROMPT {
            return Err(format!("mixed_step_tokens ({}) must be 0 (off) or more than {MIXED_STEP_MIN_PROMPT}", self.mixed_step_tokens));
        }
        if self.max_num_batched_tokens < self.max_running_requests {
            return Err(format!(
                "max_num_batched_tokens ({}) must be at least max_running_requests ({}) so every running sequence can decode each step",
                self.max_num_batched_tokens, self.max_running_requests
            ));
        }
        Ok(())
    }
}

/// Bytes of memory available to new allocations (Linux `MemAvailable`), if known.
pub(crate) fn mem_available() -> Option<usize> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
