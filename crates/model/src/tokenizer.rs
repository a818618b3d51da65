//! Tokenizer (HF tokenizer.json or GGUF metadata).
//!
//! Both sources end up as one `tokenizers::Tokenizer`, so encode/decode behave the same whatever
//! the model file; only construction differs. The GGUF path rebuilds the byte-level BPE that the
//! model was trained with from `tokenizer.ggml.*`, choosing the pre-tokenizer split the way
//! llama.cpp does from `tokenizer.ggml.pre`, because the merges alone do not say how text was
//! split before BPE and a wrong split silently changes ids.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::chat::ChatTemplate;
use crate::formats::gguf::{GgufFile, GgufValue};

/// GPT-2's split: contractions, letter runs, digit runs, punctuation runs, whitespace.
const GPT2_SPLIT: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3's split: like GPT-2 but case-insensitive contractions, a leading non-letter glued to
/// words, numbers in groups of at most three digits, and newlines kept apart from other spaces.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2 uses the Llama 3 split with single digits.
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GGUF token types (llama.cpp `llama_token_type`) that become added (special) tokens.
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Everything the GGUF tokenizer keys say, detached from the file so the tokenizer can be
/// built (and tested) without a GGUF on disk.
#[derive(Debug, Clone, Default)]
pub struct GgufTokenizerData {
    /// `tokenizer.ggml.model`; only "gpt2" (byte-level BPE) is supported.
    pub model: String,
    /// `tokenizer.ggml.pre`; selects the pre-tokenizer split.
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    /// One per token; empty when the file has no `tokenizer.ggml.token_type`.
    pub token_types: Vec<i64>,
    /// "left right" pairs, highest priority first.
    pub merges: Vec<String>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub chat_template: Option<String>,
}

impl GgufTokenizerData {
    pub fn from_gguf(gguf: &GgufFile) -> Result<GgufTokenizerData> {
        let model = gguf
            .metadata("tokenizer.ggml.model")
            .ok_or_else(|| anyhow!("GGUF has no tokenizer metadata (missing `tokenizer.ggml.model`)"))?
            .as_str()
            .ok_or_else(|| anyhow!("GGUF key `tokenizer.ggml.model` is not a string"))?
            .to_string();
        // Before reading the vocabulary: a SentencePiece file should say so, not fail later
        // on some key it lays out differently.
        check_model(&model)?;
        let str_array = |key: &str| -> Result<Option<Vec<String>>> {
            let Some(v) = gguf.metadata(key) else { return Ok(None) };
            let arr = v.as_array().ok_or_else(|| anyhow!("GGUF key `{key}` is not an array"))?;
            arr.iter()
                .enumerate()
                .map(|(i, e)| {
                    e.as_str().map(str::to_string).ok_or_else(|| anyhow!("GGUF key `{key}`[{i}] is not a string"))
                })
                .collect::<Result<Vec<_>>>()
                .map(Some)
        };
        let tokens =
            str_array("tokenizer.ggml.tokens")?.ok_or_else(|| anyhow!("GGUF has no `tokenizer.ggml.tokens`"))?;
        let merges = str_array("tokenizer.ggml.merges")?.unwrap_or_default();
        let token_types = match gguf.metadata("tokenizer.ggml.token_type") {
            None => Vec::new(),
            Some(v) => v
                .as_array()
                .ok_or_else(|| anyhow!("GGUF key `tokenizer.ggml.token_type` is not an array"))?
                .iter()
                .enumerate()
                .map(|(i, e)| {
                    e.as_i64().ok_or_else(|| anyhow!("GGUF key `tokenizer.ggml.token_type`[{i}] is not an integer"))
                })
                .collect::<Result<Vec<_>>>()?,
        };
        let id = |key: &str| -> Result<Option<u32>> {
            match gguf.metadata(key) {
                None => Ok(None),
                Some(v) => v
                    .as_u64()
                    .and_then(|x| u32::try_from(x).ok())
                    .map(Some)
                    .ok_or_else(|| anyhow!("GGUF key `{key}` is not a token id")),
            }
        };
        let flag = |key: &str| gguf.metadata(key).and_then(GgufValue::as_bool);
        Ok(GgufTokenizerData {
            model,
            pre: gguf.metadata("tokenizer.ggml.pre").and_then(|v| v.as_str()).map(str::to_string),
            tokens,
            token_types,
            merges,
            bos_id: id("tokenizer.ggml.bos_token_id")?,
            eos_id: id("tokenizer.ggml.eos_token_id")?,
            // llama.cpp writes the key for every converted model; absent means an old file, and
            // adding an unexpected BOS shifts every prompt, so default to not adding.
            add_bos: flag("tokenizer.ggml.add_bos_token").unwrap_or(false),
            add_eos: flag("tokenizer.ggml.add_eos_token").unwrap_or(false),
            chat_template: gguf.metadata("tokenizer.chat_template").and_then(|v| v.as_str()).map(str::to_string),
        })
    }
}

fn check_model(model: &str) -> Result<()> {
    if model != "gpt2" {
        bail!(
            "GGUF tokenizer model `{model}` is not supported (only `gpt2` byte-level BPE is; \
             SentencePiece `llama` vocabularies need the model's tokenizer.json)"
        );
    }
    Ok(())
}

/// A text tokenizer plus the model-level facts around it (BOS/EOS, chat template).
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos_id: Option<u32>,
    eos_ids: Vec<u32>,
    chat_template: Option<ChatTemplate>,
    /// Each token's bytes, made on first use (see [`TokenBytes`]).
    token_bytes: std::sync::OnceLock<Option<TokenBytes>>,
}

/// The bytes every token id decodes to, for tokenizers whose decoder is GPT-2's byte-level one
/// (SmolLM2, Llama 3, Qwen; also as the last of transformers 5's `ByteFallback, Fuse,
/// Replace(▁ → space), ByteLevel` sequence): there decoding a list of ids is the concatenation
/// of the ids' bytes, read as UTF-8 with invalid sequences replaced (`tokenizers`' `decode`, the
/// same rules), so a streaming detokenizer can append one token's bytes instead of decoding
/// windows of ids (a dozen allocations and two decoder passes per generated token).
pub struct TokenBytes {
    data: Vec<u8>,
    /// `ends[id]`: end of the id's bytes in `data` (they start at `ends[id - 1]`).
    ends: Vec<u32>,
    /// Ids whose text `skip_special_tokens` leaves out (their string is a special token's).
    special: Vec<bool>,
    /// Ids for which the concatenation does not hold: under the sequence decoder, a `<0xNN>`
    /// byte token, a `▁`, or a character outside the byte alphabet makes the byte-level step
    /// take the whole fused text as it is. A detokenizer meeting one decodes windows instead.
    irregular: Vec<bool>,
}

impl TokenBytes {
    fn build(inner: &tokenizers::Tokenizer) -> Option<TokenBytes> {
        use tokenizers::decoders::DecoderWrapper as D;
        let sequence = match inner.get_decoder()? {
            D::ByteLevel(_) => false,
            D::Sequence(seq) => match seq.get_decoders() {
                [D::ByteFallback(_), D::Fuse(_), D::Replace(r), D::ByteLevel(_)] if replaces_metaspace(r) => true,
                _ => return None,
            },
            _ => return None,
        };
        let byte_of = byte_level_chars();
        let added = inner.get_added_tokens_decoder();
        let specials: std::collections::HashSet<&str> = added.values().filter(|t| t.special).map(|t| t.content.as_str()).collect();
        let n = added.keys().map(|&id| id as usize + 1).max().unwrap_or(0).max(inner.get_vocab_size(false));
        let (mut data, mut ends, mut special, mut irregular) = (Vec::new(), Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
        for id in 0..n as u32 {
            // An id without a token decodes to nothing, as in `decode`.
            let token = inner.id_to_token(id).unwrap_or_default();
            special.push(specials.contains(token.as_str()));
            let mapped: Option<Vec<u8>> = token.chars().map(|c| byte_of.get(&c).copied()).collect();
            let byte_token = token.len() == 6 && token.starts_with("<0x") && token.ends_with('>');
            irregular.push(sequence && (mapped.is_none() || byte_token || token.contains('\u{2581}')));
            data.extend_from_slice(&mapped.unwrap_or_else(|| token.as_bytes().to_vec()));
            ends.push(u32::try_from(data.len()).ok()?);
        }
        Some(TokenBytes { data, ends, special, irregular })
    }

    /// Whether `id` breaks the concatenation (see the field); a skipped special token does not
    /// take part in decoding at all.
    pub fn irregular(&self, id: u32, skip_special: bool) -> bool {
        let i = id as usize;
        i < self.irregular.len() && self.irregular[i] && !(skip_special && self.special[i])
    }

    /// The bytes of `id` (none for an unknown id, or a special one when `skip_special`).
    pub fn get(&self, id: u32, skip_special: bool) -> &[u8] {
        let i = id as usize;
        if i >= self.ends.len() || (skip_special && self.special[i]) {
            return &[];
        }
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        &self.data[start..self.ends[i] as usize]
    }
}

/// Whether a `Replace` decoder turns `▁` into a space (SentencePiece's word boundary).
fn replaces_metaspace(r: &tokenizers::normalizers::replace::Replace) -> bool {
    serde_json::to_value(r).is_ok_and(|v| v["pattern"]["String"] == "\u{2581}" && v["content"] == " ")
}

/// GPT-2's byte-level alphabet, inverted: the printable Latin-1 bytes stand for themselves and
/// the other 68 bytes, in order, for the characters from U+0100 on.
fn byte_level_chars() -> std::collections::HashMap<char, u8> {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    let mut next = 0u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (char::from(b), b)
            } else {
                next += 1;
                (char::from_u32(0x100 + next - 1).expect("a valid char"), b)
            }
        })
        .collect()
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .field("chat_template", &self.chat_template.is_some())
            .finish()
    }
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))
}

/// A special token in tokenizer_config.json is either a string or an AddedToken object.
fn token_content(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(str::to_string),
        _ => None,
    }
}

/// HF stores the chat template in tokenizer_config.json (a string, or a list of named
/// templates), and since transformers 4.43+ also in chat_template.jinja / chat_template.json.
fn hf_chat_template(dir: &Path, config: Option<&serde_json::Value>) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        return std::fs::read_to_string(&jinja).map(Some).with_context(|| format!("{}: cannot read", jinja.display()));
    }
    let json = dir.join("chat_template.json");
    let from_json;
    let value = if json.is_file() {
        from_json = read_json(&json)?;
        from_json.get("chat_template")
    } else {
        config.and_then(|c| c.get("chat_template"))
    };
    Ok(match value {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        // Named templates: the one called "default" is what apply_chat_template uses.
        Some(serde_json::Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(|t| t.as_str())
            .map(str::to_string),
        _ => None,
    })
}

impl Tokenizer {
    /// Loads an HF tokenizer directory: tokenizer.json (required), tokenizer_config.json
    /// (special tokens, chat template) and generation_config.json (extra EOS ids), both optional.
    pub fn from_hf_dir(dir: &Path) -> Result<Tokenizer> {
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.is_file() {
            bail!("{}: missing (an HF model directory needs tokenizer.json)", tok_path.display());
        }
        let bytes = std::fs::read(&tok_path).with_context(|| format!("{}: cannot read", tok_path.display()))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| anyhow!("{}: not a valid tokenizer.json: {e}", tok_path.display()))?;

        let cfg_path = dir.join("tokenizer_config.json");
        let config = if cfg_path.is_file() { Some(read_json(&cfg_path)?) } else { None };
        let cfg_token = |key: &str| token_content(config.as_ref().and_then(|c| c.get(key)));
        let bos_token = cfg_token("bos_token");
        let eos_token = cfg_token("eos_token");
        let bos_id = bos_token.as_deref().and_then(|t| inner.token_to_id(t));
        let mut eos_ids: Vec<u32> = eos_token.as_deref().and_then(|t| inner.token_to_id(t)).into_iter().collect();

        let gen_path = dir.join("generation_config.json");
        if gen_path.is_file() {
            let gen = read_json(&gen_path)?;
            // generation_config's eos_token_id may be one int or a list; it lists every id the
            // model emits to stop (e.g. Llama 3's <|eot_id|> next to <|end_of_text|>).
            let ids: Vec<u32> = match gen.get("eos_token_id") {
                None | Some(serde_json::Value::Null) => Vec::new(),
                Some(serde_json::Value::Array(a)) => a
                    .iter()
                    .map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| anyhow!("{}: eos_token_id list has a non-id entry", gen_path.display()))?,
                Some(v) => vec![v
                    .as_u64()
                    .and_then(|x| u32::try_from(x).ok())
                    .ok_or_else(|| anyhow!("{}: eos_token_id is not an id", gen_path.display()))?],
            };
            for id in ids {
                if !eos_ids.contains(&id) {
                    eos_ids.push(id);
                }
            }
        }

        let chat_template = hf_chat_template(dir, config.as_ref())?
            .map(|src| {
                ChatTemplate::new(&src, bos_token.clone(), eos_token.clone())
                    .with_context(|| format!("{}: chat template does not compile", dir.display()))
            })
            .transpose()?;
        Ok(Tokenizer { inner, bos_id, eos_ids, chat_template, token_bytes: Default::default() })
    }

    /// Builds the tokenizer from a GGUF file's `tokenizer.*` metadata.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Tokenizer> {
        Self::from_gguf_data(GgufTokenizerData::from_gguf(gguf)?)
    }

    /// Opens a GGUF file and builds its tokenizer; errors name the file.
    pub fn from_gguf_path(path: &Path) -> Result<Tokenizer> {
        let gguf = GgufFile::open(path)?;
        Self::from_gguf(&gguf).with_context(|| format!("{}: cannot build tokenizer", path.display()))
    }

    pub fn from_gguf_data(data: GgufTokenizerData) -> Result<Tokenizer> {
        check_model(&data.model)?;
        if data.tokens.is_empty() {
            bail!("GGUF `tokenizer.ggml.tokens` is empty");
        }
        if !data.token_types.is_empty() && data.token_types.len() != data.tokens.len() {
            bail!(
                "GGUF `tokenizer.ggml.token_type` has {} entries for {} tokens",
                data.token_types.len(),
                data.tokens.len()
            );
        }
        let n = data.tokens.len();
        for (name, id) in [("bos", data.bos_id), ("eos", data.eos_id)] {
            if let Some(id) = id {
                if id as usize >= n {
                    bail!("GGUF `tokenizer.ggml.{name}_token_id` = {id} is outside the {n}-token vocabulary");
                }
            }
        }
        let pre = data.pre.as_deref().unwrap_or("default");
        // (split regexes applied in order, NFC first?, ignore_merges)
        let (splits, nfc, ignore_merges): (&[&str], bool, bool) = match pre {
            "gpt-2" | "default" => (&[GPT2_SPLIT], false, false),
            // Llama 3's tokenizer.json sets ignore_merges: a word already in the vocabulary is
            // one token even if the merges would build it differently.
            "llama-bpe" | "llama3" => (&[LLAMA3_SPLIT], false, true),
            "qwen2" => (&[QWEN2_SPLIT], true, false),
            // SmolLM: every digit on its own, then GPT-2.
            "smollm" => (&[r"\p{N}", GPT2_SPLIT], false, false),
            other => bail!(
                "GGUF `tokenizer.ggml.pre` = `{other}` is not supported (known: llama-bpe, llama3, qwen2, smollm, gpt-2, default)"
            ),
        };

        let mut vocab = Vocab::with_capacity(n);
        for (i, t) in data.tokens.iter().enumerate() {
            // Duplicate strings occur in some vocabularies (padding slots); the first id wins,
            // which is the id BPE would have produced anyway.
            vocab.entry(t.clone()).or_insert(i as u32);
        }
        let mut merges = Vec::with_capacity(data.merges.len());
        for (i, m) in data.merges.iter().enumerate() {
            let (a, b) = m
                .split_once(' ')
                .ok_or_else(|| anyhow!("GGUF `tokenizer.ggml.merges`[{i}] = {m:?} is not a `left right` pair"))?;
            merges.push((a.to_string(), b.to_string()));
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(ignore_merges)
            .build()
            .map_err(|e| anyhow!("GGUF tokenizer: cannot build BPE: {e}"))?;

        let mut inner = tokenizers::Tokenizer::new(bpe);
        if nfc {
            inner.with_normalizer(Some(NFC)).map_err(|e| anyhow!("GGUF tokenizer: {e}"))?;
        }
        let mut pre_tokenizers: Vec<PreTokenizerWrapper> = Vec::new();
        for re in splits {
            let split = Split::new(SplitPattern::Regex(re.to_string()), SplitDelimiterBehavior::Isolated, false)
                .map_err(|e| anyhow!("GGUF tokenizer: bad split regex: {e}"))?;
            pre_tokenizers.push(split.into());
        }
        // The splits above already did the word splitting; ByteLevel only maps bytes to the
        // printable alphabet the vocabulary is written in.
        pre_tokenizers.push(ByteLevel::new(false, false, false).into());
        inner.with_pre_tokenizer(Some(Sequence::new(pre_tokenizers)));
        inner.with_decoder(Some(ByteLevelDecoder::default()));

        let bos = data.bos_id.map(|id| (data.tokens[id as usize].clone(), id));
        let eos = data.eos_id.map(|id| (data.tokens[id as usize].clone(), id));
        let add_bos = data.add_bos && bos.is_some();
        let add_eos = data.add_eos && eos.is_some();
        if add_bos || add_eos {
            let mut single = Vec::new();
            let mut specials = Vec::new();
            if let (true, Some((t, id))) = (add_bos, &bos) {
                single.push(t.clone());
                specials.push((t.clone(), *id));
            }
            single.push("$A".to_string());
            if let (true, Some((t, id))) = (add_eos, &eos) {
                single.push(t.clone());
                if !specials.iter().any(|(_, s)| s == id) {
                    specials.push((t.clone(), *id));
                }
            }
            let mut pair = single.clone();
            pair.extend(single.iter().map(|s| if s == "$A" { "$B:1".to_string() } else { format!("{s}:1") }));
            let post = TemplateProcessing::builder()
                .try_single(single.join(" "))
                .map_err(|e| anyhow!("GGUF tokenizer: {e}"))?
                .try_pair(pair.join(" "))
                .map_err(|e| anyhow!("GGUF tokenizer: {e}"))?
                .special_tokens(specials)
                .build()
                .map_err(|e| anyhow!("GGUF tokenizer: {e}"))?;
            inner.with_post_processor(Some(post));
        }

        // Control and user-defined tokens must never be split by BPE and must be found whole
        // inside text (e.g. "<|im_start|>" typed into a prompt), which is what added tokens do.
        let specials: Vec<AddedToken> = data
            .token_types
            .iter()
            .enumerate()
            .filter(|(_, &t)| t == TOKEN_TYPE_CONTROL || t == TOKEN_TYPE_USER_DEFINED)
            .map(|(i, _)| AddedToken::from(data.tokens[i].clone(), true))
            .collect();
        inner.add_special_tokens(specials).map_err(|e| anyhow!("GGUF tokenizer: cannot add special tokens: {e}"))?;

        let chat_template = data
            .chat_template
            .as_deref()
            .map(|src| {
                ChatTemplate::new(src, bos.as_ref().map(|b| b.0.clone()), eos.as_ref().map(|e| e.0.clone()))
                    .context("GGUF `tokenizer.chat_template` does not compile")
            })
            .transpose()?;
        Ok(Tokenizer { inner, bos_id: data.bos_id, eos_ids: data.eos_id.into_iter().collect(), chat_template, token_bytes: Default::default() })
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, add_special_tokens).map_err(|e| anyhow!("encode failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.vocab_size()) {
            bail!("decode: token id {bad} is outside the vocabulary ({} tokens)", self.vocab_size());
        }
        self.inner.decode(ids, skip_special_tokens).map_err(|e| anyhow!("decode failed: {e}"))
    }

    /// Number of token ids, added tokens included (the embedding table may be larger).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_id
    }

    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    pub fn token_to_id(&self, tok: &str) -> Option<u32> {
        self.inner.token_to_id(tok)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    pub fn decode_stream(&self, skip_special_tokens: bool) -> DecodeStream<'_> {
        DecodeStream { tok: self, skip_special_tokens, ids: Vec::new(), prefix: 0, read: 0 }
    }

    /// The underlying `tokenizers` object, for callers that need offsets or batch encoding.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Every token's bytes, when decoding is their concatenation (a byte-level BPE decoder):
    /// made once, on first use.
    pub fn token_bytes(&self) -> Option<&TokenBytes> {
        self.token_bytes.get_or_init(|| TokenBytes::build(&self.inner)).as_ref()
    }
}

/// Incremental detokenizer for streaming generation.
///
/// A token can end in the middle of a UTF-8 character (byte-level BPE splits emoji and CJK
/// across tokens), and some decoders change how a token renders depending on what precedes it
/// (SentencePiece's leading space). So each step decodes a short window that starts a few
/// tokens back, and emits only the new suffix, holding it back while it ends in an incomplete
/// character (decoded as U+FFFD).
pub struct DecodeStream<'a> {
    tok: &'a Tokenizer,
    skip_special_tokens: bool,
    /// Only the ids still needed for context; older ones are dropped.
    ids: Vec<u32>,
    /// `ids[prefix..read]` is already emitted text that gives the next tokens their context.
    prefix: usize,
    /// `ids[read..]` decoded to nothing printable yet.
    read: usize,
}

impl DecodeStream<'_> {
    /// Feeds one generated id; returns newly completed text, if any. Ids outside the
    /// vocabulary produce no text.
    pub fn step(&mut self, id: u32) -> Option<String> {
        if id as usize >= self.tok.vocab_size() {
            tracing::warn!(id, "decode_stream: token id outside the vocabulary, skipped");
            return None;
        }
        self.ids.push(id);
        let before = self.tok.inner.decode(&self.ids[self.prefix..self.read], self.skip_special_tokens).ok()?;
        let now = self.tok.inner.decode(&self.ids[self.prefix..], self.skip_special_tokens).ok()?;
        if now.len() <= before.len() || now.ends_with('\u{FFFD}') || !now.is_char_boundary(before.len()) {
            return None;
        }
        let new = now[before.len()..].to_string();
        self.prefix = self.read;
        self.read = self.ids.len();
        // Keep the buffer bounded: drop ids before the context window.
        if self.prefix > 0 {
            self.ids.drain(..self.prefix);
            self.read -= self.prefix;
            self.prefix = 0;
        }
        Some(new)
    }

    /// Emits whatever is still held back at the end of generation; an incomplete trailing
    /// character becomes U+FFFD, as a full decode would render it.
    pub fn flush(&mut self) -> Option<String> {
        if self.read == self.ids.len() {
            return None;
        }
        let before = self.tok.inner.decode(&self.ids[self.prefix..self.read], self.skip_special_tokens).ok()?;
        let now = self.tok.inner.decode(&self.ids[self.prefix..], self.skip_special_tokens).ok()?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        let new = now.get(before.len()..).unwrap_or("").to_string();
        (!new.is_empty()).then_some(new)
    }
}
