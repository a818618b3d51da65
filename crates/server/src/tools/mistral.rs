//! Mistral's format (vLLM's `mistral` parser): text, then `[TOOL_CALLS]` and a JSON list of
//! `{"name": …, "arguments": …}` (tokenizers before v11), or `[TOOL_CALLS]name[ARGS]{…}` per
//! call (v11 on). Both markers are special tokens in Mistral's vocabularies, so requests
//! parsed this way keep special tokens in their text.

use super::json_scan::{skip_ws, value_extent, Extent};
use super::output::{call_list, marker_tail, push_text, ListEnd, Piece};

pub const MARKER: &str = "[TOOL_CALLS]";
pub const ARGS: &str = "[ARGS]";
const KEYS: &[&str] = &["arguments", "parameters"];

fn is_name_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.')
}

/// What follows one `[TOOL_CALLS]`.
enum After {
    /// Read on from here.
    At(usize),
    /// Held back (or, at the end, part of a call cut short).
    Stop,
    /// Not calls: the marker is the model's text.
    Text,
}

/// `name[ARGS]{…}` at `at`.
fn named_call(text: &str, at: usize, done: bool, out: &mut Vec<Piece>) -> After {
    let rest = &text.as_bytes()[at..];
    let name_len = rest.iter().take_while(|&&c| is_name_byte(c)).count();
    let args_at = at + name_len;
    if !text[args_at..].starts_with(ARGS) {
        return if !done && ARGS.starts_with(&text[args_at..]) { After::Stop } else { After::Text };
    }
    let start = args_at + ARGS.len();
    let name = text[at..args_at].to_string();
    let call = |end: usize| Piece::Call { name: name.clone(), arguments: start..end };
    match value_extent(&text[start..]) {
        Extent::Invalid(0) => After::Text,
        Extent::Partial if start == text.len() && !done => After::Stop,
        Extent::Partial => {
            out.push(call(text.len()));
            After::Stop
        }
        Extent::Complete(n) | Extent::Invalid(n) => {
            out.push(call(start + n));
            After::At(start + n)
        }
    }
}

pub fn pieces(text: &str, done: bool) -> Vec<Piece> {
    let mut out = Vec::new();
    let mut pos = 0;
    loop {
        let Some(found) = text[pos..].find(MARKER) else {
            let end = if done { text.len() } else { marker_tail(text, pos, MARKER) };
            push_text(&mut out, pos..end);
            return out;
        };
        let marker = pos + found;
        push_text(&mut out, pos..marker);
        let at = skip_ws(text, marker + MARKER.len());
        let after = match text.as_bytes().get(at) {
            None if !done => After::Stop,
            Some(b'[') => match call_list(text, at, KEYS, done, &mut out) {
                ListEnd::Closed(e) | ListEnd::Broken(e) => After::At(e),
                ListEnd::Open => After::Stop,
                ListEnd::NotAList => After::Text,
            },
            Some(&c) if is_name_byte(c) => named_call(text, at, done, &mut out),
            _ => After::Text,
        };
        match after {
            After::At(e) => pos = e,
            After::Stop => return out,
            After::Text => {
                push_text(&mut out, marker..at);
                pos = at;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::output::{assert_streams_as_whole, call, Format, Parsed};

    #[test]
    fn both_generations_of_the_format() {
        let f = Format::Mistral;
        for (out, content, calls) in [
            (r#"[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]"#, "", vec![call("get_weather", r#"{"city": "Paris"}"#)]),
            (r#"[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 2}}]"#, "", vec![call("a", "{}"), call("b", r#"{"x": 2}"#)]),
            (r#"Sure.[TOOL_CALLS][{"name": "a", "arguments": {}}]"#, "Sure.", vec![call("a", "{}")]),
            (r#"[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}"#, "", vec![call("get_weather", r#"{"city": "Paris"}"#)]),
            (r#"[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b.v2[ARGS]{"q": "x"}"#, "", vec![call("a", "{}"), call("b.v2", r#"{"q": "x"}"#)]),
            (r#"[TOOL_CALLS][{"name": "f", "arguments": {"x": "cut"#, "", vec![call("f", r#"{"x": "cut"#)]),
            (r#"[TOOL_CALLS]f[ARGS]{"x": "cut"#, "", vec![call("f", r#"{"x": "cut"#)]),
        ] {
            assert_eq!(assert_streams_as_whole(&f, out), Parsed { content: content.into(), calls }, "{out:?}");
        }
    }

    #[test]
    fn malformed_output_is_plain_content() {
        let f = Format::Mistral;
        for out in ["No tools needed.", "[TOOL_CALLS]", "[TOOL_CALLS] nothing", "[TOOL_CALLS][1, 2]", "[TOOL_CALLS]f(x=1)", "[TOOL_CALLS]f[ARGS]oops", "[TOOL_", "[TOOL_CALLS][]"] {
            assert_eq!(assert_streams_as_whole(&f, out), Parsed { content: out.into(), calls: vec![] }, "{out:?}");
        }
    }
}
