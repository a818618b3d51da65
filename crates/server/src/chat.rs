//! `POST /v1/chat/completions`: the chat template (with vLLM's `continue_final_message`,
//! `add_generation_prompt`, `documents`, `chat_template`, `chat_template_kwargs`), then one
//! generation per choice, streamed as OpenAI's deltas or collected.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use serde_json::{json, Value};

use crate::backend::Event;
use crate::error::ApiError;
use crate::logprobs::LpRender;
use crate::request::{self, ChatRequest};
use crate::server::{body_bytes, collect, finish_str, now_secs, resolve_adapter, sse_response, stop_reason_json, submit_all, truncate_prompt, usage, with_usage_tail, AppState, Job};

/// The prompt text of a chat request. With `continue_final_message` the rendering is cut
/// right after the final message's content, as transformers' `apply_chat_template` does, so
/// the model continues that message instead of closing it.
pub(crate) fn render_prompt(st: &AppState, r: &ChatRequest) -> Result<String, ApiError> {
    let text = st.backend.render_chat(&r.messages, r.add_generation_prompt, r.template_vars.clone(), r.chat_template.as_deref()).map_err(|e| ApiError::field("messages", format!("chat template: {e}")))?;
    if !r.continue_final_message {
        return Ok(text);
    }
    let last = r.messages.last().map(|m| m.content.trim()).unwrap_or_default();
    match text.rfind(last) {
        Some(at) if !last.is_empty() => Ok(text[..at + last.len()].to_string()),
        _ => Err(ApiError::field("continue_final_message", "`continue_final_message` is set but the final message does not appear in the chat after applying the chat template")),
    }
}

pub(crate) async fn chat_completions(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let body = body_bytes(body)?;
    let r = request::parse_chat(&body)?;
    let adapter = resolve_adapter(&st, r.model.as_deref(), r.lora_path.as_deref()).await?;
    let model_name = r.model.clone().unwrap_or_else(|| st.served().to_string());
    if !st.backend.has_chat_template() && r.chat_template.is_none() {
        return Err(ApiError::bad_request("This model has no chat template; use /v1/completions or give `chat_template`"));
    }
    let (prompt, _) = truncate_prompt(crate::tokenize::encode_chat(&st, &r).await?, r.common.out.truncate_prompt_tokens);
    // vLLM's chat `echo`: the reply starts with the last message when that is the assistant's.
    let echoed = match r.messages.last() {
        Some(m) if r.echo && m.role == "assistant" => m.content.clone(),
        _ => String::new(),
    };
    let (n, stream, include_usage, want_lp, top_n) = (r.common.n, r.common.stream, r.common.include_usage, r.logprobs, r.top_logprobs);
    let continuous = r.common.out.continuous_usage_stats;
    let render_ids = r.common.out.return_tokens_as_token_ids;
    let job = Job { adapter, prompts: vec![prompt.clone()], common: r.common, logprobs: want_lp.then_some(top_n), prompt_logprobs: r.prompt_logprobs, default_max_tokens: None };
    let (merged, prompt_lens) = submit_all(&st, job)?;
    let id = st.new_id("chatcmpl", r.request_id.as_deref());
    let created = now_secs();
    if !stream {
        let got = collect(&st, merged, n, 1).await?;
        let lr = LpRender { st: &st, as_ids: render_ids };
        let completion: usize = got.choices.iter().map(|c| c.completion_tokens).sum();
        let choices: Vec<Value> = got
            .choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let lp = if want_lp { lr.chat(&c.logprobs, top_n) } else { Value::Null };
                json!({"index": i, "message": {"role": "assistant", "content": format!("{echoed}{}", c.text)}, "logprobs": lp, "finish_reason": finish_str(c.finish), "stop_reason": stop_reason_json(&c.stop_reason)})
            })
            .collect();
        let plp = match (&r.prompt_logprobs, &got.prompt_logprobs[0]) {
            (Some(_), Some(l)) => lr.prompt(&prompt, l),
            _ => Value::Null,
        };
        return Ok(Json(json!({"id": id, "object": "chat.completion", "created": created, "model": model_name, "choices": choices, "usage": usage(got.prompt_tokens, completion), "prompt_logprobs": plp})).into_response());
    }
    let st2 = st.clone();
    let (id2, model2) = (id.clone(), model_name.clone());
    let prompt_len = prompt_lens[0];
    let chunk = move |choice: Value, usage_now: Option<Value>| {
        let mut v = json!({"id": id2, "object": "chat.completion.chunk", "created": created, "model": model2, "choices": [choice]});
        if include_usage || usage_now.is_some() {
            v["usage"] = usage_now.unwrap_or(Value::Null);
        }
        v
    };
    let chunk2 = chunk.clone();
    let completion = Arc::new(AtomicUsize::new(0));
    let c2 = completion.clone();
    let first_usage = continuous.then(|| usage(prompt_len, 0));
    let roles = futures::stream::iter((0..n).flat_map(move |i| {
        let mut v = vec![chunk2(json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": Value::Null, "finish_reason": Value::Null}), first_usage.clone())];
        if !echoed.is_empty() {
            v.push(chunk2(json!({"index": i, "delta": {"content": echoed}, "logprobs": Value::Null, "finish_reason": Value::Null}), first_usage.clone()));
        }
        v
    }));
    let mut counts = vec![0usize; n];
    let events = merged.filter_map(move |(_, ev)| {
        let lr = LpRender { st: &st2, as_ids: render_ids };
        let out = match ev {
            Event::PromptLogprobs(_) => None,
            Event::Token { index, token_id, text, logprob } => {
                counts[index] += 1;
                let lp = match (logprob, want_lp) {
                    (Some(l), true) => lr.chat(&[(token_id, l)], top_n),
                    _ => Value::Null,
                };
                Some(chunk(json!({"index": index, "delta": {"content": text}, "logprobs": lp, "finish_reason": Value::Null}), continuous.then(|| usage(prompt_len, counts[index]))))
            }
            Event::Finished { index, reason, stop_reason, completion_tokens, .. } => {
                c2.fetch_add(completion_tokens, Ordering::Relaxed);
                Some(chunk(json!({"index": index, "delta": {}, "logprobs": Value::Null, "finish_reason": reason.as_str(), "stop_reason": stop_reason_json(&stop_reason)}), continuous.then(|| usage(prompt_len, completion_tokens))))
            }
            Event::Error(e) => Some(ApiError::internal(format!("generation failed: {e}")).body()),
        };
        futures::future::ready(out)
    });
    let body = roles.chain(events).boxed();
    Ok(sse_response(&st, with_usage_tail(body, include_usage, completion, id, "chat.completion.chunk", created, model_name, prompt_len)))
}
