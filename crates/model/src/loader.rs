//! Turns a GGUF file or an HF directory into a [`LlamaModel`] on a device: maps tensor names,
//! checks every shape against the config, fuses q/k/v and gate/up, converts to the chosen dtype.

use crate::config::{Arch, ModelConfig, RopeScaling};
use crate::formats::gguf::GgufFile;
use crate::formats::safetensors::SafetensorsWeights;
use crate::formats::{FormatError, WeightSource};
use crate::llama::{LayerWeights, LlamaModel};
use crate::tokenizer::Tokenizer;
use anyhow::{Context, Result};
use quiver_kernels::{DType, Device, Weight};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A loaded model with its tokenizer.
pub struct LoadedModel {
    pub model: LlamaModel,
    pub tokenizer: Tokenizer,
    pub path: PathBuf,
}

/// Weight names differ by container; everything else is shared.
enum Names {
    Hf,
    Gguf,
}

impl Names {
    fn embed(&self) -> &'static str {
        match self {
            Names::Hf => "model.embed_tokens.weight",
            Names::Gguf => "token_embd.weight",
        }
    }
    fn final_norm(&self) -> &'static str {
        match self {
            Names::Hf => "model.norm.weight",
            Names::Gguf => "output_norm.weight",
        }
    }
    fn lm_head(&self) -> &'static str {
        match self {
            Names::Hf => "lm_head.weight",
            Names::Gguf => "output.weight",
        }
    }
    /// `part` is one of q,k,v,o,gate,up,down,attn_norm,mlp_norm; `suffix` weight or bias.
    fn layer(&self, i: usize, part: &str, suffix: &str) -> String {
        match self {
            Names::Hf => {
                let m = match part {
                    "q" | "k" | "v" | "o" => format!("self_attn.{part}_proj"),
                    "gate" | "up" | "down" => format!("mlp.{part}_proj"),
                    "attn_norm" => "input_layernorm".into(),
                    _ => "post_attention_layernorm".into(),
                };
                format!("model.layers.{i}.{m}.{suffix}")
            }
            Names::Gguf => {
                let m = match part {
                    "q" => "attn_q",
                    "k" => "attn_k",
                    "v" => "attn_v",
                    "o" => "attn_output",
                    "gate" => "ffn_gate",
                    "up" => "ffn_up",
                    "down" => "ffn_down",
                    "attn_norm" => "attn_norm",
                    _ => "ffn_norm",
                };
                format!("blk.{i}.{m}.{suffix}")
            }
        }
    }
}

/// Loads a tensor and checks its shape.
fn load(src: &dyn WeightSource, name: &str, shape: &[usize]) -> Result<Vec<f32>, FormatError> {
    let (data, got) = src.tensor_f32(name)?;
    if got != shape {
        return Err(FormatError::tensor(src.path(), name, format!("shape {got:?}, expected {shape:?} from the model config")));
    }
    Ok(data)
}

/// llama.cpp's converter interleaves the two rotary halves of each q/k head so it can use
/// adjacent-pair RoPE; undo it so one rotate-half RoPE (and HF-oriented LoRA deltas) fit.
fn unpermute_rows(w: &[f32], n_head: usize, rows: usize, cols: usize) -> Vec<f32> {
    let hd = rows / n_head;
    let half = hd / 2;
    let mut out = vec![0.0; w.len()];
    for h in 0..n_head {
        for i in 0..half {
            for j in 0..2 {
                let src = h * hd + 2 * i + j;
                let dst = h * hd + j * half + i;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// Loads a model from a `.gguf` file or an HF directory.
pub fn load_model(path: &Path, device: Arc<dyn Device>, dtype: DType) -> Result<LoadedModel> {
    if path.is_dir() {
        let config = ModelConfig::from_hf_dir(path)?;
        let weights = SafetensorsWeights::open(path)?;
        let tokenizer = Tokenizer::from_hf_dir(path)?;
        let model = build(&weights, Names::Hf, config, device, dtype, false)?;
        Ok(LoadedModel { model, tokenizer, path: path.to_path_buf() })
    } else {
        let gguf = GgufFile::open(path)?;
        let mut config = ModelConfig::from_gguf(&gguf).with_context(|| format!("{}", path.display()))?;
        if gguf.contains("rope_freqs.weight") {
            let (f, _) = gguf.tensor_f32("rope_freqs.weight")?;
            config.rope_scaling = Some(RopeScaling::Factors(f));
        }
        let tokenizer = Tokenizer::from_gguf(&gguf).with_context(|| format!("{}: tokenizer", path.display()))?;
        let permuted = config.arch == Arch::Llama || config.arch == Arch::Mistral;
        let model = build(&gguf, Names::Gguf, config, device, dtype, permuted)?;
        Ok(LoadedModel { model, tokenizer, path: path.to_path_buf() })
    }
}

fn build(src: &dyn WeightSource, names: Names, config: ModelConfig, device: Arc<dyn Device>, dtype: DType, permuted_qk: bool) -> Result<LlamaModel> {
    let c = &config;
    device.check_head_dim(c.head_dim).map_err(|e| anyhow::anyhow!("{}: {e}", src.path().display()))?;
    let (h, q, kv, inter) = (c.hidden_size, c.q_out(), c.kv_out(), c.intermediate_size);
    let wt = |rows: usize, cols: usize, data: Vec<f32>| device.load_weight(Weight::from_f32(rows, cols, data, dtype));
    let embed = wt(c.vocab_size, h, load(src, names.embed(), &[c.vocab_size, h])?);
    let mut layers = Vec::with_capacity(c.num_layers);
    for i in 0..c.num_layers {
        let l = |part: &str, shape: &[usize]| load(src, &names.layer(i, part, "weight"), shape);
        let mut wq = l("q", &[q, h])?;
        let mut wk = l("k", &[kv, h])?;
        if permuted_qk {
            wq = unpermute_rows(&wq, c.num_heads, q, h);
            wk = unpermute_rows(&wk, c.num_kv_heads, kv, h);
        }
        let wv = l("v", &[kv, h])?;
        let mut qkv = wq;
        qkv.extend_from_slice(&wk);
        qkv.extend_from_slice(&wv);
        let qkv_bias = if c.qkv_bias {
            let b = |part: &str, n: usize| load(src, &names.layer(i, part, "bias"), &[n]);
            let mut bq = b("q", q)?;
            let mut bk = b("k", kv)?;
            if permuted_qk {
                bq = unpermute_rows(&bq, c.num_heads, q, 1);
                bk = unpermute_rows(&bk, c.num_kv_heads, kv, 1);
            }
            bq.extend(bk);
            bq.extend(b("v", kv)?);
            Some(device.tensor_from(&bq))
        } else {
            None
        };
        let mut gate_up = l("gate", &[inter, h])?;
        gate_up.extend(l("up", &[inter, h])?);
        layers.push(LayerWeights {
            attn_norm: device.tensor_from(&l("attn_norm", &[h])?),
            qkv: wt(q + 2 * kv, h, qkv),
            qkv_bias,
            o: wt(h, q, l("o", &[h, q])?),
            mlp_norm: device.tensor_from(&l("mlp_norm", &[h])?),
            gate_up: wt(2 * inter, h, gate_up),
            down: wt(h, inter, l("down", &[h, inter])?),
        });
    }
    let final_norm = device.tensor_from(&load(src, names.final_norm(), &[h])?);
    let lm_head = if src.contains(names.lm_head()) && !(c.tie_word_embeddings && matches!(names, Names::Hf)) {
        Some(wt(c.vocab_size, h, load(src, names.lm_head(), &[c.vocab_size, h])?))
    } else if c.tie_word_embeddings {
        None
    } else {
        return Err(FormatError::tensor(src.path(), names.lm_head(), "missing (the config says embeddings are not tied)").into());
    };
    let rope = LlamaModel::build_rope(c, &*device);
    Ok(LlamaModel { config, device, embed, layers, final_norm, lm_head, rope })
}
