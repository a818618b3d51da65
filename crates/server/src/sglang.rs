//! SGLang's native `POST /generate`: `text` or `input_ids` (one or a batch), nested
//! `sampling_params`, `lora_path`, and SGLang's `meta_info` (logprobs as `[logprob, id, text]`).

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use serde_json::{json, Value};

use crate::backend::{Event, FinishReason};
use crate::error::ApiError;
use crate::request::{self, Prompt};
use crate::server::{body_bytes, collect, resolve_adapter, sse_response, submit_all, AppState, ChoiceAcc, Job, TokLp};

pub(crate) async fn generate(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let body = body_bytes(body)?;
    let r = request::parse_generate(&body)?;
    let adapter = resolve_adapter(&st, None, r.lora_path.as_deref()).await?;
    let mut prompts = Vec::new();
    for p in &r.prompts {
        prompts.push(match p {
            Prompt::Text(t) => crate::tokenize::encode(&st, "text", t, true).await?,
            Prompt::Ids(ids) => ids.clone(),
        });
    }
    let (n, np, stream) = (r.common.n, prompts.len(), r.common.stream);
    let want_lp = r.return_logprob;
    let job = Job { adapter, prompts, common: r.common, logprobs: want_lp.then_some(r.top_logprobs_num), prompt_logprobs: None, default_max_tokens: Some(128) };
    let (merged, prompt_lens) = submit_all(&st, job)?;
    let rid = st.new_id("gen", None);
    let start = Instant::now();
    let meta = move |i: usize, ids_len: usize, finish: Option<FinishReason>, lps: &[TokLp], prompt_lens: &[usize]| {
        let fr = match finish {
            None => Value::Null,
            Some(FinishReason::Length) => json!({"type": "length", "length": ids_len}),
            Some(f) => json!({"type": f.as_str()}),
        };
        let mut m = json!({"id": format!("{rid}-{i}"), "finish_reason": fr, "prompt_tokens": prompt_lens[i / n], "completion_tokens": ids_len, "cached_tokens": 0, "e2e_latency": start.elapsed().as_secs_f64()});
        if want_lp {
            m["output_token_logprobs"] = Value::Array(lps.iter().map(|(id, lp)| json!([lp.logprob, id, Value::Null])).collect());
            m["output_top_logprobs"] = Value::Array(lps.iter().map(|(_, lp)| Value::Array(lp.top.iter().map(|(id, l)| json!([l, id, Value::Null])).collect())).collect());
        }
        m
    };
    if !stream {
        let choices = collect(&st, merged, n, np).await?.choices;
        let outs: Vec<Value> = choices
            .iter()
            .enumerate()
            .map(|(i, c)| json!({"text": c.text, "output_ids": c.ids, "meta_info": meta(i, c.ids.len(), c.finish, &c.logprobs, &prompt_lens), "index": i}))
            .collect();
        let single = !r.batched && n == 1;
        return Ok(Json(if single { outs.into_iter().next().unwrap_or(Value::Null) } else { Value::Array(outs) }).into_response());
    }
    // SGLang streams the cumulative text of each output.
    let mut acc = vec![ChoiceAcc::default(); n * np];
    let body = merged
        .filter_map(move |(p, ev)| {
            let out = match ev {
                Event::Token { index, token_id, text, logprob } => {
                    let i = p * n + index;
                    let c = &mut acc[i];
                    c.text.push_str(&text);
                    c.ids.push(token_id);
                    if let Some(l) = logprob {
                        c.logprobs.push((token_id, l));
                    }
                    Some(json!({"text": c.text, "output_ids": c.ids, "meta_info": meta(i, c.ids.len(), None, &c.logprobs, &prompt_lens), "index": i}))
                }
                Event::Finished { index, reason, .. } => {
                    let i = p * n + index;
                    let c = &acc[i];
                    Some(json!({"text": c.text, "output_ids": c.ids, "meta_info": meta(i, c.ids.len(), Some(reason), &c.logprobs, &prompt_lens), "index": i}))
                }
                Event::PromptLogprobs(_) => None,
                Event::Error(e) => Some(json!({"error": {"message": e}})),
            };
            futures::future::ready(out)
        })
        .boxed();
    Ok(sse_response(&st, body))
}
