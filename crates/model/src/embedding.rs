//! Decoder embedding models (Qwen3-Embedding style): how hidden states become one vector.
//!
//! The pooling comes from the model's sentence-transformers files, read as sentence-transformers
//! reads them: `modules.json` lists the pipeline (a `Pooling` module's directory holds its
//! `config.json`; a `Normalize` module means L2 normalisation), `config_sentence_transformers.json`
//! gives the instruction prefixes (`prompts`, `default_prompt_name`). A GGUF says
//! `{arch}.pooling_type` (llama.cpp's enum) and is normalised as llama.cpp's server does. Without
//! any of that the model gets Qwen3-Embedding's recipe, last token then L2, and
//! [`EmbeddingSpec::fallback`] says so. Matryoshka truncation (`dimensions`) is allowed when
//! `config.json` declares it (`is_matryoshka` / `matryoshka_dimensions`, vLLM's convention).
//!
//! Pooled vectors are final-normed hidden states (`Qwen3Model`'s `last_hidden_state`). Mean
//! pooling sums a sequence's rows in order as its chunks arrive, so the result does not depend on
//! the batch.

use crate::formats::gguf::GgufFile;
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    /// The last token's hidden state (causal decoders: it has seen the whole input).
    LastToken,
    /// The mean over every token.
    Mean,
}

#[derive(Clone, Debug, PartialEq)]
pub struct EmbeddingSpec {
    pub pooling: Pooling,
    /// L2-normalise the pooled vector.
    pub normalize: bool,
    /// Output width before any truncation (the hidden size).
    pub dim: usize,
    /// Instruction prefixes by name, prepended to a text input (sentence-transformers' `prompts`).
    pub prompts: Vec<(String, String)>,
    /// The prompt applied when a request names none.
    pub default_prompt: Option<String>,
    /// `dimensions` a request may ask for: `None` = only the full width, `Some([])` = any width up
    /// to it, `Some(list)` = those.
    pub matryoshka: Option<Vec<usize>>,
    /// Where the pooling was read from, for the start-up log.
    pub source: String,
    /// Set when the model says nothing about pooling and the default recipe is used.
    pub fallback: Option<String>,
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))
}

impl EmbeddingSpec {
    /// The default recipe, with the reason it applies.
    fn fallback(dim: usize, why: String) -> Self {
        EmbeddingSpec { pooling: Pooling::LastToken, normalize: true, dim, prompts: vec![], default_prompt: None, matryoshka: None, source: "default (last token, L2-normalised)".into(), fallback: Some(why) }
    }

    /// For a model file or directory with hidden size `dim`.
    pub fn for_model(path: &Path, dim: usize) -> Result<Self> {
        if path.is_dir() {
            Self::from_dir(path, dim)
        } else {
            Self::from_gguf(&GgufFile::open(path)?, dim).with_context(|| format!("{}", path.display()))
        }
    }

    /// From an HF directory's sentence-transformers files (see the module docs).
    pub fn from_dir(dir: &Path, dim: usize) -> Result<Self> {
        let modules_path = dir.join("modules.json");
        let mut spec = if !modules_path.exists() {
            Self::fallback(dim, format!("{} has no sentence-transformers `modules.json`", dir.display()))
        } else {
            let modules = read_json(&modules_path)?;
            let modules = modules.as_array().with_context(|| format!("{}: expected a list of modules", modules_path.display()))?;
            let of_type = |t: &str| modules.iter().find(|m| m["type"].as_str().is_some_and(|x| x.ends_with(t)));
            match of_type(".Pooling") {
                None => Self::fallback(dim, format!("{} lists no Pooling module", modules_path.display())),
                Some(p) => {
                    let pdir = dir.join(p["path"].as_str().unwrap_or("1_Pooling"));
                    let cfg_path = pdir.join("config.json");
                    let cfg = read_json(&cfg_path)?;
                    let on = |k: &str| cfg[k].as_bool().unwrap_or(false);
                    let pooling = match (on("pooling_mode_lasttoken"), on("pooling_mode_mean_tokens")) {
                        (true, false) => Pooling::LastToken,
                        (false, true) => Pooling::Mean,
                        _ => bail!("{}: only last-token or mean pooling (one of them) is supported", cfg_path.display()),
                    };
                    for k in ["pooling_mode_cls_token", "pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens"] {
                        if on(k) {
                            bail!("{}: `{k}` is not supported (last-token or mean pooling only)", cfg_path.display());
                        }
                    }
                    if cfg["include_prompt"].as_bool() == Some(false) {
                        bail!("{}: `include_prompt: false` (pooling that skips the instruction prefix) is not supported", cfg_path.display());
                    }
                    if let Some(d) = cfg["word_embedding_dimension"].as_u64() {
                        if d as usize != dim {
                            bail!("{}: word_embedding_dimension {d} differs from the model's hidden size {dim}", cfg_path.display());
                        }
                    }
                    let normalize = of_type(".Normalize").is_some();
                    let source = format!("{} ({:?} pooling{})", modules_path.display(), pooling, if normalize { ", L2-normalised" } else { "" });
                    EmbeddingSpec { pooling, normalize, dim, prompts: vec![], default_prompt: None, matryoshka: None, source, fallback: None }
                }
            }
        };
        let st = dir.join("config_sentence_transformers.json");
        if st.exists() {
            let v = read_json(&st)?;
            if let Some(p) = v["prompts"].as_object() {
                spec.prompts = p.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string())).collect();
            }
            spec.default_prompt = v["default_prompt_name"].as_str().map(str::to_string);
            if let Some(d) = &spec.default_prompt {
                if spec.prompt(d).is_none() {
                    bail!("{}: default_prompt_name `{d}` is not among the prompts", st.display());
                }
            }
        }
        let cfg_path = dir.join("config.json");
        if cfg_path.exists() {
            let c = read_json(&cfg_path)?;
            if let Some(list) = c["matryoshka_dimensions"].as_array() {
                spec.matryoshka = Some(list.iter().filter_map(|x| x.as_u64()).map(|x| x as usize).collect());
            } else if c["is_matryoshka"].as_bool() == Some(true) {
                spec.matryoshka = Some(vec![]);
            }
        }
        Ok(spec)
    }

    /// From a GGUF's `{arch}.pooling_type` (llama.cpp: 1 mean, 3 last).
    pub fn from_gguf(g: &GgufFile, dim: usize) -> Result<Self> {
        let arch = g.metadata("general.architecture").and_then(|v| v.as_str()).unwrap_or_default().to_string();
        let key = format!("{arch}.pooling_type");
        Ok(match g.metadata(&key).and_then(|v| v.as_u64()) {
            None => Self::fallback(dim, format!("the GGUF has no `{key}`")),
            Some(1) => EmbeddingSpec { pooling: Pooling::Mean, source: format!("GGUF `{key}` = 1 (mean, L2-normalised)"), fallback: None, ..Self::fallback(dim, String::new()) },
            Some(3) => EmbeddingSpec { source: format!("GGUF `{key}` = 3 (last token, L2-normalised)"), fallback: None, ..Self::fallback(dim, String::new()) },
            Some(t) => bail!("`{key}` = {t} is not supported (1 = mean or 3 = last token)"),
        })
    }

    pub fn prompt(&self, name: &str) -> Option<&str> {
        self.prompts.iter().find(|p| p.0 == name).map(|p| p.1.as_str())
    }

    /// Checks a request's `dimensions`.
    pub fn check_dimensions(&self, d: usize) -> Result<(), String> {
        if d == self.dim {
            return Ok(());
        }
        match &self.matryoshka {
            _ if d == 0 || d > self.dim => Err(format!("dimensions must be between 1 and the model's {}, got {d}", self.dim)),
            None => Err(format!("this model does not support matryoshka representation (its config declares no `matryoshka_dimensions` / `is_matryoshka`), so dimensions must be {} or absent", self.dim)),
            Some(list) if !list.is_empty() && !list.contains(&d) => Err(format!("dimensions {d} is not one of the model's matryoshka dimensions {list:?}")),
            Some(_) => Ok(()),
        }
    }

    /// The output for a pooled vector: truncated to `dimensions`, then L2-normalised when the
    /// model (or the request's `normalize`) says so.
    pub fn finish(&self, mut v: Vec<f32>, dimensions: Option<usize>, normalize: Option<bool>) -> Vec<f32> {
        if let Some(d) = dimensions {
            v.truncate(d);
        }
        if normalize.unwrap_or(self.normalize) {
            // torch.nn.functional.normalize: x / max(‖x‖, 1e-12), the norm accumulated in f64 here.
            let n = v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt().max(1e-12) as f32;
            v.iter_mut().for_each(|x| *x /= n);
        }
        v
    }
}

/// A sequence's pooling state while its chunks arrive.
#[derive(Clone, Debug, Default)]
pub struct PoolState {
    sum: Vec<f32>,
    rows: usize,
}

impl PoolState {
    /// Adds `rows` hidden rows (`[rows, dim]`) in order.
    pub fn add_rows(&mut self, hidden: &[f32], dim: usize) {
        if self.sum.is_empty() {
            self.sum = vec![0.0; dim];
        }
        for row in hidden.chunks_exact(dim) {
            for (s, &x) in self.sum.iter_mut().zip(row) {
                *s += x;
            }
            self.rows += 1;
        }
    }
    /// The mean of the rows added so far.
    pub fn mean(&self) -> Vec<f32> {
        let n = self.rows.max(1) as f32;
        self.sum.iter().map(|&s| s / n).collect()
    }
    /// Forget everything (the sequence is recomputed from its first token).
    pub fn reset(&mut self) {
        self.sum.clear();
        self.rows = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str, files: &[(&str, &str)]) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("quiver-embed-spec-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        for (name, body) in files {
            let p = d.join(name);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, body).unwrap();
        }
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    const MODULES: &str = r#"[{"idx":0,"name":"0","path":"","type":"sentence_transformers.models.Transformer"},
        {"idx":1,"name":"1","path":"1_Pooling","type":"sentence_transformers.models.Pooling"},
        {"idx":2,"name":"2","path":"2_Normalize","type":"sentence_transformers.models.Normalize"}]"#;

    #[test]
    fn reads_sentence_transformers_pooling_prompts_and_matryoshka() {
        let d = dir("st", &[
            ("modules.json", MODULES),
            ("1_Pooling/config.json", r#"{"word_embedding_dimension":8,"pooling_mode_lasttoken":true,"pooling_mode_mean_tokens":false,"include_prompt":true}"#),
            ("config_sentence_transformers.json", r#"{"prompts":{"query":"Instruct: find\nQuery:","document":""},"default_prompt_name":null}"#),
            ("config.json", r#"{"is_matryoshka":true}"#),
        ]);
        let s = EmbeddingSpec::from_dir(&d, 8).unwrap();
        assert_eq!((s.pooling, s.normalize, s.fallback.is_none()), (Pooling::LastToken, true, true));
        assert_eq!(s.prompt("query"), Some("Instruct: find\nQuery:"));
        assert_eq!(s.default_prompt, None);
        assert!(s.check_dimensions(4).is_ok() && s.check_dimensions(8).is_ok() && s.check_dimensions(9).is_err() && s.check_dimensions(0).is_err());
        let v = s.finish(vec![3.0, 4.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0], Some(2), None);
        assert_eq!(v, vec![0.6, 0.8]);
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn mean_pooling_without_normalize_and_refusals() {
        let mean = r#"{"pooling_mode_mean_tokens":true}"#;
        let d = dir("mean", &[("modules.json", &MODULES.replace(r#",
        {"idx":2,"name":"2","path":"2_Normalize","type":"sentence_transformers.models.Normalize"}"#, "")), ("1_Pooling/config.json", mean)]);
        let s = EmbeddingSpec::from_dir(&d, 8).unwrap();
        assert_eq!((s.pooling, s.normalize, s.matryoshka.clone()), (Pooling::Mean, false, None));
        assert!(s.check_dimensions(4).unwrap_err().contains("matryoshka"));
        let mut p = PoolState::default();
        p.add_rows(&[1.0, 2.0, 3.0, 4.0], 2);
        p.add_rows(&[5.0, 6.0], 2);
        assert_eq!(p.mean(), vec![3.0, 4.0]);
        std::fs::write(d.join("1_Pooling/config.json"), r#"{"pooling_mode_cls_token":true}"#).unwrap();
        assert!(EmbeddingSpec::from_dir(&d, 8).unwrap_err().to_string().contains("1_Pooling"));
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn no_pooling_information_falls_back_to_last_token_and_says_why() {
        let d = dir("none", &[("config.json", "{}")]);
        let s = EmbeddingSpec::from_dir(&d, 8).unwrap();
        assert_eq!((s.pooling, s.normalize), (Pooling::LastToken, true));
        assert!(s.fallback.as_deref().is_some_and(|w| w.contains("modules.json")), "{:?}", s.fallback);
        std::fs::remove_dir_all(d).unwrap();
    }
}
