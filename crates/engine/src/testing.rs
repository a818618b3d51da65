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
/// every layer of `modules` at rank `rank`: A ~ U with std `1/sqrt(in)`, B with std `b_std`.
pub fn write_random_adapter(dir: &Path, dims: &LoraModelDims, modules: &[LoraModule], rank: usize, alpha: f32, b_std: f32, seed: u64) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut names = Vec::new();
    let mut data: Vec<(Vec<usize>, Vec<u8>)> = Vec::new();
    for l in 0..dims.num_layers {
        for &m in modules {
            let (din, dout) = dims.module_dims(m);
            let p = format!("base_model.model.{}", m.path(l));
            let a = uniform(&mut rng, rank * din, 1.0 / (din as f32).sqrt());
            let b = uniform(&mut rng, dout * rank, b_std);
            names.push(format!("{p}.lora_A.weight"));
            data.push((vec![rank, din], a.iter().flat_map(|x| x.to_le_bytes()).collect()));
            names.push(format!("{p}.lora_B.weight"));
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
    let vocab = tokenizer.vocab_size();
    let config = ModelConfig {
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
    };
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
            mlp_norm: device.tensor_from(&vec![1.0; h]),
            mlp: Mlp::Dense { gate_up: w(2 * i, h, 1.0 / (h as f32).sqrt()), down: w(h, i, 1.0 / (i as f32).sqrt()) },
        });
    }
    let embed = w(vocab, h, 1.0);
    let rope = LlamaModel::build_rope(&config, &*device);
    let model = LlamaModel { config, device: device.clone(), embed, layers, final_norm: device.tensor_from(&vec![1.0; h]), lm_head: None, rope };
    Ok(LoadedModel { model, tokenizer, path: PathBuf::from("tiny-random") })
}
