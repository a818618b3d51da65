//! Llama 3.1's JSON format (vLLM's `llama3_json` parser): a call is the whole output,
//! `{"name": …, "parameters": …}` (vLLM also takes `arguments`), after an optional
//! `<|python_tag|>`; several calls are separated by `;`. An output that does not begin with a
//! call is an answer in text.

use super::json_scan::{scan_call, skip_ws, Scanned};
use super::output::{push_text, Piece};

pub const PYTHON_TAG: &str = "<|python_tag|>";
pub const SEPARATOR: &str = "; ";
const KEYS: &[&str] = &["parameters", "arguments"];

pub fn pieces(text: &str, done: bool) -> Vec<Piece> {
    let whole = || vec![Piece::Text(0..text.len())];
    let mut at = skip_ws(text, 0);
    if text[at..].starts_with(PYTHON_TAG) {
        at = skip_ws(text, at + PYTHON_TAG.len());
    } else if !done && PYTHON_TAG.starts_with(&text[at..]) {
        return vec![];
    }
    match text.as_bytes().get(at) {
        Some(b'{') => {}
        None if !done => return vec![],
        _ => return whole(),
    }
    let mut out = Vec::new();
    loop {
        match scan_call(&text[at..], KEYS, done) {
            Scanned::Undecided => return out,
            Scanned::NotACall if out.is_empty() => return whole(),
            Scanned::NotACall => {
                push_text(&mut out, at..text.len());
                return out;
            }
            Scanned::Call(c) => {
                out.push(Piece::Call { name: c.name, arguments: at + c.arguments.start..at + c.arguments.end });
                let Some(end) = c.end else { return out };
                let after = at + end;
                let mut next = skip_ws(text, after);
                if text.as_bytes().get(next) == Some(&b';') {
                    next = skip_ws(text, next + 1);
                }
                match text.as_bytes().get(next) {
                    Some(b'{') => at = next,
                    None if !done => return out,
                    _ => {
                        push_text(&mut out, after..text.len());
                        return out;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::output::{assert_streams_as_whole, call, Format, Parsed};

    #[test]
    fn whole_output_calls() {
        let f = Format::Llama3Json;
        for (out, calls) in [
            (r#"{"name": "get_weather", "parameters": {"city": "Paris"}}"#, vec![call("get_weather", r#"{"city": "Paris"}"#)]),
            (r#"<|python_tag|>{"name": "f", "arguments": {"a": 1}}"#, vec![call("f", r#"{"a": 1}"#)]),
            (" \n{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": [true]}}", vec![call("a", "{}"), call("b", r#"{"x": [true]}"#)]),
            (r#"{"parameters": {"x": 1}, "name": "f"}"#, vec![call("f", r#"{"x": 1}"#)]),
            (r#"{"name": "f", "parameters": {"x": "cut sh"#, vec![call("f", r#"{"x": "cut sh"#)]),
        ] {
            assert_eq!(assert_streams_as_whole(&f, out), Parsed { content: String::new(), calls }, "{out:?}");
        }
        // Text after the calls stays.
        let got = assert_streams_as_whole(&f, r#"{"name": "f", "parameters": {}} trailing words"#);
        assert_eq!((got.content.as_str(), got.calls.len()), (" trailing words", 1));
    }

    #[test]
    fn answers_and_malformed_output_are_plain_content() {
        let f = Format::Llama3Json;
        for out in [
            "The weather in Paris is sunny.",
            r#"{"answer": 42}"#,
            r#"{"name": "f"}"#,
            r#"{"name": "f", "parameters": oops}"#,
            "{not json",
            "Here: {\"name\": \"f\", \"parameters\": {}}",
            "<|python_tag|>print(1)",
            "<|python",
            "",
        ] {
            assert_eq!(assert_streams_as_whole(&f, out), Parsed { content: out.into(), calls: vec![] }, "{out:?}");
        }
    }
}
