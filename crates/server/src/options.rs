//! vLLM's extra request fields beyond OpenAI's sampling ones (what they do is vLLM's), and the
//! refusal of schema fields Quiver does not implement: a request setting one of those to
//! anything but its default gets a 400 naming it, never a 200 that ignores it.
//! `docs/api-compat.md` lists every field of vLLM's and SGLang's schemas and where it lands.

use serde_json::Value;

use crate::error::ApiError;
use crate::request::{Fields, MAX_LOGPROBS};

/// Fields that change what is generated or reported, shared by completions, chat and
/// SGLang's `sampling_params`.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputOptions {
    pub min_tokens: usize,
    pub include_stop_str_in_output: bool,
    pub skip_special_tokens: bool,
    /// Keep only the last `k` prompt tokens.
    pub truncate_prompt_tokens: Option<usize>,
    /// Every streamed chunk carries `usage` so far.
    pub continuous_usage_stats: bool,
    /// Token strings in logprobs as `token_id:{id}`.
    pub return_tokens_as_token_ids: bool,
}

impl Default for OutputOptions {
    fn default() -> Self {
        OutputOptions { min_tokens: 0, include_stop_str_in_output: false, skip_special_tokens: true, truncate_prompt_tokens: None, continuous_usage_stats: false, return_tokens_as_token_ids: false }
    }
}

fn err(name: &str, msg: impl std::fmt::Display) -> ApiError {
    ApiError::field(name, format!("`{name}` {msg}"))
}

/// Reads [`OutputOptions`]; `min_tokens_keys` in order (SGLang spells it `min_new_tokens`).
pub fn parse_output_options(f: &Fields, min_tokens_keys: &[&str]) -> Result<OutputOptions, ApiError> {
    let mut o = OutputOptions::default();
    for &k in min_tokens_keys {
        if let Some(v) = f.i64(k)? {
            if v < 0 {
                return Err(err(&f.name(k), format!("must be >= 0, got {v}")));
            }
            o.min_tokens = v as usize;
            break;
        }
    }
    o.include_stop_str_in_output = f.bool("include_stop_str_in_output")?.or(f.bool("no_stop_trim")?).unwrap_or(false);
    o.skip_special_tokens = f.bool("skip_special_tokens")?.unwrap_or(true);
    // vLLM honours this only in its slow (Python) detokenizer; with a fast tokenizer, which
    // is what every Quiver model has, it changes nothing there either. Checked for type only.
    f.bool("spaces_between_special_tokens")?;
    if let Some(v) = f.i64("truncate_prompt_tokens")? {
        if v < 1 {
            return Err(err(&f.name("truncate_prompt_tokens"), format!("must be at least 1, got {v}")));
        }
        o.truncate_prompt_tokens = Some(v as usize);
    }
    o.return_tokens_as_token_ids = f.bool("return_tokens_as_token_ids")?.unwrap_or(false);
    Ok(o)
}

/// `(token id, bias)` pairs, sorted by id.
pub type LogitBias = Vec<(u32, f32)>;

/// OpenAI's `logit_bias` (`{"token id": bias}`, biases clamped to [-100, 100] as OpenAI and
/// vLLM do) and vLLM's `allowed_token_ids`. Ids are checked against the vocabulary by the
/// engine, which names the field.
pub fn parse_token_constraints(f: &Fields) -> Result<(LogitBias, Vec<u32>), ApiError> {
    let mut bias = Vec::new();
    if let Some(m) = f.object("logit_bias")? {
        let name = f.name("logit_bias");
        for (k, v) in m {
            let id: u32 = k.trim().parse().map_err(|_| err(&name, format!("keys must be token ids, got {k:?}")))?;
            let b = v.as_f64().ok_or_else(|| err(&name, format!("values must be numbers, got {v} for {k}")))?;
            bias.push((id, b.clamp(-100.0, 100.0) as f32));
        }
        bias.sort_by_key(|b| b.0);
    }
    let mut allowed = f.u32_list("allowed_token_ids")?;
    if f.get("allowed_token_ids").is_some() && allowed.is_empty() {
        return Err(err(&f.name("allowed_token_ids"), "must not be empty"));
    }
    allowed.sort_unstable();
    allowed.dedup();
    Ok((bias, allowed))
}

/// vLLM's `prompt_logprobs` (0..=20; not with streaming, as in vLLM).
pub fn parse_prompt_logprobs(f: &Fields, stream: bool) -> Result<Option<usize>, ApiError> {
    match f.i64("prompt_logprobs")? {
        None => Ok(None),
        Some(v) if !(0..=MAX_LOGPROBS as i64).contains(&v) => Err(err("prompt_logprobs", format!("must be between 0 and {MAX_LOGPROBS}, got {v}"))),
        Some(v) if stream && v > 0 => Err(err("prompt_logprobs", "is not available when `stream` is true")),
        Some(v) => Ok(Some(v as usize)),
    }
}

/// Fields of vLLM's request schemas that Quiver does not implement, with the value that
/// means "off"; a request giving any other value is refused.
const UNSUPPORTED: &[(&str, &str)] = &[
    ("use_beam_search", "false"),
    ("length_penalty", "1"),
    ("bad_words", "[]"),
    ("logits_processors", "null"),
    ("cache_salt", "null"),
    ("kv_transfer_params", "null"),
    ("vllm_xargs", "null"),
    ("priority", "0"),
    ("prompt_embeds", "null"),
    ("mm_processor_kwargs", "null"),
    // Structured output is read in structured.rs; Quiver has no structural tags, and
    // SGLang's `ebnf` is its own EBNF dialect, not Lark.
    ("structural_tag", "null"),
    ("ebnf", "null"),
    // SGLang's extras.
    ("return_hidden_states", "false"),
    ("session_params", "null"),
    ("custom_params", "null"),
    ("custom_logit_processor", "null"),
    ("extra_key", "null"),
];

/// Chat-only fields not implemented yet.
const UNSUPPORTED_CHAT: &[(&str, &str)] = &[("tools", "[]"), ("functions", "null"), ("function_call", "null"), ("reasoning_effort", "null")];

fn is_off(v: &Value, off: &str) -> bool {
    let off: Value = serde_json::from_str(off).unwrap_or(Value::Null);
    match (v, &off) {
        (Value::Null, _) => true,
        (Value::Number(a), Value::Number(b)) => a.as_f64() == b.as_f64(),
        _ => *v == off,
    }
}

/// 400 for the first unsupported field a request turns on.
pub fn refuse_unsupported(f: &Fields, chat: bool) -> Result<(), ApiError> {
    let extra: &[(&str, &str)] = if chat { UNSUPPORTED_CHAT } else { &[] };
    for &(k, off) in UNSUPPORTED.iter().chain(extra) {
        if let Some(v) = f.get(k) {
            if !is_off(v, off) {
                let what = match k {
                    "tools" | "functions" | "function_call" => "tool calling is not supported by this server yet",
                    _ => "is not supported by this server",
                };
                return Err(err(&f.name(k), what));
            }
        }
    }
    if chat {
        if let Some(v) = f.get("tool_choice") {
            if !matches!(v.as_str(), Some("none" | "auto")) {
                return Err(ApiError::field("tool_choice", "`tool_choice` other than none or auto needs `tools`, and tool calling is not supported by this server yet"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::parse_object;

    fn refused(body: &str, chat: bool) -> Option<String> {
        let m = parse_object(body.as_bytes()).unwrap();
        refuse_unsupported(&Fields::new(&m), chat).err().map(|e| e.param.unwrap_or_default())
    }

    #[test]
    fn unsupported_fields_are_refused_by_name_and_defaults_pass() {
        for (body, field) in [
            (r#"{"use_beam_search":true}"#, "use_beam_search"),
            (r#"{"structural_tag":"{}"}"#, "structural_tag"),
            (r#"{"priority":3}"#, "priority"),
            (r#"{"cache_salt":"x"}"#, "cache_salt"),
        ] {
            assert_eq!(refused(body, false).as_deref(), Some(field), "{body}");
        }
        assert_eq!(refused(r#"{"tools":[{"type":"function","function":{"name":"f"}}]}"#, true).as_deref(), Some("tools"));
        assert_eq!(refused(r#"{"tool_choice":"required"}"#, true).as_deref(), Some("tool_choice"));
        for body in [r#"{"use_beam_search":false,"priority":0,"length_penalty":1.0,"bad_words":[],"response_format":{"type":"text"}}"#, r#"{"tools":[],"tool_choice":"none"}"#, r#"{"tool_choice":"auto"}"#] {
            assert_eq!(refused(body, true), None, "{body}");
        }
    }

    #[test]
    fn logit_bias_parses_clamps_and_names_bad_keys() {
        let m = parse_object(br#"{"logit_bias":{"5":150,"2":-1.5},"allowed_token_ids":[9,3,9]}"#).unwrap();
        let (b, a) = parse_token_constraints(&Fields::new(&m)).unwrap();
        assert_eq!(b, vec![(2, -1.5), (5, 100.0)]);
        assert_eq!(a, vec![3, 9]);
        let m = parse_object(br#"{"logit_bias":{"x":1}}"#).unwrap();
        assert_eq!(parse_token_constraints(&Fields::new(&m)).unwrap_err().param.as_deref(), Some("logit_bias"));
    }
}
