//! Named model shapes for benchmarks on random weights (`--shape`), so shapes whose checkpoints
//! are too large to keep around can be measured: the layer shapes of the real model, with the
//! depth and vocabulary optionally cut (`--layers`, `--vocab`) to fit a small machine.

use anyhow::{bail, Result};
use clap::Args;
use std::path::PathBuf;
use quiver_kernels::{open_device, DType, DeviceKind};
use quiver_model::config::{Arch, ModelConfig, MoeConfig, QkNormKind};
use quiver_model::tokenizer::Tokenizer;
use quiver_model::LoadedModel;

pub const SHAPES: &str = "qwen3-30b-a3b, qwen3-embedding-0.6b";

/// The `--shape` flags the model benchmarks share.
#[derive(Args, Debug)]
pub struct ShapeArgs {
    /// Random weights of a named shape instead of a model file (qwen3-30b-a3b, qwen3-embedding-0.6b).
    #[arg(long, conflicts_with = "model")]
    pub shape: Option<String>,
    /// With --shape: this many layers instead of the real depth.
    #[arg(long, requires = "shape")]
    pub layers: Option<usize>,
    /// With --shape: this vocabulary size instead of the real one.
    #[arg(long, requires = "shape")]
    pub vocab: Option<usize>,
    /// With --shape: whose tokenizer to use (GGUF file or HF directory; default: the default model's).
    #[arg(long, requires = "shape")]
    pub tokenizer: Option<PathBuf>,
}

impl ShapeArgs {
    /// The random model and its report label, when `--shape` is given.
    pub fn model(&self, device: DeviceKind, dtype: DType) -> Result<Option<(LoadedModel, String)>> {
        let Some(s) = &self.shape else { return Ok(None) };
        let lm = random(s, self.layers, self.vocab, self.tokenizer.as_deref(), device, dtype)?;
        let d = describe(&lm, s);
        Ok(Some((lm, d)))
    }

    /// The random model of `--shape`, else the model file (`--model` or the default), with its
    /// report label: the file name only, since reports are committed and machine paths are not.
    pub fn model_or_file(&self, model: Option<PathBuf>, device: DeviceKind, dtype: DType) -> Result<(LoadedModel, String)> {
        if let Some(x) = self.model(device, dtype)? {
            return Ok(x);
        }
        let path = crate::model_path::resolve(model)?;
        let name = path.file_name().map_or_else(|| path.display().to_string(), |f| f.to_string_lossy().to_string());
        Ok((quiver_model::load_model(&path, open_device(device)?, dtype)?, name))
    }
}

/// The config of a named shape.
pub fn config(name: &str) -> Result<ModelConfig> {
    let qwen3 = |vocab, hidden, inter, layers, heads, kv| ModelConfig {
        arch: Arch::Qwen3,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: inter,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv,
        head_dim: 128,
        rms_norm_eps: 1e-6,
        rope_theta: 1e6,
        rope_scaling: None,
        max_position_embeddings: 32768,
        tie_word_embeddings: false,
        qkv_bias: false,
        qk_norm: Some(QkNormKind::PerHead),
        moe: None,
        has_lm_head: true,
    };
    Ok(match name {
        // Qwen/Qwen3-30B-A3B: 48 layers of 128 experts (8 per token, 768 wide), GQA 32 / 4.
        "qwen3-30b-a3b" => ModelConfig {
            arch: Arch::Qwen3Moe,
            moe: Some(MoeConfig { num_experts: 128, top_k: 8, expert_intermediate: 768, norm_topk_prob: true, shared_expert_intermediate: None, dense_layers: vec![] }),
            ..qwen3(151936, 2048, 6144, 48, 32, 4)
        },
        // Qwen/Qwen3-Embedding-0.6B: a bare 28-layer Qwen3 decoder, tied embeddings.
        "qwen3-embedding-0.6b" => ModelConfig { tie_word_embeddings: true, has_lm_head: false, ..qwen3(151669, 1024, 3072, 28, 16, 8) },
        other => bail!("unknown --shape `{other}` (known: {SHAPES})"),
    })
}

/// A random-weight model of `name`'s shape, `layers` / `vocab` overriding the real ones, with
/// the tokenizer of `tokenizer` (a GGUF file or an HF directory; default: the default model's):
/// token ids are all a benchmark feeds it.
pub fn random(name: &str, layers: Option<usize>, vocab: Option<usize>, tokenizer: Option<&std::path::Path>, device: DeviceKind, dtype: DType) -> Result<LoadedModel> {
    let mut c = config(name)?;
    if let Some(l) = layers {
        c.num_layers = l;
    }
    if let Some(v) = vocab {
        c.vocab_size = v;
    }
    let tokenizer = match tokenizer {
        Some(p) if p.is_dir() => Tokenizer::from_hf_dir(p)?,
        Some(p) => Tokenizer::from_gguf_path(p)?,
        None => Tokenizer::from_gguf_path(&crate::model_path::resolve(None)?)?,
    };
    Ok(quiver_engine::testing::random_model(c, tokenizer, open_device(device)?, dtype, 7))
}

/// What `--shape` describes, for report headers.
pub fn describe(lm: &LoadedModel, name: &str) -> String {
    let c = &lm.model.config;
    let moe = c.moe.as_ref().map(|m| format!(", {} experts top-{} x {}", m.num_experts, m.top_k, m.expert_intermediate)).unwrap_or_default();
    format!("random {name} shape: {} layers, hidden {}, vocab {}{moe}", c.num_layers, c.hidden_size, c.vocab_size)
}
