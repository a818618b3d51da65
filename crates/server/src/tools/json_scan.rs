//! JSON read incrementally from model output: how far a value at the start of a text goes, every
//! byte checked against JSON's grammar, so a tool call's arguments can be streamed as they are
//! written and a broken call is recognised at the first byte that breaks it. The call object
//! (`{"name": …, "arguments": …}`) is read on top of it.

use std::ops::Range;

/// How far a JSON value at the start of a text goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Extent {
    /// The value ends at this byte offset.
    Complete(usize),
    /// All of the text is a valid beginning of a value; more may follow.
    Partial,
    /// `text[..at]` is a valid beginning; the byte at `at` cannot continue it.
    Invalid(usize),
}

pub fn is_ws(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\n' | b'\r')
}

/// Offset of the first non-whitespace byte at or after `at`.
pub fn skip_ws(s: &str, mut at: usize) -> usize {
    let b = s.as_bytes();
    while at < b.len() && is_ws(b[at]) {
        at += 1;
    }
    at
}

#[derive(Clone, Copy)]
enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    Exp,
    ExpSign,
    ExpDigits,
}

impl Num {
    /// The state after `c`, or None when `c` does not continue the number.
    fn step(self, c: u8) -> Option<Num> {
        use Num::*;
        Some(match (self, c) {
            (Minus, b'0') => Zero,
            (Minus, b'1'..=b'9') => Int,
            (Int, b'0'..=b'9') => Int,
            (Zero | Int, b'.') => Dot,
            (Dot | Frac, b'0'..=b'9') => Frac,
            (Zero | Int | Frac, b'e' | b'E') => Exp,
            (Exp, b'+' | b'-') => ExpSign,
            (Exp | ExpSign | ExpDigits, b'0'..=b'9') => ExpDigits,
            _ => return None,
        })
    }
    fn can_end(self) -> bool {
        matches!(self, Num::Zero | Num::Int | Num::Frac | Num::ExpDigits)
    }
}

#[derive(Clone, Copy)]
enum St {
    /// A value must start here.
    Value,
    /// After `[`: a value or `]`.
    ValueOrClose,
    /// After `{`: a key or `}`.
    KeyOrClose,
    /// After `,` in an object.
    Key,
    Colon,
    /// After a value inside a container: `,` or the closer.
    After,
    /// Inside a string; `hex` counts the \u digits still due, `esc` is set after a backslash.
    Str { key: bool, esc: bool, hex: u8 },
    Num(Num),
    Lit(&'static [u8], usize),
}

/// How far the JSON value starting at byte 0 of `s` goes (no leading whitespace).
pub fn value_extent(s: &str) -> Extent {
    let b = s.as_bytes();
    let mut open: Vec<u8> = Vec::new();
    let mut st = St::Value;
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        // A value ended at `end`: done at the top level, else back inside its container.
        macro_rules! value_done {
            ($end:expr) => {{
                if open.is_empty() {
                    return Extent::Complete($end);
                }
                st = St::After;
            }};
        }
        match st {
            St::Value => match c {
                b'{' => {
                    open.push(b'}');
                    st = St::KeyOrClose;
                }
                b'[' => {
                    open.push(b']');
                    st = St::ValueOrClose;
                }
                b'"' => st = St::Str { key: false, esc: false, hex: 0 },
                b'-' => st = St::Num(Num::Minus),
                b'0' => st = St::Num(Num::Zero),
                b'1'..=b'9' => st = St::Num(Num::Int),
                b't' => st = St::Lit(b"true", 1),
                b'f' => st = St::Lit(b"false", 1),
                b'n' => st = St::Lit(b"null", 1),
                c if is_ws(c) && !open.is_empty() => {}
                _ => return Extent::Invalid(i),
            },
            St::ValueOrClose => match c {
                c if is_ws(c) => {}
                b']' => {
                    open.pop();
                    value_done!(i + 1);
                }
                _ => {
                    st = St::Value;
                    continue;
                }
            },
            St::KeyOrClose | St::Key => match c {
                c if is_ws(c) => {}
                b'"' => st = St::Str { key: true, esc: false, hex: 0 },
                b'}' if matches!(st, St::KeyOrClose) => {
                    open.pop();
                    value_done!(i + 1);
                }
                _ => return Extent::Invalid(i),
            },
            St::Colon => match c {
                c if is_ws(c) => {}
                b':' => st = St::Value,
                _ => return Extent::Invalid(i),
            },
            St::After => match c {
                c if is_ws(c) => {}
                b',' => st = if open.last() == Some(&b'}') { St::Key } else { St::Value },
                c if open.last() == Some(&c) => {
                    open.pop();
                    value_done!(i + 1);
                }
                _ => return Extent::Invalid(i),
            },
            St::Str { key, esc, hex } => {
                if hex > 0 {
                    if !c.is_ascii_hexdigit() {
                        return Extent::Invalid(i);
                    }
                    st = St::Str { key, esc: false, hex: hex - 1 };
                } else if esc {
                    match c {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => st = St::Str { key, esc: false, hex: 0 },
                        b'u' => st = St::Str { key, esc: false, hex: 4 },
                        _ => return Extent::Invalid(i),
                    }
                } else {
                    match c {
                        b'\\' => st = St::Str { key, esc: true, hex: 0 },
                        b'"' if key => st = St::Colon,
                        b'"' => value_done!(i + 1),
                        c if c < 0x20 => return Extent::Invalid(i),
                        _ => {}
                    }
                }
            }
            St::Num(n) => match n.step(c) {
                Some(next) => st = St::Num(next),
                // The number ended before this byte, which the container reads next.
                None if n.can_end() => {
                    value_done!(i);
                    continue;
                }
                None => return Extent::Invalid(i),
            },
            St::Lit(word, k) => {
                if c != word[k] {
                    return Extent::Invalid(i);
                }
                if k + 1 == word.len() {
                    value_done!(i + 1);
                } else {
                    st = St::Lit(word, k + 1);
                }
            }
        }
        i += 1;
    }
    Extent::Partial
}

/// One member of an object as far as it has been read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    pub key: String,
    /// The value's bytes so far (empty while it has not begun).
    pub value: Range<usize>,
    pub complete: bool,
}

/// The members of the object at the start of `s` (after `{`, no leading whitespace), and how
/// far the object goes. A member appears once its key and colon have been read.
pub fn object_members(s: &str) -> (Vec<Member>, Extent) {
    let b = s.as_bytes();
    let mut members = Vec::new();
    if b.is_empty() {
        return (members, Extent::Partial);
    }
    if b[0] != b'{' {
        return (members, Extent::Invalid(0));
    }
    let mut at = skip_ws(s, 1);
    if at == b.len() {
        return (members, Extent::Partial);
    }
    if b[at] == b'}' {
        return (members, Extent::Complete(at + 1));
    }
    loop {
        // The key: a string read with the value scanner (it ends at its closing quote).
        if b[at] != b'"' {
            return (members, Extent::Invalid(at));
        }
        let key_end = match value_extent(&s[at..]) {
            Extent::Complete(n) => at + n,
            Extent::Partial => return (members, Extent::Partial),
            Extent::Invalid(n) => return (members, Extent::Invalid(at + n)),
        };
        let key: String = serde_json::from_str(&s[at..key_end]).unwrap_or_default();
        at = skip_ws(s, key_end);
        if at == b.len() {
            return (members, Extent::Partial);
        }
        if b[at] != b':' {
            return (members, Extent::Invalid(at));
        }
        let start = skip_ws(s, at + 1);
        match value_extent(&s[start..]) {
            Extent::Complete(n) => members.push(Member { key, value: start..start + n, complete: true }),
            Extent::Partial => {
                members.push(Member { key, value: start..b.len(), complete: false });
                return (members, Extent::Partial);
            }
            Extent::Invalid(n) => {
                members.push(Member { key, value: start..start + n, complete: false });
                return (members, Extent::Invalid(start + n));
            }
        }
        at = skip_ws(s, members.last().map_or(at, |m| m.value.end));
        if at == b.len() {
            return (members, Extent::Partial);
        }
        match b[at] {
            b'}' => return (members, Extent::Complete(at + 1)),
            b',' => {
                at = skip_ws(s, at + 1);
                if at == b.len() {
                    return (members, Extent::Partial);
                }
            }
            _ => return (members, Extent::Invalid(at)),
        }
    }
}

/// A call object as far as it has been read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallScan {
    pub name: String,
    /// The arguments' bytes so far: a valid beginning of a JSON value.
    pub arguments: Range<usize>,
    /// Where the call's text ends: after its `}`, or at the first byte that broke it. None
    /// while it goes on.
    pub end: Option<usize>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scanned {
    /// More text is needed to tell.
    Undecided,
    /// Not a call: the text is the model's own.
    NotACall,
    Call(CallScan),
}

/// Reads `{"name": NAME, KEY: ARGS}` at the start of `s` (no leading whitespace), `KEY` one of
/// `arg_keys`. Name first, then the arguments, is the order every template shows the model and
/// every forced grammar writes: such a call is known as soon as its arguments begin, so they
/// stream. Members in another order are read once the object is complete. `done`: no more
/// text will come.
pub fn scan_call(s: &str, arg_keys: &[&str], done: bool) -> Scanned {
    let (members, extent) = object_members(s);
    if let [name, args, ..] = members.as_slice() {
        // At the end of the output a call cut right after its header is still a call (cut
        // short); arguments that break at their first byte never began.
        let begun = !args.value.is_empty() || (done && extent == Extent::Partial);
        if name.key == "name" && name.complete && arg_keys.contains(&args.key.as_str()) && begun {
            if let Ok(n) = serde_json::from_str::<String>(&s[name.value.clone()]) {
                let end = match extent {
                    Extent::Complete(e) | Extent::Invalid(e) => Some(e),
                    Extent::Partial => None,
                };
                return Scanned::Call(CallScan { name: n, arguments: args.value.clone(), end });
            }
        }
    }
    match extent {
        Extent::Partial if !done => Scanned::Undecided,
        Extent::Complete(end) => {
            let name = members.iter().find(|m| m.key == "name").and_then(|m| serde_json::from_str::<String>(&s[m.value.clone()]).ok());
            let args = members.iter().find(|m| arg_keys.contains(&m.key.as_str()));
            match (name, args) {
                (Some(name), Some(a)) => Scanned::Call(CallScan { name, arguments: a.value.clone(), end: Some(end) }),
                _ => Scanned::NotACall,
            }
        }
        _ => Scanned::NotACall,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_follow_json_grammar() {
        for (s, want) in [
            (r#"{"a": [1, 2.5e-3, true, null, "x\"\u00e9"]} tail"#, Extent::Complete(43)),
            ("{}", Extent::Complete(2)),
            ("[ ]", Extent::Complete(3)),
            ("-0.5,", Extent::Complete(4)),
            (r#""é""#, Extent::Complete(4)),
            (r#"{"a": {"b": [1, {"c": "#, Extent::Partial),
            ("12", Extent::Partial),
            ("tr", Extent::Partial),
            (r#"{"a": tru!"#, Extent::Invalid(9)),
            (r#"{"a" 1}"#, Extent::Invalid(5)),
            (r#"{"a": 1,}"#, Extent::Invalid(8)),
            ("[1 2]", Extent::Invalid(3)),
            ("01", Extent::Complete(1)),
            ("{'a': 1}", Extent::Invalid(1)),
            ("\"a\nb\"", Extent::Invalid(2)),
            (r#""\x""#, Extent::Invalid(2)),
            (r#"{"a": True}"#, Extent::Invalid(6)),
            (" 1", Extent::Invalid(0)),
            ("[1}", Extent::Invalid(2)),
        ] {
            assert_eq!(value_extent(s), want, "{s}");
        }
        // Every valid document is complete exactly at its end, and every prefix is partial.
        let doc = r#"{"city": "Zürich", "days": [1, 2], "hot": false, "t": -1.5E+2, "n": null}"#;
        assert_eq!(value_extent(doc), Extent::Complete(doc.len()));
        for (i, _) in doc.char_indices().skip(1) {
            assert_eq!(value_extent(&doc[..i]), Extent::Partial, "{}", &doc[..i]);
        }
    }

    #[test]
    fn calls_are_known_once_their_arguments_begin() {
        let keys = &["arguments"];
        let s = r#"{"name": "get_weather", "arguments": {"city": "Paris"}} rest"#;
        let Scanned::Call(c) = scan_call(s, keys, false) else { panic!() };
        assert_eq!((c.name.as_str(), &s[c.arguments.clone()], c.end), ("get_weather", r#"{"city": "Paris"}"#, Some(55)));
        // Before the arguments begin nothing is known; once they do the call streams.
        assert_eq!(scan_call(r#"{"name": "f", "argum"#, keys, false), Scanned::Undecided);
        assert_eq!(scan_call(r#"{"name": "f", "arguments": "#, keys, false), Scanned::Undecided);
        let Scanned::Call(c) = scan_call(r#"{"name": "f", "arguments": {"a"#, keys, false) else { panic!() };
        assert_eq!((c.arguments.len(), c.end), (3, None));
        // Other orders wait for the whole object.
        assert_eq!(scan_call(r#"{"arguments": {}, "name": "f""#, keys, false), Scanned::Undecided);
        let Scanned::Call(c) = scan_call(r#"{"arguments": {}, "name": "f"}"#, keys, false) else { panic!() };
        assert_eq!(c.name, "f");
        // Objects that are not calls, and broken ones before the arguments.
        for s in [r#"{"answer": 42}"#, r#"{"name": 5, "arguments": {}}"#, r#"{"name": "f"}"#, "{oops", r#"{"name": "f", "arguments": x"#] {
            assert_eq!(scan_call(s, keys, true), Scanned::NotACall, "{s}");
        }
        // A call broken inside its arguments ends at the break; its arguments are the valid part.
        let s = r#"{"name": "f", "arguments": {"a": tru!e}}"#;
        let Scanned::Call(c) = scan_call(s, keys, false) else { panic!() };
        assert_eq!((&s[c.arguments.clone()], c.end), (r#"{"a": tru"#, Some(36)));
    }
}
