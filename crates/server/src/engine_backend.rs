//! [`Backend`] over the real engine ([`quiver_engine::EngineHandle`]).

use std::path::Path;

use futures::StreamExt;
use quiver_engine::{Engine, EngineConfig, EngineHandle, GenerateRequest, StreamEvent};
use quiver_model::chat::ChatMessage;
use quiver_model::LoadedModel;

use crate::adapters::StartupAdapter;
use crate::backend::*;

pub struct EngineBackend {
    pub handle: EngineHandle,
    model_type: String,
    max_token_bytes: usize,
}

/// The longest text any single token decodes to, plus one byte for the space a SentencePiece
/// piece may stand for but not decode to on its own.
fn max_token_bytes(t: &quiver_model::tokenizer::Tokenizer) -> usize {
    (0..t.vocab_size() as u32).map(|id| t.decode(&[id], false).map_or(0, |s| s.len())).max().unwrap_or(0).max(1) + 1
}

impl EngineBackend {
    pub fn start(model: LoadedModel, cfg: EngineConfig) -> anyhow::Result<Self> {
        let model_type = format!("{:?}", model.model.config.arch).to_lowercase();
        let max_token_bytes = max_token_bytes(&model.tokenizer);
        Ok(EngineBackend { handle: Engine::start(model, cfg)?, model_type, max_token_bytes })
    }

    /// Adapters from the command line: operator-given paths, not sandboxed.
    pub fn load_startup(&self, a: &StartupAdapter) -> anyhow::Result<AdapterInfo> {
        self.handle.load_adapter_blocking(&a.name, &a.path, a.pinned, false, None).map(conv_info).map_err(|e| anyhow::anyhow!("{e}"))
    }
}

fn conv_info(a: quiver_engine::AdapterInfo) -> AdapterInfo {
    AdapterInfo { name: a.name, path: a.path, version: a.version, pinned: a.pinned, rank: a.rank }
}

fn conv_event(e: StreamEvent) -> Event {
    match e {
        StreamEvent::Token { index, token_id, text, logprob } => {
            Event::Token { index, token_id, text, logprob }
        }
        StreamEvent::PromptLogprobs(l) => Event::PromptLogprobs(l),
        StreamEvent::Finished { index, reason, stop_reason, prompt_tokens, completion_tokens } => Event::Finished { index, reason, stop_reason, prompt_tokens, completion_tokens },
        StreamEvent::Error(s) => Event::Error(s),
    }
}

fn conv_adapter_err(e: quiver_engine::AdapterError) -> AdapterError {
    use quiver_engine::AdapterError as E;
    match e {
        E::AlreadyLoaded(n) => AdapterError::AlreadyLoaded(n),
        E::VersionMismatch { name, expected, actual } => AdapterError::VersionMismatch { name, expected, actual },
        E::NotFound(n) => AdapterError::NotFound(format!("The lora adapter '{n}' cannot be found.")),
        E::Busy(n) => AdapterError::Busy(n),
        E::Invalid(m) => AdapterError::Invalid(m),
        E::ShuttingDown => AdapterError::ShuttingDown,
    }
}

impl Backend for EngineBackend {
    fn model_type(&self) -> String {
        self.model_type.clone()
    }
    fn max_model_len(&self) -> usize {
        self.handle.max_model_len()
    }
    fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }
    fn max_queued_requests(&self) -> usize {
        self.handle.config().max_queued_requests
    }
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String> {
        self.handle.tokenizer().encode(text, add_special_tokens).map_err(|e| e.to_string())
    }
    fn token_text(&self, id: u32) -> String {
        self.handle.tokenizer().decode(&[id], false).unwrap_or_default()
    }
    fn has_chat_template(&self) -> bool {
        self.handle.tokenizer().chat_template().is_some()
    }
    fn decode(&self, ids: &[u32]) -> String {
        self.handle.tokenizer().decode(ids, false).unwrap_or_default()
    }
    fn render_chat(&self, messages: &[ChatMessage], add_generation_prompt: bool, extra: serde_json::Map<String, serde_json::Value>, template: Option<&str>) -> Result<String, String> {
        let tok = self.handle.tokenizer();
        let own;
        let t = match template {
            Some(src) => {
                let name = |id: Option<u32>| id.and_then(|i| tok.id_to_token(i));
                own = quiver_model::chat::ChatTemplate::new(src, name(tok.bos_token_id()), name(tok.eos_token_ids().first().copied())).map_err(|e| format!("{e:#}"))?;
                &own
            }
            None => tok.chat_template().ok_or("this model has no chat template")?,
        };
        t.render_with(messages, add_generation_prompt, extra).map_err(|e| format!("{e:#}"))
    }
    fn submit(&self, r: GenRequest) -> Result<EventStream, SubmitError> {
        let n = r.n;
        let req = GenerateRequest {
            prompt: r.prompt,
            adapter: r.adapter,
            sampling: r.sampling,
            max_tokens: r.max_tokens,
            stop: r.stop,
            stop_token_ids: r.stop_token_ids,
            ignore_eos: r.ignore_eos,
            logprobs: r.logprobs,
            n,
            prompt_logprobs: r.prompt_logprobs,
            min_tokens: r.min_tokens,
            include_stop_str_in_output: r.include_stop_str_in_output,
            skip_special_tokens: r.skip_special_tokens,
            constraint: r.constraint,
        };
        let rs = self.handle.submit(req).map_err(|e| {
            use quiver_engine::SubmitError as E;
            match e {
                E::QueueFull { .. } => SubmitError::QueueFull,
                E::UnknownAdapter(a) => SubmitError::UnknownAdapter(a),
                E::PromptTooLong { prompt_tokens, max_tokens, max_model_len } => {
                    SubmitError::TooLong { prompt: prompt_tokens, completion: max_tokens, needed: prompt_tokens + max_tokens, max: max_model_len }
                }
                E::Invalid(m) => SubmitError::Invalid(m),
                E::InvalidConstraint(m) => SubmitError::InvalidConstraint(m),
                E::ShuttingDown => SubmitError::ShuttingDown,
            }
        })?;
        // Ends after every sample finished, even if the engine keeps its sender a while.
        let s = futures::stream::unfold((rs, 0usize), move |(mut rs, done)| async move {
            if done >= n {
                return None;
            }
            let ev = rs.recv().await?;
            let done = done + matches!(ev, StreamEvent::Finished { .. }) as usize;
            Some((conv_event(ev), (rs, done)))
        });
        Ok(s.boxed())
    }
    fn load_adapter(&self, name: &str, path: &Path, pinned: bool, load_inplace: bool, expected_version: Option<u64>) -> Result<AdapterInfo, AdapterError> {
        self.handle.load_adapter_blocking(name, path, pinned, load_inplace, expected_version).map(conv_info).map_err(conv_adapter_err)
    }
    fn unload_adapter(&self, name: &str) -> Result<(), AdapterError> {
        self.handle.unload_adapter(name).map_err(conv_adapter_err)
    }
    fn adapters(&self) -> Vec<AdapterInfo> {
        self.handle.adapters().into_iter().map(conv_info).collect()
    }
    fn stats(&self) -> Stats {
        let s = self.handle.stats();
        Stats {
            running: s.running,
            waiting: s.waiting,
            kv_usage: if s.kv_blocks_total == 0 { 0.0 } else { s.kv_blocks_used as f64 / s.kv_blocks_total as f64 },
            prefix_cache_queries: s.prefix_cache_queries,
            prefix_cache_hits: s.prefix_cache_hits,
            adapters: s.per_adapter.into_iter().map(|a| AdapterStats { name: a.name, running: a.running, waiting: a.waiting }).collect(),
            adapter_loads: s.adapter_loads,
            adapter_load_failures: s.adapter_load_failures,
            slot_loads: s.lora_slot_loads,
            adapter_evictions: s.lora_slot_evictions,
            max_loras: s.max_loras,
            preemptions: s.preemptions,
        }
    }
    /// Waits for the engine thread to end: it owns the model and the LoRA pool, and on a GPU the
    /// process must not exit (tearing the CUDA driver down) while that thread still frees device
    /// memory (the H200 check saw a segfault after "quiver: stopped" without this).
    fn shutdown(&self) {
        self.handle.shutdown_and_join();
    }
}
