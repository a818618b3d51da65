//! Streaming text of one sequence: incremental detokenization (never splitting a UTF-8
//! character) and stop strings (never emitting text that might begin a stop string until it is
//! resolved, and never emitting the stop string itself).

use quiver_model::tokenizer::Tokenizer;

/// Context tokens decoded in front of the new ones, so decoders whose rendering depends on the
/// previous token (SentencePiece's leading space) render the new text correctly.
const CONTEXT: usize = 4;

/// Incremental detokenizer over a sequence's token list (prompt + generated): it decodes a
/// window of ids (a few before the last shown text, then the new ones) with and without the new
/// ones and shows the difference once it does not end in U+FFFD (an incomplete character). With
/// a byte-level tokenizer (`Tokenizer::token_bytes`) the window is kept as bytes, each new
/// token's appended, and decoded by UTF-8 rules alone — the same text at the same tokens
/// without the tokenizer's decoder (a dozen allocations per token); from the first token it
/// cannot render alone it falls back to decoding ids.
#[derive(Clone, Debug)]
pub struct Detok {
    /// The window: ids from `prefix`, the shown text ending at `read`.
    prefix: usize,
    read: usize,
    skip_special: bool,
    /// Byte path: the bytes of ids `prefix..bytes_read`, the first `split` of them those of
    /// `prefix..read`.
    win: Vec<u8>,
    split: usize,
    bytes_read: usize,
    /// False: ids decoded by the tokenizer (always for `windowed`, the tests' reference).
    bytes_ok: bool,
}

impl Detok {
    /// `skip_special`: leave special tokens' text out (the request's `skip_special_tokens`).
    pub fn new(prompt_len: usize, skip_special: bool) -> Self {
        let prefix = prompt_len.saturating_sub(CONTEXT);
        Detok { prefix, read: prompt_len, skip_special, win: Vec::new(), split: 0, bytes_read: prefix, bytes_ok: true }
    }

    /// A detokenizer that always decodes ids with the tokenizer, whatever it is.
    pub fn windowed(prompt_len: usize, skip_special: bool) -> Self {
        Detok { bytes_ok: false, ..Detok::new(prompt_len, skip_special) }
    }

    /// Byte path: appends the bytes of the ids not read yet; false (and ids decoded from now
    /// on) without a byte table or at an id it cannot render alone.
    fn read_bytes(&mut self, tok: &Tokenizer, ids: &[u32]) -> bool {
        let Some(bytes) = tok.token_bytes().filter(|_| self.bytes_ok) else { return false };
        let from = self.bytes_read.min(ids.len());
        if ids[from..].iter().any(|&id| bytes.irregular(id, self.skip_special)) {
            self.bytes_ok = false;
            self.win = Vec::new();
            return false;
        }
        for (i, &id) in ids.iter().enumerate().skip(from) {
            let b = bytes.get(id, self.skip_special);
            self.win.extend_from_slice(b);
            if i < self.read {
                self.split += b.len();
            }
        }
        self.bytes_read = self.bytes_read.max(ids.len());
        true
    }

    /// The window decoded without and with the new ids.
    fn texts<'a>(&'a self, tok: &Tokenizer, ids: &[u32], byte_path: bool) -> (std::borrow::Cow<'a, str>, std::borrow::Cow<'a, str>) {
        if byte_path {
            (String::from_utf8_lossy(&self.win[..self.split]), String::from_utf8_lossy(&self.win))
        } else {
            let decode = |ids: &[u32]| tok.inner().decode(ids, self.skip_special).unwrap_or_default().into();
            (decode(&ids[self.prefix..self.read]), decode(&ids[self.prefix..]))
        }
    }

    /// The window now starts at `read` and shows through `end`.
    fn advance(&mut self, end: usize) {
        self.prefix = self.read;
        self.read = end;
        if self.bytes_ok {
            self.win.drain(..self.split);
            self.split = self.win.len();
        }
    }

    /// `ids` ends with the newly generated token; returns text completed by it.
    pub fn step(&mut self, tok: &Tokenizer, ids: &[u32]) -> Option<String> {
        let byte_path = self.read_bytes(tok, ids);
        let (before, now) = self.texts(tok, ids, byte_path);
        if now.len() <= before.len() || now.ends_with('\u{FFFD}') || !now.is_char_boundary(before.len()) {
            return None;
        }
        let new = now[before.len()..].to_string();
        self.advance(ids.len());
        Some(new)
    }

    /// Whatever is still held back (an incomplete trailing character renders as U+FFFD).
    pub fn flush(&mut self, tok: &Tokenizer, ids: &[u32]) -> Option<String> {
        let byte_path = self.read_bytes(tok, ids);
        if self.read >= ids.len() {
            return None;
        }
        let (before, now) = self.texts(tok, ids, byte_path);
        let new = now.get(before.len()..).unwrap_or("").to_string();
        // Nothing is held any more: the window restarts after the last id.
        self.prefix = ids.len();
        self.read = ids.len();
        self.win.clear();
        self.split = 0;
        (!new.is_empty()).then_some(new)
    }
}

/// Holds back text that could be the start of a stop string.
#[derive(Clone, Debug, Default)]
pub struct StopScan {
    pending: String,
}

impl StopScan {
    /// Appends `text`; writes what can be emitted to `out`. Returns the index in `stops` of
    /// the stop string that matched (the earliest in the text): `out` then ends right before
    /// it (`include`: right after it) and the rest is dropped.
    pub fn push(&mut self, text: &str, stops: &[String], include: bool, out: &mut String) -> Option<usize> {
        self.pending.push_str(text);
        if stops.is_empty() {
            out.push_str(&self.pending);
            self.pending.clear();
            return None;
        }
        let first = stops.iter().enumerate().filter(|(_, s)| !s.is_empty()).filter_map(|(i, s)| self.pending.find(s.as_str()).map(|p| (p, i))).min();
        if let Some((p, i)) = first {
            let end = if include { p + stops[i].len() } else { p };
            out.push_str(&self.pending[..end]);
            self.pending.clear();
            return Some(i);
        }
        // Longest suffix of pending that is a proper prefix of some stop string.
        let mut hold = 0;
        for s in stops {
            let max = (s.len().saturating_sub(1)).min(self.pending.len());
            for k in (hold + 1..=max).rev() {
                if s.is_char_boundary(k) && self.pending.ends_with(&s[..k]) {
                    hold = k;
                    break;
                }
            }
        }
        let cut = self.pending.len() - hold;
        out.push_str(&self.pending[..cut]);
        self.pending.drain(..cut);
        None
    }

    /// Appends text that stop strings are not matched in (generated before `min_tokens`, as
    /// vLLM starts its stop-string search after them): emitted as it is.
    pub fn push_unchecked(&mut self, text: &str, out: &mut String) {
        self.flush(out);
        out.push_str(text);
    }

    /// End of generation without a stop string: release what was held back.
    pub fn flush(&mut self, out: &mut String) {
        out.push_str(&self.pending);
        self.pending.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(chunks: &[&str], stops: &[&str]) -> (Vec<String>, bool) {
        feed_incl(chunks, stops, false)
    }

    fn feed_incl(chunks: &[&str], stops: &[&str], include: bool) -> (Vec<String>, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut s = StopScan::default();
        let mut outs = Vec::new();
        for c in chunks {
            let mut o = String::new();
            let stop = s.push(c, &stops, include, &mut o);
            outs.push(o);
            if stop.is_some() {
                return (outs, true);
            }
        }
        let mut o = String::new();
        s.flush(&mut o);
        outs.push(o);
        (outs, false)
    }

    #[test]
    fn stop_string_split_across_chunks_is_never_emitted() {
        let (o, stopped) = feed(&["Hello ", "wor", "ld! END", "more"], &["world!"]);
        assert!(stopped);
        assert_eq!(o, vec!["Hello ", "", ""]);
        let (o, stopped) = feed(&["a<", "b", "<st", "x"], &["<stop>"]);
        assert!(!stopped);
        assert_eq!(o.concat(), "a<b<stx");
        assert_eq!(o[0], "a");
        assert_eq!(o[2], "");
    }

    #[test]
    fn multibyte_stop_prefixes_hold_on_char_boundaries() {
        let (o, stopped) = feed(&["x", "é", "ab", "éc"], &["éé", "abé"]);
        assert!(stopped);
        assert_eq!(o.concat(), "xé");
    }

    #[test]
    fn included_stop_string_ends_the_output_and_reports_its_index() {
        let (o, stopped) = feed_incl(&["Hello ", "wor", "ld! END"], &["zz", "world!"], true);
        assert!(stopped);
        assert_eq!(o.concat(), "Hello world!");
        let mut s = StopScan::default();
        let mut o = String::new();
        assert_eq!(s.push("a b END c", &["END".into(), "b".into()], false, &mut o), Some(1));
        assert_eq!(o, "a ");
    }
}
