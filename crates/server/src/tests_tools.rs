//! Tool calling through the routes over the mock backend, whose output is scripted token by
//! token: the reply and stream shapes, the switches, and the refusals.

use std::sync::Arc;

use serde_json::{json, Value};

use crate::server::{AppState, ServerConfig};
use crate::tests::{call, error_of, post, Env, Mock};
use crate::tools::ToolParser;

fn env_with(parser: Option<ToolParser>, auto: bool) -> Env {
    let mock = Arc::new(Mock::default());
    let cfg = ServerConfig { tool_parser: parser, enable_auto_tool_choice: auto, ..Default::default() };
    Env { st: AppState::new(mock.clone(), cfg), mock, dir: std::env::temp_dir() }
}

fn script(e: &Env, tokens: &[&str]) {
    *e.mock.script.lock().unwrap() = Some(tokens.iter().map(|t| t.to_string()).collect());
}

const TOOLS: &str = r#"[{"type":"function","function":{"name":"get_weather","description":"Weather now","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}]"#;

fn body(extra: &str) -> String {
    format!(r#"{{"messages":[{{"role":"user","content":"hi"}}],"tools":{TOOLS}{extra}}}"#)
}

/// A call split the way a model's tokens split it.
const CALL_TOKENS: &[&str] = &["Checking", ".\n", "<tool", "_call", ">\n{\"", "name\": \"get", "_weather\", \"arg", "uments\": {\"city", "\": \"Par", "is\"}}\n</", "tool_call>"];

/// The stream's chunks (after `data: `, before `[DONE]`).
async fn stream(e: &Env, body: &str) -> Vec<Value> {
    let (s, b) = call(e, "POST", "/v1/chat/completions", Some(body), None).await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    let text = String::from_utf8(b).unwrap();
    let datas: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(datas.last(), Some(&"[DONE]"));
    datas[..datas.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect()
}

#[tokio::test]
async fn auto_calls_come_back_whole_and_streamed() {
    let e = env_with(Some(ToolParser::Hermes), true);
    script(&e, CALL_TOKENS);
    let (s, v) = post(&e, "/v1/chat/completions", &body("")).await;
    assert_eq!(s, 200, "{v}");
    let ch = &v["choices"][0];
    assert_eq!(ch["finish_reason"], "tool_calls");
    assert_eq!(ch["message"]["content"], "Checking.\n");
    let calls = ch["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!((calls[0]["type"].clone(), calls[0]["function"]["name"].clone()), (json!("function"), json!("get_weather")));
    assert_eq!(calls[0]["function"]["arguments"], r#"{"city": "Paris"}"#);
    assert!(calls[0]["id"].as_str().unwrap().starts_with("chatcmpl-tool-"));
    // Hermes' markers may be special tokens: their text is kept (vLLM's parser does this).
    assert!(!e.mock.last.lock().unwrap().as_ref().unwrap().skip_special_tokens);

    // Streamed: content deltas, then the call's first delta (index, id, type, name), then
    // argument fragments; no markup in any content; the fragments add up to the arguments.
    let chunks = stream(&e, &body(r#","stream":true"#)).await;
    let deltas: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"].get(0).map(|ch| &ch["delta"])).collect();
    let content: String = deltas.iter().filter_map(|d| d["content"].as_str()).collect();
    assert_eq!(content, "Checking.\n");
    let parts: Vec<&Value> = deltas.iter().filter_map(|d| d["tool_calls"].as_array()).flatten().collect();
    assert!(parts.len() >= 3, "arguments should stream in fragments: {parts:?}");
    assert_eq!((parts[0]["index"].clone(), parts[0]["type"].clone(), parts[0]["function"]["name"].clone()), (json!(0), json!("function"), json!("get_weather")));
    assert!(parts[0]["id"].as_str().unwrap().starts_with("chatcmpl-tool-"));
    assert!(parts[1..].iter().all(|p| p["index"] == 0 && p.get("id").is_none() && p["function"].get("name").is_none()));
    let args: String = parts.iter().filter_map(|p| p["function"]["arguments"].as_str()).collect();
    assert_eq!(args, r#"{"city": "Paris"}"#);
    let last = chunks.iter().rev().find(|c| c["choices"].get(0).is_some()).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
}

#[tokio::test]
async fn malformed_and_unparsed_output_is_content() {
    let e = env_with(Some(ToolParser::Hermes), true);
    let broken: &[&str] = &["<tool_call>", "\n{\"name\": ", "oops}", "\n</tool_call>"];
    script(&e, broken);
    let (s, v) = post(&e, "/v1/chat/completions", &body("")).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], broken.concat());
    assert!(v["choices"][0]["message"].get("tool_calls").is_none());
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let chunks = stream(&e, &body(r#","stream":true"#)).await;
    let content: String = chunks.iter().filter_map(|c| c["choices"].get(0)?.get("delta")?.get("content")?.as_str().map(str::to_string)).collect();
    assert_eq!(content, broken.concat());
    // tool_choice none: the output is not read for calls at all, and needs no flags.
    let e = env_with(None, false);
    script(&e, CALL_TOKENS);
    let (s, v) = post(&e, "/v1/chat/completions", &body(r#","tool_choice":"none""#)).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], CALL_TOKENS.concat());
}

#[tokio::test]
async fn forced_choices_put_a_grammar_on_the_request() {
    let e = env_with(Some(ToolParser::Hermes), false);
    script(&e, &["<tool_call>\n", "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}", "\n</tool_call>"]);
    let (s, v) = post(&e, "/v1/chat/completions", &body(r#","tool_choice":"required""#)).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(v["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"], r#"{"city": "Rome"}"#);
    let req = e.mock.last.lock().unwrap().clone().unwrap();
    let Some(quiver_engine::Constraint::Lark(g)) = &req.constraint else { panic!("no grammar: {:?}", req.constraint) };
    assert!(g.contains("<tool_call>") && g.contains("get_weather") && g.contains("%json"), "{g}");
    // A named function: one call, and finish_reason stays `stop` (OpenAI, vLLM).
    let named = r#","tool_choice":{"type":"function","function":{"name":"get_weather"}}"#;
    let (s, v) = post(&e, "/v1/chat/completions", &body(named)).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "get_weather");
    // Without a parser: vLLM's format, the bare arguments of the named function.
    let e = env_with(None, false);
    script(&e, &["{\"city\": ", "\"Oslo\"}"]);
    let (s, v) = post(&e, "/v1/chat/completions", &body(named)).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"], r#"{"city": "Oslo"}"#);
    assert!(e.mock.last.lock().unwrap().as_ref().unwrap().skip_special_tokens);
}

#[tokio::test]
async fn switches_and_bad_tool_input_are_400s_naming_the_field() {
    // vLLM's refusal of auto without both flags.
    for (parser, auto) in [(None, false), (Some(ToolParser::Hermes), false)] {
        let e = env_with(parser, auto);
        for extra in ["", r#","tool_choice":"auto""#] {
            let (s, v) = post(&e, "/v1/chat/completions", &body(extra)).await;
            assert_eq!(s, 400, "{v}");
            assert_eq!(error_of(&v), (crate::tools::AUTO_NEEDS_FLAGS, Some("tool_choice")));
        }
    }
    let e = env_with(Some(ToolParser::Hermes), true);
    for (b, field) in [
        (r#"{"messages":[{"role":"user","content":"hi"}],"tool_choice":"required"}"#.to_string(), "tool_choice"),
        (body(r#","tool_choice":{"type":"function","function":{"name":"nope"}}"#), "tool_choice"),
        (r#"{"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"no-such-type"}}}]}"#.into(), "tools[0].function.parameters"),
        (body(r#","tool_choice":"required","guided_regex":"a+""#), "tool_choice"),
        (r#"{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{no"}}]}]}"#.into(), "messages[0].tool_calls[0].function.arguments"),
        (r#"{"messages":[{"role":"tool","content":"18C","tool_call_id":7}]}"#.into(), "messages[0].tool_call_id"),
        (r#"{"messages":[{"role":"user","content":"hi"}],"functions":[{"name":"f"}]}"#.into(), "functions"),
    ] {
        let (s, v) = post(&e, "/v1/chat/completions", &b).await;
        assert_eq!(s, 400, "{b}: {v}");
        let (msg, param) = error_of(&v);
        assert_eq!(param, Some(field), "{b}: {msg}");
        assert!(msg.contains(field.split('[').next().unwrap()), "{b}: {msg}");
    }
    // A history with calls and results is accepted.
    let history = r#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},{"role":"tool","tool_call_id":"c1","content":"18C"}],"max_tokens":2}"#;
    let (s, v) = post(&e, "/v1/chat/completions", history).await;
    assert_eq!(s, 200, "{v}");
}
