//! Helpers for tests and benchmarks: random PEFT adapters written to disk, and a tiny random
//! Llama model (with a real tokenizer) for fast randomized engine tests.

use anyhow::{Context, Result};
use quiver_kernels::{open_device, DType, DeviceKind, Weight};
use quiver_lora::{LoraModelDims, LoraModule};
use quiver_model::config::{Arch, ModelConfig};
use quiver_model::llama::{LayerWeights, LlamaModel};
use quiver_model::moe::Mlp;
use quiver_model::tokenizer::Tokenizer;
use quiver_model::LoadedModel;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A fresh directory under the system temp dir.
pub fn temp_dir(tag: &str) -> PathBuf {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    let d = std::env::temp_dir().join(format!("quiver-engine-{tag}-{}-{n}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&d).expect("create temp dir");
    d
}

fn uniform(rng: &mut StdRng, n: usize, std: f32) -> Vec<f32> {
    let a = std * 3f32.sqrt();
    (0..n).map(|_| rng.random_range(-a..a)).collect()
}

/// Writes a PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`, f32) with
/// every layer of `modules` at rank `rank` (the embedding and LM head once): A ~ U with std
/// `1/sqrt(in)`, B with std `b_std`.
pub fn write_random_adapter(dir: &Path, dims: &LoraModelDims, modules: &[LoraModule], rank: usize, alpha: f32, b_std: f32, seed: u64) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut names = Vec::new();
    let mut data: Vec<(Vec<usize>, Vec<u8>)> = Vec::new();
    for l in 0..dims.num_layers {
        for &m in modules.iter().filter(|m| l == 0 || m.is_projection()) {
            let (din, dout) = dims.module_dims(m);
            let p = format!("base_model.model.{}", m.path(l));
            let a = uniform(&mut rng, rank * din, 1.0 / (din as f32).sqrt());
            let b = uniform(&mut rng, dout * rank, b_std);
            // PEFT names an embedding's factors apart (`lora_embedding_A`: `(r, vocab)`).
            let (an, bn) = if m == LoraModule::EmbedTokens { ("lora_embedding_A", "lora_embedding_B") } else { ("lora_A.weight", "lora_B.weight") };
            names.push(format!("{p}.{an}"));
            data.push((vec![rank, din], a.iter().flat_map(|x| x.to_le_bytes()).collect()));
            names.push(format!("{p}.{bn}"));
            data.push((vec![dout, rank], b.iter().flat_map(|x| x.to_le_bytes()).collect()));
        }
    }
    let views: Vec<(String, TensorView<'_>)> =
        names.iter().zip(&data).map(|(n, (shape, bytes))| Ok((n.clone(), TensorView::new(Dtype::F32, shape.clone(), bytes)?))).collect::<Result<_, safetensors::SafeTensorError>>()?;
    let bytes = safetensors::tensor::serialize(views, None)?;
    std::fs::write(dir.join("adapter_model.safetensors"), bytes)?;
    let cfg = serde_json::json!({
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": modules.iter().map(|m| m.name()).collect::<Vec<_>>(),
        "bias": "none",
        "base_model_name_or_path": "random",
    });
    std::fs::write(dir.join("adapter_config.json"), serde_json::to_string_pretty(&cfg)?)?;
    Ok(())
}

/// A tiny random Llama (2 layers, hidden 64) over the tokenizer of `tokenizer_gguf`, so token
/// ids render as real text. Logits are large (unit embeddings, tied head), so greedy choices are
/// decisive and batch-composition rounding does not flip them.
pub fn tiny_model(tokenizer_gguf: &Path, seed: u64) -> Result<LoadedModel> {
    let tokenizer = Tokenizer::from_gguf_path(tokenizer_gguf).with_context(|| format!("tokenizer of {}", tokenizer_gguf.display()))?;
    let config = tiny_config(tokenizer.vocab_size());
    let vocab = config.vocab_size;
    let device = open_device(DeviceKind::Cpu)?;
    let mut rng = StdRng::seed_from_u64(seed);
    let (h, i, q, kv) = (config.hidden_size, config.intermediate_size, config.q_out(), config.kv_out());
    let mut w = |rows: usize, cols: usize, std: f32| device.load_weight(Weight::from_f32(rows, cols, uniform(&mut rng, rows * cols, std), DType::F32));
    let mut layers = Vec::new();
    for _ in 0..config.num_layers {
        layers.push(LayerWeights {
            attn_norm: device.tensor_from(&vec![1.0; h]),
            qkv: w(q + 2 * kv, h, 1.0 / (h as f32).sqrt()),
            qkv_bias: None,
            qk_norm: None,
            o: w(h, q, 1.0 / (q as f32).sqrt()),
            o_bias: None,
            mlp_norm: device.tensor_from(&vec![1.0; h]),
            mlp: Mlp::Dense { gate_up: w(2 * i, h, 1.0 / (h as f32).sqrt()), down: w(h, i, 1.0 / (i as f32).sqrt()) },
        });
    }
    let embed = w(vocab, h, 1.0);
    let rope = LlamaModel::build_rope(&config, &*device);
    let model = LlamaModel { config, device: device.clone(), embed, layers, final_norm: device.tensor_from(&vec![1.0; h]), lm_head: None, rope, tp: None };
    Ok(LoadedModel { model, tokenizer, path: PathBuf::from("tiny-random") })
}

/// The shape of [`tiny_model`]: 2 layers, hidden 64, 4 heads over 2 kv heads, tied embeddings.
fn tiny_config(vocab: usize) -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        vocab_size: vocab,
        hidden_size: 64,
        intermediate_size: 128,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        max_position_embeddings: 4096,
        tie_word_embeddings: true,
        qkv_bias: false,
        qk_norm: None,
        moe: None,
        has_lm_head: true,
    }
}

/// [`tiny_model`]'s shape with [`random_hf_weights`] (other values), split over `tp`
/// tensor-parallel CPU ranks through the loader (`tp` = 1: unsplit).
pub fn tiny_model_tp(tokenizer_gguf: &Path, seed: u64, tp: usize) -> Result<LoadedModel> {
    tiny_model_tp_on(tokenizer_gguf, seed, tp, DeviceKind::Cpu)
}

/// [`tiny_model_tp`] on `device` (f32 weights).
pub fn tiny_model_tp_on(tokenizer_gguf: &Path, seed: u64, tp: usize, device: DeviceKind) -> Result<LoadedModel> {
    let tokenizer = Tokenizer::from_gguf_path(tokenizer_gguf).with_context(|| format!("tokenizer of {}", tokenizer_gguf.display()))?;
    let config = tiny_config(tokenizer.vocab_size());
    let weights = random_hf_weights(&config, seed);
    let model = quiver_model::loader::load_hf_weights(&weights, config, open_device(device)?, DType::F32, tp)?;
    Ok(LoadedModel { model, tokenizer, path: PathBuf::from(format!("tiny-random-tp{tp}")) })
}

/// `n` values uniform with standard deviation `std`, from a counter-based generator (splitmix64
/// of `seed` and the index), filled in parallel: a benchmark model's billions of weights take
/// seconds, and the values do not depend on the thread count.
fn fast_uniform(n: usize, std: f32, seed: u64) -> Vec<f32> {
    use rayon::prelude::*;
    let a = std * 3f32.sqrt();
    let mut v = vec![0.0f32; n];
    v.par_chunks_mut(1 << 16).enumerate().for_each(|(c, out)| {
        for (i, o) in out.iter_mut().enumerate() {
            let mut z = seed ^ ((c << 16 | i) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            *o = ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a;
        }
    });
    v
}

/// A model of `config`'s shape (dense or mixture-of-experts) with random weights on `device`,
/// for benchmarks of shapes whose checkpoints are too large to keep around: linear weights with
/// std 1/√in (residual branches also / √(2·layers)), routers with std 2/√hidden (so routing
/// is varied), unit norms, no biases.
pub fn random_model(config: ModelConfig, tokenizer: Tokenizer, device: std::sync::Arc<dyn quiver_kernels::Device>, dtype: DType, seed: u64) -> LoadedModel {
    use quiver_kernels::QkNorm;
    use quiver_model::config::QkNormKind;
    use quiver_model::moe::{MoeWeights, SharedExpert};
    let c = &config;
    let (h, q, kv, inter, nl) = (c.hidden_size, c.q_out(), c.kv_out(), c.intermediate_size, c.num_layers);
    let mut next = seed;
    let mut draw = |n: usize, std: f32| {
        next = next.wrapping_add(0x632B_E59B_D9B4_E019);
        fast_uniform(n, std, next)
    };
    let resid = 1.0 / (2.0 * nl as f32).sqrt();
    let ones = |n: usize| device.tensor_from(&vec![1.0; n]);
    let mut layers = Vec::with_capacity(nl);
    for l in 0..nl {
        let mut w = |rows: usize, cols: usize, std: f32, dt: DType| device.load_weight(Weight::from_f32(rows, cols, draw(rows * cols, std), dt));
        let qkv = w(q + 2 * kv, h, 1.0 / (h as f32).sqrt(), dtype);
        let o = w(h, q, resid / (q as f32).sqrt(), dtype);
        let qk_norm = c.qk_norm.map(|k| {
            let (qg, kg) = if k == QkNormKind::PerHead { (c.head_dim, c.head_dim) } else { (q, kv) };
            QkNorm { q: ones(qg), k: ones(kg), q_group: qg, k_group: kg, eps: c.rms_norm_eps }
        });
        let mlp = match &c.moe {
            Some(mc) if c.is_moe_layer(l) => {
                let (e, ie) = (mc.num_experts, mc.expert_intermediate);
                let router = w(e, h, 2.0 / (h as f32).sqrt(), DType::F32);
                let mut experts = |rows: usize, cols: usize, std: f32| (0..e).map(|_| Weight::from_f32(rows, cols, draw(rows * cols, std), dtype)).collect::<Vec<_>>();
                let gate_up = device.load_experts(2 * ie, h, experts(2 * ie, h, 1.0 / (h as f32).sqrt()));
                let down = device.load_experts(h, ie, experts(h, ie, resid / (ie as f32).sqrt()));
                let mut w = |rows: usize, cols: usize, std: f32, dt: DType| device.load_weight(Weight::from_f32(rows, cols, draw(rows * cols, std), dt));
                let shared = mc.shared_expert_intermediate.map(|is| SharedExpert { gate_up: w(2 * is, h, 1.0 / (h as f32).sqrt(), dtype), down: w(h, is, resid / (is as f32).sqrt(), dtype), gate: w(1, h, 1.0 / (h as f32).sqrt(), DType::F32) });
                Mlp::Moe(Box::new(MoeWeights { router, gate_up, down, shared }))
            }
            _ => Mlp::Dense { gate_up: w(2 * inter, h, 1.0 / (h as f32).sqrt(), dtype), down: w(h, inter, resid / (inter as f32).sqrt(), dtype) },
        };
        layers.push(LayerWeights { attn_norm: ones(h), qkv, qkv_bias: None, qk_norm, o, o_bias: None, mlp_norm: ones(h), mlp });
    }
    let embed = device.load_weight(Weight::from_f32(c.vocab_size, h, draw(c.vocab_size * h, 1.0), dtype));
    let lm_head = (c.has_lm_head && !c.tie_word_embeddings).then(|| device.load_weight(Weight::from_f32(c.vocab_size, h, draw(c.vocab_size * h, 1.0 / (h as f32).sqrt()), dtype)));
    let rope = LlamaModel::build_rope(c, &*device);
    let model = LlamaModel { config, device: device.clone(), embed, layers, final_norm: ones(h), lm_head, rope, tp: None };
    LoadedModel { model, tokenizer, path: PathBuf::from("random") }
}

/// Random weights of a dense model of `config`'s shape, named as in an HF checkpoint, for
/// `quiver_model::loader::load_hf_weights` (which can split them over tensor-parallel ranks):
/// linear weights with std 1/√in, the embedding (and a tied head) with std 1 as in
/// [`tiny_model`], norm weights and biases drawn around 1 and 0 so that sharding them wrongly
/// shows. With `qkv_bias`, o_proj has a bias too, as HF Llama's `attention_bias` gives it.
pub fn random_hf_weights(config: &ModelConfig, seed: u64) -> quiver_model::formats::memory::MemoryWeights {
    let c = config;
    let (h, q, kv, inter, nl) = (c.hidden_size, c.q_out(), c.kv_out(), c.intermediate_size, c.num_layers);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut w = quiver_model::formats::memory::MemoryWeights::new("random-hf");
    let mut put = |name: String, shape: &[usize], mean: f32, std: f32| {
        let data = uniform(&mut rng, shape.iter().product(), std).into_iter().map(|v| v + mean).collect();
        w.insert(name, shape, data);
    };
    put("model.embed_tokens.weight".into(), &[c.vocab_size, h], 0.0, 1.0);
    for l in 0..nl {
        let p = format!("model.layers.{l}");
        put(format!("{p}.input_layernorm.weight"), &[h], 1.0, 0.1);
        put(format!("{p}.post_attention_layernorm.weight"), &[h], 1.0, 0.1);
        for (m, rows) in [("q", q), ("k", kv), ("v", kv)] {
            put(format!("{p}.self_attn.{m}_proj.weight"), &[rows, h], 0.0, 1.0 / (h as f32).sqrt());
            if c.qkv_bias {
                put(format!("{p}.self_attn.{m}_proj.bias"), &[rows], 0.0, 0.1);
            }
        }
        put(format!("{p}.self_attn.o_proj.weight"), &[h, q], 0.0, 1.0 / (q as f32).sqrt());
        if c.qkv_bias {
            // HF Llama's `attention_bias` puts a bias on o_proj too.
            put(format!("{p}.self_attn.o_proj.bias"), &[h], 0.0, 0.1);
        }
        put(format!("{p}.mlp.gate_proj.weight"), &[inter, h], 0.0, 1.0 / (h as f32).sqrt());
        put(format!("{p}.mlp.up_proj.weight"), &[inter, h], 0.0, 1.0 / (h as f32).sqrt());
        put(format!("{p}.mlp.down_proj.weight"), &[h, inter], 0.0, 1.0 / (inter as f32).sqrt());
    }
    put("model.norm.weight".into(), &[h], 1.0, 0.1);
    if !c.tie_word_embeddings {
        put("lm_head.weight".into(), &[c.vocab_size, h], 0.0, 1.0 / (h as f32).sqrt());
    }
    w
}
