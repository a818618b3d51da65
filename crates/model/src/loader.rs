//! Turns a GGUF file or an HF directory into a [`LlamaModel`] on a device: maps tensor names,
//! checks every shape against the config, fuses q/k/v and gate/up (per expert too), converts
//! to the chosen dtype. Every missing or misshapen tensor is an error naming file and tensor.

use crate::config::{Arch, ModelConfig, QkNormKind, RopeScaling};
use crate::formats::gguf::GgufFile;
use crate::formats::safetensors::SafetensorsWeights;
use crate::formats::{FormatError, WeightSource};
use crate::llama::{LayerWeights, LlamaModel};
use crate::moe::{Mlp, MoeWeights, SharedExpert};
use crate::tokenizer::Tokenizer;
use crate::tp::shard::{take_cols, take_rows};
use crate::tp::TensorParallel;
use anyhow::{Context, Result};
use quiver_kernels::{DType, Device, QkNorm, Weight};
use quiver_lora::TpShard;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A loaded model with its tokenizer.
pub struct LoadedModel {
    pub model: LlamaModel,
    pub tokenizer: Tokenizer,
    pub path: PathBuf,
}

/// Weight names differ by container; everything else is shared.
#[derive(Clone, Copy)]
enum Names {
    /// `prefix` is `model.` in a `…ForCausalLM` checkpoint, empty in a bare decoder's.
    Hf { prefix: &'static str, arch: Arch },
    Gguf,
}

impl Names {
    fn hf(src: &dyn WeightSource, arch: Arch) -> Names {
        let prefix = if !src.contains("model.embed_tokens.weight") && src.contains("embed_tokens.weight") { "" } else { "model." };
        Names::Hf { prefix, arch }
    }
    fn embed(&self) -> String {
        match self {
            Names::Hf { prefix, .. } => format!("{prefix}embed_tokens.weight"),
            Names::Gguf => "token_embd.weight".into(),
        }
    }
    fn final_norm(&self) -> String {
        match self {
            Names::Hf { prefix, .. } => format!("{prefix}norm.weight"),
            Names::Gguf => "output_norm.weight".into(),
        }
    }
    fn lm_head(&self) -> &'static str {
        match self {
            Names::Hf { .. } => "lm_head.weight",
            Names::Gguf => "output.weight",
        }
    }
    /// `part` is one of q,k,v,o,q_norm,k_norm,gate,up,down,attn_norm,mlp_norm, or of an expert
    /// layer router, shared_gate, shared_{gate,up,down}; `suffix` weight or bias.
    fn layer(&self, i: usize, part: &str, suffix: &str) -> String {
        match self {
            Names::Hf { prefix, arch } => {
                let moe = if *arch == Arch::Mixtral { "block_sparse_moe" } else { "mlp" };
                let m = match part {
                    "q" | "k" | "v" | "o" => format!("self_attn.{part}_proj"),
                    "q_norm" | "k_norm" => format!("self_attn.{part}"),
                    "gate" | "up" | "down" => format!("mlp.{part}_proj"),
                    "attn_norm" => "input_layernorm".into(),
                    "router" => format!("{moe}.gate"),
                    "shared_gate" => "mlp.shared_expert_gate".into(),
                    "shared_gate_proj" | "shared_up_proj" | "shared_down_proj" => format!("mlp.shared_expert.{}", &part["shared_".len()..]),
                    _ => "post_attention_layernorm".into(),
                };
                format!("{prefix}layers.{i}.{m}.{suffix}")
            }
            Names::Gguf => {
                let m = match part {
                    "q" => "attn_q",
                    "k" => "attn_k",
                    "v" => "attn_v",
                    "o" => "attn_output",
                    "q_norm" => "attn_q_norm",
                    "k_norm" => "attn_k_norm",
                    "gate" => "ffn_gate",
                    "up" => "ffn_up",
                    "down" => "ffn_down",
                    "attn_norm" => "attn_norm",
                    "router" => "ffn_gate_inp",
                    "shared_gate" => "ffn_gate_inp_shexp",
                    "shared_gate_proj" => "ffn_gate_shexp",
                    "shared_up_proj" => "ffn_up_shexp",
                    "shared_down_proj" => "ffn_down_shexp",
                    _ => "ffn_norm",
                };
                format!("blk.{i}.{m}.{suffix}")
            }
        }
    }
    /// HF: expert `e`'s projection (`gate`, `up`, `down`). GGUF stacks all experts in one
    /// `[E, out, in]` tensor per projection, named here for any `e`.
    fn expert(&self, i: usize, e: usize, part: &str) -> String {
        match self {
            Names::Hf { prefix, arch: Arch::Mixtral } => {
                let w = match part {
                    "gate" => "w1",
                    "down" => "w2",
                    _ => "w3",
                };
                format!("{prefix}layers.{i}.block_sparse_moe.experts.{e}.{w}.weight")
            }
            Names::Hf { prefix, .. } => format!("{prefix}layers.{i}.mlp.experts.{e}.{part}_proj.weight"),
            Names::Gguf => format!("blk.{i}.ffn_{part}_exps.weight"),
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
    load_model_tp(path, device, dtype, 1)
}

/// Loads a model split over `tp` tensor-parallel ranks formed from `device`
/// (`Device::tensor_parallel_group`); `tp` = 1 is [`load_model`].
pub fn load_model_tp(path: &Path, device: Arc<dyn Device>, dtype: DType, tp: usize) -> Result<LoadedModel> {
    if path.is_dir() {
        let config = ModelConfig::from_hf_dir(path)?;
        let weights = SafetensorsWeights::open(path)?;
        let tokenizer = Tokenizer::from_hf_dir(path)?;
        let names = Names::hf(&weights, config.arch);
        let model = build_group(&weights, names, config, device, dtype, false, tp)?;
        Ok(LoadedModel { model, tokenizer, path: path.to_path_buf() })
    } else {
        let gguf = GgufFile::open(path)?;
        let mut config = ModelConfig::from_gguf(&gguf).with_context(|| format!("{}", path.display()))?;
        if gguf.contains("rope_freqs.weight") {
            let (f, _) = gguf.tensor_f32("rope_freqs.weight")?;
            config.rope_scaling = Some(RopeScaling::Factors(f));
        }
        let tokenizer = Tokenizer::from_gguf(&gguf).with_context(|| format!("{}: tokenizer", path.display()))?;
        // llama.cpp permutes q/k rows for the archs it runs with adjacent-pair RoPE.
        let permuted = matches!(config.arch, Arch::Llama | Arch::Mistral | Arch::Mixtral);
        let model = build_group(&gguf, Names::Gguf, config, device, dtype, permuted, tp)?;
        Ok(LoadedModel { model, tokenizer, path: path.to_path_buf() })
    }
}

/// A model from tensors named as in an HF checkpoint (`model.…`), split over `tp` ranks like
/// [`load_model_tp`]: models built in memory ([`crate::formats::memory::MemoryWeights`]).
pub fn load_hf_weights(src: &dyn WeightSource, config: ModelConfig, device: Arc<dyn Device>, dtype: DType, tp: usize) -> Result<LlamaModel> {
    let names = Names::hf(src, config.arch);
    build_group(src, names, config, device, dtype, false, tp)
}

/// The whole model on `device` (`tp` = 1), or rank 0 of a group of `tp` ranks carrying the
/// others, each rank's weights sliced from the full tensors.
fn build_group(src: &dyn WeightSource, names: Names, config: ModelConfig, device: Arc<dyn Device>, dtype: DType, permuted_qk: bool, tp: usize) -> Result<LlamaModel> {
    if tp == 1 {
        return build(src, names, config, device, dtype, permuted_qk, None);
    }
    let shards = crate::tp::shard::shards(&config, tp).map_err(anyhow::Error::msg)?;
    let group = device.tensor_parallel_group(tp).map_err(|e| anyhow::anyhow!("--tensor-parallel-size {tp}: {e}"))?;
    let comms: Vec<_> = group.iter().map(|(_, c)| c.clone()).collect();
    let mut ranks = shards.into_iter().zip(group).map(|(shard, (dev, comm))| {
        let mut m = build(src, names, config.clone(), dev, dtype, permuted_qk, Some(&shard))?;
        m.tp = Some(Box::new(TensorParallel::peer(shard, comm)));
        Ok(m)
    });
    let mut leader = ranks.next().expect("rank 0")?;
    let peers = ranks.collect::<Result<Vec<_>>>()?;
    let shard0 = leader.tp.take().expect("set above").shard;
    leader.tp = Some(Box::new(TensorParallel::leader(shard0, comms, peers)));
    Ok(leader)
}

/// The model, or with `shard` one tensor-parallel rank's part of it: q heads and kv heads of
/// qkv, intermediate columns of gate_up and down, q columns of o, vocab rows of the embedding
/// and the LM head (`tp::shard`); the caller sets `tp`.
fn build(src: &dyn WeightSource, names: Names, config: ModelConfig, device: Arc<dyn Device>, dtype: DType, permuted_qk: bool, shard: Option<&TpShard>) -> Result<LlamaModel> {
    let c = &config;
    device.check_head_dim(c.head_dim).map_err(|e| anyhow::anyhow!("{}: {e}", src.path().display()))?;
    device.check_layer_ops(c.qk_norm.is_some(), c.moe.is_some()).map_err(|e| anyhow::anyhow!("{}: {e}", src.path().display()))?;
    let (h, q, kv, inter) = (c.hidden_size, c.q_out(), c.kv_out(), c.intermediate_size);
    // The largest single buffer the model needs on the device: the embedding / LM head, a fused
    // qkv or gate_up weight, a layer's stacked experts.
    let elem = if dtype == DType::Bf16 { 2 } else { 4 };
    let experts = c.moe.as_ref().map_or(0, |m| m.num_experts * 2 * m.expert_intermediate * h);
    let largest = [c.vocab_size * h, (q + 2 * kv) * h, 2 * inter * h, experts].into_iter().max().unwrap_or(0) * elem;
    device.check_alloc(largest).map_err(|e| anyhow::anyhow!("{}: {e}", src.path().display()))?;
    let wt = |rows: usize, cols: usize, data: Vec<f32>| device.load_weight(Weight::from_f32(rows, cols, data, dtype));
    // A rank's rows (or columns) of a full tensor; everything without a shard.
    let whole = TpShard { rank: 0, ranks: 1, q: 0..q, kv: 0..kv, inter: 0..inter, vocab: 0..c.vocab_size };
    let sh = shard.unwrap_or(&whole);
    let vocab_rows = |w: Vec<f32>| take_rows(w, h, sh.vocab.clone());
    let embed = wt(sh.vocab.len(), h, vocab_rows(load(src, &names.embed(), &[c.vocab_size, h])?));
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
        let mut qkv = take_rows(wq, h, sh.q.clone());
        qkv.extend_from_slice(&wk[sh.kv.start * h..sh.kv.end * h]);
        qkv.extend_from_slice(&wv[sh.kv.start * h..sh.kv.end * h]);
        let qkv_bias = if c.qkv_bias {
            let b = |part: &str, n: usize| load(src, &names.layer(i, part, "bias"), &[n]);
            let mut bq = b("q", q)?;
            let mut bk = b("k", kv)?;
            if permuted_qk {
                bq = unpermute_rows(&bq, c.num_heads, q, 1);
                bk = unpermute_rows(&bk, c.num_kv_heads, kv, 1);
            }
            let bv = b("v", kv)?;
            let mut bias = bq[sh.q.clone()].to_vec();
            bias.extend_from_slice(&bk[sh.kv.clone()]);
            bias.extend_from_slice(&bv[sh.kv.clone()]);
            Some(device.tensor_from(&bias))
        } else {
            None
        };
        // o_proj's bias where the checkpoint has one (HF Llama's `attention_bias` covers o_proj
        // too); rank 0's alone under tensor parallelism (its all-reduce adds it once).
        let o_bias_name = names.layer(i, "o", "bias");
        let o_bias = if src.contains(&o_bias_name) {
            let b = load(src, &o_bias_name, &[h])?;
            (sh.rank == 0).then(|| device.tensor_from(&b))
        } else {
            None
        };
        let qk_norm = match c.qk_norm {
            None => None,
            Some(kind) => {
                let (qg, kg) = match kind {
                    QkNormKind::PerHead => (c.head_dim, c.head_dim),
                    QkNormKind::Whole => (q, kv),
                };
                Some(QkNorm { q: device.tensor_from(&l("q_norm", &[qg])?), k: device.tensor_from(&l("k_norm", &[kg])?), q_group: qg, k_group: kg, eps: c.rms_norm_eps })
            }
        };
        let mlp = if c.is_moe_layer(i) {
            Mlp::Moe(Box::new(load_experts(src, &names, c, i, &*device, dtype)?))
        } else {
            let mut gate_up = take_rows(l("gate", &[inter, h])?, h, sh.inter.clone());
            gate_up.extend(take_rows(l("up", &[inter, h])?, h, sh.inter.clone()));
            let down = take_cols(l("down", &[h, inter])?, inter, sh.inter.clone());
            Mlp::Dense { gate_up: wt(2 * sh.inter.len(), h, gate_up), down: wt(h, sh.inter.len(), down) }
        };
        layers.push(LayerWeights {
            attn_norm: device.tensor_from(&l("attn_norm", &[h])?),
            qkv: wt(sh.q.len() + 2 * sh.kv.len(), h, qkv),
            qkv_bias,
            qk_norm,
            o: wt(h, sh.q.len(), take_cols(l("o", &[h, q])?, q, sh.q.clone())),
            o_bias,
            mlp_norm: device.tensor_from(&l("mlp_norm", &[h])?),
            mlp,
        });
    }
    let final_norm = device.tensor_from(&load(src, &names.final_norm(), &[h])?);
    let hf = matches!(names, Names::Hf { .. });
    let lm_head = if src.contains(names.lm_head()) && !(c.tie_word_embeddings && hf) {
        Some(wt(sh.vocab.len(), h, vocab_rows(load(src, names.lm_head(), &[c.vocab_size, h])?)))
    } else if c.tie_word_embeddings || !c.has_lm_head {
        None
    } else {
        return Err(FormatError::tensor(src.path(), names.lm_head(), "missing (the config says embeddings are not tied)").into());
    };
    let rope = LlamaModel::build_rope(c, &*device);
    Ok(LlamaModel { config, device, embed, layers, final_norm, lm_head, rope, tp: None })
}

/// Layer `i`'s router, experts (fused gate/up per expert) and shared expert. HF checkpoints
/// hold one tensor per expert and projection; GGUF one `[E, out, in]` stack per projection.
/// The router and the shared expert's gate stay f32 whatever `dtype` (routing in f32).
fn load_experts(src: &dyn WeightSource, names: &Names, c: &ModelConfig, i: usize, device: &dyn Device, dtype: DType) -> Result<MoeWeights> {
    let mc = c.moe.as_ref().expect("an MoE layer in a model with an MoE config");
    let (h, n_exp, ie) = (c.hidden_size, mc.num_experts, mc.expert_intermediate);
    let f32w = |rows: usize, cols: usize, data: Vec<f32>| device.load_weight(Weight::from_f32(rows, cols, data, DType::F32));
    let wt = |rows: usize, cols: usize, data: Vec<f32>| device.load_weight(Weight::from_f32(rows, cols, data, dtype));
    let router = f32w(n_exp, h, load(src, &names.layer(i, "router", "weight"), &[n_exp, h])?);
    let mut gate_up = Vec::with_capacity(n_exp);
    let mut down = Vec::with_capacity(n_exp);
    match names {
        Names::Gguf => {
            let g = load(src, &names.expert(i, 0, "gate"), &[n_exp, ie, h])?;
            let u = load(src, &names.expert(i, 0, "up"), &[n_exp, ie, h])?;
            let d = load(src, &names.expert(i, 0, "down"), &[n_exp, h, ie])?;
            for e in 0..n_exp {
                let span = ie * h;
                let mut gu = g[e * span..(e + 1) * span].to_vec();
                gu.extend_from_slice(&u[e * span..(e + 1) * span]);
                gate_up.push(gu);
                down.push(d[e * span..(e + 1) * span].to_vec());
            }
        }
        Names::Hf { .. } => {
            // One expert past the config's count means the checkpoint has more experts than
            // the config says: refuse rather than silently serve a subset.
            let extra = names.expert(i, n_exp, "gate");
            if src.contains(&extra) {
                return Err(FormatError::tensor(src.path(), extra, format!("expert {n_exp} exists but the config gives {n_exp} experts per layer")).into());
            }
            for e in 0..n_exp {
                let mut gu = load(src, &names.expert(i, e, "gate"), &[ie, h])?;
                gu.extend(load(src, &names.expert(i, e, "up"), &[ie, h])?);
                gate_up.push(gu);
                down.push(load(src, &names.expert(i, e, "down"), &[h, ie])?);
            }
        }
    }
    let gate_up = device.load_experts(2 * ie, h, gate_up.into_iter().map(|v| Weight::from_f32(2 * ie, h, v, dtype)).collect());
    let down = device.load_experts(h, ie, down.into_iter().map(|v| Weight::from_f32(h, ie, v, dtype)).collect());
    let shared = match mc.shared_expert_intermediate {
        None => None,
        Some(is) => {
            let l = |part: &str, shape: &[usize]| load(src, &names.layer(i, part, "weight"), shape);
            let mut gu = l("shared_gate_proj", &[is, h])?;
            gu.extend(l("shared_up_proj", &[is, h])?);
            // llama.cpp stores the shared expert's gate as a vector.
            let gname = names.layer(i, "shared_gate", "weight");
            let gate = match src.shape(&gname)?.as_slice() {
                [n] if *n == h => load(src, &gname, &[h])?,
                _ => load(src, &gname, &[1, h])?,
            };
            Some(SharedExpert { gate_up: wt(2 * is, h, gu), down: wt(h, is, l("shared_down_proj", &[h, is])?), gate: f32w(1, h, gate) })
        }
    };
    Ok(MoeWeights { router, gate_up, down, shared })
}
