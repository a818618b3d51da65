//! Structured output: a request's constraint (JSON schema, any JSON object, regex, a fixed
//! choice, a Lark grammar) compiled by llguidance into a per-sequence matcher whose mask of
//! allowed tokens goes into the row's logit edits before the draw (applied on the model's
//! device: `quiver_kernels::logit_edits`) and which advances on the drawn token. Only that row
//! is touched; unconstrained rows in the same step never see a grammar.
//!
//! llguidance computes each mask lazily over a token trie of the vocabulary (about 20 µs a
//! token on SmolLM2's 49k vocabulary, BENCHMARKS.md), so masks are computed on the host while
//! the device runs the forward pass, once the previous token is known (`engine/draw.rs`).

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use quiver_model::tokenizer::Tokenizer;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

/// What a request's output must match.
#[derive(Clone, Debug, PartialEq)]
pub enum Constraint {
    /// A JSON Schema (OpenAI's `json_schema`, vLLM's `guided_json`).
    JsonSchema(serde_json::Value),
    /// Any JSON object (`response_format: json_object`).
    JsonObject,
    /// A regular expression the whole output matches.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A Lark grammar (vLLM's `guided_grammar` with the llguidance backend).
    Lark(String),
}

/// JSON is written compactly (`", "` and `": "`, no other whitespace) unless the schema's
/// `x-guidance` says otherwise: vLLM's `disable_any_whitespace`. With free whitespace small
/// models loop on newlines inside an object until `max_tokens` (seen with SmolLM2-135M).
fn compact_json(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(m) = schema.as_object_mut() {
        m.entry("x-guidance").or_insert_with(|| serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}));
    }
    schema
}

impl Constraint {
    fn grammar(&self) -> TopLevelGrammar {
        match self {
            Constraint::JsonSchema(s) => TopLevelGrammar::from_json_schema(compact_json(s.clone())),
            Constraint::JsonObject => TopLevelGrammar::from_json_schema(compact_json(serde_json::json!({"type": "object"}))),
            Constraint::Regex(r) => TopLevelGrammar::from_regex(r),
            Constraint::Choice(c) => {
                // Lark string literals take JSON's escapes.
                let alts: Vec<String> = c.iter().map(|s| serde_json::to_string(s).unwrap_or_default()).collect();
                TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
            }
            Constraint::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        }
    }
}

/// The vocabulary as llguidance sees it: each token's bytes in a trie.
struct VocabEnv {
    trie: TokTrie,
}

impl TokenizerEnv for VocabEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.trie.greedy_tokenize(s)
    }
}

/// GPT-2's byte-level alphabet, inverted: the character each byte is written as in a
/// byte-level BPE vocabulary, back to the byte.
fn byte_level_decoder() -> std::collections::HashMap<char, u8> {
    let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    let mut map = std::collections::HashMap::new();
    let mut shifted = 0;
    for b in 0..256u32 {
        let c = if printable(b) {
            b
        } else {
            shifted += 1;
            255 + shifted
        };
        map.insert(char::from_u32(c).expect("valid char"), b as u8);
    }
    map
}

/// The bytes each token id stands for, `n_vocab` of them. Added (special) tokens carry
/// toktrie's marker so grammars never produce them as text; ids past the tokenizer's
/// vocabulary (padding rows of the LM head) become unreachable special tokens.
pub fn token_bytes(tok: &Tokenizer, n_vocab: usize) -> Vec<Vec<u8>> {
    let inner = tok.inner();
    let byte_level = format!("{:?}", inner.get_decoder()).contains("ByteLevel");
    let dec = byte_level_decoder();
    let special_of = |name: &str| {
        let mut v = vec![TokTrie::SPECIAL_TOKEN_MARKER];
        v.extend_from_slice(name.as_bytes());
        v
    };
    let mut out: Vec<Vec<u8>> = (0..n_vocab).map(|i| special_of(&format!("<[{i}]>"))).collect();
    let added = inner.get_added_tokens_decoder();
    for (s, id) in inner.get_vocab(true) {
        let Some(slot) = out.get_mut(id as usize) else { continue };
        *slot = if added.get(&id).is_some_and(|t| t.special) {
            special_of(&s)
        } else if byte_level && s.chars().all(|c| dec.contains_key(&c)) {
            s.chars().map(|c| dec[&c]).collect()
        } else if let Some(b) = s.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')).and_then(|h| u8::from_str_radix(h, 16).ok()) {
            // SentencePiece byte fallback.
            vec![b]
        } else {
            s.replace('\u{2581}', " ").into_bytes()
        };
    }
    out
}

/// Compiles constraints for one model's vocabulary (built once per engine: the trie takes
/// ~100 ms for 49k tokens).
pub struct Grammars {
    factory: ParserFactory,
}

impl Grammars {
    pub fn new(tok: &Tokenizer, n_vocab: usize) -> anyhow::Result<Grammars> {
        let words = token_bytes(tok, n_vocab);
        let eos = tok.eos_token_ids();
        let info = TokRxInfo::new(n_vocab as u32, eos.first().copied().unwrap_or(0));
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let env: TokEnv = Arc::new(VocabEnv { trie });
        let factory = ParserFactory::new_simple(&env)?;
        Ok(Grammars { factory })
    }

    /// A matcher at the start of the output; the error says what is wrong with the grammar.
    pub fn compile(&self, c: &Constraint) -> Result<Guide, String> {
        let parser = self.factory.create_parser(c.grammar()).map_err(|e| format!("{e:#}"))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Guide { matcher, ready: None })
    }
}

/// One sequence's position in its grammar.
pub struct Guide {
    matcher: Matcher,
    /// The next token's mask, computed ahead (`prepare`) while the forward pass runs.
    ready: Option<Result<toktrie::SimpleVob, String>>,
}

impl Guide {
    /// An independent copy (the samples of `n > 1` each follow the grammar on their own).
    pub fn fork(&self) -> Guide {
        Guide { matcher: self.matcher.deep_clone(), ready: None }
    }

    /// The tokens the grammar allows next (computed ahead by [`Self::prepare`], or now): for
    /// the draw's logit edits. Err: the grammar is in an error state.
    pub fn next_mask(&mut self) -> Result<toktrie::SimpleVob, String> {
        match self.ready.take() {
            Some(m) => m,
            None => self.matcher.compute_mask_or_eos().map_err(|e| format!("{e:#}")),
        }
    }

    /// Sets every token the grammar does not allow next to -inf (the host's form of the mask
    /// the engine's draws apply on the device). Err: the grammar is at a dead end (an error
    /// state, or no token can continue).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        let mask = self.next_mask()?;
        let n = logits.len();
        // Word-wise over the bitset: runs of allowed tokens cost one test per 32.
        mask.iter_unset_entries(|t| {
            if t < n {
                logits[t] = f32::NEG_INFINITY;
            }
        });
        logits[mask.len().min(n)..].fill(f32::NEG_INFINITY);
        let mut any = false;
        mask.iter_set_entries(|t| any |= t < n && logits[t] > f32::NEG_INFINITY);
        if any {
            Ok(())
        } else {
            Err("no token the grammar allows can be drawn".into())
        }
    }

    /// Computes the next token's mask now (it depends on the grammar state only, not on the
    /// logits), so the engine can do it while the device runs the forward pass.
    pub fn prepare(&mut self) {
        if self.ready.is_none() {
            self.ready = Some(self.matcher.compute_mask_or_eos().map_err(|e| format!("{e:#}")));
        }
    }

    /// Advances past the drawn token.
    pub fn advance(&mut self, token: u32) -> Result<(), String> {
        self.matcher.consume_token(token).map_err(|e| format!("{e:#}"))
    }

    /// The grammar is complete: nothing more may follow.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_alphabet_round_trips_every_byte() {
        let d = byte_level_decoder();
        assert_eq!(d.len(), 256);
        assert_eq!(d[&'Ġ'], b' ');
        assert_eq!(d[&'Ċ'], b'\n');
        assert_eq!(d[&'a'], b'a');
        let mut bytes: Vec<u8> = d.values().copied().collect();
        bytes.sort_unstable();
        bytes.dedup();
        assert_eq!(bytes.len(), 256);
    }
}
