//! Forced calls (`tool_choice` `required` or a named function): a Lark grammar for llguidance
//! that lets the model write nothing but calls, in its own format (what its template shows it
//! in the history, so the forced text stays in distribution), each call's arguments following
//! its tool's JSON Schema. Without a parser the format is vLLM's: a JSON list of
//! `{"name", "parameters"}` (`required`) or the bare arguments (named).
//!
//! Every call is its own `%json` alternative, so each tool's `$defs` stay with its schema.
//! JSON inside is compact with `", "` and `": "`, what the templates' `tojson` writes.

use serde_json::{json, Map, Value};

use super::spec::Tool;
use super::{hermes, llama3, mistral, ToolParser};

fn compact() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// A tool's parameters, or what vLLM forces for a tool without them: an empty object.
fn parameters(t: &Tool) -> Value {
    t.parameters.clone().unwrap_or_else(|| json!({"type": "object", "properties": {}, "additionalProperties": false}))
}

/// `%json {…}` for `schema`, written compactly.
fn json_rule(mut schema: Value) -> String {
    if let Some(m) = schema.as_object_mut() {
        m.insert("x-guidance".into(), compact());
    }
    format!("%json {schema}")
}

/// `{"name": NAME, KEY: ARGS}`: the name first, so a streaming reader knows the call as soon
/// as its arguments begin. The parameters' definitions move to the root, where their `$ref`s
/// (`#/$defs/…`) point.
fn call_schema(t: &Tool, key: &str) -> Value {
    let mut params = parameters(t);
    let mut root = Map::new();
    root.insert("type".into(), "object".into());
    if let Some(p) = params.as_object_mut() {
        for defs in ["$defs", "definitions"] {
            if let Some(d) = p.remove(defs) {
                root.insert(defs.into(), d);
            }
        }
    }
    root.insert("properties".into(), json!({"name": {"const": t.name}, key: params}));
    root.insert("required".into(), json!(["name", key]));
    root.insert("additionalProperties".into(), false.into());
    Value::Object(root)
}

/// A Lark string literal (Lark takes JSON's escapes).
fn lit(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// A marker the vocabulary has as one token is forced as that token (`<[id]>`): it may be
/// special, and a model only ever writes it that way.
fn marker(s: &str, token: &dyn Fn(&str) -> Option<u32>) -> String {
    token(s).map_or_else(|| lit(s), |id| format!("<[{id}]>"))
}

/// `start` writes one `item`, or with `many` at least one, separated by `sep`.
fn repeat(item: &str, sep: &str, many: bool) -> String {
    if many {
        format!("start: {item} ({} {item})*\n", lit(sep))
    } else {
        format!("start: {item}\n")
    }
}

/// The rest of a JSON list after its first item: more items when `many`.
fn more_items(many: bool) -> String {
    if many {
        format!(" ({} item)*", lit(", "))
    } else {
        String::new()
    }
}

/// Rules `t0`, `t1`, … (one per candidate's call object) and the alternative over them.
fn call_alternatives(candidates: &[&Tool], key: &str) -> (String, String) {
    let rules: String = candidates.iter().enumerate().map(|(i, t)| format!("t{i}: {}\n", json_rule(call_schema(t, key)))).collect();
    let alt = (0..candidates.len()).map(|i| format!("t{i}")).collect::<Vec<_>>().join(" | ");
    (rules, alt)
}

/// The grammar of forced calls to `candidates` (one of them when `named`), at most one call
/// unless `many`. `token` finds a text's id when the vocabulary has it as a single token.
pub fn grammar(parser: Option<ToolParser>, candidates: &[&Tool], many: bool, named: bool, token: &dyn Fn(&str) -> Option<u32>) -> String {
    match parser {
        Some(ToolParser::Hermes) => {
            let (rules, alt) = call_alternatives(candidates, "arguments");
            let open = format!("{} {}", marker(hermes::OPEN, token), lit("\n"));
            let close = format!("{} {}", lit("\n"), marker(hermes::CLOSE, token));
            format!("{}call: {open} ({alt}) {close}\n{rules}", repeat("call", "\n", many))
        }
        Some(ToolParser::Llama3Json) => {
            let (rules, alt) = call_alternatives(candidates, "parameters");
            format!("{}call: {alt}\n{rules}", repeat("call", llama3::SEPARATOR, many))
        }
        Some(ToolParser::Mistral) => {
            let calls = marker(mistral::MARKER, token);
            match token(mistral::ARGS) {
                // Tokenizer v11 on: `[TOOL_CALLS]name[ARGS]{…}` per call.
                Some(args) => {
                    let rules: String = candidates.iter().enumerate().map(|(i, t)| format!("a{i}: {}\n", json_rule(parameters(t)))).collect();
                    let alt: Vec<String> = candidates.iter().enumerate().map(|(i, t)| format!("{} <[{args}]> a{i}", lit(&t.name))).collect();
                    let start = if many { "start: call+\n" } else { "start: call\n" };
                    format!("{start}call: {calls} ({})\n{rules}", alt.join(" | "))
                }
                None => {
                    let (rules, alt) = call_alternatives(candidates, "arguments");
                    format!("start: {calls} \"[\" item{} \"]\"\nitem: {alt}\n{rules}", more_items(many))
                }
            }
        }
        None if named => format!("start: {}\n", json_rule(parameters(candidates[0]))),
        None => {
            let (rules, alt) = call_alternatives(candidates, "parameters");
            format!("start: \"[\" item{} \"]\"\nitem: {alt}\n{rules}", more_items(many))
        }
    }
}
