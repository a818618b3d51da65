//! Model configuration from an HF `config.json` or from GGUF metadata, normalised to one struct.

use crate::formats::gguf::GgufFile;
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::Path;

/// The decoder families Quiver runs. They differ only in details the forward pass reads from
/// [`ModelConfig`] (biases, rope, tying, q/k norms, mixture-of-experts MLPs), so one forward
/// pass runs them all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Mistral,
    /// Per-head RMSNorm on q and k before RoPE, no q/k/v bias.
    Qwen3,
    /// Top-2 of 8 experts, probabilities renormalised over the two.
    Mixtral,
    /// q/k/v bias; experts plus a sigmoid-gated shared expert.
    Qwen2Moe,
    /// Qwen3's attention with expert MLPs (`norm_topk_prob`).
    Qwen3Moe,
    /// RMSNorm over the whole q and k projections; experts.
    Olmoe,
}

/// How q and k are normalised before RoPE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNormKind {
    /// Every head on its own, one `[head_dim]` weight each for q and k (Qwen3).
    PerHead,
    /// The whole q projection and the whole k projection (OLMoE).
    Whole,
}

/// The mixture-of-experts MLP of the layers that have one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoeConfig {
    pub num_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Intermediate width of one expert.
    pub expert_intermediate: usize,
    /// Renormalise the top-k probabilities to sum to one (Mixtral always; Qwen's `norm_topk_prob`).
    pub norm_topk_prob: bool,
    /// Intermediate width of Qwen2-MoE's sigmoid-gated shared expert.
    pub shared_expert_intermediate: Option<usize>,
    /// Layers whose MLP is dense (`intermediate_size`) instead: Qwen's `mlp_only_layers` and
    /// `decoder_sparse_step`.
    pub dense_layers: Vec<usize>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Llama 3.1 frequency-band scaling.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: f64 },
    /// Position interpolation: every frequency divided by `factor`.
    Linear { factor: f64 },
    /// Per-frequency divisors read from a GGUF `rope_freqs.weight` tensor.
    Factors(Vec<f32>),
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry biases (Qwen2).
    pub qkv_bias: bool,
    /// RMSNorm on q and k before RoPE (Qwen3, OLMoE).
    pub qk_norm: Option<QkNormKind>,
    /// Expert MLPs (all layers but `dense_layers`).
    pub moe: Option<MoeConfig>,
    /// The checkpoint has an LM head or ties it to the embedding (`…ForCausalLM`); false for a
    /// bare decoder (`Qwen3Model`: an embedding model), which serves embeddings only.
    pub has_lm_head: bool,
}

impl ModelConfig {
    pub fn q_out(&self) -> usize {
        self.num_heads * self.head_dim
    }
    pub fn kv_out(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Reads `config.json` of an HF model directory.
    pub fn from_hf_dir(dir: &Path) -> Result<ModelConfig> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).with_context(|| format!("{}: cannot read", path.display()))?;
        let v: Value = serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))?;
        Self::from_hf_json(&v).with_context(|| format!("{}", path.display()))
    }

    pub fn from_hf_json(v: &Value) -> Result<ModelConfig> {
        let archs: Vec<&str> = v["architectures"].as_array().map(|a| a.iter().filter_map(|x| x.as_str()).collect()).unwrap_or_default();
        let model_type = v["model_type"].as_str().unwrap_or("");
        // `…Model` (no head) is how a bare decoder saved for embeddings names itself.
        let (arch, has_lm_head) = match (archs.first().copied(), model_type) {
            (Some("LlamaForCausalLM"), _) | (None, "llama") => (Arch::Llama, true),
            (Some("Qwen2ForCausalLM"), _) | (None, "qwen2") => (Arch::Qwen2, true),
            (Some("MistralForCausalLM"), _) | (None, "mistral") => (Arch::Mistral, true),
            (Some("Qwen3ForCausalLM"), _) | (None, "qwen3") => (Arch::Qwen3, true),
            (Some("MixtralForCausalLM"), _) | (None, "mixtral") => (Arch::Mixtral, true),
            (Some("Qwen2MoeForCausalLM"), _) | (None, "qwen2_moe") => (Arch::Qwen2Moe, true),
            (Some("Qwen3MoeForCausalLM"), _) | (None, "qwen3_moe") => (Arch::Qwen3Moe, true),
            (Some("OlmoeForCausalLM"), _) | (None, "olmoe") => (Arch::Olmoe, true),
            (Some("LlamaModel"), _) => (Arch::Llama, false),
            (Some("Qwen2Model"), _) => (Arch::Qwen2, false),
            (Some("Qwen3Model"), _) => (Arch::Qwen3, false),
            (Some(other), _) => bail!("unsupported architecture `{other}` (supported: {})", SUPPORTED_HF.join(", ")),
            (None, other) => bail!("unsupported model_type `{other}` and no `architectures` field"),
        };
        if v["layer_types"].as_array().is_some_and(|t| t.iter().any(|x| x.as_str() == Some("sliding_attention"))) {
            bail!("sliding-window attention layers (`layer_types`) are not supported");
        }
        if !v["clip_qkv"].is_null() {
            bail!("`clip_qkv` is not supported");
        }
        if v["mlp_bias"].as_bool() == Some(true) {
            // Biases on gate / up / down (HF Llama's `mlp_bias`) would otherwise be dropped.
            bail!("`mlp_bias: true` (biases on the MLP projections) is not supported");
        }
        let req = |k: &str| -> Result<usize> { v[k].as_u64().map(|x| x as usize).with_context(|| format!("missing or non-integer field `{k}`")) };
        let hidden = req("hidden_size")?;
        let num_heads = req("num_attention_heads")?;
        let num_kv_heads = v["num_key_value_heads"].as_u64().map(|x| x as usize).unwrap_or(num_heads);
        let head_dim = v["head_dim"].as_u64().map(|x| x as usize).unwrap_or(hidden / num_heads.max(1));
        // transformers ≥ 5 writes `rope_parameters` (type, theta and scaling in one object);
        // earlier versions `rope_theta` plus an optional `rope_scaling`.
        let rope_params = v.get("rope_parameters").filter(|p| p.is_object());
        let rope_scaling = match rope_params.or_else(|| v.get("rope_scaling")) {
            Some(Value::Object(o)) => {
                let ty = o.get("rope_type").or_else(|| o.get("type")).and_then(|t| t.as_str()).unwrap_or("");
                let f = |k: &str| -> Result<f64> { o.get(k).and_then(|x| x.as_f64()).with_context(|| format!("rope_scaling: missing `{k}`")) };
                match ty {
                    "llama3" => Some(RopeScaling::Llama3 {
                        factor: f("factor")?,
                        low_freq_factor: f("low_freq_factor")?,
                        high_freq_factor: f("high_freq_factor")?,
                        original_max_position_embeddings: f("original_max_position_embeddings")?,
                    }),
                    "linear" => Some(RopeScaling::Linear { factor: f("factor")? }),
                    "default" | "" => None,
                    other => bail!("unsupported rope_scaling type `{other}` (supported: llama3, linear)"),
                }
            }
            _ => None,
        };
        let mut cfg = ModelConfig {
            arch,
            vocab_size: req("vocab_size")?,
            hidden_size: hidden,
            intermediate_size: req("intermediate_size")?,
            num_layers: req("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: v["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32,
            rope_theta: v["rope_theta"].as_f64().or_else(|| rope_params.and_then(|p| p["rope_theta"].as_f64())).unwrap_or(10000.0),
            rope_scaling,
            max_position_embeddings: v["max_position_embeddings"].as_u64().unwrap_or(4096) as usize,
            tie_word_embeddings: v["tie_word_embeddings"].as_bool().unwrap_or(false),
            qkv_bias: match arch {
                Arch::Qwen2 => true,
                Arch::Qwen2Moe => v["qkv_bias"].as_bool().unwrap_or(true),
                _ => v["attention_bias"].as_bool().unwrap_or(false),
            },
            qk_norm: match arch {
                Arch::Qwen3 | Arch::Qwen3Moe => Some(QkNormKind::PerHead),
                Arch::Olmoe => Some(QkNormKind::Whole),
                _ => None,
            },
            moe: hf_moe(v, arch)?,
            has_lm_head,
        };
        // Sliding-window attention (Mistral v0.1's `sliding_window`; Qwen's when
        // `use_sliding_window`) is not implemented: within the window full attention is the same
        // thing, so the context stops at the window instead of silently attending past it.
        let window = match arch {
            Arch::Mistral | Arch::Mixtral => v["sliding_window"].as_u64(),
            _ if v["use_sliding_window"].as_bool() == Some(true) => v["sliding_window"].as_u64(),
            _ => None,
        };
        if let Some(w) = window.map(|w| w as usize).filter(|&w| w > 0 && w < cfg.max_position_embeddings) {
            tracing::warn!(
                "the model attends through a sliding window of {w} tokens, which Quiver does not implement: contexts stop at {w} tokens (max_position_embeddings {})",
                cfg.max_position_embeddings
            );
            cfg.max_position_embeddings = w;
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads `general.architecture` and the `{arch}.*` keys of a GGUF file.
    pub fn from_gguf(g: &GgufFile) -> Result<ModelConfig> {
        let arch_name = g.metadata("general.architecture").and_then(|v| v.as_str()).context("missing `general.architecture`")?.to_string();
        let key = |k: &str| format!("{arch_name}.{k}");
        let int = |k: &str| g.metadata(&key(k)).and_then(|v| v.as_u64()).map(|x| x as usize);
        let req = |k: &str| -> Result<usize> { int(k).with_context(|| format!("missing metadata `{}`", key(k))) };
        let arch = match arch_name.as_str() {
            // llama.cpp writes Mixtral as `llama` with experts.
            "llama" if int("expert_count").unwrap_or(0) > 0 => Arch::Mixtral,
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "mistral" => Arch::Mistral,
            "qwen3" => Arch::Qwen3,
            "qwen2moe" => Arch::Qwen2Moe,
            "qwen3moe" => Arch::Qwen3Moe,
            "olmoe" => Arch::Olmoe,
            other => bail!("unsupported GGUF architecture `{other}` (supported: llama, qwen2, mistral, qwen3, qwen2moe, qwen3moe, olmoe)"),
        };
        let hidden = req("embedding_length")?;
        let num_heads = req("attention.head_count")?;
        let num_kv_heads = g.metadata(&key("attention.head_count_kv")).and_then(|v| v.as_u64()).map(|x| x as usize).unwrap_or(num_heads);
        let head_dim = g.metadata(&key("attention.key_length")).and_then(|v| v.as_u64()).map(|x| x as usize).unwrap_or(hidden / num_heads.max(1));
        let vocab_size = match g.tensor_info("token_embd.weight") {
            Some(t) if t.dims.len() == 2 => t.dims[1] as usize,
            _ => bail!("missing tensor `token_embd.weight`"),
        };
        let rope_scaling = match g.metadata(&key("rope.scaling.type")).and_then(|v| v.as_str()) {
            Some("linear") => Some(RopeScaling::Linear {
                factor: g.metadata(&key("rope.scaling.factor")).and_then(|v| v.as_f64()).context("rope.scaling.factor missing")?,
            }),
            Some("none") | None => None,
            Some(other) => bail!("unsupported GGUF rope scaling `{other}`"),
        };
        let cfg = ModelConfig {
            arch,
            vocab_size,
            hidden_size: hidden,
            // Mixtral GGUFs give the expert width here; a Qwen MoE its dense layers' width.
            intermediate_size: int("feed_forward_length").or(int("expert_feed_forward_length")).with_context(|| format!("missing metadata `{}`", key("feed_forward_length")))?,
            num_layers: req("block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: g.metadata(&key("attention.layer_norm_rms_epsilon")).and_then(|v| v.as_f64()).unwrap_or(1e-5) as f32,
            rope_theta: g.metadata(&key("rope.freq_base")).and_then(|v| v.as_f64()).unwrap_or(10000.0),
            rope_scaling,
            max_position_embeddings: g.metadata(&key("context_length")).and_then(|v| v.as_u64()).unwrap_or(4096) as usize,
            tie_word_embeddings: g.tensor_info("output.weight").is_none(),
            qkv_bias: g.tensor_info("blk.0.attn_q.bias").is_some(),
            qk_norm: match arch {
                Arch::Qwen3 | Arch::Qwen3Moe => Some(QkNormKind::PerHead),
                Arch::Olmoe => Some(QkNormKind::Whole),
                _ => None,
            },
            moe: gguf_moe(g, &arch_name, arch)?,
            has_lm_head: true,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Whether layer `l` has an expert MLP.
    pub fn is_moe_layer(&self, l: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| !m.dense_layers.contains(&l))
    }

    fn validate(&self) -> Result<()> {
        if let Some(m) = &self.moe {
            if m.num_experts == 0 || m.num_experts > quiver_kernels::moe::MAX_EXPERTS || m.top_k == 0 || m.top_k > m.num_experts {
                bail!("{} experts with {} per token: need 1 ≤ experts per token ≤ experts ≤ {}", m.num_experts, m.top_k, quiver_kernels::moe::MAX_EXPERTS);
            }
            if m.expert_intermediate == 0 || m.shared_expert_intermediate == Some(0) {
                bail!("expert intermediate sizes must be positive");
            }
        }
        if self.num_heads == 0 || self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            bail!("num_attention_heads {} must be a positive multiple of num_key_value_heads {}", self.num_heads, self.num_kv_heads);
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            bail!("head_dim {} must be even and positive", self.head_dim);
        }
        if self.hidden_size == 0 || self.vocab_size == 0 || self.num_layers == 0 || self.intermediate_size == 0 {
            bail!("hidden_size, vocab_size, num_hidden_layers and intermediate_size must be positive");
        }
        Ok(())
    }

    /// RoPE inverse frequencies, computed in f32 exactly as transformers does so positions far
    /// into the context rotate identically.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        // transformers computes `1 / base ** (arange(0, d, 2) / d)` in float32: round the power
        // to f32 before the reciprocal, as torch does.
        let mut inv: Vec<f32> = (0..d / 2)
            .map(|i| {
                let e = ((2 * i) as f32 / d as f32) as f64;
                1.0f32 / ((self.rope_theta as f32 as f64).powf(e) as f32)
            })
            .collect();
        match &self.rope_scaling {
            None => {}
            Some(RopeScaling::Linear { factor }) => inv.iter_mut().for_each(|v| *v /= *factor as f32),
            Some(RopeScaling::Factors(f)) => inv.iter_mut().zip(f).for_each(|(v, f)| *v /= f),
            Some(RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings }) => {
                let (factor, lo, hi, old) = (*factor as f32, *low_freq_factor as f32, *high_freq_factor as f32, *original_max_position_embeddings as f32);
                let low_wavelen = old / lo;
                let high_wavelen = old / hi;
                for v in inv.iter_mut() {
                    let wavelen = 2.0 * std::f32::consts::PI / *v;
                    let scaled = if wavelen > low_wavelen { *v / factor } else { *v };
                    let medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
                    *v = if medium {
                        let smooth = (old / wavelen - lo) / (hi - lo);
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    } else {
                        scaled
                    };
                }
            }
        }
        inv
    }
}


const SUPPORTED_HF: [&str; 11] = [
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
    "LlamaModel",
    "Qwen2Model",
    "Qwen3Model",
];

/// The expert settings of an HF `config.json`, in each family's spelling.
fn hf_moe(v: &Value, arch: Arch) -> Result<Option<MoeConfig>> {
    let int = |k: &str| v[k].as_u64().map(|x| x as usize);
    let req = |k: &str| int(k).with_context(|| format!("missing or non-integer field `{k}`"));
    let top_k = || req("num_experts_per_tok");
    Ok(Some(match arch {
        Arch::Mixtral => MoeConfig {
            num_experts: req("num_local_experts")?,
            top_k: top_k()?,
            expert_intermediate: req("intermediate_size")?,
            norm_topk_prob: true,
            shared_expert_intermediate: None,
            dense_layers: Vec::new(),
        },
        Arch::Olmoe => MoeConfig {
            num_experts: req("num_experts")?,
            top_k: top_k()?,
            expert_intermediate: req("intermediate_size")?,
            norm_topk_prob: v["norm_topk_prob"].as_bool().unwrap_or(false),
            shared_expert_intermediate: None,
            dense_layers: Vec::new(),
        },
        Arch::Qwen2Moe | Arch::Qwen3Moe => {
            let layers = req("num_hidden_layers")?;
            let step = int("decoder_sparse_step").unwrap_or(1).max(1);
            let only: Vec<usize> = v["mlp_only_layers"].as_array().map(|a| a.iter().filter_map(|x| x.as_u64()).map(|x| x as usize).collect()).unwrap_or_default();
            // transformers ≥ 5.17 saves Qwen3-MoE's expert count as `num_local_experts` (Mixtral's
            // spelling); earlier versions and Qwen2-MoE as `num_experts`.
            let num_experts = int("num_experts").or_else(|| int("num_local_experts")).context("missing or non-integer field `num_experts` (or `num_local_experts`)")?;
            MoeConfig {
                num_experts,
                top_k: top_k()?,
                expert_intermediate: req("moe_intermediate_size")?,
                norm_topk_prob: v["norm_topk_prob"].as_bool().unwrap_or(false),
                shared_expert_intermediate: if arch == Arch::Qwen2Moe { Some(req("shared_expert_intermediate_size")?) } else { None },
                dense_layers: (0..layers).filter(|l| only.contains(l) || num_experts == 0 || !(l + 1).is_multiple_of(step)).collect(),
            }
        }
        _ => return Ok(None),
    }))
}

/// The expert settings of a GGUF (llama.cpp's keys). Which layers have experts is read from the
/// tensors (`ffn_gate_inp` present) when the weights are loaded; here every layer does.
fn gguf_moe(g: &GgufFile, arch_name: &str, arch: Arch) -> Result<Option<MoeConfig>> {
    if !matches!(arch, Arch::Mixtral | Arch::Qwen2Moe | Arch::Qwen3Moe | Arch::Olmoe) {
        return Ok(None);
    }
    let key = |k: &str| format!("{arch_name}.{k}");
    let int = |k: &str| g.metadata(&key(k)).and_then(|v| v.as_u64()).map(|x| x as usize);
    let req = |k: &str| int(k).with_context(|| format!("missing metadata `{}`", key(k)));
    // llama.cpp renormalises for Mixtral and Qwen3-MoE and not for Qwen2-MoE or OLMoE, unless
    // the file says otherwise.
    let norm = g.metadata(&key("expert_weights_norm")).and_then(|v| v.as_bool()).unwrap_or(matches!(arch, Arch::Mixtral | Arch::Qwen3Moe));
    let dense_layers = (0..req("block_count")?).filter(|l| g.tensor_info(&format!("blk.{l}.ffn_gate_inp.weight")).is_none()).collect();
    Ok(Some(MoeConfig {
        num_experts: req("expert_count")?,
        top_k: req("expert_used_count")?,
        expert_intermediate: int("expert_feed_forward_length").or(int("feed_forward_length")).with_context(|| format!("missing metadata `{}`", key("expert_feed_forward_length")))?,
        norm_topk_prob: norm,
        shared_expert_intermediate: if arch == Arch::Qwen2Moe { Some(req("expert_shared_feed_forward_length")?) } else { None },
        dense_layers,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})
    }

    /// transformers 4.x: top-level `rope_theta` and `rope_scaling`; 5.x: one `rope_parameters`.
    #[test]
    fn rope_settings_from_both_config_generations() {
        let mut v4 = base();
        v4["rope_theta"] = json!(500000.0);
        v4["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let mut v5 = base();
        v5["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let (a, b) = (ModelConfig::from_hf_json(&v4).unwrap(), ModelConfig::from_hf_json(&v5).unwrap());
        assert_eq!(a.rope_theta, 500000.0);
        assert_eq!(b.rope_theta, 500000.0);
        assert!(matches!(b.rope_scaling, Some(RopeScaling::Llama3 { factor, .. }) if factor == 8.0));
        assert_eq!(a.rope_inv_freq(), b.rope_inv_freq());

        let mut plain = base();
        plain["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 1e6});
        let c = ModelConfig::from_hf_json(&plain).unwrap();
        assert_eq!(c.rope_theta, 1e6);
        assert!(c.rope_scaling.is_none());
        assert_eq!(ModelConfig::from_hf_json(&base()).unwrap().rope_theta, 10000.0);
    }

    /// Qwen3-MoE's expert count under both spellings transformers has written (`num_experts`;
    /// `num_local_experts` from 5.17); neither is an error naming both.
    #[test]
    fn qwen3_moe_expert_count_in_both_spellings() {
        let moe = |key: Option<&str>| {
            let mut v = base();
            v["architectures"] = json!(["Qwen3MoeForCausalLM"]);
            v["num_experts_per_tok"] = json!(2);
            v["moe_intermediate_size"] = json!(32);
            v["head_dim"] = json!(16);
            if let Some(k) = key {
                v[k] = json!(8);
            }
            ModelConfig::from_hf_json(&v)
        };
        for k in ["num_experts", "num_local_experts"] {
            let c = moe(Some(k)).unwrap_or_else(|e| panic!("{k}: {e:#}"));
            assert_eq!(c.moe.as_ref().map(|m| (m.num_experts, m.top_k)), Some((8, 2)), "{k}");
        }
        let e = format!("{:#}", moe(None).unwrap_err());
        assert!(e.contains("num_experts") && e.contains("num_local_experts"), "{e}");
    }

    /// A sliding window caps the context at its width (full attention is the same within it);
    /// Qwen's counts only with `use_sliding_window`, and a window no narrower than the context
    /// changes nothing.
    #[test]
    fn sliding_windows_cap_the_context() {
        let mut m = base();
        m["architectures"] = json!(["MistralForCausalLM"]);
        m["max_position_embeddings"] = json!(32768);
        m["sliding_window"] = json!(4096);
        assert_eq!(ModelConfig::from_hf_json(&m).unwrap().max_position_embeddings, 4096);
        m["sliding_window"] = json!(null);
        assert_eq!(ModelConfig::from_hf_json(&m).unwrap().max_position_embeddings, 32768);
        let mut q = base();
        q["architectures"] = json!(["Qwen2ForCausalLM"]);
        q["max_position_embeddings"] = json!(32768);
        q["sliding_window"] = json!(4096);
        q["use_sliding_window"] = json!(false);
        assert_eq!(ModelConfig::from_hf_json(&q).unwrap().max_position_embeddings, 32768);
        q["use_sliding_window"] = json!(true);
        assert_eq!(ModelConfig::from_hf_json(&q).unwrap().max_position_embeddings, 4096);
        q["sliding_window"] = json!(131072);
        assert_eq!(ModelConfig::from_hf_json(&q).unwrap().max_position_embeddings, 32768);
    }

    /// Llama's `attention_bias` turns the q / k / v biases on (o_proj's is read when the
    /// checkpoint has it); `mlp_bias` is refused by name rather than dropped.
    #[test]
    fn llama_bias_flags() {
        let mut v = base();
        v["attention_bias"] = json!(true);
        assert!(ModelConfig::from_hf_json(&v).unwrap().qkv_bias);
        assert!(!ModelConfig::from_hf_json(&base()).unwrap().qkv_bias);
        v["mlp_bias"] = json!(true);
        let e = format!("{:#}", ModelConfig::from_hf_json(&v).unwrap_err());
        assert!(e.contains("mlp_bias"), "{e}");
        v["mlp_bias"] = json!(false);
        assert!(ModelConfig::from_hf_json(&v).is_ok());
    }
}
