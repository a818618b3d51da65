//! Streaming text of one sequence: incremental detokenization (never splitting a UTF-8
//! character) and stop strings (never emitting text that might begin a stop string until it is
//! resolved, and never emitting the stop string itself).

use quiver_model::tokenizer::Tokenizer;

/// Context tokens decoded in front of the new ones, so decoders whose rendering depends on the
/// previous token (SentencePiece's leading space) render the new text correctly.
const CONTEXT: usize = 4;

/// Incremental detokenizer over a sequence's token list (prompt + generated).
#[derive(Clone, Debug)]
pub struct Detok {
    prefix: usize,
    read: usize,
    skip_special: bool,
}

impl Detok {
    /// `skip_special`: leave special tokens' text out (the request's `skip_special_tokens`).
    pub fn new(prompt_len: usize, skip_special: bool) -> Self {
        Detok { prefix: prompt_len.saturating_sub(CONTEXT), read: prompt_len, skip_special }
    }

    fn decode(&self, tok: &Tokenizer, ids: &[u32]) -> String {
        tok.inner().decode(ids, self.skip_special).unwrap_or_default()
    }

    /// `ids` ends with the newly generated token; returns text completed by it.
    pub fn step(&mut self, tok: &Tokenizer, ids: &[u32]) -> Option<String> {
        let before = self.decode(tok, &ids[self.prefix..self.read]);
        let now = self.decode(tok, &ids[self.prefix..]);
        if now.len() <= before.len() || now.ends_with('\u{FFFD}') || !now.is_char_boundary(before.len()) {
            return None;
        }
        let new = now[before.len()..].to_string();
        self.prefix = self.read;
        self.read = ids.len();
        Some(new)
    }

    /// Whatever is still held back (an incomplete trailing character renders as U+FFFD).
    pub fn flush(&mut self, tok: &Tokenizer, ids: &[u32]) -> Option<String> {
        if self.read >= ids.len() {
            return None;
        }
        let before = self.decode(tok, &ids[self.prefix..self.read]);
        let now = self.decode(tok, &ids[self.prefix..]);
        self.prefix = ids.len();
        self.read = ids.len();
        let new = now.get(before.len()..).unwrap_or("").to_string();
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
