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
}

impl EngineBackend {
    pub fn start(model: LoadedModel, cfg: EngineConfig) -> anyhow::Result<Self> {
        let model_type = format!("{:?}", model.model.config.arch).to_lowercase();
        Ok(EngineBackend { handle: Engine::start(model, cfg)?, model_type })
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
        StreamEvent::Finished { index, reason, prompt_tokens, completion_tokens } => Event::Finished { index, reason, prompt_tokens, completion_tokens },
        StreamEvent::Error(s) => Event::Error(s),
    }
}

fn conv_submit_err(e: quiver_engine::SubmitError) -> SubmitError {
    use quiver_engine::SubmitError as E;
    match e {
        E::QueueFull { .. } => SubmitError::QueueFull,
        E::UnknownAdapter(a) => SubmitError::UnknownAdapter(a),
        E::PromptTooLong { prompt_tokens, max_tokens, max_model_len } => SubmitError::TooLong { prompt: prompt_tokens, completion: max_tokens, needed: prompt_tokens + max_tokens, max: max_model_len },
        E::Invalid(m) => SubmitError::Invalid(m),
        E::ShuttingDown => SubmitError::ShuttingDown,
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
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String> {
        self.handle.tokenizer().encode(text, add_special_tokens).map_err(|e| e.to_string())
    }
    fn token_text(&self, id: u32) -> String {
        self.handle.tokenizer().decode(&[id], false).unwrap_or_default()
    }
    fn has_chat_template(&self) -> bool {
        self.handle.tokenizer().chat_template().is_some()
    }
    fn render_chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, String> {
        let t = self.handle.tokenizer().chat_template().ok_or("this model has no chat template")?;
        t.render(messages, add_generation_prompt).map_err(|e| format!("{e:#}"))
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
        };
        let rs = self.handle.submit(req).map_err(conv_submit_err)?;
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
    fn shutdown(&self) {
        self.handle.shutdown();
    }
    fn embedding_info(&self) -> Option<quiver_model::EmbeddingSpec> {
        self.handle.embedding_spec().cloned()
    }
    fn embed(&self, r: EmbedInput) -> Result<EmbedFuture, SubmitError> {
        let req = quiver_engine::EmbedRequest { input: r.input, adapter: r.adapter, dimensions: r.dimensions, normalize: r.normalize };
        let s = self.handle.submit_embed(req).map_err(conv_submit_err)?;
        Ok(Box::pin(s.result()))
    }
}
