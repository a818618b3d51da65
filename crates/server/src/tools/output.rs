//! Tool calls read out of model output, whole or as it streams.
//!
//! A format reads the output so far into [`Piece`]s: the model's own text and the calls, in
//! order; text it cannot place yet (a marker half written, a call whose name has not come) is
//! held back. Formats are written so that reading more text only extends what was read before:
//! the last piece grows and new ones follow. Streaming then is the difference between two
//! reads, and the deltas of a stream add up to exactly what the whole output reads as. Output
//! that is not a call in the format (broken JSON, another shape) is the model's text, never an
//! error.

use std::ops::Range;

use super::json_scan::{scan_call, skip_ws, Scanned};
use super::{hermes, llama3, mistral};

/// One call as the client sees it: `arguments` is the model's JSON text, as written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Call {
    pub name: String,
    pub arguments: String,
}

/// What an output reads as: the model's text (tool-call markup taken out) and its calls.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Parsed {
    pub content: String,
    pub calls: Vec<Call>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    Text(Range<usize>),
    Call { name: String, arguments: Range<usize> },
}

/// How calls are written in an output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Format {
    /// Hermes / Qwen: `<tool_call>{"name": …, "arguments": …}</tool_call>`, text around them.
    Hermes,
    /// Llama 3.1 JSON: the whole output is `{"name": …, "parameters": …}` (`; ` between calls),
    /// optionally after `<|python_tag|>`.
    Llama3Json,
    /// Mistral: `[TOOL_CALLS][{"name": …, "arguments": …}, …]`, or from tokenizer v11 on
    /// `[TOOL_CALLS]name[ARGS]{…}`.
    Mistral,
    /// vLLM's forced calls without a parser: `[{"name": …, "parameters": …}, …]`.
    CallList,
    /// vLLM's named call without a parser: the output is the arguments of this function.
    Arguments(String),
}

impl Format {
    pub fn pieces(&self, text: &str, done: bool) -> Vec<Piece> {
        match self {
            Format::Hermes => hermes::pieces(text, done),
            Format::Llama3Json => llama3::pieces(text, done),
            Format::Mistral => mistral::pieces(text, done),
            Format::CallList => whole_list(text, done),
            Format::Arguments(name) => whole_arguments(name, text, done),
        }
    }

    /// A finished output.
    pub fn parse(&self, text: &str) -> Parsed {
        assemble(text, &self.pieces(text, true), true)
    }
}

/// Adds a text piece (nothing for an empty range).
pub(crate) fn push_text(out: &mut Vec<Piece>, r: Range<usize>) {
    if !r.is_empty() {
        out.push(Piece::Text(r));
    }
}

/// Where a trailing beginning of `marker` starts in `text[from..]` (the text's length when
/// there is none): that tail is held back until it is known whether the marker follows.
pub(crate) fn marker_tail(text: &str, from: usize, marker: &str) -> usize {
    let (t, m) = (&text.as_bytes()[from..], marker.as_bytes());
    (1..m.len().min(t.len() + 1)).rev().find(|&k| t.ends_with(&m[..k])).map_or(text.len(), |k| text.len() - k)
}

/// How a list of calls ended.
pub(crate) enum ListEnd {
    /// After its `]`.
    Closed(usize),
    /// It goes on (or the output was cut inside it).
    Open,
    /// The text from here is not part of the list.
    Broken(usize),
    /// Its first item is not a call.
    NotAList,
}

/// Reads `[CALL, CALL, …]` whose `[` is at `at`, pushing the calls.
pub(crate) fn call_list(text: &str, at: usize, keys: &[&str], done: bool, out: &mut Vec<Piece>) -> ListEnd {
    let mut i = skip_ws(text, at + 1);
    let mut first = true;
    loop {
        match scan_call(&text[i..], keys, done) {
            Scanned::Undecided => return ListEnd::Open,
            Scanned::NotACall if first => return ListEnd::NotAList,
            Scanned::NotACall => return ListEnd::Broken(i),
            Scanned::Call(c) => {
                out.push(Piece::Call { name: c.name, arguments: i + c.arguments.start..i + c.arguments.end });
                first = false;
                let Some(end) = c.end else { return ListEnd::Open };
                i = skip_ws(text, i + end);
                match text.as_bytes().get(i) {
                    None => return ListEnd::Open,
                    Some(b',') => i = skip_ws(text, i + 1),
                    Some(b']') => return ListEnd::Closed(i + 1),
                    Some(_) => return ListEnd::Broken(i),
                }
            }
        }
    }
}

fn whole_list(text: &str, done: bool) -> Vec<Piece> {
    let start = skip_ws(text, 0);
    let mut out = Vec::new();
    match text.as_bytes().get(start) {
        None if !done => {}
        Some(b'[') => match call_list(text, start, &["parameters", "arguments"], done, &mut out) {
            ListEnd::NotAList => return vec![Piece::Text(0..text.len())],
            ListEnd::Closed(e) | ListEnd::Broken(e) => push_text(&mut out, e..text.len()),
            ListEnd::Open => {}
        },
        _ => push_text(&mut out, 0..text.len()),
    }
    out
}

fn whole_arguments(name: &str, text: &str, done: bool) -> Vec<Piece> {
    use super::json_scan::{value_extent, Extent};
    let start = skip_ws(text, 0);
    if start == text.len() {
        return if done { vec![Piece::Text(0..text.len())] } else { vec![] };
    }
    // Arguments are an object (every tool's parameters are): output that does not open one is
    // text from its first byte, before any of it could have been streamed as a call.
    if text.as_bytes()[start] != b'{' {
        return vec![Piece::Text(0..text.len())];
    }
    let call = |end: usize| Piece::Call { name: name.to_string(), arguments: start..end };
    match value_extent(&text[start..]) {
        Extent::Invalid(0) => vec![Piece::Text(0..text.len())],
        Extent::Partial => vec![call(text.len())],
        Extent::Complete(n) | Extent::Invalid(n) => {
            let mut out = vec![call(start + n)];
            push_text(&mut out, start + n..text.len());
            out
        }
    }
}

/// The reading of `pieces`. Text next to calls that is only whitespace (the newlines between
/// `</tool_call>` and `<tool_call>`) is markup, not content. Without calls the text is the
/// content as written; while streaming, leading whitespace waits until it is known whether a
/// call follows it.
pub fn assemble(text: &str, pieces: &[Piece], done: bool) -> Parsed {
    let mut segments: Vec<String> = vec![String::new()];
    let mut calls = Vec::new();
    for p in pieces {
        match p {
            Piece::Text(r) => segments.last_mut().expect("a segment").push_str(&text[r.clone()]),
            Piece::Call { name, arguments } => {
                calls.push(Call { name: name.clone(), arguments: text[arguments.clone()].to_string() });
                segments.push(String::new());
            }
        }
    }
    let blank = |s: &String| s.trim_matches(|c: char| c.is_ascii_whitespace()).is_empty();
    let content = if calls.is_empty() {
        let only = segments.pop().unwrap_or_default();
        if done || !blank(&only) {
            only
        } else {
            String::new()
        }
    } else {
        segments.into_iter().filter(|s| !blank(s)).collect()
    };
    Parsed { content, calls }
}

/// What a stream chunk carries for tool calling.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Delta {
    Content(String),
    /// A new call (`index` among this output's calls) and its arguments so far.
    Call { index: usize, name: String, arguments: String },
    /// More of call `index`'s arguments.
    Arguments { index: usize, arguments: String },
}

/// One output being streamed through a format.
pub struct ToolStream {
    format: Format,
    text: String,
    content_sent: usize,
    /// Bytes of each started call's arguments sent.
    args_sent: Vec<usize>,
}

impl ToolStream {
    pub fn new(format: Format) -> Self {
        ToolStream { format, text: String::new(), content_sent: 0, args_sent: Vec::new() }
    }

    /// The deltas that `text`, the output's next piece, makes known.
    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        self.text.push_str(text);
        self.deltas(false)
    }

    /// The deltas of what was held back, at the end of the output.
    pub fn finish(&mut self) -> Vec<Delta> {
        self.deltas(true)
    }

    /// Calls begun so far.
    pub fn calls(&self) -> usize {
        self.args_sent.len()
    }

    fn deltas(&mut self, done: bool) -> Vec<Delta> {
        let p = assemble(&self.text, &self.format.pieces(&self.text, done), done);
        let mut out = Vec::new();
        // Formats only ever extend what they read; a reading that did not would be a bug, and
        // nothing already sent can be taken back, so such a difference is skipped.
        if let Some(more) = p.content.get(self.content_sent..).filter(|m| !m.is_empty()) {
            debug_assert!(p.content.len() >= self.content_sent);
            out.push(Delta::Content(more.to_string()));
            self.content_sent = p.content.len();
        }
        for (index, c) in p.calls.into_iter().enumerate() {
            match self.args_sent.get(index).copied() {
                None => {
                    self.args_sent.push(c.arguments.len());
                    out.push(Delta::Call { index, name: c.name, arguments: c.arguments });
                }
                Some(sent) => {
                    if let Some(more) = c.arguments.get(sent..).filter(|m| !m.is_empty()) {
                        out.push(Delta::Arguments { index, arguments: more.to_string() });
                        self.args_sent[index] = c.arguments.len();
                    }
                }
            }
        }
        out
    }
}

/// Test help: a call from its parts.
#[cfg(test)]
pub(crate) fn call(name: &str, arguments: &str) -> Call {
    Call { name: name.into(), arguments: arguments.into() }
}

/// Test help for every format: an output fed in every way of cutting it into two and three
/// pieces, and one character at a time, must stream to exactly what it reads as whole.
#[cfg(test)]
pub(crate) fn assert_streams_as_whole(format: &Format, text: &str) -> Parsed {
    let whole = format.parse(text);
    let mut cuts: Vec<Vec<usize>> = text.char_indices().map(|(i, _)| vec![i]).collect();
    let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).step_by(3).collect();
    for &a in &bounds {
        for &b in bounds.iter().filter(|&&b| b > a) {
            cuts.push(vec![a, b]);
        }
    }
    cuts.push(text.char_indices().map(|(i, _)| i).collect());
    for cut in cuts {
        let mut s = ToolStream::new(format.clone());
        let mut got = Parsed::default();
        let mut apply = |d: Vec<Delta>| {
            for d in d {
                match d {
                    Delta::Content(c) => got.content.push_str(&c),
                    Delta::Call { index, name, arguments } => {
                        assert_eq!(index, got.calls.len(), "{text:?} cut at {cut:?}");
                        got.calls.push(Call { name, arguments });
                    }
                    Delta::Arguments { index, arguments } => got.calls[index].arguments.push_str(&arguments),
                }
            }
        };
        let mut from = 0;
        for &c in cut.iter().chain(std::iter::once(&text.len())) {
            apply(s.push(&text[from..c]));
            from = c;
        }
        apply(s.finish());
        assert_eq!(got, whole, "{text:?} streamed cut at {cut:?}");
    }
    whole
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marker_tails_are_held() {
        assert_eq!(marker_tail("abc<tool", 0, "<tool_call>"), 3);
        assert_eq!(marker_tail("abc<", 0, "<tool_call>"), 3);
        assert_eq!(marker_tail("abc", 0, "<tool_call>"), 3);
        assert_eq!(marker_tail("<tool_call", 0, "<tool_call>"), 0);
        assert_eq!(marker_tail("a<b", 0, "<tool_call>"), 3);
    }

    #[test]
    fn forced_outputs_without_a_parser_read_as_vllm_writes_them() {
        let list = Format::CallList;
        let got = assert_streams_as_whole(&list, r#"[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]"#);
        assert_eq!(got, Parsed { content: String::new(), calls: vec![call("a", r#"{"x": 1}"#), call("b", "{}")] });
        assert_eq!(assert_streams_as_whole(&list, "[1, 2]").content, "[1, 2]");
        let named = Format::Arguments("f".into());
        assert_eq!(assert_streams_as_whole(&named, r#"{"city": "Oslo"}"#).calls, vec![call("f", r#"{"city": "Oslo"}"#)]);
        // Cut short by max_tokens: the call is there with what was written.
        assert_eq!(named.parse(r#"{"city": "Os"#).calls, vec![call("f", r#"{"city": "Os"#)]);
        assert_eq!(assert_streams_as_whole(&named, "no json").content, "no json");
    }
}
