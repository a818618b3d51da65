//! Chat templates rendered with minijinja, byte-identical to transformers' `apply_chat_template`.
//!
//! Model templates are written for Jinja2 as transformers configures it, so the environment
//! here reproduces that configuration rather than minijinja's defaults: trim_blocks and
//! lstrip_blocks on, Python string methods, Python-style printing of True/False/None, and
//! transformers' own `tojson`, `raise_exception` and `strftime_now`. minijinja's built-in
//! `tojson` HTML-escapes and sorts keys, which would change prompts (and so model outputs).

use std::fmt::Write as _;

use anyhow::{anyhow, Result};
use minijinja::value::{Kwargs, Rest};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};

/// One message as templates see it. The optional fields are OpenAI's tool-calling ones; absent,
/// they are undefined in the template (not null), as in the dicts transformers passes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant turn's calls in OpenAI's shape (`id`, `type`, `function.name`,
    /// `function.arguments`), with `arguments` a JSON value: HF templates index into it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A `tool` turn's answer to this call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into(), ..Default::default() }
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

const NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compiles `source`; syntax errors are reported here, not at the first request.
    pub fn new(source: &str, bos_token: Option<String>, eos_token: Option<String>) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_filter("tojson", tojson_filter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(NAME, source.to_string()).map_err(|e| anyhow!("chat template: {}", describe(&e)))?;
        Ok(ChatTemplate { env, source: source.to_string(), bos_token, eos_token })
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, serde_json::Map::new())
    }

    /// Renders with extra template variables (e.g. `tools`, `documents`), as transformers
    /// passes its `**kwargs`. Extra keys override bos_token/eos_token.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let mut ctx = serde_json::Map::new();
        ctx.insert("messages".into(), serde_json::to_value(messages)?);
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        // transformers passes only the special tokens the tokenizer has; an absent one is
        // undefined in the template, not an empty string.
        if let Some(b) = &self.bos_token {
            ctx.insert("bos_token".into(), b.clone().into());
        }
        if let Some(e) = &self.eos_token {
            ctx.insert("eos_token".into(), e.clone().into());
        }
        ctx.extend(extra);
        let tmpl = self.env.get_template(NAME).map_err(|e| anyhow!("chat template: {}", describe(&e)))?;
        tmpl.render(Value::from_serialize(&ctx)).map_err(|e| anyhow!("chat template: {}", describe(&e)))
    }
}

/// minijinja's Display of an error omits the chain; templates' raise_exception messages live
/// in the detail, and a user needs them.
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        let _ = write!(s, ": {inner}");
        src = inner.source();
    }
    s
}

/// Jinja2 prints Python's `str()` of a value: True/False/None. minijinja would print
/// true/false/none, which templates that interpolate flags would get wrong.
fn python_formatter(out: &mut minijinja::Output, state: &minijinja::State, value: &Value) -> Result<(), Error> {
    if value.kind() == minijinja::value::ValueKind::Bool {
        out.write_str(if value.is_true() { "True" } else { "False" })
            .map_err(|_| Error::new(ErrorKind::WriteFailure, "write"))
    } else if value.is_none() {
        out.write_str("None").map_err(|_| Error::new(ErrorKind::WriteFailure, "write"))
    } else {
        minijinja::escape_formatter(out, state, value)
    }
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, format!("raise_exception: {msg}")))
}

fn strftime_now(fmt: String) -> Result<String, Error> {
    use chrono::format::{Item, StrftimeItems};
    // chrono panics on Display of an invalid format; check the items first.
    if StrftimeItems::new(&fmt).any(|i| matches!(i, Item::Error)) {
        return Err(Error::new(ErrorKind::InvalidOperation, format!("strftime_now: invalid format {fmt:?}")));
    }
    let mut s = String::new();
    write!(s, "{}", chrono::Local::now().format(&fmt))
        .map_err(|_| Error::new(ErrorKind::InvalidOperation, format!("strftime_now: cannot format {fmt:?}")))?;
    Ok(s)
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`,
/// i.e. Python's `json.dumps` with those arguments. Positional arguments follow that order.
fn tojson_filter(value: Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let bad = |m: &str| Error::new(ErrorKind::InvalidOperation, format!("tojson: {m}"));
    let arg = |pos: usize, name: &str| -> Result<Option<Value>, Error> {
        let kw: Option<Value> = kwargs.get(name)?;
        Ok(kw.or_else(|| args.get(pos).cloned()).filter(|v| !v.is_none() && !v.is_undefined()))
    };
    let ensure_ascii = arg(0, "ensure_ascii")?.map(|v| v.is_true()).unwrap_or(false);
    let indent = match arg(1, "indent")? {
        None => None,
        Some(v) if v.as_str().is_some() => Some(v.as_str().unwrap_or_default().to_string()),
        Some(v) => {
            let n = i64::try_from(v).map_err(|_| bad("indent must be an integer or a string"))?;
            Some(" ".repeat(n.max(0) as usize))
        }
    };
    let (item_sep, key_sep) = match arg(2, "separators")? {
        None => (if indent.is_some() { "," } else { ", " }.to_string(), ": ".to_string()),
        Some(v) => {
            let parts: Vec<String> = v
                .try_iter()
                .map_err(|_| bad("separators must be a pair of strings"))?
                .map(|p| p.as_str().map(str::to_string).ok_or_else(|| bad("separators must be strings")))
                .collect::<Result<_, _>>()?;
            match <[String; 2]>::try_from(parts) {
                Ok([a, b]) => (a, b),
                Err(_) => return Err(bad("separators must be a pair of strings")),
            }
        }
    };
    let sort_keys = arg(3, "sort_keys")?.map(|v| v.is_true()).unwrap_or(false);
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value).map_err(|e| bad(&format!("cannot serialize: {e}")))?;
    let opts = JsonOpts { ensure_ascii, indent, item_sep, key_sep, sort_keys };
    let mut out = String::new();
    write_json(&mut out, &json, &opts, 0);
    Ok(Value::from(out))
}

struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn newline_indent(out: &mut String, opts: &JsonOpts, depth: usize) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(ind);
        }
    }
}

fn write_json(out: &mut String, v: &serde_json::Value, opts: &JsonOpts, depth: usize) {
    use serde_json::Value as J;
    match v {
        J::Null => out.push_str("null"),
        J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        J::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => {
                let _ = write!(out, "{i}");
            }
            (_, Some(u), _) => {
                let _ = write!(out, "{u}");
            }
            (_, _, Some(f)) => out.push_str(&python_float_repr(f)),
            _ => out.push_str(&n.to_string()),
        },
        J::String(s) => write_json_str(out, s, opts.ensure_ascii),
        J::Array(a) => {
            if a.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, e) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(out, opts, depth + 1);
                write_json(out, e, opts, depth + 1);
            }
            newline_indent(out, opts, depth);
            out.push(']');
        }
        J::Object(m) => {
            if m.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut entries: Vec<(&String, &serde_json::Value)> = m.iter().collect();
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, e)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(out, opts, depth + 1);
                write_json_str(out, k, opts.ensure_ascii);
                out.push_str(&opts.key_sep);
                write_json(out, e, opts, depth + 1);
            }
            newline_indent(out, opts, depth);
            out.push('}');
        }
    }
}

/// Python's json string escaping: the short escapes, other C0 controls as \u00xx, and with
/// ensure_ascii everything outside printable ASCII as \uxxxx (UTF-16 surrogate pairs).
fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{:04x}", unit);
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: shortest round-trip digits, positional for exponents in [-4, 16),
/// scientific (`1e-05`, `1.5e+16`) otherwise; json.dumps spells non-finite values NaN/Infinity.
fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    let sci = format!("{f:e}"); // e.g. "-1.5e-7", "1e16"
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = format!("{f}");
        if s.contains('.') {
            s
        } else {
            format!("{s}.0")
        }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        for (f, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (1e15, "1000000000000000.0"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1.2345e-7, "1.2345e-07"),
            (1e100, "1e+100"),
        ] {
            assert_eq!(python_float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn json_string_escaping_matches_python() {
        let mut s = String::new();
        write_json_str(&mut s, "a\"b\\c\n\u{1}\u{7f}é😀", false);
        assert_eq!(s, "\"a\\\"b\\\\c\\n\\u0001\u{7f}é😀\"");
        let mut s = String::new();
        write_json_str(&mut s, "\u{7f}é😀", true);
        assert_eq!(s, "\"\\u007f\\u00e9\\ud83d\\ude00\"");
    }

    /// The tool-calling fields reach the template as transformers passes them: history calls
    /// with their arguments as objects (templates `tojson` them, key order kept), the tool
    /// turn's id, and none of them defined on a plain message.
    #[test]
    fn tool_fields_reach_the_template() {
        let src = "{% for m in messages %}{{ m.role }}:{% if m.tool_calls is defined %}{% for c in m.tool_calls %}{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}{% endif %}{% if m.tool_call_id is defined %}[{{ m.tool_call_id }}]{% endif %}{{ m.content }};{% endfor %}{{ tools | tojson }}";
        let t = ChatTemplate::new(src, None, None).unwrap();
        let call = serde_json::json!({"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"z": 1, "a": [true, null]}}});
        let msgs = [
            ChatMessage::new("user", "hi"),
            ChatMessage { tool_calls: Some(vec![call]), ..ChatMessage::new("assistant", "") },
            ChatMessage { tool_call_id: Some("c1".into()), ..ChatMessage::new("tool", "18C") },
        ];
        let mut extra = serde_json::Map::new();
        extra.insert("tools".into(), serde_json::json!([{"type": "function", "function": {"name": "f"}}]));
        let got = t.render_with(&msgs, false, extra).unwrap();
        assert_eq!(got, r#"user:hi;assistant:f{"z": 1, "a": [true, null]};tool:[c1]18C;[{"type": "function", "function": {"name": "f"}}]"#);
    }
}
