//! The engine's public request/response types.

use crate::sampling::SamplingParams;
use crate::structured::Constraint;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedReceiver;

#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    /// Adapter name; `None` = base model.
    pub adapter: Option<String>,
    /// Each sample owns an RNG seeded from `sampling.seed` (+ its index), so its draws do not
    /// depend on what else is batched with it. (The batched forward's logits may differ from a
    /// lone run in the last float bits, which can only matter for a draw landing on a boundary.)
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    /// Stop strings: generation ends before the first occurrence, which is never streamed.
    pub stop: Vec<String>,
    /// Extra stop ids (honoured even with `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// Keep going past the tokenizer's EOS ids.
    pub ignore_eos: bool,
    /// `Some(k)`: report the chosen token's logprob and the top `k` (`Some(0)` = chosen only).
    pub logprobs: Option<usize>,
    /// Parallel samples sharing the prompt's KV blocks; sample `i` uses seed `seed + i`.
    pub n: usize,
    /// `Some(k)`: the logprob of every prompt token after the first under the model (raw
    /// logits, as vLLM's `prompt_logprobs`), with the top `k`; sent as one
    /// [`StreamEvent::PromptLogprobs`] before any token. A request asking for them never
    /// reads the prefix cache for rows still to be scored (the rows must run to be scored).
    pub prompt_logprobs: Option<usize>,
    /// EOS and `stop_token_ids` cannot end the sequence, nor stop strings match, before this
    /// many tokens were generated (vLLM's `min_tokens`).
    pub min_tokens: usize,
    /// A matched stop string, or the text of a matched stop token, stays in the output.
    pub include_stop_str_in_output: bool,
    /// Leave special tokens' text out of the streamed text (the default).
    pub skip_special_tokens: bool,
    /// Structured output: what the generated text must match (compiled at submission; an
    /// invalid one is `SubmitError::InvalidConstraint`).
    pub constraint: Option<Constraint>,
}

impl Default for GenerateRequest {
    fn default() -> Self {
        GenerateRequest {
            prompt: Vec::new(),
            adapter: None,
            sampling: SamplingParams::default(),
            max_tokens: 16,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            n: 1,
            prompt_logprobs: None,
            min_tokens: 0,
            include_stop_str_in_output: false,
            skip_special_tokens: true,
            constraint: None,
        }
    }
}

/// One input to embed (an engine started with `Task::Embed`). Inputs submitted together are
/// batched in the same forward passes, whatever their adapters.
#[derive(Clone, Debug, Default)]
pub struct EmbedRequest {
    /// Token ids, instruction prefix and special tokens included.
    pub input: Vec<u32>,
    /// Adapter name; `None` = base model.
    pub adapter: Option<String>,
    /// Matryoshka truncation to this many dimensions (before normalisation).
    pub dimensions: Option<usize>,
    /// Overrides the model's normalisation (vLLM's `normalize`).
    pub normalize: Option<bool>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// Log-probability of the chosen token (after penalties, before temperature).
    pub logprob: f32,
    /// `(token id, logprob)` of the most likely tokens, best first.
    pub top: Vec<(u32, f32)>,
    /// 1-based rank of the chosen token among all tokens (vLLM's `rank`).
    pub rank: u32,
}

/// What ended a sequence with [`FinishReason::Stop`], as vLLM's `stop_reason` reports it
/// (`None` there means EOS).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// One of the request's `stop_token_ids`.
    Token(u32),
    /// One of the request's stop strings.
    Text(String),
    /// The constraint's grammar reached a dead end (with [`FinishReason::Abort`]).
    Grammar(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token id or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// Cancelled, or failed (an `Error` event precedes it).
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

#[derive(Clone, Debug)]
pub enum StreamEvent {
    /// One generated token of sample `index`. Every generated token gets exactly one event
    /// (the final EOS / stop-id token included, with empty text). `text` is the newly
    /// completed text: never a partial UTF-8 character, never text that might begin a stop
    /// string before that is resolved, never the stop string itself.
    Token { index: usize, token_id: u32, text: String, logprob: Option<TokenLogprob> },
    /// Logprobs of prompt tokens `1..` (see [`GenerateRequest::prompt_logprobs`]); sent once,
    /// before the first `Token`.
    PromptLogprobs(Vec<TokenLogprob>),
    /// Sample `index` is done; `completion_tokens` counts its Token events. `stop_reason` says
    /// which stop id or string ended a `Stop` (none for EOS).
    Finished { index: usize, reason: FinishReason, stop_reason: Option<StopReason>, prompt_tokens: usize, completion_tokens: usize },
    /// The request failed; `Finished { reason: Abort }` follows for each unfinished sample.
    Error(String),
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the waiting queue is full ({max} requests); retry later")]
    QueueFull { max: usize },
    #[error("LoRA adapter `{0}` is not loaded")]
    UnknownAdapter(String),
    #[error("prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the context window of {max_model_len} tokens")]
    PromptTooLong { prompt_tokens: usize, max_tokens: usize, max_model_len: usize },
    #[error("{0}")]
    Invalid(String),
    /// The structured-output constraint does not compile (the message says why).
    #[error("{0}")]
    InvalidConstraint(String),
    #[error("the engine is shutting down")]
    ShuttingDown,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AdapterError {
    #[error("LoRA adapter `{0}` is already loaded (load it in place to replace it)")]
    AlreadyLoaded(String),
    #[error("LoRA adapter `{name}`: expected version {expected}, but the current version is {}", actual.map_or("none (not loaded)".to_string(), |v| v.to_string()))]
    VersionMismatch { name: String, expected: u64, actual: Option<u64> },
    #[error("LoRA adapter `{0}` is not loaded")]
    NotFound(String),
    #[error("LoRA adapter `{0}` is being loaded; retry when that load has finished")]
    Busy(String),
    /// The adapter is malformed or incompatible; the message names the file / tensor.
    #[error("{0}")]
    Invalid(String),
    #[error("the engine is shutting down")]
    ShuttingDown,
}

/// The current version of a loaded adapter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdapterInfo {
    pub name: String,
    pub path: PathBuf,
    /// Unique per load (a replace gets a new one).
    pub version: u64,
    pub pinned: bool,
    /// Largest rank over its modules.
    pub rank: usize,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AdapterStats {
    pub name: String,
    /// Requests with a sequence running / only waiting.
    pub running: usize,
    pub waiting: usize,
}

#[derive(Clone, Debug, Default)]
pub struct EngineStats {
    /// Requests with at least one running sequence.
    pub running: usize,
    /// Requests accepted and not running (queued, preempted, or waiting for their adapter's load).
    pub waiting: usize,
    pub running_seqs: usize,
    pub kv_blocks_total: usize,
    /// Blocks held by sequences.
    pub kv_blocks_used: usize,
    /// Idle blocks kept by the prefix cache (reclaimable).
    pub kv_blocks_cached: usize,
    pub kv_blocks_free: usize,
    pub block_size: usize,
    /// Full prompt blocks looked up in the prefix cache at admission, and how many hit.
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub per_adapter: Vec<AdapterStats>,
    /// Successful adapter loads (including replaces) and failed ones.
    pub adapter_loads: u64,
    pub adapter_load_failures: u64,
    /// LoRA slot loads, and those that evicted a resident adapter.
    pub lora_slot_loads: u64,
    pub lora_slot_evictions: u64,
    pub max_loras: usize,
    pub preemptions: u64,
    pub steps: u64,
    pub generated_tokens: u64,
    /// Prompt tokens run through the model (recomputation included; prefix hits excluded).
    pub prefill_tokens: u64,
    /// Steps whose draws were still in flight when the next step was queued (overlapped
    /// scheduling); the others ran to their end first.
    pub overlapped_steps: u64,
    /// Steps whose logits came to the host (only to score prompt rows: every draw, edited or
    /// not, happens on the model's device).
    pub logits_to_host_steps: u64,
    /// Logits rows edited on the device before their draw (penalties, logit bias, allowed
    /// ids, a `min_tokens` ban, a grammar's mask); a fork's samples share their first row.
    pub edited_rows: u64,
}

/// Engine internals for leak checks and diagnostics (a round trip to the engine thread).
#[derive(Clone, Debug)]
pub struct DebugState {
    pub kv_total: usize,
    pub kv_free: usize,
    pub kv_cached_idle: usize,
    pub kv_in_use: usize,
    /// `Err` describes a broken block-pool invariant.
    pub kv_invariants: Result<(), String>,
    pub requests: usize,
    pub running_seqs: usize,
    pub waiting_seqs: usize,
    pub pending_on_load: usize,
    /// Counter behind `QueueFull`.
    pub queued: usize,
    /// `(name, version, in_flight, current)` of every registered adapter version.
    pub lora_versions: Vec<(String, u64, usize, bool)>,
    /// `(slot, version)` of slot-resident adapters.
    pub lora_resident: Vec<(usize, u64)>,
    pub lora_pinned_slots: usize,
}

/// Stream of one request's events. Dropping it cancels the request (its blocks and slot are
/// freed at the next step).
pub struct RequestStream {
    pub(crate) id: u64,
    pub(crate) rx: UnboundedReceiver<StreamEvent>,
    pub(crate) cancel: CancelGuard,
    pub(crate) n: usize,
    pub(crate) prompt_tokens: usize,
}

pub(crate) struct CancelGuard {
    pub flag: Arc<AtomicBool>,
    pub wake: std::sync::mpsc::Sender<crate::engine::Msg>,
}

impl CancelGuard {
    fn cancel(&self) {
        if !self.flag.swap(true, Ordering::SeqCst) {
            let _ = self.wake.send(crate::engine::Msg::Wake);
        }
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        self.cancel();
    }
}

/// Everything a request produced, gathered by [`RequestStream::collect_blocking`].
#[derive(Clone, Debug, Default)]
pub struct Completion {
    pub tokens: Vec<Vec<u32>>,
    pub text: Vec<String>,
    pub logprobs: Vec<Vec<TokenLogprob>>,
    pub prompt_logprobs: Option<Vec<TokenLogprob>>,
    pub finish: Vec<Option<FinishReason>>,
    pub stop_reason: Vec<Option<StopReason>>,
    pub prompt_tokens: usize,
    pub error: Option<String>,
}

impl RequestStream {
    pub fn id(&self) -> u64 {
        self.id
    }
    pub fn n(&self) -> usize {
        self.n
    }
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }
    pub async fn recv(&mut self) -> Option<StreamEvent> {
        self.rx.recv().await
    }
    /// For threads outside an async runtime (CLI, tests).
    pub fn blocking_recv(&mut self) -> Option<StreamEvent> {
        self.rx.blocking_recv()
    }
    pub fn try_recv(&mut self) -> Option<StreamEvent> {
        self.rx.try_recv().ok()
    }
    /// Cancels now (same as dropping the stream, but keeps receiving what is in flight).
    pub fn cancel(&self) {
        self.cancel.cancel();
    }
    /// Receives until every sample finished (or the engine went away).
    pub fn collect_blocking(mut self) -> Completion {
        let n = self.n;
        let mut c = Completion {
            tokens: vec![Vec::new(); n],
            text: vec![String::new(); n],
            logprobs: vec![Vec::new(); n],
            prompt_logprobs: None,
            finish: vec![None; n],
            stop_reason: vec![None; n],
            prompt_tokens: self.prompt_tokens,
            error: None,
        };
        let mut done = 0;
        while done < n {
            match self.blocking_recv() {
                Some(StreamEvent::Token { index, token_id, text, logprob }) => {
                    c.tokens[index].push(token_id);
                    c.text[index].push_str(&text);
                    if let Some(l) = logprob {
                        c.logprobs[index].push(l);
                    }
                }
                Some(StreamEvent::PromptLogprobs(lps)) => c.prompt_logprobs = Some(lps),
                Some(StreamEvent::Finished { index, reason, stop_reason, .. }) => {
                    c.finish[index] = Some(reason);
                    c.stop_reason[index] = stop_reason;
                    done += 1;
                }
                Some(StreamEvent::Error(e)) => c.error = Some(e),
                None => break,
            }
        }
        c
    }
}

/// The result of one [`EmbedRequest`]; dropping it cancels the request.
pub struct EmbedStream {
    pub(crate) stream: RequestStream,
    pub(crate) rx: tokio::sync::oneshot::Receiver<Vec<f32>>,
}

impl EmbedStream {
    pub fn prompt_tokens(&self) -> usize {
        self.stream.prompt_tokens
    }
    /// Waits for the embedding (or the reason there is none).
    pub async fn result(mut self) -> Result<Vec<f32>, String> {
        let mut error = None;
        while let Some(ev) = self.stream.recv().await {
            if Self::last(ev, &mut error) {
                break;
            }
        }
        self.take(error)
    }
    /// [`Self::result`] for threads outside an async runtime.
    pub fn blocking_result(mut self) -> Result<Vec<f32>, String> {
        let mut error = None;
        while let Some(ev) = self.stream.blocking_recv() {
            if Self::last(ev, &mut error) {
                break;
            }
        }
        self.take(error)
    }
    /// Notes an error event; true at the request's end.
    fn last(ev: StreamEvent, error: &mut Option<String>) -> bool {
        match ev {
            StreamEvent::Error(e) => *error = Some(e),
            StreamEvent::Finished { .. } => return true,
            _ => {}
        }
        false
    }
    fn take(mut self, error: Option<String>) -> Result<Vec<f32>, String> {
        self.rx.try_recv().map_err(|_| error.unwrap_or_else(|| "the request ended without an embedding".into()))
    }
}
