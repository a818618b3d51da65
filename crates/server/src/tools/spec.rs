//! What a chat request says about tools: the definitions, `tool_choice`,
//! `parallel_tool_calls`, and the calls and results in its history. Checked field by field
//! with vLLM's rules (`ChatCompletionRequest.check_tool_usage`) and, where vLLM has one, its
//! message; every refusal names the field.

use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::request::{kind, Fields};

/// One function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    /// The JSON Schema of its arguments, when given.
    pub parameters: Option<Value>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Choice {
    /// No calls are read from the output (the template still sees the tools, as in vLLM).
    None,
    /// The model decides; calls are read from its output by the server's parser.
    Auto,
    /// At least one call, forced by a grammar.
    Required,
    /// One call of this function, forced by a grammar.
    Named(String),
}

#[derive(Clone, Debug, PartialEq)]
pub struct ToolSpec {
    pub tools: Vec<Tool>,
    pub choice: Choice,
    /// OpenAI's `parallel_tool_calls` (default true): false allows one call.
    pub parallel: bool,
}

fn bad(param: &str, msg: impl Into<String>) -> ApiError {
    ApiError::field(param, msg)
}

fn parse_tool(i: usize, v: &Value) -> Result<Tool, ApiError> {
    let at = format!("tools[{i}]");
    let t = v.as_object().ok_or_else(|| bad(&at, format!("`{at}` must be an object, got {}", kind(v))))?;
    match t.get("type") {
        None => {}
        Some(Value::String(s)) if s == "function" => {}
        Some(other) => return Err(bad(&format!("{at}.type"), format!("`{at}.type` must be \"function\", got {other}"))),
    }
    let fat = format!("{at}.function");
    let f = match t.get("function") {
        Some(Value::Object(f)) => f,
        Some(other) => return Err(bad(&fat, format!("`{fat}` must be an object, got {}", kind(other)))),
        None => return Err(bad(&fat, format!("`{fat}` is required"))),
    };
    let name = match f.get("name") {
        Some(Value::String(n)) if !n.is_empty() => n.clone(),
        _ => return Err(bad(&format!("{fat}.name"), format!("`{fat}.name` must be a non-empty string"))),
    };
    if let Some(d) = f.get("description").filter(|d| !d.is_null() && !d.is_string()) {
        return Err(bad(&format!("{fat}.description"), format!("`{fat}.description` must be a string, got {}", kind(d))));
    }
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => None,
        Some(p @ Value::Object(_)) => Some(p.clone()),
        Some(other) => return Err(bad(&format!("{fat}.parameters"), format!("`{fat}.parameters` must be a JSON Schema object, got {}", kind(other)))),
    };
    Ok(Tool { name, parameters })
}

const CORRECT_USAGE: &str = "Correct usage: `{\"type\": \"function\", \"function\": {\"name\": \"my_function\"}}`";

fn parse_choice(v: Option<&Value>, tools: Option<&[Tool]>) -> Result<Choice, ApiError> {
    let p = "tool_choice";
    let Some(v) = v else {
        // vLLM: tools without a choice mean "auto".
        return Ok(if tools.is_some_and(|t| !t.is_empty()) { Choice::Auto } else { Choice::None });
    };
    if v.as_str() == Some("none") {
        return Ok(Choice::None);
    }
    let Some(tools) = tools else {
        return Err(bad(p, "When using `tool_choice`, `tools` must be set."));
    };
    match v {
        Value::String(s) if s == "auto" => Ok(Choice::Auto),
        // With no tools `required` behaves like `none`, as in OpenAI's API and vLLM.
        Value::String(s) if s == "required" => Ok(if tools.is_empty() { Choice::None } else { Choice::Required }),
        Value::Object(o) => {
            if let Some(t) = o.get("type").filter(|t| t.as_str() != Some("function")) {
                return Err(bad(p, format!("Invalid `type` in `tool_choice`: {t}! {CORRECT_USAGE}")));
            }
            let f = match o.get("function") {
                Some(Value::Object(f)) => f,
                other => return Err(bad(p, format!("Invalid value for `function`: `{}` in `tool_choice`! {CORRECT_USAGE}", other.unwrap_or(&Value::Null)))),
            };
            let name = match f.get("name") {
                None => return Err(bad(p, format!("Expected field `name` in `function` in `tool_choice`! {CORRECT_USAGE}"))),
                Some(Value::String(n)) if !n.is_empty() => n.clone(),
                Some(n) => return Err(bad(p, format!("Invalid `name` in `function`: `{n}` in `tool_choice`! {CORRECT_USAGE}"))),
            };
            if !tools.iter().any(|t| t.name == name) {
                return Err(bad(p, "The tool specified in `tool_choice` does not match any of the specified `tools`"));
            }
            Ok(Choice::Named(name))
        }
        other => Err(bad(p, format!("Invalid value for `tool_choice`: {other}! Only named tools, \"none\", \"auto\" or \"required\" are supported."))),
    }
}

/// `tools`, `tool_choice` and `parallel_tool_calls` of a chat request; None when it has no
/// tools and no choice. The second value is `tools` as the client wrote it: what the chat
/// template renders, key order and all, as transformers renders the dicts it is given.
pub fn parse(f: &Fields) -> Result<Option<(ToolSpec, Value)>, ApiError> {
    let raw = match f.get("tools") {
        None => None,
        Some(v @ Value::Array(_)) => Some(v.clone()),
        Some(v) => return Err(bad("tools", format!("`tools` must be a list of tools, got {}", kind(v)))),
    };
    let tools = match &raw {
        Some(Value::Array(a)) => Some(a.iter().enumerate().map(|(i, t)| parse_tool(i, t)).collect::<Result<Vec<_>, _>>()?),
        _ => None,
    };
    let choice = parse_choice(f.get("tool_choice"), tools.as_deref())?;
    let parallel = f.bool("parallel_tool_calls")?.unwrap_or(true);
    Ok(match (tools, raw) {
        (Some(tools), Some(raw)) => Some((ToolSpec { tools, choice, parallel }, raw)),
        _ => None,
    })
}

/// An assistant message's `tool_calls`, for the template: OpenAI sends each call's
/// `arguments` as a JSON string, HF templates expect the object (vLLM parses it the same way).
pub fn history_calls(i: usize, v: &Value) -> Result<Vec<Value>, ApiError> {
    let at = format!("messages[{i}].tool_calls");
    let calls = v.as_array().ok_or_else(|| bad(&at, format!("`{at}` must be a list of tool calls, got {}", kind(v))))?;
    calls
        .iter()
        .enumerate()
        .map(|(j, c)| {
            let cat = format!("{at}[{j}]");
            let mut c: Map<String, Value> = c.as_object().cloned().ok_or_else(|| bad(&cat, format!("`{cat}` must be an object")))?;
            let f = match c.get_mut("function") {
                Some(Value::Object(f)) => f,
                _ => return Err(bad(&format!("{cat}.function"), format!("`{cat}.function` must be an object with `name` and `arguments`"))),
            };
            if !f.get("name").is_some_and(Value::is_string) {
                return Err(bad(&format!("{cat}.function.name"), format!("`{cat}.function.name` must be a string")));
            }
            let aat = format!("{cat}.function.arguments");
            if let Some(Value::String(s)) = f.get("arguments") {
                let parsed: Value = serde_json::from_str(s).map_err(|e| bad(&aat, format!("`{aat}` is not valid JSON: {e}")))?;
                f.insert("arguments".into(), parsed);
            } else if !f.get("arguments").is_some_and(Value::is_object) {
                return Err(bad(&aat, format!("`{aat}` must be a JSON string")));
            }
            Ok(Value::Object(c))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::parse_object;

    fn spec(body: &str) -> Result<Option<ToolSpec>, ApiError> {
        let m = parse_object(body.as_bytes()).unwrap();
        parse(&Fields::new(&m)).map(|o| o.map(|(s, _)| s))
    }

    const TOOLS: &str = r#"[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object"}}},{"function":{"name":"noop"}}]"#;

    #[test]
    fn choices_follow_vllm() {
        let choice = |c: &str| spec(&format!(r#"{{"tools":{TOOLS}{c}}}"#)).unwrap().unwrap().choice;
        assert_eq!(choice(""), Choice::Auto);
        assert_eq!(choice(r#","tool_choice":"none""#), Choice::None);
        assert_eq!(choice(r#","tool_choice":"required""#), Choice::Required);
        assert_eq!(choice(r#","tool_choice":{"type":"function","function":{"name":"noop"}}"#), Choice::Named("noop".into()));
        assert_eq!(spec(r#"{"tools":[],"tool_choice":"required"}"#).unwrap().unwrap().choice, Choice::None);
        assert_eq!(spec(r#"{"tool_choice":"none"}"#).unwrap(), None);
        let s = spec(&format!(r#"{{"tools":{TOOLS},"parallel_tool_calls":false}}"#)).unwrap().unwrap();
        assert_eq!((s.parallel, s.tools[1].parameters.clone()), (false, None));
    }

    #[test]
    fn bad_tools_and_choices_name_the_field() {
        for (body, field, says) in [
            (r#"{"tool_choice":"required"}"#.to_string(), "tool_choice", "`tools` must be set"),
            (format!(r#"{{"tools":{TOOLS},"tool_choice":{{"type":"function","function":{{"name":"nope"}}}}}}"#), "tool_choice", "does not match any"),
            (format!(r#"{{"tools":{TOOLS},"tool_choice":"sometimes"}}"#), "tool_choice", "Invalid value for `tool_choice`"),
            (format!(r#"{{"tools":{TOOLS},"tool_choice":{{"function":"f"}}}}"#), "tool_choice", "Invalid value for `function`"),
            (format!(r#"{{"tools":{TOOLS},"tool_choice":{{"function":{{}}}}}}"#), "tool_choice", "Expected field `name`"),
            (r#"{"tools":{"name":"f"}}"#.into(), "tools", "must be a list"),
            (r#"{"tools":[{"type":"code","function":{"name":"f"}}]}"#.into(), "tools[0].type", "function"),
            (r#"{"tools":[{"type":"function"}]}"#.into(), "tools[0].function", "required"),
            (r#"{"tools":[{"function":{"name":""}}]}"#.into(), "tools[0].function.name", "non-empty"),
            (r#"{"tools":[{"function":{"name":"f","parameters":"{}"}}]}"#.into(), "tools[0].function.parameters", "JSON Schema"),
            (r#"{"tools":[{"function":{"name":"f","description":5}}]}"#.into(), "tools[0].function.description", "string"),
        ] {
            let e = spec(&body).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{body}");
            assert!(e.message.contains(says), "{body}: {}", e.message);
        }
    }

    #[test]
    fn history_arguments_become_objects() {
        let v: Value = serde_json::from_str(r#"[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\": [1]}"}}]"#).unwrap();
        let got = history_calls(2, &v).unwrap();
        assert_eq!(got[0]["function"]["arguments"], serde_json::json!({"a": [1]}));
        assert_eq!(got[0]["id"], "c1");
        let v: Value = serde_json::from_str(r#"[{"function":{"name":"f","arguments":"{oops"}}]"#).unwrap();
        assert_eq!(history_calls(2, &v).unwrap_err().param.as_deref(), Some("messages[2].tool_calls[0].function.arguments"));
    }
}
