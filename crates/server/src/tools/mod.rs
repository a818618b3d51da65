//! Tool calling on `/v1/chat/completions`, with vLLM's switches: `--tool-call-parser NAME`
//! names how the model writes calls, `--enable-auto-tool-choice` lets it decide (`tool_choice`
//! `auto`). Tools always reach the chat template. `required` and a named function force the
//! calls through the structured-output grammar (`forced`); `auto` reads them out of free output
//! (`output` and the format modules). `spec` reads the request, `reply` writes OpenAI's shapes.

pub mod forced;
pub mod hermes;
pub mod json_scan;
pub mod llama3;
pub mod mistral;
pub mod output;
pub mod reply;
pub mod spec;

use std::str::FromStr;

use quiver_engine::Constraint;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::request::ChatRequest;
use crate::server::AppState;
pub use output::{Call, Delta, Format, Parsed, ToolStream};
pub use spec::{Choice, Tool, ToolSpec};

/// vLLM's `--tool-call-parser` names Quiver implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolParser {
    Hermes,
    Llama3Json,
    Mistral,
}

impl FromStr for ToolParser {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "hermes" => Ok(ToolParser::Hermes),
            "llama3_json" => Ok(ToolParser::Llama3Json),
            "mistral" => Ok(ToolParser::Mistral),
            _ => Err(format!("unknown tool-call parser `{s}`; available: hermes, llama3_json, mistral")),
        }
    }
}

impl ToolParser {
    pub fn format(self) -> Format {
        match self {
            ToolParser::Hermes => Format::Hermes,
            ToolParser::Llama3Json => Format::Llama3Json,
            ToolParser::Mistral => Format::Mistral,
        }
    }
    /// Hermes' and Mistral's markers are special tokens in their models' vocabularies: vLLM's
    /// parsers turn `skip_special_tokens` off so the markers stay in the text they read.
    fn keeps_special_tokens(self) -> bool {
        matches!(self, ToolParser::Hermes | ToolParser::Mistral)
    }
}

/// How a chat request's output is read for calls.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolPlan {
    pub format: Format,
    pub ids: reply::IdStyle,
    /// A named function was forced: the reply's `finish_reason` stays `stop`, as in OpenAI's
    /// API and vLLM.
    pub named: bool,
}

/// vLLM's refusal of `tool_choice: auto` without both flags.
pub const AUTO_NEEDS_FLAGS: &str = "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set";

/// `schema` for llguidance's check: lenient (unsupported keywords pass, a malformed schema
/// does not) unless the schema will drive a grammar.
fn schema_check(schema: &Value, strict: bool) -> Constraint {
    let mut s = schema.clone();
    if !strict {
        if let Some(m) = s.as_object_mut() {
            let g = m.entry("x-guidance").or_insert_with(|| json!({}));
            if let Some(g) = g.as_object_mut() {
                g.insert("lenient".into(), true.into());
            }
        }
    }
    Constraint::JsonSchema(s)
}

/// Decides what the request's tools do; a forced choice puts its grammar in the request's
/// constraint. None: the output is plain content.
pub fn plan(st: &AppState, r: &mut ChatRequest) -> Result<Option<ToolPlan>, ApiError> {
    let Some(spec) = &r.tools else { return Ok(None) };
    let parser = st.cfg.tool_parser;
    if spec.choice == Choice::Auto && !(st.cfg.enable_auto_tool_choice && parser.is_some()) {
        return Err(ApiError::field("tool_choice", AUTO_NEEDS_FLAGS));
    }
    let forced: Vec<&Tool> = match &spec.choice {
        Choice::Required => spec.tools.iter().collect(),
        Choice::Named(n) => spec.tools.iter().filter(|t| &t.name == n).take(1).collect(),
        Choice::None | Choice::Auto => vec![],
    };
    // Every definition must be a JSON Schema; those a grammar will follow must also be ones
    // llguidance implements in full (as for `response_format`).
    for (i, t) in spec.tools.iter().enumerate() {
        if let Some(p) = &t.parameters {
            let strict = forced.iter().any(|f| std::ptr::eq(*f, t));
            st.backend.check_constraint(&schema_check(p, strict)).map_err(|e| {
                let field = format!("tools[{i}].function.parameters");
                ApiError::field(&field, format!("`{field}` is not a JSON Schema this server can {}: {e}", if strict { "force" } else { "read" }))
            })?;
        }
    }
    let ids = match parser {
        Some(ToolParser::Mistral) => reply::IdStyle::Mistral,
        _ => reply::IdStyle::Random,
    };
    let named = matches!(spec.choice, Choice::Named(_));
    let format = match &spec.choice {
        Choice::None => return Ok(None),
        Choice::Auto if spec.tools.is_empty() => return Ok(None),
        Choice::Auto => parser.map(ToolParser::format).ok_or_else(|| ApiError::field("tool_choice", AUTO_NEEDS_FLAGS))?,
        Choice::Required | Choice::Named(_) => {
            if let Some((_, field)) = &r.common.constraint {
                return Err(ApiError::field("tool_choice", format!("a forced `tool_choice` writes its calls through a grammar and cannot be combined with `{field}`")));
            }
            let many = spec.parallel && !named;
            let grammar = forced::grammar(parser, &forced, many, named, &|s: &str| st.backend.token_id(s));
            r.common.constraint = Some((Constraint::Lark(grammar), "tool_choice".into()));
            match (parser, &spec.choice) {
                (Some(p), _) => p.format(),
                (None, Choice::Named(n)) => Format::Arguments(n.clone()),
                (None, _) => Format::CallList,
            }
        }
    };
    if parser.is_some_and(ToolParser::keeps_special_tokens) {
        r.common.out.skip_special_tokens = false;
    }
    Ok(Some(ToolPlan { format, ids, named }))
}
