//! Calls in OpenAI's shapes: `message.tool_calls` of a response and `delta.tool_calls` of a
//! stream chunk (the first delta of a call carries `index`, `id`, `type` and
//! `function.name`; later ones `index` and `function.arguments` fragments).

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{json, Map, Value};

use super::output::{Call, Delta};

/// How call ids look: vLLM's `chatcmpl-tool-<32 hex>`, or Mistral's 9 alphanumerics (its chat
/// templates refuse any other id when the call comes back in the history).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdStyle {
    Random,
    Mistral,
}

/// 64 unpredictable bits: std's per-process random hash keys over a counter (ids need to be
/// unique and unguessable, not cryptographic; no extra dependency for that).
fn random_u64() -> u64 {
    static N: AtomicU64 = AtomicU64::new(0);
    let mut h = RandomState::new().build_hasher();
    h.write_u64(N.fetch_add(1, Ordering::Relaxed));
    h.finish()
}

pub fn call_id(style: IdStyle) -> String {
    match style {
        IdStyle::Random => format!("chatcmpl-tool-{:016x}{:016x}", random_u64(), random_u64()),
        IdStyle::Mistral => {
            const ALNUM: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
            let mut x = random_u64();
            (0..9)
                .map(|_| {
                    let c = ALNUM[(x % ALNUM.len() as u64) as usize] as char;
                    x /= ALNUM.len() as u64;
                    c
                })
                .collect()
        }
    }
}

/// `message.tool_calls`.
pub fn message_calls(calls: &[Call], style: IdStyle) -> Value {
    Value::Array(calls.iter().map(|c| json!({"id": call_id(style), "type": "function", "function": {"name": c.name, "arguments": c.arguments}})).collect())
}

/// A stream chunk's `delta` fields for `deltas` (`content`, `tool_calls`); empty when they
/// carry nothing.
pub fn delta_fields(deltas: Vec<Delta>, style: IdStyle) -> Map<String, Value> {
    let mut content = String::new();
    let mut calls = Vec::new();
    for d in deltas {
        match d {
            Delta::Content(c) => content.push_str(&c),
            Delta::Call { index, name, arguments } => calls.push(json!({"index": index, "id": call_id(style), "type": "function", "function": {"name": name, "arguments": arguments}})),
            Delta::Arguments { index, arguments } => calls.push(json!({"index": index, "function": {"arguments": arguments}})),
        }
    }
    let mut m = Map::new();
    if !content.is_empty() {
        m.insert("content".into(), content.into());
    }
    if !calls.is_empty() {
        m.insert("tool_calls".into(), calls.into());
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_have_their_styles_and_differ() {
        let a = call_id(IdStyle::Random);
        assert!(a.starts_with("chatcmpl-tool-") && a.len() == 14 + 32 && a != call_id(IdStyle::Random), "{a}");
        let m = call_id(IdStyle::Mistral);
        assert!(m.len() == 9 && m.bytes().all(|c| c.is_ascii_alphanumeric()) && m != call_id(IdStyle::Mistral), "{m}");
    }

    #[test]
    fn deltas_take_openai_shape() {
        let d = delta_fields(vec![Delta::Content("Hi".into()), Delta::Call { index: 0, name: "f".into(), arguments: "{\"a\"".into() }], IdStyle::Random);
        assert_eq!(d["content"], "Hi");
        let c = &d["tool_calls"][0];
        assert_eq!((c["index"].clone(), c["type"].clone(), c["function"]["name"].clone(), c["function"]["arguments"].clone()), (json!(0), json!("function"), json!("f"), json!("{\"a\"")));
        let d = delta_fields(vec![Delta::Arguments { index: 1, arguments: ": 1}".into() }], IdStyle::Random);
        assert_eq!(d["tool_calls"], json!([{"index": 1, "function": {"arguments": ": 1}"}}]));
        assert!(delta_fields(vec![], IdStyle::Random).is_empty());
    }
}
