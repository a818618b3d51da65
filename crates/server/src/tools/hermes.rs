//! The Hermes / Qwen format (vLLM's `hermes` parser): each call a JSON object between
//! `<tool_call>` and `</tool_call>`, free text around them. Qwen2.5's template renders history
//! calls as `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>`, one per line; forced
//! calls are written the same way.

use super::json_scan::{scan_call, skip_ws, Scanned};
use super::output::{marker_tail, push_text, Piece};

pub const OPEN: &str = "<tool_call>";
pub const CLOSE: &str = "</tool_call>";
const KEYS: &[&str] = &["arguments", "parameters"];

pub fn pieces(text: &str, done: bool) -> Vec<Piece> {
    let mut out = Vec::new();
    let mut pos = 0;
    loop {
        let Some(found) = text[pos..].find(OPEN) else {
            let end = if done { text.len() } else { marker_tail(text, pos, OPEN) };
            push_text(&mut out, pos..end);
            return out;
        };
        let open = pos + found;
        push_text(&mut out, pos..open);
        let body = skip_ws(text, open + OPEN.len());
        match scan_call(&text[body..], KEYS, done) {
            Scanned::Undecided => return out,
            // `<tool_call>` with something else after it: the model's text; read on after it.
            Scanned::NotACall => {
                push_text(&mut out, open..body);
                pos = body;
            }
            Scanned::Call(c) => {
                out.push(Piece::Call { name: c.name, arguments: body + c.arguments.start..body + c.arguments.end });
                let Some(end) = c.end else { return out };
                let after = body + end;
                let close = skip_ws(text, after);
                if text[close..].starts_with(CLOSE) {
                    pos = close + CLOSE.len();
                } else if !done && CLOSE.starts_with(&text[close..]) {
                    return out;
                } else {
                    // A call without its closing tag (the output ended, or text follows).
                    pos = after;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::output::{assert_streams_as_whole, call, Call, Format, Parsed};

    fn parsed(content: &str, calls: Vec<Call>) -> Parsed {
        Parsed { content: content.into(), calls }
    }

    #[test]
    fn calls_and_text_around_them() {
        let f = Format::Hermes;
        for (out, want) in [
            ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>", parsed("", vec![call("get_weather", r#"{"city": "Paris", "unit": "celsius"}"#)])),
            // Qwen's parallel calls: one block per call, a newline between.
            (
                "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {\"n\": [1, 2]}}\n</tool_call>",
                parsed("", vec![call("a", "{}"), call("b", r#"{"n": [1, 2]}"#)]),
            ),
            ("Let me look that up.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"q\": \"é ü\"}}\n</tool_call>", parsed("Let me look that up.\n", vec![call("f", r#"{"q": "é ü"}"#)])),
            ("<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call> And done.", parsed(" And done.", vec![call("f", "{}")])),
            // Members in another order, and vLLM's `parameters` spelling.
            ("<tool_call>\n{\"arguments\": {\"x\": 1}, \"name\": \"f\"}\n</tool_call>", parsed("", vec![call("f", r#"{"x": 1}"#)])),
            ("<tool_call>{\"name\": \"f\", \"parameters\": {\"x\": 1}}</tool_call>", parsed("", vec![call("f", r#"{"x": 1}"#)])),
            // No closing tag before the end.
            ("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": true}}", parsed("", vec![call("f", r#"{"x": true}"#)])),
            // Cut by max_tokens inside the arguments: the call with what was written.
            ("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"city\": \"Par", parsed("", vec![call("f", r#"{"city": "Par"#)])),
        ] {
            assert_eq!(assert_streams_as_whole(&f, out), want, "{out:?}");
        }
    }

    #[test]
    fn malformed_output_is_plain_content() {
        let f = Format::Hermes;
        for out in [
            "Just an answer, no tools.",
            "<tool_call>\nnot json\n</tool_call>",
            "<tool_call>\n{\"tool\": \"f\", \"args\": {}}\n</tool_call>",
            "<tool_call>\n{\"name\": 3, \"arguments\": {}}\n</tool_call>",
            "<tool_call>\n{'name': 'f', 'arguments': {}}\n</tool_call>",
            "<tool_call>",
            "<tool_",
            "  \n",
            "",
            "A <b>tag</b> and a <tool_call",
        ] {
            assert_eq!(assert_streams_as_whole(&f, out), parsed(out, vec![]), "{out:?}");
        }
        // A call that breaks inside its arguments keeps what was valid; the rest is text.
        let out = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"ok\": True}}\n</tool_call>";
        assert_eq!(assert_streams_as_whole(&f, out), parsed("True}}\n</tool_call>", vec![call("f", r#"{"ok": "#)]));
        // A broken block before a good one: text, then the call.
        let out = "<tool_call>oops</tool_call><tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>";
        assert_eq!(assert_streams_as_whole(&f, out), parsed("<tool_call>oops</tool_call>", vec![call("g", "{}")]));
    }
}
