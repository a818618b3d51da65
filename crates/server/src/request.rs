//! Parsing and validating request bodies by hand from `serde_json::Value`, so that every 400
//! names the offending field (serde's derive errors name a line and column, not a field).

use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::options::{self, OutputOptions};
use quiver_engine::SamplingParams;
use quiver_model::chat::ChatMessage;

pub const MAX_N: usize = 128;
pub const MAX_LOGPROBS: usize = 20;
pub const MAX_STOP: usize = 16;

/// Parses a body as a JSON object.
pub fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("Malformed JSON body: {e}")))?;
    match v {
        Value::Object(m) => Ok(m),
        other => Err(ApiError::bad_request(format!("The request body must be a JSON object, got {}", kind(&other)))),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Typed accessors over a JSON object; `null` counts as absent.
pub struct Fields<'a> {
    m: &'a Map<String, Value>,
    /// Prefix for nested objects, e.g. `sampling_params.`.
    prefix: &'static str,
}

impl<'a> Fields<'a> {
    pub fn new(m: &'a Map<String, Value>) -> Self {
        Fields { m, prefix: "" }
    }
    pub fn nested(m: &'a Map<String, Value>, prefix: &'static str) -> Self {
        Fields { m, prefix }
    }
    pub fn name(&self, k: &str) -> String {
        format!("{}{k}", self.prefix)
    }
    fn wrong(&self, k: &str, want: &str, v: &Value) -> ApiError {
        let n = self.name(k);
        ApiError::field(&n, format!("`{n}` must be {want}, got {}", kind(v)))
    }
    pub fn get(&self, k: &str) -> Option<&'a Value> {
        self.m.get(k).filter(|v| !v.is_null())
    }
    pub fn f32(&self, k: &str) -> Result<Option<f32>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64().map(|x| x as f32)),
            Some(v) => Err(self.wrong(k, "a number", v)),
        }
    }
    pub fn i64(&self, k: &str) -> Result<Option<i64>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Number(n)) => {
                if let Some(i) = n.as_i64() {
                    Ok(Some(i))
                } else if n.as_u64().is_some() {
                    Ok(Some(i64::MAX))
                } else {
                    match n.as_f64() {
                        Some(f) if f.fract() == 0.0 && f.abs() < 9e18 => Ok(Some(f as i64)),
                        _ => Err(ApiError::field(&self.name(k), format!("`{}` must be an integer, got {n}", self.name(k)))),
                    }
                }
            }
            Some(v) => Err(self.wrong(k, "an integer", v)),
        }
    }
    pub fn bool(&self, k: &str) -> Result<Option<bool>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.wrong(k, "a boolean", v)),
        }
    }
    pub fn str(&self, k: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.wrong(k, "a string", v)),
        }
    }
    pub fn required_str(&self, k: &str) -> Result<&'a str, ApiError> {
        self.str(k)?.ok_or_else(|| ApiError::field(&self.name(k), format!("`{}` is required", self.name(k))))
    }
    /// A string or a list of strings (`stop`).
    pub fn str_list(&self, k: &str) -> Result<Vec<String>, ApiError> {
        match self.get(k) {
            None => Ok(vec![]),
            Some(Value::String(s)) => Ok(vec![s.clone()]),
            Some(Value::Array(a)) => a.iter().map(|v| v.as_str().map(str::to_string).ok_or_else(|| self.wrong(k, "a string or a list of strings", v))).collect(),
            Some(v) => Err(self.wrong(k, "a string or a list of strings", v)),
        }
    }
    pub fn u32_list(&self, k: &str) -> Result<Vec<u32>, ApiError> {
        match self.get(k) {
            None => Ok(vec![]),
            Some(Value::Array(a)) => a.iter().map(|v| token_id(v).ok_or_else(|| self.wrong(k, "a list of token ids", v))).collect(),
            Some(v) => Err(self.wrong(k, "a list of token ids", v)),
        }
    }
    pub fn object(&self, k: &str) -> Result<Option<&'a Map<String, Value>>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(m)),
            Some(v) => Err(self.wrong(k, "an object", v)),
        }
    }
}

fn token_id(v: &Value) -> Option<u32> {
    v.as_u64().filter(|&x| x <= u32::MAX as u64).map(|x| x as u32)
}

/// Sampling and stopping fields shared by every generation route.
#[derive(Clone, Debug, PartialEq)]
pub struct Common {
    pub sampling: SamplingParams,
    /// `None` = the route's default.
    pub max_tokens: Option<usize>,
    pub n: usize,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub stream: bool,
    pub include_usage: bool,
    pub out: OutputOptions,
    /// Structured output, with the field that asked for it.
    pub constraint: Option<crate::structured::Named>,
}

fn range_err(name: &str, want: &str, got: impl std::fmt::Display) -> ApiError {
    ApiError::field(name, format!("`{name}` must be {want}, got {got}"))
}

/// Reads the sampling fields. `max_tokens_keys` are tried in order (the first present wins).
pub fn parse_common(f: &Fields, max_tokens_keys: &[&str], default_temperature: f32) -> Result<Common, ApiError> {
    let mut s = SamplingParams { temperature: default_temperature, ..Default::default() };
    let p = f.prefix;
    let nm = |k: &str| format!("{p}{k}");
    if let Some(t) = f.f32("temperature")? {
        if t.is_nan() || t < 0.0 || !t.is_finite() {
            return Err(range_err(&nm("temperature"), ">= 0", t));
        }
        s.temperature = t;
    }
    if let Some(v) = f.f32("top_p")? {
        if !(v > 0.0 && v <= 1.0) {
            return Err(range_err(&nm("top_p"), "in (0, 1]", v));
        }
        s.top_p = v;
    }
    if let Some(v) = f.i64("top_k")? {
        if v < -1 {
            return Err(range_err(&nm("top_k"), "-1 (disabled) or a positive integer", v));
        }
        s.top_k = v.min(i32::MAX as i64) as i32;
    }
    if let Some(v) = f.f32("min_p")? {
        if !(0.0..=1.0).contains(&v) {
            return Err(range_err(&nm("min_p"), "in [0, 1]", v));
        }
        s.min_p = v;
    }
    for (k, slot) in [("presence_penalty", &mut s.presence_penalty), ("frequency_penalty", &mut s.frequency_penalty)] {
        if let Some(v) = f.f32(k)? {
            if !(-2.0..=2.0).contains(&v) {
                return Err(range_err(&nm(k), "in [-2, 2]", v));
            }
            *slot = v;
        }
    }
    if let Some(v) = f.f32("repetition_penalty")? {
        if v.is_nan() || v <= 0.0 || !v.is_finite() {
            return Err(range_err(&nm("repetition_penalty"), "> 0", v));
        }
        s.repetition_penalty = v;
    }
    for k in ["seed", "sampling_seed"] {
        if let Some(v) = f.i64(k)? {
            s.seed = Some(v as u64);
        }
    }
    let mut max_tokens = None;
    for &k in max_tokens_keys {
        if let Some(v) = f.i64(k)? {
            // 0 is meaningful only with `echo` (score the prompt); each route checks that.
            if v < 0 {
                return Err(range_err(&nm(k), "at least 1", v));
            }
            max_tokens = Some(v as usize);
            break;
        }
    }
    let n = match f.i64("n")? {
        None => 1,
        Some(v) if (1..=MAX_N as i64).contains(&v) => v as usize,
        Some(v) => return Err(range_err(&nm("n"), &format!("between 1 and {MAX_N}"), v)),
    };
    let stop = f.str_list("stop")?;
    if stop.len() > MAX_STOP {
        return Err(range_err(&nm("stop"), &format!("at most {MAX_STOP} sequences"), stop.len()));
    }
    if stop.iter().any(|s| s.is_empty()) {
        return Err(ApiError::field(&nm("stop"), format!("`{}` must not contain empty strings", nm("stop"))));
    }
    let stop_token_ids = f.u32_list("stop_token_ids")?;
    let ignore_eos = f.bool("ignore_eos")?.unwrap_or(false);
    let stream = f.bool("stream")?.unwrap_or(false);
    let mut out = options::parse_output_options(f, &["min_tokens", "min_new_tokens"])?;
    (s.logit_bias, s.allowed_token_ids) = options::parse_token_constraints(f)?;
    let include_usage = match f.object("stream_options")? {
        Some(_) if !stream => return Err(ApiError::field(&nm("stream_options"), format!("`{}` can only be given when `stream` is true", nm("stream_options")))),
        Some(o) => {
            let of = Fields::nested(o, "stream_options.");
            out.continuous_usage_stats = of.bool("continuous_usage_stats")?.unwrap_or(false);
            of.bool("include_usage")?.unwrap_or(false)
        }
        None => false,
    };
    if let Some(m) = max_tokens {
        if out.min_tokens > m {
            return Err(range_err(&nm("min_tokens"), &format!("at most max_tokens ({m})"), out.min_tokens));
        }
    }
    let constraint = crate::structured::parse_constraint(f)?;
    Ok(Common { sampling: s, max_tokens, n, stop, stop_token_ids, ignore_eos, stream, include_usage, out, constraint })
}

/// 400 unless `max_tokens` is at least 1 (routes without `echo`).
fn require_max_tokens(c: &Common, key: &str) -> Result<(), ApiError> {
    match c.max_tokens {
        Some(0) => Err(range_err(key, "at least 1", 0)),
        _ => Ok(()),
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

#[derive(Clone, Debug, PartialEq)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub lora_path: Option<String>,
    pub prompts: Vec<Prompt>,
    pub common: Common,
    pub logprobs: Option<usize>,
    pub echo: bool,
    pub prompt_logprobs: Option<usize>,
    pub add_special_tokens: bool,
    pub request_id: Option<String>,
}

/// `prompt`: a string, a list of strings, a list of token ids, or a list of lists of ids.
fn parse_prompt(v: Option<&Value>, field: &str) -> Result<Vec<Prompt>, ApiError> {
    let bad = || ApiError::field(field, format!("`{field}` must be a string, a list of strings, a list of token ids, or a list of lists of token ids"));
    let v = v.ok_or_else(|| ApiError::field(field, format!("`{field}` is required")))?;
    let out = match v {
        Value::String(s) => vec![Prompt::Text(s.clone())],
        Value::Array(a) if a.is_empty() => return Err(ApiError::field(field, format!("`{field}` must not be empty"))),
        Value::Array(a) => match &a[0] {
            Value::String(_) => a.iter().map(|x| x.as_str().map(|s| Prompt::Text(s.to_string())).ok_or_else(bad)).collect::<Result<_, _>>()?,
            Value::Number(_) => vec![Prompt::Ids(a.iter().map(|x| token_id(x).ok_or_else(bad)).collect::<Result<_, _>>()?)],
            Value::Array(_) => a
                .iter()
                .map(|x| match x {
                    Value::Array(ids) if !ids.is_empty() => Ok(Prompt::Ids(ids.iter().map(|t| token_id(t).ok_or_else(bad)).collect::<Result<_, _>>()?)),
                    _ => Err(bad()),
                })
                .collect::<Result<_, _>>()?,
            _ => return Err(bad()),
        },
        _ => return Err(bad()),
    };
    Ok(out)
}

pub fn parse_completion(body: &[u8]) -> Result<CompletionRequest, ApiError> {
    let m = parse_object(body)?;
    let f = Fields::new(&m);
    let model = f.str("model")?.map(str::to_string);
    let lora_path = f.str("lora_path")?.map(str::to_string);
    let prompts = parse_prompt(f.get("prompt"), "prompt")?;
    let common = parse_common(&f, &["max_tokens"], 1.0)?;
    let logprobs = match f.i64("logprobs")? {
        None => None,
        Some(v) if (0..=MAX_LOGPROBS as i64).contains(&v) => Some(v as usize),
        Some(v) => return Err(range_err("logprobs", &format!("between 0 and {MAX_LOGPROBS}"), v)),
    };
    let echo = f.bool("echo")?.unwrap_or(false);
    if !echo {
        require_max_tokens(&common, "max_tokens")?;
    }
    let prompt_logprobs = options::parse_prompt_logprobs(&f, common.stream)?;
    options::refuse_unsupported(&f, false)?;
    if f.get("suffix").is_some() {
        return Err(ApiError::field("suffix", "`suffix` is not supported"));
    }
    if let Some(b) = f.i64("best_of")? {
        if b as usize != common.n && b != 1 {
            return Err(ApiError::field("best_of", "`best_of` other than 1 or `n` is not supported"));
        }
    }
    let add_special_tokens = f.bool("add_special_tokens")?.unwrap_or(true);
    let request_id = f.str("request_id")?.map(str::to_string);
    Ok(CompletionRequest { model, lora_path, prompts, common, logprobs, echo, prompt_logprobs, add_special_tokens, request_id })
}

#[derive(Clone, Debug, PartialEq)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub lora_path: Option<String>,
    pub messages: Vec<ChatMessage>,
    pub common: Common,
    pub logprobs: bool,
    pub top_logprobs: usize,
    pub add_generation_prompt: bool,
    /// Render the final (assistant) message open-ended, for the model to continue it.
    pub continue_final_message: bool,
    /// Prefix the reply with the last message's content when that is the assistant's.
    pub echo: bool,
    pub add_special_tokens: bool,
    pub prompt_logprobs: Option<usize>,
    /// Template variables: `documents` and `chat_template_kwargs`.
    pub template_vars: Map<String, Value>,
    pub chat_template: Option<String>,
    pub request_id: Option<String>,
}

/// Message content: a string, or a list of `{"type": "text", "text": ...}` parts (joined).
fn message_content(v: Option<&Value>, i: usize) -> Result<String, ApiError> {
    let field = format!("messages[{i}].content");
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for p in parts {
                let ty = p.get("type").and_then(Value::as_str).unwrap_or("");
                match (ty, p.get("text").and_then(Value::as_str)) {
                    ("text", Some(t)) => out.push_str(t),
                    _ => return Err(ApiError::field(&field, format!("`{field}`: only text parts are supported (got type `{ty}`)"))),
                }
            }
            Ok(out)
        }
        Some(v) => Err(ApiError::field(&field, format!("`{field}` must be a string or a list of content parts, got {}", kind(v)))),
    }
}

pub fn parse_chat(body: &[u8]) -> Result<ChatRequest, ApiError> {
    let m = parse_object(body)?;
    let f = Fields::new(&m);
    let model = f.str("model")?.map(str::to_string);
    let lora_path = f.str("lora_path")?.map(str::to_string);
    let msgs = match f.get("messages") {
        None => return Err(ApiError::field("messages", "`messages` is required")),
        Some(Value::Array(a)) if a.is_empty() => return Err(ApiError::field("messages", "`messages` must not be empty")),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(ApiError::field("messages", format!("`messages` must be a list of messages, got {}", kind(v)))),
    };
    let mut messages = Vec::with_capacity(msgs.len());
    for (i, mv) in msgs.iter().enumerate() {
        let mo = mv.as_object().ok_or_else(|| ApiError::field(&format!("messages[{i}]"), format!("`messages[{i}]` must be an object")))?;
        let role = match mo.get("role") {
            Some(Value::String(r)) => r.clone(),
            _ => return Err(ApiError::field(&format!("messages[{i}].role"), format!("`messages[{i}].role` must be a string"))),
        };
        messages.push(ChatMessage { role, content: message_content(mo.get("content"), i)? });
    }
    let common = parse_common(&f, &["max_completion_tokens", "max_tokens"], 1.0)?;
    let logprobs = f.bool("logprobs")?.unwrap_or(false);
    let top_logprobs = match f.i64("top_logprobs")? {
        None => 0,
        Some(v) if (0..=MAX_LOGPROBS as i64).contains(&v) => v as usize,
        Some(v) => return Err(range_err("top_logprobs", &format!("between 0 and {MAX_LOGPROBS}"), v)),
    };
    if top_logprobs > 0 && !logprobs {
        return Err(ApiError::field("top_logprobs", "`top_logprobs` requires `logprobs` to be true"));
    }
    require_max_tokens(&common, if f.get("max_completion_tokens").is_some() { "max_completion_tokens" } else { "max_tokens" })?;
    options::refuse_unsupported(&f, true)?;
    let continue_final_message = f.bool("continue_final_message")?.unwrap_or(false);
    let add_generation_prompt = f.bool("add_generation_prompt")?.unwrap_or(!continue_final_message);
    if continue_final_message && add_generation_prompt {
        return Err(ApiError::field("continue_final_message", "Cannot set both `continue_final_message` and `add_generation_prompt` to true"));
    }
    let prompt_logprobs = options::parse_prompt_logprobs(&f, common.stream)?;
    let mut template_vars = Map::new();
    if let Some(kw) = f.object("chat_template_kwargs")? {
        template_vars.extend(kw.clone());
    }
    match f.get("documents") {
        None => {}
        Some(d @ Value::Array(_)) => {
            template_vars.insert("documents".into(), d.clone());
        }
        Some(v) => return Err(ApiError::field("documents", format!("`documents` must be a list of objects, got {}", kind(v)))),
    }
    Ok(ChatRequest {
        model,
        lora_path,
        messages,
        common,
        logprobs,
        top_logprobs,
        add_generation_prompt,
        continue_final_message,
        echo: f.bool("echo")?.unwrap_or(false),
        add_special_tokens: f.bool("add_special_tokens")?.unwrap_or(false),
        prompt_logprobs,
        template_vars,
        chat_template: f.str("chat_template")?.map(str::to_string),
        request_id: f.str("request_id")?.map(str::to_string),
    })
}

/// SGLang's native `/generate`.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateRequest {
    pub prompts: Vec<Prompt>,
    /// True when `text`/`input_ids` was a list of prompts (the answer is then a list).
    pub batched: bool,
    pub common: Common,
    pub lora_path: Option<String>,
    pub return_logprob: bool,
    pub top_logprobs_num: usize,
}

pub fn parse_generate(body: &[u8]) -> Result<GenerateRequest, ApiError> {
    let m = parse_object(body)?;
    let f = Fields::new(&m);
    let (prompts, batched) = match (f.get("text"), f.get("input_ids")) {
        (Some(_), Some(_)) => return Err(ApiError::field("text", "give either `text` or `input_ids`, not both")),
        (Some(v @ Value::String(_)), None) => (parse_prompt(Some(v), "text")?, false),
        (Some(v), None) => (parse_prompt(Some(v), "text")?, true),
        (None, Some(Value::String(_))) => return Err(ApiError::field("input_ids", "`input_ids` must be a list of token ids or a list of lists of token ids, got a string (send text in `text`)")),
        (None, Some(v)) => {
            let batched = matches!(v, Value::Array(a) if a.first().is_some_and(Value::is_array));
            (parse_prompt(Some(v), "input_ids")?, batched)
        }
        (None, None) => return Err(ApiError::field("text", "`text` or `input_ids` is required")),
    };
    let empty = Map::new();
    let sp = f.object("sampling_params")?.unwrap_or(&empty);
    let sf = Fields::nested(sp, "sampling_params.");
    let mut common = parse_common(&sf, &["max_new_tokens"], 1.0)?;
    require_max_tokens(&common, "sampling_params.max_new_tokens")?;
    options::refuse_unsupported(&sf, false)?;
    common.stream = f.bool("stream")?.unwrap_or(false);
    let lora_path = match f.get("lora_path") {
        None => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(a)) => {
            // One per prompt; Quiver serves one adapter per call, so they must agree.
            let names: Vec<Option<&str>> = a.iter().map(Value::as_str).collect();
            if names.windows(2).any(|w| w[0] != w[1]) {
                return Err(ApiError::field("lora_path", "different adapters per prompt in one call are not supported; send separate requests"));
            }
            names.first().copied().flatten().map(str::to_string)
        }
        Some(v) => return Err(ApiError::field("lora_path", format!("`lora_path` must be a string, got {}", kind(v)))),
    };
    let return_logprob = f.bool("return_logprob")?.unwrap_or(false);
    let top_logprobs_num = f.i64("top_logprobs_num")?.unwrap_or(0).clamp(0, MAX_LOGPROBS as i64) as usize;
    Ok(GenerateRequest { prompts, batched, common, lora_path, return_logprob, top_logprobs_num })
}

/// Which adapter a request names. vLLM: `model` is an adapter name; SGLang: `model` is
/// `base:adapter` (split on the first colon, trimmed; `base:` = base) or the `lora_path`
/// field, the `model` suffix winning.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelRef {
    Base,
    Adapter(String),
}

pub fn resolve_model_ref(model: Option<&str>, lora_path: Option<&str>, served: &[String]) -> ModelRef {
    let lora_path = lora_path.map(str::trim).filter(|s| !s.is_empty());
    let from_lora_path = || lora_path.map_or(ModelRef::Base, |s| ModelRef::Adapter(s.to_string()));
    match model.map(str::trim) {
        None | Some("") => from_lora_path(),
        Some(m) if served.iter().any(|s| s == m) => from_lora_path(),
        Some(m) => match m.split_once(':') {
            Some((_, a)) if a.trim().is_empty() => ModelRef::Base,
            Some((_, a)) => ModelRef::Adapter(a.trim().to_string()),
            None => ModelRef::Adapter(m.to_string()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(r: Result<impl std::fmt::Debug, ApiError>) -> ApiError {
        r.expect_err("expected an error")
    }

    #[test]
    fn completion_prompt_forms() {
        let r = parse_completion(br#"{"model":"m","prompt":"hi"}"#).unwrap();
        assert_eq!(r.prompts, vec![Prompt::Text("hi".into())]);
        let r = parse_completion(br#"{"prompt":["a","b"]}"#).unwrap();
        assert_eq!(r.prompts.len(), 2);
        let r = parse_completion(br#"{"prompt":[1,2,3]}"#).unwrap();
        assert_eq!(r.prompts, vec![Prompt::Ids(vec![1, 2, 3])]);
        let r = parse_completion(br#"{"prompt":[[1],[2,3]]}"#).unwrap();
        assert_eq!(r.prompts, vec![Prompt::Ids(vec![1]), Prompt::Ids(vec![2, 3])]);
        assert_eq!(err(parse_completion(br#"{"prompt":[1,"a"]}"#)).param.as_deref(), Some("prompt"));
        assert_eq!(err(parse_completion(br#"{"model":"m"}"#)).param.as_deref(), Some("prompt"));
        assert_eq!(err(parse_completion(br#"{"prompt":[]}"#)).param.as_deref(), Some("prompt"));
    }

    #[test]
    fn bad_fields_are_named() {
        for (body, field) in [
            (r#"{"prompt":"x","max_tokens":-1}"#, "max_tokens"),
            (r#"{"prompt":"x","max_tokens":"ten"}"#, "max_tokens"),
            (r#"{"prompt":"x","temperature":-0.5}"#, "temperature"),
            (r#"{"prompt":"x","temperature":"hot"}"#, "temperature"),
            (r#"{"prompt":"x","n":100000}"#, "n"),
            (r#"{"prompt":"x","n":0}"#, "n"),
            (r#"{"prompt":"x","top_p":0}"#, "top_p"),
            (r#"{"prompt":"x","top_k":-2}"#, "top_k"),
            (r#"{"prompt":"x","stop":5}"#, "stop"),
            (r#"{"prompt":"x","stream":"yes"}"#, "stream"),
            (r#"{"prompt":"x","logprobs":50}"#, "logprobs"),
            (r#"{"prompt":"x","presence_penalty":3}"#, "presence_penalty"),
            (r#"{"prompt":"x","stream":true,"stream_options":{"include_usage":1}}"#, "stream_options.include_usage"),
            (r#"{"prompt":"x","stream_options":{"include_usage":true}}"#, "stream_options"),
            (r#"{"prompt":"x","max_tokens":0}"#, "max_tokens"),
            (r#"{"prompt":"x","min_tokens":5,"max_tokens":2}"#, "min_tokens"),
            (r#"{"prompt":"x","prompt_logprobs":21}"#, "prompt_logprobs"),
            (r#"{"prompt":"x","stream":true,"prompt_logprobs":2}"#, "prompt_logprobs"),
            (r#"{"prompt":"x","logit_bias":{"a":1}}"#, "logit_bias"),
            (r#"{"prompt":"x","truncate_prompt_tokens":0}"#, "truncate_prompt_tokens"),
            (r#"{"prompt":"x","guided_json":5}"#, "guided_json"),
        ] {
            let e = err(parse_completion(body.as_bytes()));
            assert_eq!(e.status.as_u16(), 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(field), "{body}");
            assert!(e.message.contains(field), "{body}: {}", e.message);
        }
        let e = err(parse_completion(b"{not json"));
        assert!(e.message.contains("Malformed JSON"));
        let e = err(parse_completion(b"[1,2]"));
        assert!(e.message.contains("JSON object"));
    }

    #[test]
    fn chat_parsing() {
        let r = parse_chat(br#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],"max_completion_tokens":5,"max_tokens":9,"logprobs":true,"top_logprobs":3,"stop":"x","stream":true,"stream_options":{"include_usage":true}}"#).unwrap();
        assert_eq!(r.messages[1].content, "ab");
        assert_eq!(r.common.max_tokens, Some(5));
        assert_eq!(r.top_logprobs, 3);
        assert_eq!(r.common.stop, vec!["x".to_string()]);
        assert!(r.common.stream && r.common.include_usage);
        assert_eq!(err(parse_chat(br#"{"messages":[{"content":"hi"}]}"#)).param.as_deref(), Some("messages[0].role"));
        assert_eq!(err(parse_chat(br#"{"messages":"hi"}"#)).param.as_deref(), Some("messages"));
        assert_eq!(err(parse_chat(br#"{"messages":[{"role":"user","content":"x"}],"top_logprobs":2}"#)).param.as_deref(), Some("top_logprobs"));
    }

    #[test]
    fn generate_parsing() {
        let r = parse_generate(br#"{"text":"hi","sampling_params":{"max_new_tokens":4,"temperature":0},"lora_path":"a"}"#).unwrap();
        assert_eq!(r.common.max_tokens, Some(4));
        assert_eq!(r.common.sampling.temperature, 0.0);
        assert_eq!(r.lora_path.as_deref(), Some("a"));
        assert!(!r.batched);
        let r = parse_generate(br#"{"input_ids":[[1,2],[3]]}"#).unwrap();
        assert!(r.batched);
        let e = err(parse_generate(br#"{"text":"x","sampling_params":{"temperature":-1}}"#));
        assert_eq!(e.param.as_deref(), Some("sampling_params.temperature"));
        assert!(e.message.contains("sampling_params.temperature"));
    }

    #[test]
    fn model_refs() {
        let served = vec!["base".to_string()];
        let r = |m: Option<&str>, l: Option<&str>| resolve_model_ref(m, l, &served);
        assert_eq!(r(None, None), ModelRef::Base);
        assert_eq!(r(Some("base"), None), ModelRef::Base);
        assert_eq!(r(Some("base"), Some("a")), ModelRef::Adapter("a".into()));
        assert_eq!(r(Some("a"), None), ModelRef::Adapter("a".into()));
        assert_eq!(r(Some("base:a"), None), ModelRef::Adapter("a".into()));
        assert_eq!(r(Some("whatever: a "), Some("b")), ModelRef::Adapter("a".into()));
        assert_eq!(r(Some("base:"), Some("b")), ModelRef::Base);
        assert_eq!(r(Some("base: "), None), ModelRef::Base);
        assert_eq!(r(Some("x:a:b"), None), ModelRef::Adapter("a:b".into()));
    }
}
