//! The request fields that ask for structured output, in OpenAI's, vLLM's and SGLang's
//! spellings, read into one engine [`Constraint`] together with the field that gave it (a
//! constraint the grammar engine refuses is a 400 naming that field).

use serde_json::Value;

use crate::error::ApiError;
use crate::request::Fields;
use quiver_engine::Constraint;

/// A constraint and the request field it came from.
pub type Named = (Constraint, String);

fn schema_of(name: &str, v: &Value) -> Result<Value, ApiError> {
    match v {
        Value::Object(_) | Value::Bool(_) => Ok(v.clone()),
        // vLLM and SGLang also take the schema as a JSON string.
        Value::String(s) => serde_json::from_str(s).map_err(|e| ApiError::field(name, format!("`{name}` is not valid JSON: {e}"))),
        _ => Err(ApiError::field(name, format!("`{name}` must be a JSON Schema object"))),
    }
}

fn string_of(name: &str, v: &Value) -> Result<String, ApiError> {
    v.as_str().map(str::to_string).ok_or_else(|| ApiError::field(name, format!("`{name}` must be a string")))
}

fn choices_of(name: &str, v: &Value) -> Result<Constraint, ApiError> {
    let bad = || ApiError::field(name, format!("`{name}` must be a non-empty list of strings"));
    let a = v.as_array().filter(|a| !a.is_empty()).ok_or_else(bad)?;
    Ok(Constraint::Choice(a.iter().map(|x| x.as_str().map(str::to_string).ok_or_else(bad)).collect::<Result<_, _>>()?))
}

/// Reads at most one constraint from `f` (vLLM refuses two kinds at once, so does this).
pub fn parse_constraint(f: &Fields) -> Result<Option<Named>, ApiError> {
    let mut found: Vec<Named> = Vec::new();
    // JSON's whitespace (compact unless asked for): a pattern and the field that gave it.
    let mut whitespace: Option<(String, String)> = f.str("guided_whitespace_pattern")?.map(|w| (w.to_string(), "guided_whitespace_pattern".to_string()));
    let mut push = |c: Constraint, name: String| found.push((c, name));
    if let Some(rf) = f.object("response_format")? {
        match rf.get("type").and_then(Value::as_str) {
            Some("text") => {}
            Some("json_object") => push(Constraint::JsonObject, "response_format".into()),
            Some("json_schema") => {
                let js = rf.get("json_schema").and_then(Value::as_object).ok_or_else(|| ApiError::field("response_format", "`response_format.json_schema` is required for type json_schema"))?;
                let schema = js.get("schema").ok_or_else(|| ApiError::field("response_format", "`response_format.json_schema.schema` is required"))?;
                push(Constraint::JsonSchema(schema_of("response_format.json_schema.schema", schema)?), "response_format".into());
            }
            Some(t @ "structural_tag") => return Err(ApiError::field("response_format", format!("`response_format` of type `{t}` is not supported by this server"))),
            other => return Err(ApiError::field("response_format", format!("`response_format.type` must be one of text, json_object, json_schema; got {other:?}"))),
        }
    }
    for (k, v) in [("guided_json", f.get("guided_json")), ("json_schema", f.get("json_schema"))] {
        if let Some(v) = v {
            let name = f.name(k);
            push(Constraint::JsonSchema(schema_of(&name, v)?), name);
        }
    }
    for k in ["guided_regex", "regex"] {
        if let Some(v) = f.get(k) {
            let name = f.name(k);
            push(Constraint::Regex(string_of(&name, v)?), name);
        }
    }
    if let Some(v) = f.get("guided_choice") {
        push(choices_of("guided_choice", v)?, "guided_choice".into());
    }
    if let Some(v) = f.get("guided_grammar") {
        push(Constraint::Lark(string_of("guided_grammar", v)?), "guided_grammar".into());
    }
    // vLLM's newer spelling: one object holding the same choices.
    if let Some(so) = f.object("structured_outputs")? {
        let sf = Fields::nested(so, "structured_outputs.");
        if let Some(v) = sf.get("json") {
            push(Constraint::JsonSchema(schema_of("structured_outputs.json", v)?), "structured_outputs.json".into());
        }
        if let Some(v) = sf.get("regex") {
            push(Constraint::Regex(string_of("structured_outputs.regex", v)?), "structured_outputs.regex".into());
        }
        if let Some(v) = sf.get("choice") {
            push(choices_of("structured_outputs.choice", v)?, "structured_outputs.choice".into());
        }
        if let Some(v) = sf.get("grammar") {
            push(Constraint::Lark(string_of("structured_outputs.grammar", v)?), "structured_outputs.grammar".into());
        }
        if sf.bool("json_object")?.unwrap_or(false) {
            push(Constraint::JsonObject, "structured_outputs.json_object".into());
        }
        if sf.get("structural_tag").is_some() {
            return Err(ApiError::field("structured_outputs.structural_tag", "`structured_outputs.structural_tag` is not supported by this server"));
        }
        if let Some(w) = sf.str("whitespace_pattern")? {
            whitespace = Some((w.to_string(), "structured_outputs.whitespace_pattern".to_string()));
        }
        if sf.bool("disable_any_whitespace")? == Some(false) {
            whitespace.get_or_insert((r"[\x20\x0A\x0D\x09]+".to_string(), "structured_outputs.disable_any_whitespace".to_string()));
        }
    }
    // The engine is llguidance; naming it (or leaving the choice to the server) is fine.
    if let Some(b) = f.str("guided_decoding_backend")? {
        if !matches!(b, "auto" | "guidance" | "llguidance") {
            return Err(ApiError::field("guided_decoding_backend", format!("`guided_decoding_backend` {b:?} is not available: this server's backend is llguidance")));
        }
    }
    if found.len() > 1 {
        return Err(ApiError::field(&found[1].1, format!("only one kind of structured output per request; got `{}` and `{}`", found[0].1, found[1].1)));
    }
    let mut c = found.pop();
    if let Some((pattern, field)) = whitespace {
        let schema = match &mut c {
            Some((Constraint::JsonSchema(s), _)) => s,
            Some((c @ Constraint::JsonObject, _)) => {
                *c = Constraint::JsonSchema(serde_json::json!({"type": "object"}));
                let Constraint::JsonSchema(s) = c else { unreachable!() };
                s
            }
            _ => return Err(ApiError::field(&field, format!("`{field}` applies to JSON output only"))),
        };
        match schema.as_object_mut() {
            Some(m) => {
                m.insert("x-guidance".into(), serde_json::json!({"whitespace_pattern": pattern}));
            }
            None => return Err(ApiError::field(&field, format!("`{field}` needs an object schema"))),
        }
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::parse_object;

    fn parse(body: &str) -> Result<Option<Named>, ApiError> {
        let m = parse_object(body.as_bytes()).unwrap();
        parse_constraint(&Fields::new(&m))
    }

    #[test]
    fn every_spelling_reads_into_one_constraint() {
        let schema = serde_json::json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        for (body, want) in [
            (format!(r#"{{"response_format":{{"type":"json_schema","json_schema":{{"name":"x","schema":{schema},"strict":true}}}}}}"#), Constraint::JsonSchema(schema.clone())),
            (format!(r#"{{"guided_json":{schema}}}"#), Constraint::JsonSchema(schema.clone())),
            (format!(r#"{{"guided_json":{}}}"#, serde_json::to_string(&schema.to_string()).unwrap()), Constraint::JsonSchema(schema.clone())),
            (r#"{"response_format":{"type":"json_object"}}"#.into(), Constraint::JsonObject),
            (r#"{"guided_regex":"[0-9]+"}"#.into(), Constraint::Regex("[0-9]+".into())),
            (r#"{"guided_choice":["yes","no"]}"#.into(), Constraint::Choice(vec!["yes".into(), "no".into()])),
            (r#"{"guided_grammar":"start: \"a\""}"#.into(), Constraint::Lark("start: \"a\"".into())),
            (r#"{"structured_outputs":{"regex":"a|b"}}"#.into(), Constraint::Regex("a|b".into())),
        ] {
            assert_eq!(parse(&body).unwrap().map(|n| n.0), Some(want), "{body}");
        }
        assert_eq!(parse(r#"{"response_format":{"type":"text"}}"#).unwrap(), None);
        // vLLM's whitespace pattern reaches llguidance through the schema's x-guidance.
        let got = parse(r#"{"response_format":{"type":"json_object"},"guided_whitespace_pattern":" *"}"#).unwrap().unwrap().0;
        assert_eq!(got, Constraint::JsonSchema(serde_json::json!({"type": "object", "x-guidance": {"whitespace_pattern": " *"}})));
    }

    #[test]
    fn bad_or_conflicting_constraints_name_the_field() {
        for (body, field) in [
            (r#"{"guided_regex":"a","guided_choice":["b"]}"#, "guided_choice"),
            (r#"{"guided_choice":[]}"#, "guided_choice"),
            (r#"{"guided_json":"{not json"}"#, "guided_json"),
            (r#"{"response_format":{"type":"json_schema"}}"#, "response_format"),
            (r#"{"guided_decoding_backend":"outlines","guided_regex":"a"}"#, "guided_decoding_backend"),
            (r#"{"guided_whitespace_pattern":" ","guided_regex":"a"}"#, "guided_whitespace_pattern"),
        ] {
            assert_eq!(parse(body).unwrap_err().param.as_deref(), Some(field), "{body}");
        }
    }
}
