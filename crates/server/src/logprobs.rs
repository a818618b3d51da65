//! Logprobs in the shapes clients read: OpenAI completions' parallel lists (prompt tokens
//! first under `echo`, the first of them `null`), chat's `content` list, and vLLM's
//! `prompt_logprobs` (`[null, {token id: {logprob, rank, decoded_token}}, ...]`).

use serde_json::{json, Map, Value};

use crate::backend::TokenLogprob;
use crate::server::AppState;

/// How token strings are written: their text, or `token_id:{id}` (vLLM's
/// `return_tokens_as_token_ids`, for tokens whose text is not valid on its own).
pub(crate) struct LpRender<'a> {
    pub st: &'a AppState,
    pub as_ids: bool,
}

impl LpRender<'_> {
    pub fn text(&self, id: u32) -> String {
        if self.as_ids {
            format!("token_id:{id}")
        } else {
            self.st.backend.token_text(id)
        }
    }

    /// Completions' `logprobs` for `toks` (a token without a logprob, the first prompt token
    /// under `echo`, gets `null`s); text offsets count from `offset` bytes into the choice.
    /// Returns the object and the offset after the last token.
    pub fn completion<'t>(&self, toks: impl IntoIterator<Item = (u32, Option<&'t TokenLogprob>)>, mut offset: usize) -> (Value, usize) {
        let (mut tokens, mut token_logprobs, mut top, mut offsets) = (vec![], vec![], vec![], vec![]);
        for (id, lp) in toks {
            let t = self.text(id);
            offsets.push(offset);
            offset += t.len();
            match lp {
                None => {
                    token_logprobs.push(Value::Null);
                    top.push(Value::Null);
                }
                Some(lp) => {
                    token_logprobs.push(json!(lp.logprob));
                    let mut m = Map::new();
                    m.insert(t.clone(), json!(lp.logprob));
                    for &(alt, l) in &lp.top {
                        m.entry(self.text(alt)).or_insert(json!(l));
                    }
                    top.push(Value::Object(m));
                }
            }
            tokens.push(Value::from(t));
        }
        (json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}), offset)
    }

    /// Chat's `logprobs.content` with `top_n` alternatives per token.
    pub fn chat(&self, toks: &[(u32, TokenLogprob)], top_n: usize) -> Value {
        let content: Vec<Value> = toks
            .iter()
            .map(|(id, lp)| {
                let top: Vec<Value> = lp
                    .top
                    .iter()
                    .take(top_n)
                    .map(|&(alt, l)| {
                        let s = self.text(alt);
                        json!({"token": s, "logprob": l, "bytes": s.as_bytes()})
                    })
                    .collect();
                let t = self.text(*id);
                json!({"token": t, "logprob": lp.logprob, "bytes": t.as_bytes(), "top_logprobs": top})
            })
            .collect();
        json!({"content": content})
    }

    /// vLLM's `prompt_logprobs` for `prompt`, whose tokens `1..` have `lps`: per position the
    /// prompt token and the top alternatives, keyed by token id.
    pub fn prompt(&self, prompt: &[u32], lps: &[TokenLogprob]) -> Value {
        let mut out = vec![Value::Null];
        for (&id, lp) in prompt[1..].iter().zip(lps) {
            let mut m = Map::new();
            m.insert(id.to_string(), json!({"logprob": lp.logprob, "rank": lp.rank, "decoded_token": self.text(id)}));
            for (rank, &(alt, l)) in lp.top.iter().enumerate() {
                m.entry(alt.to_string()).or_insert_with(|| json!({"logprob": l, "rank": rank + 1, "decoded_token": self.text(alt)}));
            }
            out.push(Value::Object(m));
        }
        Value::Array(out)
    }
}
