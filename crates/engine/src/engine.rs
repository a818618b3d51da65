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
use crate::config::{mem_available, EngineConfig, SchedulePolicy};
use crate::kv::{BlockId, BlockPool, Parent};
use crate::sampling::{self, Sampler, SamplingParams};
use crate::text::{Detok, StopScan};
use quiver_kernels::KvStorage;
use quiver_lora::{AdapterKey, LoraAdapter, LoraConfig, LoraError, LoraHook, LoraManager, LoraModelDims, LoraModule, NoLora};
use quiver_model::tokenizer::Tokenizer;
use quiver_model::{ForwardBatch, LlamaModel, LoadedModel, LogitsFor, Workspace};
use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tokio::sync::oneshot;

pub(crate) enum Msg {
    Submit(Box<NewRequest>),
    Wake,
    AdapterLoaded { job: LoadJob, result: Result<LoraAdapter, LoraError> },
    Unload(String),
    Debug(mpsc::Sender<DebugState>),
    Shutdown,
}

pub(crate) struct NewRequest {
    id: u64,
    req: GenerateRequest,
    tx: UnboundedSender<StreamEvent>,
    cancel: Arc<AtomicBool>,
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
}

struct Inner {
    shared: Arc<Shared>,
    tx: Sender<Msg>,
    loader: Mutex<Option<Sender<LoadJob>>>,
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
        let LoadedModel { model, tokenizer, .. } = model;
        let tokenizer = Arc::new(tokenizer);
        let c = &model.config;
        let max_model_len = cfg.max_model_len.unwrap_or(c.max_position_embeddings).min(model.rope.max_pos).max(1);
        let bs = cfg.block_size;
        let bpb = model.kv_bytes_per_block(bs);
        let num_blocks = match cfg.kv_cache_memory {
            Some(b) => b / bpb,
            None => {
                let budget = match model.device.memory_info() {
                    Some((free, total)) => free.saturating_sub(((1.0 - cfg.gpu_memory_utilization.clamp(0.0, 1.0)) * total as f64) as usize),
                    None => mem_available().map_or(1 << 30, |m| m * 3 / 10).min(4 << 30),
                };
                let need = cfg.max_running_requests * max_model_len.div_ceil(bs) + 1;
                (budget / bpb).min(need)
            }
        };
        anyhow::ensure!(num_blocks >= 2, "kv_cache_memory is too small: one block of {bs} tokens takes {bpb} bytes");
        let dims = model.lora_dims();
        let lcfg = LoraConfig {
            max_loras_per_batch: cfg.max_loras_per_batch,
            max_lora_rank: cfg.max_lora_rank,
            max_loaded_loras: cfg.max_loaded_loras,
            eviction_policy: cfg.eviction_policy,
            backend: cfg.lora_backend.clone(),
            target_modules: cfg.lora_target_modules.clone(),
            chunk_size: quiver_lora::batch::DEFAULT_CHUNK_SIZE,
            max_batch_tokens: cfg.max_num_batched_tokens,
        };
        let manager = LoraManager::new(dims, lcfg, model.device.kind()).map_err(|e| anyhow::anyhow!("LoRA setup: {e}"))?;
        let kv = model.alloc_kv(num_blocks, bs);
        tracing::info!(num_blocks, block_size = bs, bytes = num_blocks * bpb, max_model_len, "allocated paged KV cache");
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
            cfg: cfg.clone(),
        });
        let (tx, rx) = mpsc::channel::<Msg>();
        // Loader thread: reads and validates adapters off the engine thread.
        let (ltx, lrx) = mpsc::channel::<LoadJob>();
        let etx = tx.clone();
        let (max_rank, modules) = (cfg.max_lora_rank, cfg.lora_target_modules.clone());
        std::thread::Builder::new().name("quiver-lora-loader".into()).spawn(move || loader_loop(lrx, etx, dims, max_rank, modules))?;
        let stride = max_model_len.div_ceil(bs);
        let core = Core {
            ws: model.new_workspace(cfg.max_num_batched_tokens, cfg.max_running_requests),
            batch: ForwardBatch::with_capacity(cfg.max_num_batched_tokens, cfg.max_running_requests, stride),
            stride,
            kv,
            pool: BlockPool::new(num_blocks, bs, !cfg.disable_prefix_cache),
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
            running_adapters: HashMap::new(),
            next_order: 1,
            step_no: 0,
            shutdown: false,
            sched: Vec::new(),
            seq_adapters: Vec::new(),
            keys_buf: Vec::new(),
            match_buf: Vec::new(),
            logits_buf: Vec::new(),
            work_buf: Vec::new(),
            cand_buf: Vec::new(),
            counters: Counters::default(),
        };
        let thread = std::thread::Builder::new().name("quiver-engine".into()).spawn(move || core.run(rx))?;
        Ok(EngineHandle { inner: Arc::new(Inner { shared, tx, loader: Mutex::new(Some(ltx)), thread: Mutex::new(Some(thread)) }) })
    }
}

fn loader_loop(rx: Receiver<LoadJob>, engine: Sender<Msg>, dims: LoraModelDims, max_rank: usize, modules: Vec<LoraModule>) {
    while let Ok(job) = rx.recv() {
        let result = LoraAdapter::load(&job.name, &job.path, &dims).and_then(|a| a.check_compatible(max_rank, &modules).map(|_| a));
        if engine.send(Msg::AdapterLoaded { job, result }).is_err() {
            return;
        }
    }
}

impl EngineHandle {
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.inner.shared.tokenizer
    }
    pub fn tokenizer_arc(&self) -> Arc<Tokenizer> {
        self.inner.shared.tokenizer.clone()
    }
    pub fn config(&self) -> &EngineConfig {
        &self.inner.shared.cfg
    }
    /// The context window requests are checked against.
    pub fn max_model_len(&self) -> usize {
        self.inner.shared.max_model_len
    }

    /// Queues a request. Fails at once (nothing queued) on invalid input, an unknown adapter
    /// (a name still loading is accepted and waits), a full queue, or shutdown.
    pub fn submit(&self, req: GenerateRequest) -> Result<RequestStream, SubmitError> {
        let sh = &self.inner.shared;
        if req.prompt.is_empty() {
            return Err(SubmitError::Invalid("prompt is empty".into()));
        }
        if req.max_tokens == 0 {
            return Err(SubmitError::Invalid("max_tokens must be at least 1".into()));
        }
        if req.n == 0 || req.n > sh.cfg.max_running_requests {
            return Err(SubmitError::Invalid(format!("n must be in 1..={}, got {}", sh.cfg.max_running_requests, req.n)));
        }
        if let Some(k) = req.logprobs {
            if k > 20 {
                return Err(SubmitError::Invalid(format!("top_logprobs must be at most 20, got {k}")));
            }
        }
        req.sampling.validate().map_err(SubmitError::Invalid)?;
        if let Some(&bad) = req.prompt.iter().chain(&req.stop_token_ids).find(|&&t| t as usize >= sh.vocab) {
            return Err(SubmitError::Invalid(format!("token id {bad} is outside the vocabulary ({} tokens)", sh.vocab)));
        }
        let total = req.prompt.len() + req.max_tokens;
        if total > sh.max_model_len {
            return Err(SubmitError::PromptTooLong { prompt_tokens: req.prompt.len(), max_tokens: req.max_tokens, max_model_len: sh.max_model_len });
        }
        if total > sh.kv_capacity_tokens {
            return Err(SubmitError::Invalid(format!(
                "prompt + max_tokens ({total} tokens) exceeds the whole KV cache ({} tokens); raise --kv-cache-memory",
                sh.kv_capacity_tokens
            )));
        }
        // The adapter table lock orders this submit against unloads.
        let table = sh.adapters.lock().unwrap();
        if !sh.accepting.load(Ordering::SeqCst) {
            return Err(SubmitError::ShuttingDown);
        }
        if let Some(name) = &req.adapter {
            match table.get(name) {
                Some(e) if e.info.is_some() || e.loading => {}
                _ => return Err(SubmitError::UnknownAdapter(name.clone())),
            }
        }
        let max = sh.cfg.max_queued_requests;
        if sh.queued.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |q| (q < max).then_some(q + 1)).is_err() {
            return Err(SubmitError::QueueFull { max });
        }
        let id = sh.next_id.fetch_add(1, Ordering::Relaxed);
        let (etx, erx) = unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let (n, prompt_tokens) = (req.n, req.prompt.len());
        if self.inner.tx.send(Msg::Submit(Box::new(NewRequest { id, req, tx: etx, cancel: cancel.clone() }))).is_err() {
            sh.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::ShuttingDown);
        }
        drop(table);
        Ok(RequestStream { id, rx: erx, cancel: CancelGuard { flag: cancel, wake: self.inner.tx.clone() }, n, prompt_tokens })
    }

    /// Loads (or, with `load_inplace`, replaces) an adapter. Reading and validating the files
    /// happens on the loader thread; requests for a new name submitted meanwhile wait for it.
    /// `expected_version` makes a replace a compare-and-swap.
    ///
    /// The load starts when this is called (not when the future is first polled), so a request
    /// submitted right after it waits for the adapter instead of being refused.
    pub fn load_adapter(&self, name: &str, path: &Path, pinned: bool, load_inplace: bool, expected_version: Option<u64>) -> impl std::future::Future<Output = Result<AdapterInfo, AdapterError>> + Send + 'static {
        let started = self.start_load(name, path, pinned, load_inplace, expected_version);
        async move {
            match started {
                Ok(rx) => rx.await.unwrap_or(Err(AdapterError::ShuttingDown)),
                Err(e) => Err(e),
            }
        }
    }

    /// [`Self::load_adapter`] for threads outside an async runtime.
    pub fn load_adapter_blocking(&self, name: &str, path: &Path, pinned: bool, load_inplace: bool, expected_version: Option<u64>) -> Result<AdapterInfo, AdapterError> {
        let rx = self.start_load(name, path, pinned, load_inplace, expected_version)?;
        rx.blocking_recv().unwrap_or(Err(AdapterError::ShuttingDown))
    }

    fn start_load(&self, name: &str, path: &Path, pinned: bool, load_inplace: bool, expected_version: Option<u64>) -> Result<oneshot::Receiver<Result<AdapterInfo, AdapterError>>, AdapterError> {
        let sh = &self.inner.shared;
        if name.is_empty() {
            return Err(AdapterError::Invalid("adapter name is empty".into()));
        }
        let mut table = sh.adapters.lock().unwrap();
        if !sh.accepting.load(Ordering::SeqCst) {
            return Err(AdapterError::ShuttingDown);
        }
        let replace = match table.get(name) {
            Some(e) if e.loading => return Err(AdapterError::Busy(name.into())),
            Some(e) => {
                let cur = e.info.as_ref().map(|i| i.version);
                if !load_inplace {
                    return Err(AdapterError::AlreadyLoaded(name.into()));
                }
                if let Some(exp) = expected_version {
                    if Some(exp) != cur {
                        return Err(AdapterError::VersionMismatch { name: name.into(), expected: exp, actual: cur });
                    }
                }
                true
            }
            None => {
                if let Some(exp) = expected_version {
                    return Err(AdapterError::VersionMismatch { name: name.into(), expected: exp, actual: None });
                }
                false
            }
        };
        let (reply, rx) = oneshot::channel();
        let job = LoadJob { name: name.into(), path: path.to_path_buf(), pinned, replace, reply };
        let loader = self.inner.loader.lock().unwrap();
        let Some(l) = loader.as_ref() else { return Err(AdapterError::ShuttingDown) };
        l.send(job).map_err(|_| AdapterError::ShuttingDown)?;
        table.entry(name.into()).or_default().loading = true;
        Ok(rx)
    }

    /// Removes `name`: new requests for it are refused from now on; accepted ones finish on
    /// the weights they were given; the weights are freed when the last of them finishes.
    pub fn unload_adapter(&self, name: &str) -> Result<(), AdapterError> {
        let sh = &self.inner.shared;
        let mut table = sh.adapters.lock().unwrap();
        match table.get(name) {
            None => return Err(AdapterError::NotFound(name.into())),
            Some(e) if e.loading => return Err(AdapterError::Busy(name.into())),
            Some(_) => {}
        }
        table.remove(name);
        self.inner.tx.send(Msg::Unload(name.into())).map_err(|_| AdapterError::ShuttingDown)
    }

    /// Current versions of loaded adapters, by name.
    pub fn adapters(&self) -> Vec<AdapterInfo> {
        let table = self.inner.shared.adapters.lock().unwrap();
        let mut v: Vec<AdapterInfo> = table.values().filter_map(|e| e.info.clone()).collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    pub fn stats(&self) -> EngineStats {
        self.inner.shared.stats.lock().unwrap().clone()
    }

    /// A consistent snapshot of the engine's internals (waits for the current step).
    pub fn debug_state(&self) -> Option<DebugState> {
        let (tx, rx) = mpsc::channel();
        self.inner.tx.send(Msg::Debug(tx)).ok()?;
        rx.recv().ok()
    }

    /// Stops accepting requests and loads; accepted requests run to completion, then the
    /// engine thread exits.
    pub fn shutdown(&self) {
        {
            let _t = self.inner.shared.adapters.lock().unwrap();
            self.inner.shared.accepting.store(false, Ordering::SeqCst);
        }
        let _ = self.inner.tx.send(Msg::Shutdown);
        self.inner.loader.lock().unwrap().take();
    }

    /// [`Self::shutdown`], then waits for the engine thread to finish.
    pub fn shutdown_and_join(&self) {
        self.shutdown();
        if let Some(t) = self.inner.thread.lock().unwrap().take() {
            let _ = t.join();
        }
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
    tx: UnboundedSender<StreamEvent>,
    cancel: Arc<AtomicBool>,
    seq_ids: Vec<usize>,
    live: usize,
    forked: bool,
    /// Admitted at least once (no longer counts against the queue limit).
    started: bool,
}

struct Seq {
    req: usize,
    index: usize,
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
}

struct Core {
    model: LlamaModel,
    tokenizer: Arc<Tokenizer>,
    eos: Vec<u32>,
    kv: KvStorage,
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
    /// Running sequences per adapter version.
    running_adapters: HashMap<AdapterKey, usize>,
    next_order: u64,
    step_no: u64,
    shutdown: bool,
    sched: Vec<(usize, usize)>,
    seq_adapters: Vec<Option<AdapterKey>>,
    keys_buf: Vec<Option<AdapterKey>>,
    match_buf: Vec<BlockId>,
    logits_buf: Vec<f32>,
    work_buf: Vec<f32>,
    cand_buf: Vec<(usize, usize)>,
    counters: Counters,
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

    fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
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
            }
            while let Ok(m) = rx.try_recv() {
                self.handle(m);
            }
            self.check_cancellations();
            if !self.has_work() {
                self.publish_stats();
                continue;
            }
            let progressed = self.step();
            self.publish_stats();
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
                let _ = r.tx.send(StreamEvent::Finished { index: 0, reason: FinishReason::Abort, prompt_tokens: r.req.prompt.len(), completion_tokens: 0 });
            }
        }
        self.publish_stats();
    }

    fn handle(&mut self, m: Msg) {
        match m {
            Msg::Submit(nr) => self.accept(*nr),
            Msg::Wake => {}
            Msg::AdapterLoaded { job, result } => self.finish_load(job, result),
            Msg::Unload(name) => {
                if let Err(e) = self.manager.unload_adapter(&name) {
                    tracing::warn!(adapter = %name, "unload: {e}");
                }
            }
            Msg::Debug(tx) => {
                self.check_cancellations();
                let _ = tx.send(self.debug_state());
            }
            Msg::Shutdown => self.shutdown = true,
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

    fn reject(&self, nr: NewRequest, msg: String) {
        self.shared.queued.fetch_sub(1, Ordering::SeqCst);
        let _ = nr.tx.send(StreamEvent::Error(msg));
        for index in 0..nr.req.n {
            let _ = nr.tx.send(StreamEvent::Finished { index, reason: FinishReason::Abort, prompt_tokens: nr.req.prompt.len(), completion_tokens: 0 });
        }
    }

    /// A submitted request enters the engine: bind its adapter version now (so an unload or
    /// replace after acceptance does not affect it) and queue it.
    fn accept(&mut self, nr: NewRequest) {
        let (key, name) = match &nr.req.adapter {
            None => (None, None),
            Some(name) => match self.manager.acquire(name) {
                Ok(k) => (Some(k), Some(Arc::<str>::from(name.as_str()))),
                Err(_) => {
                    let loading = self.shared.adapters.lock().unwrap().get(name).is_some_and(|e| e.loading);
                    if loading {
                        self.pending_load.entry(name.clone()).or_default().push(nr);
                    } else {
                        let msg = format!("LoRA adapter `{name}` is not loaded");
                        self.reject(nr, msg);
                    }
                    return;
                }
            },
        };
        let NewRequest { id, req, tx, cancel } = nr;
        let ri = match self.free_reqs.pop() {
            Some(i) => i,
            None => {
                self.reqs.push(None);
                self.reqs.len() - 1
            }
        };
        let prompt_len = req.prompt.len();
        let sampler = Sampler::new(req.sampling.clone(), &req.prompt);
        let si = self.new_seq(Seq {
            req: ri,
            index: 0,
            detok: Detok::new(prompt_len),
            tokens: req.prompt,
            num_computed: 0,
            blocks: Vec::new(),
            num_registered: 0,
            chain_ok: true,
            sampler,
            stop: StopScan::default(),
            order: 0,
            running: false,
            waiting_since: self.step_no,
            scheduled: false,
        });
        self.reqs[ri] = Some(Req {
            id,
            adapter: key,
            adapter_name: name,
            params: req.sampling,
            max_tokens: req.max_tokens,
            stop: req.stop,
            stop_ids: req.stop_token_ids,
            ignore_eos: req.ignore_eos,
            logprobs: req.logprobs,
            n: req.n,
            prompt_len,
            tx,
            cancel,
            seq_ids: vec![si],
            live: req.n,
            forked: req.n == 1,
            started: false,
        });
        self.waiting.push_back(si);
    }

    fn new_seq(&mut self, s: Seq) -> usize {
        match self.free_seqs.pop() {
            Some(i) => {
                self.seqs[i] = Some(s);
                i
            }
            None => {
                self.seqs.push(Some(s));
                self.seqs.len() - 1
            }
        }
    }

    fn finish_load(&mut self, job: LoadJob, result: Result<LoraAdapter, LoraError>) {
        // The manager re-reads the files here (it has no API taking pre-read weights yet); the
        // loader thread already validated them, so failures here are rare races.
        let r = result.and_then(|_adapter| {
            if job.replace {
                let k = self.manager.replace_adapter(&job.name, &job.path)?;
                if job.pinned {
                    self.manager.pin(&job.name, true)?;
                }
                Ok(k)
            } else {
                self.manager.load_adapter_with(&job.name, &job.path, job.pinned)
            }
        });
        let r = r.map(|key| {
            let a = self.manager.adapters().into_iter().find(|a| a.key == key);
            AdapterInfo {
                name: job.name.clone(),
                path: job.path.clone(),
                version: key.version,
                pinned: a.as_ref().is_some_and(|a| a.pinned),
                rank: a.map_or(0, |a| a.max_rank),
            }
        });
        {
            let mut table = self.shared.adapters.lock().unwrap();
            let entry = table.entry(job.name.clone()).or_default();
            entry.loading = false;
            match &r {
                Ok(info) => entry.info = Some(info.clone()),
                Err(_) => {
                    if entry.info.is_none() {
                        table.remove(&job.name);
                    }
                }
            }
        }
        match &r {
            Ok(info) => {
                self.counters.adapter_loads += 1;
                tracing::info!(adapter = %info.name, version = info.version, rank = info.rank, "LoRA adapter loaded");
            }
            Err(e) => {
                self.counters.adapter_load_failures += 1;
                tracing::warn!(adapter = %job.name, "LoRA adapter load failed: {e}");
            }
        }
        let pending = self.pending_load.remove(&job.name).unwrap_or_default();
        for nr in pending {
            match &r {
                Ok(_) => self.accept(nr),
                Err(e) => {
                    let msg = format!("loading LoRA adapter `{}` failed: {e}", job.name);
                    self.reject(nr, msg);
                }
            }
        }
        let _ = job.reply.send(r.map_err(|e| match e {
            LoraError::AlreadyLoaded(n) => AdapterError::AlreadyLoaded(n),
            LoraError::UnknownAdapter(n) => AdapterError::NotFound(n),
            e => AdapterError::Invalid(e.to_string()),
        }));
    }

    fn check_cancellations(&mut self) {
        for ri in 0..self.reqs.len() {
            let cancelled = match &self.reqs[ri] {
                Some(r) => r.cancel.load(Ordering::Relaxed) || r.tx.is_closed(),
                None => false,
            };
            if cancelled {
                self.abort_request(ri, None);
            }
        }
        // Requests waiting for an adapter load can be cancelled too.
        for v in self.pending_load.values_mut() {
            let before = v.len();
            v.retain(|nr| !(nr.cancel.load(Ordering::Relaxed) || nr.tx.is_closed()));
            self.shared.queued.fetch_sub(before - v.len(), Ordering::SeqCst);
        }
    }

    fn abort_request(&mut self, ri: usize, error: Option<String>) {
        let seq_ids = std::mem::take(&mut self.req_mut(ri).seq_ids);
        if let Some(e) = error {
            let _ = self.req(ri).tx.send(StreamEvent::Error(e));
        }
        for si in seq_ids {
            if self.seqs[si].is_some() {
                self.end_seq(si, FinishReason::Abort);
            }
        }
        // Samples not forked yet.
        while self.reqs[ri].as_ref().is_some_and(|r| r.live > 0) {
            let r = self.req_mut(ri);
            r.live -= 1;
            let (index, pl) = (r.n - r.live - 1, r.prompt_len);
            let _ = r.tx.send(StreamEvent::Finished { index, reason: FinishReason::Abort, prompt_tokens: pl, completion_tokens: 0 });
        }
        if self.reqs[ri].is_some() {
            self.drop_request(ri);
        }
    }

    fn release_blocks(&mut self, si: usize) {
        let blocks = std::mem::take(&mut self.seq_mut(si).blocks);
        for &b in blocks.iter().rev() {
            self.pool.release(b);
        }
        let mut blocks = blocks;
        blocks.clear();
        self.seq_mut(si).blocks = blocks;
    }

    fn remove_running(&mut self, si: usize) {
        if let Some(p) = self.running.iter().position(|&x| x == si) {
            self.running.remove(p);
            let key = self.req(self.seq(si).req).adapter;
            if let Some(k) = key {
                let c = self.running_adapters.get_mut(&k).expect("running adapter counted");
                *c -= 1;
                if *c == 0 {
                    self.running_adapters.remove(&k);
                }
            }
        }
        self.seq_mut(si).running = false;
    }

    fn insert_running(&mut self, si: usize) {
        let order = self.seq(si).order;
        let pos = self.running.partition_point(|&x| self.seq(x).order < order);
        self.running.insert(pos, si);
        self.seq_mut(si).running = true;
        if let Some(k) = self.req(self.seq(si).req).adapter {
            *self.running_adapters.entry(k).or_insert(0) += 1;
        }
    }

    /// Sequence `si` is done: free everything it holds and tell the client.
    fn end_seq(&mut self, si: usize, reason: FinishReason) {
        self.release_blocks(si);
        if self.seq(si).running {
            self.remove_running(si);
        } else if let Some(p) = self.waiting.iter().position(|&x| x == si) {
            self.waiting.remove(p);
        }
        let seq = self.seqs[si].take().expect("live sequence");
        self.free_seqs.push(si);
        let ri = seq.req;
        let r = self.req_mut(ri);
        let completion = seq.tokens.len() - r.prompt_len;
        let _ = r.tx.send(StreamEvent::Finished { index: seq.index, reason, prompt_tokens: r.prompt_len, completion_tokens: completion });
        r.live -= 1;
        r.seq_ids.retain(|&x| x != si);
        if r.live == 0 {
            self.drop_request(ri);
        }
    }

    fn drop_request(&mut self, ri: usize) {
        let r = self.reqs[ri].take().expect("live request");
        self.free_reqs.push(ri);
        if !r.started {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
        }
        if let Some(k) = r.adapter {
            self.manager.release(k);
        }
    }

    fn preempt(&mut self, si: usize) {
        tracing::debug!(request = self.req(self.seq(si).req).id, seq = si, "preempting sequence (recompute)");
        self.counters.preemptions += 1;
        self.release_blocks(si);
        self.remove_running(si);
        let step = self.step_no;
        let s = self.seq_mut(si);
        s.num_computed = 0;
        s.num_registered = 0;
        s.chain_ok = true;
        s.waiting_since = step;
        if s.scheduled {
            s.scheduled = false;
            if let Some(p) = self.sched.iter().position(|&(x, _)| x == si) {
                self.sched.remove(p);
            }
        }
        self.waiting.push_front(si);
    }

    /// Makes sure `si` has blocks for `upto` tokens, preempting newer sequences if needed.
    /// False if `si` itself had to be preempted.
    fn grow_blocks(&mut self, si: usize, upto: usize) -> bool {
        let bs = self.pool.block_size();
        let need = upto.div_ceil(bs).saturating_sub(self.seq(si).blocks.len());
        while self.pool.available() < need {
            let victim = *self.running.last().expect("si is running");
            self.preempt(victim);
            if victim == si {
                return false;
            }
        }
        for _ in 0..need {
            let b = self.pool.allocate().expect("checked available");
            self.seq_mut(si).blocks.push(b);
        }
        true
    }

    fn schedule(&mut self) -> bool {
        let mut budget = self.cfg.max_num_batched_tokens;
        let chunk_cap = self.cfg.chunked_prefill_size;
        self.sched.clear();
        let mut preempted = false;
        // Decode rows first, then running prefills, both oldest first.
        for pass in 0..2 {
            let mut i = 0;
            while i < self.running.len() && budget > 0 {
                let si = self.running[i];
                let s = self.seq(si);
                let remaining = s.tokens.len() - s.num_computed;
                let is_decode = remaining == 1;
                if (pass == 0) != is_decode || s.scheduled {
                    i += 1;
                    continue;
                }
                let chunk = remaining.min(budget).min(if is_decode { 1 } else { chunk_cap });
                let upto = s.num_computed + chunk;
                let before = self.preemptions_now();
                if !self.grow_blocks(si, upto) {
                    preempted = true;
                    break;
                }
                if self.preemptions_now() != before {
                    preempted = true;
                    // Victims scheduled earlier gave their budget back.
                    budget = self.cfg.max_num_batched_tokens - self.sched.iter().map(|x| x.1).sum::<usize>();
                }
                self.sched.push((si, chunk));
                self.seq_mut(si).scheduled = true;
                budget -= chunk;
                i += 1;
            }
        }
        if !preempted {
            self.admit(&mut budget);
        }
        !self.sched.is_empty()
    }

    fn preemptions_now(&self) -> u64 {
        self.counters.preemptions
    }

    /// Admission from the waiting queue (see the module docs for the rules).
    fn admit(&mut self, budget: &mut usize) {
        if self.waiting.is_empty() {
            return;
        }
        let bs = self.pool.block_size();
        let head = self.waiting[0];
        let strict = self.step_no.saturating_sub(self.seq(head).waiting_since) >= self.cfg.aging_steps;
        // Candidate order: queue order, or longest prefix match first.
        self.cand_buf.clear();
        let scan = self.waiting.len().min(256);
        for qi in 0..scan {
            self.cand_buf.push((qi, 0));
        }
        if self.cfg.schedule_policy == SchedulePolicy::Lpm && !strict && self.pool.prefix_cache_enabled() {
            for c in 0..self.cand_buf.len() {
                let si = self.waiting[self.cand_buf[c].0];
                let s = self.seqs[si].as_ref().expect("waiting sequence");
                let key = self.reqs[s.req].as_ref().expect("live request").adapter;
                self.pool.match_prefix(key, &s.tokens, (s.tokens.len() - 1) / bs, &mut self.match_buf);
                self.cand_buf[c].1 = self.match_buf.len();
            }
            self.cand_buf.sort_by_key(|&(qi, m)| (std::cmp::Reverse(m), qi));
        }
        let watermark = if self.running.is_empty() { 0 } else { (self.pool.num_blocks() / 100).max(1) };
        let mut admitted_q: Vec<usize> = Vec::new();
        for c in 0..self.cand_buf.len() {
            if *budget == 0 {
                break;
            }
            let qi = self.cand_buf[c].0;
            let si = self.waiting[qi];
            let s = self.seqs[si].as_ref().expect("waiting sequence");
            let ri = s.req;
            let r = self.reqs[ri].as_ref().expect("live request");
            let reserve = if !r.forked { r.n } else { 1 };
            if self.running.len() + reserve > self.cfg.max_running_requests {
                break;
            }
            // Adapter slots: the running set plus this one must fit.
            if let Some(k) = r.adapter {
                if !self.running_adapters.contains_key(&k) {
                    self.keys_buf.clear();
                    self.keys_buf.extend(self.running_adapters.keys().map(|&k| Some(k)));
                    self.keys_buf.push(Some(k));
                    if self.manager.validate_batch(&self.keys_buf).is_err() {
                        if strict {
                            break;
                        }
                        continue;
                    }
                }
            }
            // KV blocks for the first chunk after prefix-cache hits.
            let max_match = (s.tokens.len() - 1) / bs;
            self.pool.match_prefix(r.adapter, &s.tokens, max_match, &mut self.match_buf);
            let matched = self.match_buf.len();
            let idle_matched = self.match_buf.iter().filter(|&&b| self.pool.refs(b) == 0).count();
            let start = matched * bs;
            let chunk = (s.tokens.len() - start).min(*budget).min(self.cfg.chunked_prefill_size);
            let need = (start + chunk).div_ceil(bs) - matched;
            if self.pool.available() < idle_matched + need + watermark {
                break;
            }
            // Admit.
            self.counters.prefix_queries += max_match as u64;
            self.counters.prefix_hits += matched as u64;
            let matched_blocks = std::mem::take(&mut self.match_buf);
            for &b in &matched_blocks {
                self.pool.retain(b);
            }
            let order = self.next_order;
            self.next_order += 1;
            let s = self.seq_mut(si);
            s.blocks.extend_from_slice(&matched_blocks);
            s.num_computed = start;
            s.num_registered = matched;
            s.chain_ok = true;
            if s.order == 0 {
                s.order = order;
            }
            self.match_buf = matched_blocks;
            for _ in 0..need {
                let b = self.pool.allocate().expect("checked available");
                self.seq_mut(si).blocks.push(b);
            }
            self.insert_running(si);
            let r = self.req_mut(ri);
            if !r.started {
                r.started = true;
                self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            }
            self.sched.push((si, chunk));
            self.seq_mut(si).scheduled = true;
            *budget -= chunk;
            admitted_q.push(qi);
        }
        if !admitted_q.is_empty() {
            admitted_q.sort_unstable();
            for &qi in admitted_q.iter().rev() {
                self.waiting.remove(qi);
            }
        }
    }

    /// One engine step. False when nothing could be scheduled.
    fn step(&mut self) -> bool {
        self.step_no += 1;
        if !self.schedule() {
            return false;
        }
        // Build the batch.
        self.batch.clear(self.stride);
        self.seq_adapters.clear();
        for &(si, chunk) in &self.sched {
            let s = self.seqs[si].as_ref().expect("scheduled sequence");
            let end = s.num_computed + chunk;
            let want = if end == s.tokens.len() { LogitsFor::Last } else { LogitsFor::None };
            self.batch.push_seq(&s.tokens[s.num_computed..end], s.num_computed, &s.blocks, want);
            self.seq_adapters.push(self.reqs[s.req].as_ref().expect("live request").adapter);
            if !(chunk == 1 && end == s.tokens.len()) {
                self.counters.prefill_tokens += chunk as u64;
            }
        }
        // Forward.
        let any_lora = self.seq_adapters.iter().any(|a| a.is_some());
        if any_lora {
            self.count_slot_loads();
            let hook = self.manager.prepare_batch(&self.seq_adapters, &self.batch.seq_starts, &self.batch.logits_rows);
            match hook {
                Ok(hook) => {
                    self.model.forward(&self.batch, &mut self.kv, &mut self.ws, &hook as &dyn LoraHook);
                }
                Err(e) => {
                    self.fail_unresident(e);
                    for &(si, _) in &self.sched {
                        if let Some(s) = self.seqs[si].as_mut() {
                            s.scheduled = false;
                        }
                    }
                    return true;
                }
            }
        } else {
            self.model.forward(&self.batch, &mut self.kv, &mut self.ws, &NoLora);
        }
        // Sample and stream.
        let vocab = self.model.config.vocab_size;
        let mut row = 0;
        let sched = std::mem::take(&mut self.sched);
        let mut logits = std::mem::take(&mut self.logits_buf);
        logits.resize(vocab, 0.0);
        for &(si, chunk) in &sched {
            let s = self.seq_mut(si);
            s.scheduled = false;
            s.num_computed += chunk;
            let wants = s.num_computed == s.tokens.len();
            self.register_blocks(si);
            if wants {
                logits.copy_from_slice(&self.ws.host_logits[row * vocab..(row + 1) * vocab]);
                row += 1;
                self.sample_seq(si, &logits);
            }
        }
        self.logits_buf = logits;
        self.sched = sched;
        self.sched.clear();
        true
    }

    fn count_slot_loads(&mut self) {
        self.keys_buf.clear();
        for k in self.seq_adapters.iter().flatten() {
            if !self.keys_buf.contains(&Some(*k)) {
                self.keys_buf.push(Some(*k));
            }
        }
        let mut loads = 0;
        for k in self.keys_buf.iter().flatten() {
            if !self.manager.is_resident(*k) {
                loads += 1;
            }
        }
        if loads > 0 {
            let resident = self.manager.resident().len();
            let free = self.manager.pool().num_slots() - resident;
            self.counters.slot_loads += loads;
            self.counters.slot_evictions += loads.saturating_sub(free as u64);
        }
    }

    /// `prepare_batch` failed (e.g. an evicted adapter's files changed on disk): fail the
    /// requests whose adapter could not be made resident.
    fn fail_unresident(&mut self, e: LoraError) {
        tracing::warn!("LoRA batch preparation failed: {e}");
        let bad: Vec<AdapterKey> = self.seq_adapters.iter().flatten().copied().filter(|k| !self.manager.is_resident(*k)).collect();
        for ri in 0..self.reqs.len() {
            let hit = self.reqs[ri].as_ref().is_some_and(|r| r.adapter.is_some_and(|k| bad.contains(&k)));
            if hit {
                self.abort_request(ri, Some(format!("LoRA adapter could not be loaded into a slot: {e}")));
            }
        }
    }

    fn register_blocks(&mut self, si: usize) {
        if !self.pool.prefix_cache_enabled() {
            return;
        }
        let bs = self.pool.block_size();
        let s = self.seqs[si].as_mut().expect("live sequence");
        if !s.chain_ok {
            return;
        }
        let root = self.reqs[s.req].as_ref().expect("live request").adapter;
        let full = s.num_computed / bs;
        while s.num_registered < full {
            let b = s.num_registered;
            let parent = if b == 0 { Parent::Root(root) } else { Parent::Block(s.blocks[b - 1]) };
            if !self.pool.register(s.blocks[b], parent, &s.tokens[b * bs..(b + 1) * bs]) {
                s.chain_ok = false;
                return;
            }
            s.num_registered += 1;
        }
    }

    /// The first sample of an `n > 1` request forks the other samples, sharing the prompt's
    /// full blocks; each recomputes only the partial last prompt block in its own block.
    fn fork(&mut self, si: usize) -> Vec<usize> {
        let ri = self.seq(si).req;
        let bs = self.pool.block_size();
        let (n, prompt_len, params) = {
            let r = self.req(ri);
            (r.n, r.prompt_len, r.params.clone())
        };
        self.req_mut(ri).forked = true;
        let full = prompt_len / bs;
        let (shared, registered, chain_ok, prompt) = {
            let s = self.seq(si);
            (s.blocks[..full].to_vec(), s.num_registered.min(full), s.chain_ok || s.num_registered >= full, s.tokens[..prompt_len].to_vec())
        };
        let mut out = vec![si];
        for index in 1..n {
            for &b in &shared {
                self.pool.retain(b);
            }
            let p = SamplingParams { seed: params.seed.map(|x| x.wrapping_add(index as u64)), ..params.clone() };
            let order = self.next_order;
            self.next_order += 1;
            let child = self.new_seq(Seq {
                req: ri,
                index,
                tokens: prompt.clone(),
                num_computed: full * bs,
                blocks: shared.clone(),
                num_registered: registered,
                chain_ok,
                sampler: Sampler::new(p, &prompt),
                detok: Detok::new(prompt_len),
                stop: StopScan::default(),
                order,
                running: false,
                waiting_since: self.step_no,
                scheduled: false,
            });
            self.insert_running(child);
            self.req_mut(ri).seq_ids.push(child);
            out.push(child);
        }
        out
    }

    fn sample_seq(&mut self, si: usize, logits: &[f32]) {
        let ri = self.seq(si).req;
        if !self.req(ri).forked {
            for s in self.fork(si) {
                self.sample_one(s, logits);
            }
        } else {
            self.sample_one(si, logits);
        }
    }

    fn sample_one(&mut self, si: usize, logits: &[f32]) {
        let mut work = std::mem::take(&mut self.work_buf);
        work.clear();
        work.extend_from_slice(logits);
        let ri = self.seq(si).req;
        let tokenizer = self.tokenizer.clone();
        let eos_hit;
        let (tok, logprob) = {
            let s = self.seqs[si].as_mut().expect("live sequence");
            let r = self.reqs[ri].as_ref().expect("live request");
            s.sampler.apply_penalties(&mut work);
            let tok = s.sampler.sample(&work);
            let lp = r.logprobs.map(|k| {
                let mut top = Vec::new();
                let lp = sampling::logprobs(&work, tok, k, &mut top);
                TokenLogprob { logprob: lp, top }
            });
            s.sampler.observe(tok);
            s.tokens.push(tok);
            eos_hit = r.stop_ids.contains(&tok) || (!r.ignore_eos && self.eos.contains(&tok));
            (tok, lp)
        };
        self.work_buf = work;
        self.counters.generated += 1;
        let s = self.seqs[si].as_mut().expect("live sequence");
        let r = self.reqs[ri].as_ref().expect("live request");
        let completion = s.tokens.len() - r.prompt_len;
        let mut text = String::new();
        let mut finish = None;
        if eos_hit {
            // The stop token's own text is never shown; release what was held back.
            let n = s.tokens.len();
            if let Some(t) = s.detok.flush(&tokenizer, &s.tokens[..n - 1]) {
                s.stop.push(&t, &r.stop, &mut text);
            }
            s.stop.flush(&mut text);
            finish = Some(FinishReason::Stop);
        } else {
            if let Some(t) = s.detok.step(&tokenizer, &s.tokens) {
                if s.stop.push(&t, &r.stop, &mut text) {
                    finish = Some(FinishReason::Stop);
                }
            }
            if finish.is_none() && completion >= r.max_tokens {
                if let Some(t) = s.detok.flush(&tokenizer, &s.tokens) {
                    if s.stop.push(&t, &r.stop, &mut text) {
                        finish = Some(FinishReason::Stop);
                    }
                }
                if finish.is_none() {
                    s.stop.flush(&mut text);
                    finish = Some(FinishReason::Length);
                }
            }
        }
        let _ = r.tx.send(StreamEvent::Token { index: s.index, token_id: tok, text, logprob });
        if let Some(reason) = finish {
            self.end_seq(si, reason);
        }
    }

    fn publish_stats(&mut self) {
        let mut st = self.shared.stats.lock().unwrap();
        st.running_seqs = self.running.len();
        st.kv_blocks_used = self.pool.num_in_use();
        st.kv_blocks_cached = self.pool.num_cached_idle();
        st.kv_blocks_free = self.pool.num_free();
        st.prefix_cache_queries = self.counters.prefix_queries;
        st.prefix_cache_hits = self.counters.prefix_hits;
        st.adapter_loads = self.counters.adapter_loads;
        st.adapter_load_failures = self.counters.adapter_load_failures;
        st.lora_slot_loads = self.counters.slot_loads;
        st.lora_slot_evictions = self.counters.slot_evictions;
        st.preemptions = self.counters.preemptions;
        st.steps = self.step_no;
        st.generated_tokens = self.counters.generated;
        st.prefill_tokens = self.counters.prefill_tokens;
        st.running = 0;
        st.waiting = 0;
        for a in st.per_adapter.iter_mut() {
            a.running = 0;
            a.waiting = 0;
        }
        let pending: usize = self.pending_load.values().map(|v| v.len()).sum();
        st.waiting += pending;
        for r in self.reqs.iter().flatten() {
            let running = r.seq_ids.iter().any(|&s| self.seqs[s].as_ref().is_some_and(|s| s.running));
            if running {
                st.running += 1;
            } else {
                st.waiting += 1;
            }
            if let Some(name) = &r.adapter_name {
                let e = match st.per_adapter.iter().position(|a| a.name == **name) {
                    Some(p) => &mut st.per_adapter[p],
                    None => {
                        st.per_adapter.push(AdapterStats { name: name.to_string(), ..Default::default() });
                        st.per_adapter.last_mut().unwrap()
                    }
                };
                if running {
                    e.running += 1;
                } else {
                    e.waiting += 1;
                }
            }
        }
        for (name, v) in &self.pending_load {
            match st.per_adapter.iter().position(|a| a.name == *name) {
                Some(p) => st.per_adapter[p].waiting += v.len(),
                None => st.per_adapter.push(AdapterStats { name: name.clone(), running: 0, waiting: v.len() }),
            }
        }
        st.per_adapter.retain(|a| a.running + a.waiting > 0);
    }
}
