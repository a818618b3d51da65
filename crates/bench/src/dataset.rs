//! Request datasets: `random` (exact token counts) and ShareGPT-style JSON.

use anyhow::{bail, Context, Result};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::path::Path;

/// What goes into the request's `prompt` / user message.
#[derive(Clone, Debug, PartialEq)]
pub enum PromptData {
    /// Token ids (sent as an int array to `/v1/completions`).
    Ids(Vec<u32>),
    Text(String),
}

#[derive(Clone, Debug)]
pub struct Prompt {
    pub data: PromptData,
    /// Client-side prompt token count (exact for `Ids`, exact with a tokenizer, an estimate
    /// otherwise; the server's `usage.prompt_tokens` replaces it when reported).
    pub input_len: usize,
    /// `max_tokens` to ask for.
    pub output_len: usize,
}

/// An HF `tokenizer.json` (path to the file or to a directory holding it).
pub struct Tok(tokenizers::Tokenizer);

impl Tok {
    pub fn load(path: &Path) -> Result<Tok> {
        let file = if path.is_dir() { path.join("tokenizer.json") } else { path.to_path_buf() };
        if file.extension().is_some_and(|e| e == "gguf") {
            bail!("--tokenizer: GGUF files are not supported by the bench client; pass the model's tokenizer.json (or its directory)");
        }
        let t = tokenizers::Tokenizer::from_file(&file)
            .map_err(|e| anyhow::anyhow!("loading tokenizer {}: {e}", file.display()))?;
        Ok(Tok(t))
    }
    pub fn vocab_size(&self) -> usize {
        self.0.get_vocab_size(true)
    }
    pub fn encode(&self, s: &str) -> Vec<u32> {
        self.0.encode(s, false).map(|e| e.get_ids().to_vec()).unwrap_or_default()
    }
    pub fn decode(&self, ids: &[u32]) -> String {
        self.0.decode(ids, true).unwrap_or_default()
    }
}

/// Settings of the `random` dataset.
#[derive(Clone, Debug)]
pub struct RandomSpec {
    pub input_len: usize,
    pub output_len: usize,
    /// SGLang semantics: each length is uniform in `[max(1, len·ratio), len]`; 1.0 = exact.
    pub range_ratio: f64,
    /// Token ids are drawn uniformly from `[id_low, vocab_size)`.
    pub vocab_size: usize,
    pub id_low: usize,
    /// Produce text (for `/v1/chat/completions`) instead of token ids.
    pub as_text: bool,
}

/// Common English words that are one token (with their leading space) in typical BPE vocabularies;
/// used to build text prompts of ≈N tokens when no tokenizer is given.
const WORDS: &[&str] = &[
    " the", " of", " and", " to", " in", " is", " that", " for", " it", " as", " was", " with", " be", " by", " on",
    " not", " he", " this", " are", " or", " his", " from", " at", " which", " but", " have", " an", " had", " they",
    " you", " were", " their", " one", " all", " we", " can", " her", " has", " there", " been", " if", " more",
    " when", " will", " would", " who", " so", " no", " time", " people", " year", " way", " day", " man", " thing",
    " world", " life", " hand", " part", " child", " eye", " place", " work", " week", " case", " point", " number",
    " group", " problem", " fact", " good", " new", " first", " last", " long", " great", " little", " own", " other",
    " old", " right", " big", " high", " small", " large", " next", " early", " young", " important", " few", " public",
];

fn draw_len(rng: &mut StdRng, len: usize, ratio: f64) -> usize {
    let len = len.max(1);
    let lo = ((len as f64 * ratio.clamp(0.0, 1.0)) as usize).max(1).min(len);
    rng.random_range(lo..=len)
}

/// `n` random prompts of (exactly, where possible) the drawn token lengths.
pub fn random_prompts(spec: &RandomSpec, n: usize, tok: Option<&Tok>, seed: u64) -> Result<Vec<Prompt>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let vocab = tok.map(|t| t.vocab_size()).unwrap_or(spec.vocab_size);
    if vocab <= spec.id_low + 1 {
        bail!("vocabulary size {vocab} too small for random token ids from {}", spec.id_low);
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let il = draw_len(&mut rng, spec.input_len, spec.range_ratio);
        let ol = draw_len(&mut rng, spec.output_len, spec.range_ratio);
        let ids: Vec<u32> = (0..il).map(|_| rng.random_range(spec.id_low..vocab) as u32).collect();
        let (data, input_len) = if !spec.as_text {
            (PromptData::Ids(ids), il)
        } else if let Some(t) = tok {
            // decode → re-encode → truncate/pad to the target length, a few rounds (vLLM's approach)
            let mut ids = ids;
            let mut text = t.decode(&ids);
            for _ in 0..4 {
                let re = t.encode(&text);
                if re.len() == il {
                    break;
                }
                ids = if re.len() > il {
                    re[..il].to_vec()
                } else {
                    let mut v = re;
                    while v.len() < il {
                        v.push(rng.random_range(spec.id_low..vocab) as u32);
                    }
                    v
                };
                text = t.decode(&ids);
            }
            let n = t.encode(&text).len();
            (PromptData::Text(text), n)
        } else {
            let mut s = String::new();
            for _ in 0..il {
                s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
            }
            (PromptData::Text(s.trim_start().to_string()), il)
        };
        out.push(Prompt { data, input_len, output_len: ol });
    }
    Ok(out)
}

/// ShareGPT JSON: `[{"conversations": [{"from": "human", "value": …}, {"from": "gpt", "value": …}, …]}, …]`.
/// Takes the first human turn and the reply after it; the reply's length becomes `max_tokens`
/// (or `fixed_output_len`). Lengths are counted with the tokenizer when given, else estimated as
/// chars/4. Like vLLM, drops pairs with a prompt or reply under 4 tokens, a prompt over 1024 or a
/// total over 2048 (unless `fixed_output_len` is set, which only drops short prompts).
pub fn sharegpt_prompts(path: &Path, n: usize, fixed_output_len: Option<usize>, tok: Option<&Tok>, seed: u64) -> Result<Vec<Prompt>> {
    let raw = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&raw).with_context(|| format!("parsing {} as JSON", path.display()))?;
    let arr = v.as_array().context("ShareGPT file must be a JSON array")?;
    let count = |s: &str| tok.map(|t| t.encode(s).len()).unwrap_or_else(|| s.chars().count().div_ceil(4));
    let mut pairs = Vec::new();
    for item in arr {
        let Some(conv) = item.get("conversations").or_else(|| item.get("conversation")).and_then(|c| c.as_array()) else {
            continue;
        };
        let turn = |t: &serde_json::Value| {
            let from = t.get("from").or_else(|| t.get("role")).and_then(|x| x.as_str()).unwrap_or("");
            let val = t.get("value").or_else(|| t.get("content")).and_then(|x| x.as_str()).unwrap_or("");
            (from.to_string(), val.to_string())
        };
        let Some(hi) = conv.iter().position(|t| matches!(turn(t).0.as_str(), "human" | "user")) else {
            continue;
        };
        let (_, prompt) = turn(&conv[hi]);
        let reply = conv.get(hi + 1).map(|t| turn(t).1).unwrap_or_default();
        let il = count(&prompt);
        let ol = match fixed_output_len {
            Some(f) => f,
            None => count(&reply),
        };
        if il < 4 || (fixed_output_len.is_none() && (ol < 4 || il > 1024 || il + ol > 2048)) {
            continue;
        }
        pairs.push(Prompt { data: PromptData::Text(prompt), input_len: il, output_len: ol.max(1) });
    }
    if pairs.is_empty() {
        bail!("{}: no usable conversations (need a human turn followed by a reply)", path.display());
    }
    let mut rng = StdRng::seed_from_u64(seed);
    pairs.shuffle(&mut rng);
    Ok((0..n).map(|i| pairs[i % pairs.len()].clone()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_ids_exact_len() {
        let spec = RandomSpec { input_len: 37, output_len: 5, range_ratio: 1.0, vocab_size: 1000, id_low: 10, as_text: false };
        let p = random_prompts(&spec, 20, None, 1).unwrap();
        assert_eq!(p.len(), 20);
        for q in &p {
            let PromptData::Ids(ids) = &q.data else { panic!() };
            assert_eq!(ids.len(), 37);
            assert!(ids.iter().all(|&i| (10..1000).contains(&i)));
            assert_eq!((q.input_len, q.output_len), (37, 5));
        }
        // deterministic per seed, different across prompts
        let p2 = random_prompts(&spec, 20, None, 1).unwrap();
        assert_eq!(p[3].data, p2[3].data);
        assert_ne!(p[0].data, p[1].data);
    }

    #[test]
    fn random_range_ratio_sglang_semantics() {
        let spec = RandomSpec { input_len: 100, output_len: 10, range_ratio: 0.5, vocab_size: 1000, id_low: 10, as_text: true };
        let p = random_prompts(&spec, 200, None, 7).unwrap();
        assert!(p.iter().all(|q| (50..=100).contains(&q.input_len) && (5..=10).contains(&q.output_len)));
        assert!(p.iter().any(|q| q.input_len < 75));
        let PromptData::Text(t) = &p[0].data else { panic!() };
        assert_eq!(t.split_whitespace().count(), p[0].input_len);
    }

    #[test]
    fn sharegpt_parsing() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("sg.json");
        let long = "word ".repeat(40);
        let data = serde_json::json!([
            {"conversations": [{"from": "human", "value": long}, {"from": "gpt", "value": "x".repeat(80)}]},
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "too short prompt"}]},
            {"conversations": [{"from": "gpt", "value": "no human"}]},
            {"id": "no conversations"}
        ]);
        std::fs::write(&f, data.to_string()).unwrap();
        let p = sharegpt_prompts(&f, 3, None, None, 0).unwrap();
        assert_eq!(p.len(), 3);
        assert_eq!(p[0].input_len, 50);
        assert_eq!(p[0].output_len, 20);
        let p = sharegpt_prompts(&f, 1, Some(7), None, 0).unwrap();
        assert_eq!(p[0].output_len, 7);
        std::fs::write(&f, "[]").unwrap();
        assert!(sharegpt_prompts(&f, 1, None, None, 0).is_err());
    }
}
