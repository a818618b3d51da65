//! `POST /v1/completions` with vLLM's semantics for `echo` and prompt scoring: with `echo`
//! the choice's text and logprobs start with the prompt (a token-id prompt echoes its decoded
//! text; the first prompt token's logprob is `null`), `max_tokens: 0` scores the prompt
//! without generating, and a stream sends the prompt as its first chunk. This is what
//! lm-eval's loglikelihood requests read.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use serde_json::{json, Value};

use crate::backend::{Event, TokenLogprob};
use crate::error::ApiError;
use crate::logprobs::LpRender;
use crate::request::{self, Prompt};
use crate::server::{body_bytes, collect, finish_str, now_secs, resolve_adapter, sse_response, stop_reason_json, submit_all, truncate_prompt, usage, with_usage_tail, AppState, Job};

pub(crate) async fn completions(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let body = body_bytes(body)?;
    let r = request::parse_completion(&body)?;
    let adapter = resolve_adapter(&st, r.model.as_deref(), r.lora_path.as_deref()).await?;
    let model_name = r.model.clone().unwrap_or_else(|| st.served().to_string());
    let trunc = r.common.out.truncate_prompt_tokens;
    let mut prompts = Vec::with_capacity(r.prompts.len());
    let mut prompt_texts = Vec::with_capacity(r.prompts.len());
    for p in &r.prompts {
        let (ids, text) = match p {
            Prompt::Text(t) => (crate::tokenize::encode(&st, "prompt", t, r.add_special_tokens).await?, Some(t.clone())),
            Prompt::Ids(ids) => (ids.clone(), None),
        };
        let (ids, cut) = truncate_prompt(ids, trunc);
        // Echo shows the prompt the model saw: a token-id or truncated prompt as decoded text.
        prompt_texts.push(if r.echo { text.filter(|_| !cut).unwrap_or_else(|| st.backend.decode(&ids)) } else { String::new() });
        prompts.push(ids);
    }
    let (n, np, stream, include_usage, echo) = (r.common.n, prompts.len(), r.common.stream, r.common.include_usage, r.echo);
    let continuous = r.common.out.continuous_usage_stats;
    let want_lp = r.logprobs.is_some();
    // Echo always scores the prompt: the prompt's logprobs (vLLM derives `prompt_logprobs`
    // from `logprobs` under echo) arrive as one event, which is also where a stream sends
    // the prompt's chunk.
    let score = r.prompt_logprobs.or(if echo { Some(r.logprobs.unwrap_or(0)) } else { None });
    let show_prompt_lps = r.prompt_logprobs.is_some();
    let render_ids = r.common.out.return_tokens_as_token_ids;
    let job = Job { adapter, prompts: prompts.clone(), common: r.common, logprobs: r.logprobs, prompt_logprobs: score, default_max_tokens: Some(16) };
    let (merged, prompt_lens) = submit_all(&st, job)?;
    let id = st.new_id("cmpl", r.request_id.as_deref());
    let created = now_secs();
    if !stream {
        let got = collect(&st, merged, n, np).await?;
        let lr = LpRender { st: &st, as_ids: render_ids };
        let completion: usize = got.choices.iter().map(|c| c.completion_tokens).sum();
        let choices: Vec<Value> = got
            .choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let p = i / n;
                let plps = got.prompt_logprobs[p].as_deref().unwrap_or(&[]);
                let text = if echo { format!("{}{}", prompt_texts[p], c.text) } else { c.text.clone() };
                let lp = if !want_lp {
                    Value::Null
                } else if echo {
                    lr.completion(echo_tokens(&prompts[p], plps).chain(c.logprobs.iter().map(|(t, l)| (*t, Some(l)))), 0).0
                } else {
                    lr.completion(c.logprobs.iter().map(|(t, l)| (*t, Some(l))), 0).0
                };
                let plp = if show_prompt_lps { lr.prompt(&prompts[p], plps) } else { Value::Null };
                json!({"index": i, "text": text, "logprobs": lp, "finish_reason": finish_str(c.finish), "stop_reason": stop_reason_json(&c.stop_reason), "prompt_logprobs": plp})
            })
            .collect();
        return Ok(Json(json!({"id": id, "object": "text_completion", "created": created, "model": model_name, "choices": choices, "usage": usage(got.prompt_tokens, completion)})).into_response());
    }
    let st2 = st.clone();
    let mut offsets = vec![0usize; n * np];
    let mut counts = vec![0usize; n * np];
    let completion = Arc::new(AtomicUsize::new(0));
    let c2 = completion.clone();
    let prompt_total: usize = prompt_lens.iter().sum();
    let (id2, model2) = (id.clone(), model_name.clone());
    let chunk = move |choices: Vec<Value>, usage_now: Option<Value>| {
        let mut v = json!({"id": id2, "object": "text_completion", "created": created, "model": model2, "choices": choices});
        if include_usage || usage_now.is_some() {
            v["usage"] = usage_now.unwrap_or(Value::Null);
        }
        v
    };
    let body = merged
        .flat_map(move |(p, ev)| {
            let lr = LpRender { st: &st2, as_ids: render_ids };
            let usage_of = |counts: &[usize], ci: usize| continuous.then(|| usage(prompt_lens[p], counts[ci]));
            let out: Vec<Value> = match ev {
                Event::PromptLogprobs(plps) if echo => (0..n)
                    .map(|i| {
                        let ci = p * n + i;
                        let (lp, end) = lr.completion(echo_tokens(&prompts[p], &plps), 0);
                        offsets[ci] = end;
                        let lp = if want_lp { lp } else { Value::Null };
                        chunk(vec![json!({"index": ci, "text": prompt_texts[p], "logprobs": lp, "finish_reason": Value::Null})], usage_of(&counts, ci))
                    })
                    .collect(),
                Event::PromptLogprobs(_) => vec![],
                Event::Token { index, token_id, text, logprob } => {
                    let ci = p * n + index;
                    counts[ci] += 1;
                    let lp = match (&logprob, want_lp) {
                        (Some(l), true) => lr.completion([(token_id, Some(l))], offsets[ci]).0,
                        _ => Value::Null,
                    };
                    offsets[ci] += text.len();
                    vec![chunk(vec![json!({"index": ci, "text": text, "logprobs": lp, "finish_reason": Value::Null})], usage_of(&counts, ci))]
                }
                Event::Finished { index, reason, stop_reason, completion_tokens, .. } => {
                    let ci = p * n + index;
                    c2.fetch_add(completion_tokens, Ordering::Relaxed);
                    vec![chunk(vec![json!({"index": ci, "text": "", "logprobs": Value::Null, "finish_reason": reason.as_str(), "stop_reason": stop_reason_json(&stop_reason)})], usage_of(&counts, ci))]
                }
                Event::Error(e) => vec![ApiError::internal(format!("generation failed: {e}")).body()],
            };
            futures::stream::iter(out)
        })
        .boxed();
    Ok(sse_response(&st, with_usage_tail(body, include_usage, completion, id, "text_completion", created, model_name, prompt_total)))
}

/// The prompt's tokens for an echoed logprobs list: the first has no logprob.
fn echo_tokens<'a>(prompt: &'a [u32], plps: &'a [TokenLogprob]) -> impl Iterator<Item = (u32, Option<&'a TokenLogprob>)> + 'a {
    prompt.iter().enumerate().map(move |(j, &t)| (t, if j == 0 { None } else { plps.get(j - 1) }))
}
