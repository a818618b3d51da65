//! `POST /v1/embeddings` in OpenAI's shape, with vLLM's and sentence-transformers' extras.
//!
//! OpenAI: `model` (the served name, or an adapter's as for generation), `input` (a string, a
//! list of strings, a list of token ids or a list of such lists), `encoding_format` (`float`,
//! or `base64`: the little-endian f32 bytes, which the `openai` SDK asks for by default),
//! `dimensions` (Matryoshka truncation, where the model declares it), `user` (ignored); the
//! reply is `{object: list, data: [{object: embedding, index, embedding}], model, usage}`.
//! vLLM's pooling parameters: `truncate_prompt_tokens` (keep the last k tokens; -1 = the context
//! window), `add_special_tokens` (default true), `normalize`. sentence-transformers: `prompt_name`
//! picks an instruction prefix from the model's `prompts` (default: its `default_prompt_name`);
//! token-id inputs are used as they are.
//!
//! Every input is its own engine request and all are submitted before any is awaited, so the
//! engine batches them into the same forward passes.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use serde_json::{json, Value};

use crate::backend::EmbedInput;
use crate::error::ApiError;
use crate::request::{parse_object, Fields};
use crate::server::{body_bytes, resolve_adapter, AppState};

/// One `input` item before tokenization.
enum Item {
    Text(String),
    Ids(Vec<u32>),
}

fn items(v: &Value) -> Result<Vec<Item>, ApiError> {
    let bad = || ApiError::field("input", "`input` must be a string, a list of strings, a list of token ids or a list of lists of token ids");
    let ids = |a: &[Value]| a.iter().map(|x| x.as_u64().filter(|&t| t <= u32::MAX as u64).map(|t| t as u32)).collect::<Option<Vec<u32>>>();
    let out = match v {
        Value::String(s) => vec![Item::Text(s.clone())],
        Value::Array(a) if a.is_empty() => return Err(ApiError::field("input", "`input` is an empty list")),
        Value::Array(a) if a.iter().all(Value::is_string) => a.iter().map(|x| Item::Text(x.as_str().unwrap_or_default().to_string())).collect(),
        Value::Array(a) if a.iter().all(Value::is_number) => vec![Item::Ids(ids(a).ok_or_else(bad)?)],
        Value::Array(a) if a.iter().all(Value::is_array) => a.iter().map(|x| ids(x.as_array().map_or(&[][..], |v| v)).map(Item::Ids).ok_or_else(bad)).collect::<Result<_, _>>()?,
        _ => return Err(bad()),
    };
    Ok(out)
}

pub(crate) async fn embeddings(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let body = body_bytes(body)?;
    let m = parse_object(&body)?;
    let f = Fields::new(&m);
    let Some(info) = st.backend.embedding_info() else {
        return Err(ApiError::bad_request("This server generates text and serves no embeddings (start it with `quiver serve --task embed`)."));
    };
    let model = f.str("model")?;
    let adapter = resolve_adapter(&st, model, None).await?;
    let model_name = model.map_or_else(|| st.served().to_string(), str::to_string);
    let input = f.get("input").ok_or_else(|| ApiError::field("input", "`input` is required"))?;
    let items = items(input)?;
    let base64 = match f.str("encoding_format")? {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => return Err(ApiError::field("encoding_format", format!("`encoding_format` must be \"float\" or \"base64\", got \"{other}\""))),
    };
    let dimensions = match f.i64("dimensions")? {
        None => None,
        Some(d) if d >= 1 => Some(d as usize),
        Some(d) => return Err(ApiError::field("dimensions", format!("`dimensions` must be at least 1, got {d}"))),
    };
    if let Some(d) = dimensions {
        info.check_dimensions(d).map_err(|e| ApiError::field("dimensions", e))?;
    }
    let _user = f.str("user")?;
    let add_special = f.bool("add_special_tokens")?.unwrap_or(true);
    let normalize = f.bool("normalize")?;
    let max_len = st.backend.max_model_len();
    let truncate = match f.i64("truncate_prompt_tokens")? {
        None => None,
        Some(-1) => Some(max_len),
        Some(k) if k >= 1 => Some(k as usize),
        Some(k) => return Err(ApiError::field("truncate_prompt_tokens", format!("`truncate_prompt_tokens` must be -1 or at least 1, got {k}"))),
    };
    let prompt = match f.str("prompt_name")?.map(str::to_string).or(info.default_prompt.clone()) {
        None => String::new(),
        Some(name) => match info.prompt(&name) {
            Some(p) => p.to_string(),
            None => {
                let known: Vec<&str> = info.prompts.iter().map(|p| p.0.as_str()).collect();
                return Err(ApiError::field("prompt_name", format!("`prompt_name` \"{name}\" is not one of the model's prompts {known:?}")));
            }
        },
    };
    let mut inputs = Vec::with_capacity(items.len());
    for (i, it) in items.into_iter().enumerate() {
        let mut ids = match it {
            // On the tokenizer pool, after its length bound, like every other route.
            Item::Text(t) => crate::tokenize::encode(&st, "input", &format!("{prompt}{t}"), add_special).await?,
            Item::Ids(ids) => ids,
        };
        if let Some(k) = truncate {
            let cut = ids.len().saturating_sub(k);
            ids.drain(..cut);
        }
        if ids.is_empty() {
            return Err(ApiError::field("input", format!("input {i} is empty")));
        }
        if ids.len() > max_len {
            return Err(ApiError::field(
                "input",
                format!("This model's maximum context length is {max_len} tokens. However, input {i} has {} tokens. Please reduce the length of the input (or set truncate_prompt_tokens).", ids.len()),
            ));
        }
        inputs.push(ids);
    }
    let _in_flight = st.in_flight_guard();
    let prompt_tokens: usize = inputs.iter().map(Vec::len).sum();
    let mut futures = Vec::with_capacity(inputs.len());
    for ids in inputs {
        // Submitted one after another before any is awaited: the engine batches them.
        futures.push(st.backend.embed(EmbedInput { input: ids, adapter: adapter.clone(), dimensions, normalize }).map_err(ApiError::from)?);
    }
    let vectors = futures::future::join_all(futures).await;
    let mut data = Vec::with_capacity(vectors.len());
    for (i, v) in vectors.into_iter().enumerate() {
        let v = v.map_err(|e| ApiError::internal(format!("embedding failed: {e}")))?;
        let embedding = if base64 {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            Value::from(base64::engine::general_purpose::STANDARD.encode(bytes))
        } else {
            // As f64: the shortest decimal that reads back as exactly this f32 value in
            // clients that parse JSON numbers as doubles (so float and base64 agree).
            json!(v.iter().map(|&x| x as f64).collect::<Vec<f64>>())
        };
        data.push(json!({"object": "embedding", "index": i, "embedding": embedding}));
    }
    Ok(Json(json!({"object": "list", "data": data, "model": model_name, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})).into_response())
}
