//! What the HTTP layer needs from the engine, as a trait: the real engine implements it in
//! [`crate::engine_backend`], and tests use a small mock. Keeping the seam narrow means the
//! HTTP code never waits on engine internals and can be tested without a model.

use futures::Stream;
use quiver_engine::SamplingParams;
use std::path::PathBuf;
use std::pin::Pin;

/// One generation request as the HTTP layer hands it to the engine.
#[derive(Clone, Debug, PartialEq)]
pub struct GenRequest {
    pub prompt: Vec<u32>,
    /// Registered adapter name; `None` = base model.
    pub adapter: Option<String>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Number of top alternatives to report per token (`Some(0)` = only the chosen token).
    pub logprobs: Option<usize>,
    /// Completions sampled from this prompt; events carry `index` in `0..n`.
    pub n: usize,
    /// Score the prompt: logprobs of prompt tokens `1..` with this many top alternatives
    /// (an [`Event::PromptLogprobs`] before the first token). With it `max_tokens` may be 0.
    pub prompt_logprobs: Option<usize>,
    pub min_tokens: usize,
    pub include_stop_str_in_output: bool,
    pub skip_special_tokens: bool,
    pub constraint: Option<quiver_engine::Constraint>,
}

// The engine's own event payload types: the HTTP layer renders them as they are.
pub use quiver_engine::{FinishReason, StopReason, TokenLogprob};

#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Token { index: usize, token_id: u32, text: String, logprob: Option<TokenLogprob> },
    /// Logprobs of prompt tokens `1..`, once, before the first token.
    PromptLogprobs(Vec<TokenLogprob>),
    Finished { index: usize, reason: FinishReason, stop_reason: Option<StopReason>, prompt_tokens: usize, completion_tokens: usize },
    Error(String),
}

/// Events of one submitted request; dropping it cancels the request.
pub type EventStream = Pin<Box<dyn Stream<Item = Event> + Send>>;

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SubmitError {
    #[error("the server is overloaded: the request queue is full")]
    QueueFull,
    #[error("the adapter `{0}` is not loaded")]
    UnknownAdapter(String),
    #[error("this model's maximum context length is {max} tokens; the request needs {needed} tokens ({prompt} in the prompt, {completion} in the completion)")]
    TooLong { prompt: usize, completion: usize, needed: usize, max: usize },
    #[error("{0}")]
    Invalid(String),
    /// The structured-output constraint does not compile.
    #[error("{0}")]
    InvalidConstraint(String),
    #[error("the server is shutting down")]
    ShuttingDown,
}

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum AdapterError {
    #[error("the adapter `{0}` is already loaded")]
    AlreadyLoaded(String),
    #[error("version mismatch for `{name}`: expected {expected}, current is {}", actual.map_or("none (not loaded)".to_string(), |v| v.to_string()))]
    VersionMismatch { name: String, expected: u64, actual: Option<u64> },
    #[error("the adapter `{0}` is being loaded; retry when that load has finished")]
    Busy(String),
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Invalid(String),
}

#[derive(Clone, Debug, PartialEq)]
pub struct AdapterInfo {
    pub name: String,
    pub path: PathBuf,
    pub version: u64,
    pub pinned: bool,
    pub rank: usize,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct AdapterStats {
    pub name: String,
    pub running: usize,
    pub waiting: usize,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    pub running: usize,
    pub waiting: usize,
    /// Fraction of KV blocks in use, 0..=1.
    pub kv_usage: f64,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub adapters: Vec<AdapterStats>,
    /// Adapter loads from disk (replaces included), and failed ones.
    pub adapter_loads: u64,
    pub adapter_load_failures: u64,
    /// Adapter loads into the LoRA slot pool, and those that evicted a resident adapter.
    pub slot_loads: u64,
    pub adapter_evictions: u64,
    pub max_loras: usize,
    pub preemptions: u64,
}

/// The engine as the HTTP layer sees it. Calls may block briefly (they talk to the engine
/// thread); the server calls the adapter-management ones from `spawn_blocking`.
pub trait Backend: Send + Sync + 'static {
    /// Architecture name, for `/get_model_info`.
    fn model_type(&self) -> String;
    fn max_model_len(&self) -> usize;
    /// The most bytes of text one token stands for: text longer than this times
    /// `max_model_len` is refused without tokenizing it.
    fn max_token_bytes(&self) -> usize;
    /// Requests the engine queues at most (a request with more prompts can never be taken).
    fn max_queued_requests(&self) -> usize;
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String>;
    /// Text of one token for logprob reports.
    fn token_text(&self, id: u32) -> String;
    /// Text of a token sequence (special tokens kept), for echoing token-id prompts.
    fn decode(&self, ids: &[u32]) -> String;
    fn has_chat_template(&self) -> bool;
    /// Renders the chat template; `extra` are further template variables (`documents`,
    /// `chat_template_kwargs`), `template` a request's own template source.
    fn render_chat(&self, messages: &[quiver_model::chat::ChatMessage], add_generation_prompt: bool, extra: serde_json::Map<String, serde_json::Value>, template: Option<&str>) -> Result<String, String>;
    fn submit(&self, req: GenRequest) -> Result<EventStream, SubmitError>;
    fn load_adapter(&self, name: &str, path: &std::path::Path, pinned: bool, load_inplace: bool, expected_version: Option<u64>) -> Result<AdapterInfo, AdapterError>;
    fn unload_adapter(&self, name: &str) -> Result<(), AdapterError>;
    fn adapters(&self) -> Vec<AdapterInfo>;
    fn stats(&self) -> Stats;
    /// Stop accepting work; running requests continue.
    fn shutdown(&self);
}
