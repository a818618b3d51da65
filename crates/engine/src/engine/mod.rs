//! The serving engine: one dedicated thread owns the model, the paged KV pool, the prefix cache
//! and the LoRA manager; requests arrive on a channel and stream events back.
//!
//! # A step
//! 1. Drain messages (new requests, cancellations, finished adapter loads, unloads).
//! 2. Schedule: every running sequence in decode gets one row (oldest first), then running
//!    sequences mid-prefill get chunks of at most `chunked_prefill_size`, then waiting
//!    sequences are admitted while every limit holds. All within `max_num_batched_tokens`.
//! 3. One forward over the varlen batch (decode rows + prefill chunks, mixed adapters).
//! 4. Sample per sequence (its own seeded RNG), stream text, finish, free blocks.
//!
//! With overlap on (the default, `overlap.rs`), step N+1 is scheduled and queued on the device
//! before step N's draws are collected: the host accepts N's tokens, streams them and ends
//! finished requests while N+1 runs.
//!
//! # Admission limits
//! - running sequences ≤ `max_running_requests` (a request with `n` samples reserves `n`);
//! - distinct adapters among **running** sequences ≤ `max_loras_per_batch`, pinned slots
//!   accounted by `LoraManager::validate_batch`. Running includes sequences mid chunked
//!   prefill whether or not they got a chunk this step, so the next batch can never hold more
//!   adapters than slots (SGLang #23141). Base rows take no slot;
//! - KV blocks for the first chunk (after prefix-cache hits) plus a 1% watermark;
//! - the step's token budget.
//!
//! # Starvation: aging
//! A request blocked only by the adapter limit is skipped so that others (whose adapters are
//! resident) can go — until the oldest waiting request has waited `aging_steps` steps. From
//! then on admission is strictly FCFS: nothing behind it is admitted, so running sequences
//! drain (each is bounded by its `max_tokens`), slots free up, and it is admitted. Its wait is
//! bounded by `aging_steps` + the longest remaining generation among running sequences.
//!
//! # Preemption
//! When a running sequence needs a block and none is free (after reclaiming idle cached
//! blocks), the newest running sequence is preempted: its blocks are released (full ones stay
//! in the prefix cache) and it goes to the front of the waiting queue with all its tokens and
//! its sampler state; on readmission its tokens are recomputed as a prefill, so it continues
//! exactly where it was.

use crate::api::*;
use crate::config::{mem_available, EngineConfig, SchedulePolicy, Task};
use crate::kv::{BlockId, BlockPool, Parent};
use crate::sampling::{self, Sampler, SamplingParams};
use crate::structured::{Grammars, Guide};
use crate::text::{Detok, StopScan};
use quiver_kernels::logit_edits::LogitEdits;
use quiver_kernels::sample::{SampleOut, SampleSpec};
use quiver_lora::adapter::FileStamp;
use quiver_lora::{AdapterKey, LoraAdapter, LoraConfig, LoraError, LoraHook, LoraManager, LoraModelDims, LoraModule, NoLora, ReadLimits};
use quiver_model::tokenizer::Tokenizer;
use quiver_model::{ForwardBatch, LlamaModel, LoadedModel, LogitsFor, ModelConfig, Workspace};
use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tokio::sync::oneshot;

mod adapters;
mod profile;
mod draw;
mod embed;
mod handle;
mod overlap;
mod prompt_logprobs;
mod requests;
mod schedule;
mod step;

use adapters::{loader_loop, Loader, LoaderJob};
use embed::{EmbedJob, EmbedState};

/// A draw not given a device spec (yet, or at all: its grammar reached a dead end).
const NO_SPEC: u32 = u32::MAX;

/// One token to draw this step: the sequence (and its `uid`, so a slot reused since is never
/// mistaken for it), the logits row, and its index among the device's specs or `NO_SPEC`.
#[derive(Clone, Copy)]
struct Draw {
    seq: usize,
    uid: u64,
    row: usize,
    spec: u32,
}

/// A prompt row of this step that scores prompt tokens or ends the prompt (see `Core::draw`):
/// its sequence, first logits row, the chunk `[start, end)`, and what it needs.
#[derive(Clone, Copy)]
struct PromptRows {
    seq: usize,
    row: usize,
    start: usize,
    end: usize,
    scored: bool,
    wants_token: bool,
}

pub(crate) enum Msg {
    Submit(Box<NewRequest>),
    Wake,
    AdapterLoaded { job: LoadJob, result: Result<LoraAdapter, LoraError> },
    AdapterReloaded { key: AdapterKey, result: Result<LoraAdapter, LoraError> },
    Unload(String),
    Debug(mpsc::Sender<DebugState>),
    Shutdown,
}

pub(crate) struct NewRequest {
    id: u64,
    req: GenerateRequest,
    tx: UnboundedSender<StreamEvent>,
    cancel: Arc<AtomicBool>,
    /// The compiled constraint, if any.
    guide: Option<Guide>,
    /// Set for an embedding request.
    embed: Option<EmbedJob>,
}

pub(crate) struct LoadJob {
    name: String,
    path: PathBuf,
    pinned: bool,
    replace: bool,
    reply: oneshot::Sender<Result<AdapterInfo, AdapterError>>,
}

#[derive(Default)]
struct AdapterEntry {
    info: Option<AdapterInfo>,
    loading: bool,
}

struct Shared {
    tokenizer: Arc<Tokenizer>,
    cfg: EngineConfig,
    max_model_len: usize,
    kv_capacity_tokens: usize,
    vocab: usize,
    accepting: AtomicBool,
    queued: AtomicUsize,
    next_id: AtomicU64,
    adapters: Mutex<HashMap<String, AdapterEntry>>,
    stats: Mutex<EngineStats>,
    /// Structured output for this vocabulary; `Err` says why it is unavailable.
    grammars: Result<Grammars, String>,
    /// The pooling, when the engine serves embeddings.
    embedding: Option<quiver_model::EmbeddingSpec>,
}

struct Inner {
    shared: Arc<Shared>,
    tx: Sender<Msg>,
    loader: Mutex<Option<Sender<LoaderJob>>>,
    /// Cancels the load in progress at shutdown.
    cancel_loads: Arc<AtomicBool>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.tx.send(Msg::Shutdown);
    }
}

/// Cheap to clone; the engine stops (after finishing its work) when the last clone drops or
/// on [`EngineHandle::shutdown`].
#[derive(Clone)]
pub struct EngineHandle {
    inner: Arc<Inner>,
}

pub struct Engine;

impl Engine {
    /// Spawns the engine thread (owning the model, KV pool and LoRA state) and the adapter
    /// loader thread.
    pub fn start(model: LoadedModel, cfg: EngineConfig) -> anyhow::Result<EngineHandle> {
        cfg.validate().map_err(anyhow::Error::msg)?;
        let LoadedModel { mut model, tokenizer, path } = model;
        let tokenizer = Arc::new(tokenizer);
        // The streaming detokenizer's byte table (~20 ms for a 49k vocabulary), now rather than
        // on the first generated token.
        let _ = tokenizer.token_bytes();
        let c = model.config.clone();
        let embedding = match &cfg.task {
            Task::Embed(spec) => Some(spec.clone()),
            Task::Generate if !c.has_lm_head => anyhow::bail!("{}: the model has no LM head (a bare `{:?}` decoder, an embedding model): serve it with --task embed", path.display(), c.arch),
            Task::Generate => None,
        };
        let mean_pooling = embedding.as_ref().is_some_and(|e| e.pooling == quiver_model::Pooling::Mean);
        let max_model_len = cfg.max_model_len.unwrap_or(c.max_position_embeddings).min(model.rope.max_pos).max(1);
        let dims = model.lora_dims();
        // No adapter can come: the smallest pool (the engine's batches still carry LoRA info).
        let (slots, rank) = if cfg.lora_enabled { (cfg.max_loras_per_batch, cfg.max_lora_rank) } else { (1, 1) };
        let lcfg = LoraConfig {
            max_loras_per_batch: slots,
            max_lora_rank: rank,
            max_loaded_loras: cfg.max_loaded_loras,
            eviction_policy: cfg.eviction_policy,
            backend: cfg.lora_backend.clone(),
            target_modules: cfg.lora_target_modules.clone(),
            chunk_size: quiver_lora::batch::DEFAULT_CHUNK_SIZE,
            max_batch_tokens: cfg.max_num_batched_tokens,
        };
        // The LoRA pool lives on the model's device: allocate it before sizing the KV cache from
        // what memory is left.
        let mut manager = LoraManager::new(dims, lcfg, model.device.clone()).map_err(|e| anyhow::anyhow!("LoRA setup: {e}"))?;
        // A tensor-parallel model: every rank gets its cut of each adapter.
        if let Some(ranks) = model.tp_ranks() {
            manager.shard_pool(&ranks).map_err(|e| anyhow::anyhow!("LoRA setup over {} tensor-parallel ranks: {e}", ranks.len()))?;
        }
        // Where the device adds deltas inside the base GEMM (CUDA: long prompts), the sites' base
        // weights get room for B, before any adapter is resident.
        if cfg.lora_enabled {
            model.attach_lora_tails(manager.pool());
        }
        // Host-cache reloads go through the loader thread too (see `adapters`).
        manager.set_disk_reload(false);
        let bs = cfg.block_size;
        let bpb = model.kv_bytes_per_block(bs);
        let num_blocks = match cfg.kv_cache_memory {
            Some(b) => b / bpb,
            None => {
                // Device memory: each tensor-parallel rank's own; host memory: shared by all.
                let util = cfg.gpu_memory_utilization.clamp(0.0, 1.0);
                let on_device = model.kv_blocks_in_memory(bs, &|free, total| free.saturating_sub(((1.0 - util) * total as f64) as usize));
                let fit = on_device.unwrap_or_else(|| mem_available().map_or(1 << 30, |m| m * 3 / 10).min(4 << 30) / bpb);
                let need = cfg.max_running_requests * max_model_len.div_ceil(bs) + 1;
                fit.min(need)
            }
        };
        anyhow::ensure!(num_blocks >= 2, "kv_cache_memory is too small: one block of {bs} tokens takes {bpb} bytes");
        let kv = model.alloc_kv(num_blocks, bs);
        tracing::info!(num_blocks, block_size = bs, bytes = num_blocks * bpb, max_model_len, "allocated paged KV cache");
        // Embedding steps draw nothing: there is no next step's input to run ahead with.
        let overlap = !cfg.disable_overlap_schedule && embedding.is_none();
        if !overlap && embedding.is_none() {
            tracing::info!("overlapped scheduling is off: every step finishes before the next is scheduled");
        }
        let shared = Arc::new(Shared {
            tokenizer: tokenizer.clone(),
            vocab: c.vocab_size,
            max_model_len,
            kv_capacity_tokens: num_blocks * bs,
            accepting: AtomicBool::new(true),
            queued: AtomicUsize::new(0),
            next_id: AtomicU64::new(1),
            adapters: Mutex::new(HashMap::new()),
            stats: Mutex::new(EngineStats { kv_blocks_total: num_blocks, kv_blocks_free: num_blocks, block_size: bs, max_loras: cfg.max_loras_per_batch, ..Default::default() }),
            grammars: Grammars::new(&tokenizer, c.vocab_size).map_err(|e| format!("structured output is unavailable for this tokenizer: {e:#}")),
            cfg: cfg.clone(),
            embedding: embedding.clone(),
        });
        let (tx, rx) = mpsc::channel::<Msg>();
        // Loader thread: every adapter file read happens there, never on the engine thread.
        let (ltx, lrx) = mpsc::channel::<LoaderJob>();
        let etx = tx.clone();
        let cancel_loads = Arc::new(AtomicBool::new(false));
        let sandbox = match &cfg.lora_dir {
            Some(d) => Some(d.canonicalize().map_err(|e| anyhow::anyhow!("--lora-dir {}: {e}", d.display()))?),
            None => None,
        };
        let loader = Loader {
            dims,
            max_rank: cfg.max_lora_rank,
            modules: cfg.lora_target_modules.clone(),
            sandbox,
            cancel: cancel_loads.clone(),
            model: model.config.clone(),
            images: manager.image_maker(),
        };
        std::thread::Builder::new().name("quiver-lora-loader".into()).spawn(move || loader_loop(lrx, etx, loader))?;
        let stride = max_model_len.div_ceil(bs);
        // An embedding step returns hidden states: every row of a chunk under mean pooling.
        let ws = match &embedding {
            None => model.new_workspace(cfg.max_num_batched_tokens, cfg.max_running_requests),
            Some(_) if mean_pooling => model.new_hidden_workspace(cfg.max_num_batched_tokens, cfg.max_num_batched_tokens),
            Some(_) => model.new_hidden_workspace(cfg.max_num_batched_tokens, cfg.max_running_requests),
        };
        let core = Core {
            ws,
            batch: ForwardBatch::with_capacity(cfg.max_num_batched_tokens, cfg.max_running_requests, stride),
            stride,
            kv,
            // Mean pooling needs every row computed, so no prefix may be skipped.
            pool: BlockPool::new(num_blocks, bs, !cfg.disable_prefix_cache && !mean_pooling),
            eos: tokenizer.eos_token_ids().to_vec(),
            tokenizer,
            model,
            manager,
            shared: shared.clone(),
            cfg,
            reqs: Vec::new(),
            free_reqs: Vec::new(),
            seqs: Vec::new(),
            free_seqs: Vec::new(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            pending_load: HashMap::new(),
            loader: ltx.clone(),
            reloading: HashSet::new(),
            running_adapters: HashMap::new(),
            next_order: 1,
            step_no: 0,
            shutdown: false,
            sched: Vec::new(),
            seq_adapters: Vec::new(),
            keys_buf: Vec::new(),
            match_buf: Vec::new(),
            edits: LogitEdits::new(),
            to_sample: Vec::new(),
            prompt_rows: Vec::new(),
            in_flight: Vec::new(),
            overlap,
            next_uid: 1,
            guided_buf: Vec::new(),
            specs: Vec::new(),
            sampled: Vec::new(),
            profile: profile::StepProfile::from_env(),
            cand_buf: Vec::new(),
            counters: Counters::default(),
            embedding,
        };
        let thread = std::thread::Builder::new().name("quiver-engine".into()).spawn(move || core.run(rx))?;
        Ok(EngineHandle { inner: Arc::new(Inner { shared, tx, loader: Mutex::new(Some(ltx)), cancel_loads, thread: Mutex::new(Some(thread)) }) })
    }
}

// ------------------------------------------------------------------------------------------
// Engine thread

struct Req {
    id: u64,
    adapter: Option<AdapterKey>,
    adapter_name: Option<Arc<str>>,
    params: SamplingParams,
    max_tokens: usize,
    stop: Vec<String>,
    stop_ids: Vec<u32>,
    ignore_eos: bool,
    logprobs: Option<usize>,
    n: usize,
    prompt_len: usize,
    /// Prompt scoring (see `prompt_logprobs.rs`): top-k asked for, the next prompt index to
    /// score, the logprobs so far, and whether they were sent.
    prompt_logprobs: Option<usize>,
    prompt_lp_next: usize,
    prompt_lps: Vec<TokenLogprob>,
    prompt_lps_sent: bool,
    min_tokens: usize,
    include_stop: bool,
    skip_special: bool,
    tx: UnboundedSender<StreamEvent>,
    cancel: Arc<AtomicBool>,
    seq_ids: Vec<usize>,
    live: usize,
    forked: bool,
    /// Admitted at least once (no longer counts against the queue limit).
    started: bool,
    /// Set for an embedding request.
    embed: Option<EmbedState>,
}

struct Seq {
    req: usize,
    index: usize,
    /// Unique over the engine's life (set by `new_seq`): slots are reused.
    uid: u64,
    /// Prompt and generated tokens; with overlap, the last may be a draw still on the device
    /// (`sample::DRAWN`, see `overlap.rs`).
    tokens: Vec<u32>,
    num_computed: usize,
    blocks: Vec<BlockId>,
    num_registered: usize,
    chain_ok: bool,
    sampler: Sampler,
    detok: Detok,
    stop: StopScan,
    /// Admission order (preemption picks the largest); 0 = never admitted.
    order: u64,
    running: bool,
    waiting_since: u64,
    /// Index of this step's schedule entry, if scheduled.
    scheduled: bool,
    /// The stop id or string that ended it (reported in `Finished`).
    stop_reason: Option<StopReason>,
    /// Position in the request's constraint (each sample has its own).
    guide: Option<Guide>,
}

#[derive(Default)]
struct Counters {
    prefix_queries: u64,
    prefix_hits: u64,
    adapter_loads: u64,
    adapter_load_failures: u64,
    slot_loads: u64,
    slot_evictions: u64,
    preemptions: u64,
    generated: u64,
    prefill_tokens: u64,
    overlapped_steps: u64,
    logits_to_host_steps: u64,
    edited_rows: u64,
}

struct Core {
    model: LlamaModel,
    tokenizer: Arc<Tokenizer>,
    eos: Vec<u32>,
    kv: quiver_model::KvCache,
    ws: Workspace,
    batch: ForwardBatch,
    stride: usize,
    pool: BlockPool,
    manager: LoraManager,
    shared: Arc<Shared>,
    cfg: EngineConfig,
    reqs: Vec<Option<Req>>,
    free_reqs: Vec<usize>,
    seqs: Vec<Option<Seq>>,
    free_seqs: Vec<usize>,
    /// Running sequence ids sorted by admission order (newest last).
    running: Vec<usize>,
    waiting: VecDeque<usize>,
    /// Requests for a name whose first load is in progress.
    pending_load: HashMap<String, Vec<NewRequest>>,
    /// Sends loads and host-cache reloads to the loader thread.
    loader: Sender<LoaderJob>,
    /// Versions whose weights the loader is reading again; their sequences wait.
    reloading: HashSet<AdapterKey>,
    /// Running sequences per adapter version.
    running_adapters: HashMap<AdapterKey, usize>,
    next_order: u64,
    step_no: u64,
    shutdown: bool,
    sched: Vec<(usize, usize)>,
    seq_adapters: Vec<Option<AdapterKey>>,
    keys_buf: Vec<Option<AdapterKey>>,
    match_buf: Vec<BlockId>,
    /// This step's logit edits, applied on the device before its draws (`draw.rs`).
    edits: LogitEdits,
    /// This step's draws, and its prompt rows that score or end a prompt.
    to_sample: Vec<Draw>,
    prompt_rows: Vec<PromptRows>,
    /// The draws of the step in flight (launched, not collected), in spec order: sequence and
    /// uid. Empty when nothing is in flight.
    in_flight: Vec<(usize, u64)>,
    /// Queue step N+1 before collecting step N (`EngineConfig::disable_overlap_schedule`).
    overlap: bool,
    next_uid: u64,
    /// This step's constrained draws (see `prepare_masks`).
    guided_buf: Vec<usize>,
    /// The draws made on the model's device, and their results.
    specs: Vec<SampleSpec>,
    sampled: Vec<SampleOut>,
    /// `QUIVER_ENGINE_PROFILE=1`: per-phase step times.
    profile: Option<profile::StepProfile>,
    cand_buf: Vec<(usize, usize)>,
    counters: Counters,
    /// The pooling, when the engine serves embeddings.
    embedding: Option<quiver_model::EmbeddingSpec>,
}

impl Core {
    fn seq(&self, s: usize) -> &Seq {
        self.seqs[s].as_ref().expect("live sequence")
    }
    fn seq_mut(&mut self, s: usize) -> &mut Seq {
        self.seqs[s].as_mut().expect("live sequence")
    }
    fn req(&self, r: usize) -> &Req {
        self.reqs[r].as_ref().expect("live request")
    }
    fn req_mut(&mut self, r: usize) -> &mut Req {
        self.reqs[r].as_mut().expect("live request")
    }

    /// Profiling: the time since the last mark was spent in phase `p` (see `profile.rs`).
    fn prof(&mut self, p: usize) {
        if let Some(pr) = self.profile.as_mut() {
            pr.mark(p);
        }
    }

    fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty() || !self.in_flight.is_empty()
    }

    fn run(mut self, rx: Receiver<Msg>) {
        loop {
            if !self.has_work() {
                if self.shutdown {
                    break;
                }
                match rx.recv() {
                    Ok(m) => self.handle(m),
                    Err(_) => break,
                }
                if let Some(p) = self.profile.as_mut() {
                    p.skip();
                }
            }
            while let Ok(m) = rx.try_recv() {
                self.handle(m);
            }
            self.check_cancellations();
            if !self.has_work() {
                self.publish_stats();
                continue;
            }
            self.prof(0);
            let progressed = self.step();
            self.publish_stats();
            self.prof(7);
            if !progressed {
                // Nothing could run (e.g. every waiting request needs a slot held by a
                // failing adapter): wait for a message rather than spin.
                if let Ok(m) = rx.recv_timeout(Duration::from_millis(5)) {
                    self.handle(m);
                }
            }
        }
        for (_, reqs) in std::mem::take(&mut self.pending_load) {
            for r in reqs {
                let _ = r.tx.send(StreamEvent::Error("the engine shut down before the adapter finished loading".into()));
                let _ = r.tx.send(StreamEvent::Finished { index: 0, reason: FinishReason::Abort, stop_reason: None, prompt_tokens: r.req.prompt.len(), completion_tokens: 0 });
            }
        }
        self.publish_stats();
    }

    fn handle(&mut self, m: Msg) {
        match m {
            Msg::Submit(nr) => self.accept(*nr),
            Msg::Wake => {}
            Msg::AdapterLoaded { job, result } => self.finish_load(job, result),
            Msg::AdapterReloaded { key, result } => self.finish_reload(key, result),
            Msg::Unload(name) => {
                if let Err(e) = self.manager.unload_adapter(&name) {
                    tracing::warn!(adapter = %name, "unload: {e}");
                }
            }
            Msg::Debug(tx) => {
                self.check_cancellations();
                let _ = tx.send(self.debug_state());
            }
            Msg::Shutdown => {
                self.shutdown = true;
                self.abandon_reloads();
            }
        }
    }

    fn debug_state(&self) -> DebugState {
        DebugState {
            kv_total: self.pool.num_blocks(),
            kv_free: self.pool.num_free(),
            kv_cached_idle: self.pool.num_cached_idle(),
            kv_in_use: self.pool.num_in_use(),
            kv_invariants: self.pool.check_invariants(),
            requests: self.reqs.iter().filter(|r| r.is_some()).count(),
            running_seqs: self.running.len(),
            waiting_seqs: self.waiting.len(),
            pending_on_load: self.pending_load.values().map(|v| v.len()).sum(),
            queued: self.shared.queued.load(Ordering::SeqCst),
            lora_versions: self.manager.adapters().into_iter().map(|a| (a.name, a.key.version, a.in_flight, a.current)).collect(),
            lora_resident: self.manager.resident().into_iter().map(|(s, k)| (s, k.version)).collect(),
            lora_pinned_slots: self.manager.pool().pinned_count(),
        }
    }
}
