//! Tokenization and chat-template rendering off the async workers. Both are CPU work that
//! grows with the input (two 31 MB prompts once froze `/health` for 53 s on the two tokio
//! workers), so they run on tokio's blocking threads, at most one per core at a time, after a
//! cheap length check has refused input that cannot fit the context window anyway.

use std::sync::{Arc, OnceLock};

use tokio::sync::Semaphore;

use crate::error::ApiError;
use crate::limits::check_prompt_bytes;
use crate::request::ChatRequest;
use crate::server::AppState;

/// Tokenizations running at once: the cores. More would only queue inside the OS scheduler
/// and slow the engine thread down; fewer would leave cores idle.
fn permits() -> &'static Semaphore {
    static P: OnceLock<Semaphore> = OnceLock::new();
    P.get_or_init(|| Semaphore::new(std::thread::available_parallelism().map_or(2, |n| n.get())))
}

/// Runs `f` on a blocking thread under the pool's permit.
async fn on_pool<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, ApiError> {
    let _permit = permits().acquire().await.map_err(|_| ApiError::internal("the tokenizer pool is closed"))?;
    tokio::task::spawn_blocking(f).await.map_err(|e| ApiError::internal(format!("tokenization failed: {e}")))
}

/// Token ids of `text` (the prompt field `param`).
pub async fn encode(st: &Arc<AppState>, param: &str, text: &str, add_special: bool) -> Result<Vec<u32>, ApiError> {
    let b = &st.backend;
    check_prompt_bytes(param, text.len(), b.max_token_bytes(), b.max_model_len())?;
    let (b, text) = (b.clone(), text.to_string());
    on_pool(move || b.encode(&text, add_special)).await?.map_err(|e| ApiError::bad_request(format!("tokenization failed: {e}")))
}

/// A chat request's prompt: its template rendering (`chat::render_prompt`), tokenized. The
/// rendered text holds every message's content, so their total length bounds it from below.
pub async fn encode_chat(st: &Arc<AppState>, r: &ChatRequest) -> Result<Vec<u32>, ApiError> {
    let b = &st.backend;
    let content: usize = r.messages.iter().map(|m| m.content.len() + m.role.len()).sum();
    check_prompt_bytes("messages", content, b.max_token_bytes(), b.max_model_len())?;
    let (st, r) = (st.clone(), r.clone());
    on_pool(move || {
        let text = crate::chat::render_prompt(&st, &r)?;
        st.backend.encode(&text, r.add_special_tokens).map_err(|e| ApiError::bad_request(format!("tokenization failed: {e}")))
    })
    .await?
}
