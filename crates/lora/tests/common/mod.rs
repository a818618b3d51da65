//! Test helpers: write PEFT adapter directories (safetensors + JSON) into unique temp dirs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use quiver_lora::{LinearSite, LoraManager, LoraModelDims, LoraModule, SiteRef};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::tensor::TensorView;
use safetensors::Dtype;

/// Small dims with odd widths so no kernel can rely on multiples of a tile.
pub const DIMS: LoraModelDims = LoraModelDims { num_layers: 2, hidden: 20, q_out: 20, kv_out: 12, intermediate: 36, vocab: 53 };

static COUNTER: AtomicUsize = AtomicUsize::new(0);

pub fn temp_dir(tag: &str) -> PathBuf {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    let d = std::env::temp_dir().join(format!("quiver-lora-{tag}-{}-{n}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub struct T {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

pub fn write_adapter(dir: &Path, config: &serde_json::Value, tensors: &[T]) {
    std::fs::write(dir.join("adapter_config.json"), serde_json::to_string_pretty(config).unwrap()).unwrap();
    let bytes: Vec<Vec<u8>> = tensors.iter().map(|t| t.data.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|(t, b)| (t.name.clone(), TensorView::new(Dtype::F32, t.shape.clone(), b).unwrap()))
        .collect();
    let out = safetensors::tensor::serialize(views, None).unwrap();
    std::fs::write(dir.join("adapter_model.safetensors"), out).unwrap();
}

pub fn tensor_names(m: LoraModule, layer: usize) -> (String, String) {
    let p = format!("base_model.model.{}", m.path(layer));
    match m {
        LoraModule::EmbedTokens => (format!("{p}.lora_embedding_A"), format!("{p}.lora_embedding_B")),
        _ => (format!("{p}.lora_A.weight"), format!("{p}.lora_B.weight")),
    }
}

/// A random adapter: every module in `modules`, every layer, rank `r`, alpha `alpha`.
/// `rank_of` may override the rank per (module, layer) (matching a rank_pattern in `extra`).
pub fn random_adapter(
    tag: &str,
    seed: u64,
    r: usize,
    alpha: f32,
    modules: &[LoraModule],
    rank_of: &dyn Fn(LoraModule, usize) -> usize,
    extra: serde_json::Value,
) -> PathBuf {
    random_adapter_for(&DIMS, tag, seed, r, alpha, modules, rank_of, extra, false)
}

/// [`random_adapter`] for a model of `dims`; with `bf16` every value is representable in bf16,
/// so a device that stores adapters in bf16 holds exactly what the f32 reference computes with
/// and the two differ only by accumulation order.
#[allow(clippy::too_many_arguments)]
pub fn random_adapter_for(
    dims: &LoraModelDims,
    tag: &str,
    seed: u64,
    r: usize,
    alpha: f32,
    modules: &[LoraModule],
    rank_of: &dyn Fn(LoraModule, usize) -> usize,
    extra: serde_json::Value,
    bf16: bool,
) -> PathBuf {
    let mut rng = StdRng::seed_from_u64(seed);
    let value = move |rng: &mut StdRng| {
        let v: f32 = rng.random_range(-0.5..0.5);
        if bf16 { half::bf16::from_f32(v).to_f32() } else { v }
    };
    let mut tensors = Vec::new();
    for &m in modules {
        let layers: Vec<usize> = if m.is_projection() { (0..dims.num_layers).collect() } else { vec![0] };
        for l in layers {
            let rk = rank_of(m, l);
            let (din, dout) = dims.module_dims(m);
            let (an, bn) = tensor_names(m, l);
            tensors.push(T { name: an, shape: vec![rk, din], data: (0..rk * din).map(|_| value(&mut rng)).collect() });
            tensors.push(T { name: bn, shape: vec![dout, rk], data: (0..dout * rk).map(|_| value(&mut rng)).collect() });
        }
    }
    let mut cfg = serde_json::json!({
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": alpha,
        "target_modules": modules.iter().map(|m| m.name()).collect::<Vec<_>>(),
        "bias": "none",
    });
    if let serde_json::Value::Object(e) = extra {
        for (k, v) in e {
            cfg[k] = v;
        }
    }
    let dir = temp_dir(tag);
    write_adapter(&dir, &cfg, &tensors);
    dir
}

pub fn simple_adapter(tag: &str, seed: u64, r: usize, modules: &[LoraModule]) -> PathBuf {
    random_adapter(tag, seed, r, 2.0 * r as f32, modules, &|_, _| r, serde_json::json!({}))
}

pub fn fresh_seed() -> u64 {
    let s = std::env::var("QUIVER_TEST_SEED").ok().and_then(|s| s.parse().ok());
    s.unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64)
}

/// Every site of the manager's pool: (label, site, whether it is the embedding, whether its
/// rows are the logits rows).
pub fn pool_sites(mgr: &LoraManager) -> Vec<(String, SiteRef<'_>, bool, bool)> {
    let pool = mgr.pool();
    let r = |(buffers, entry)| SiteRef { buffers, table: pool.table(), entry };
    let mut v = Vec::new();
    for l in 0..pool.dims.num_layers {
        for s in LinearSite::ALL {
            if let Some(x) = pool.site(l, s) {
                v.push((format!("layer {l} {s:?}"), r(x), false, false));
            }
        }
    }
    if let Some(x) = pool.embedding() {
        v.push(("embedding".into(), r(x), true, false));
    }
    if let Some(x) = pool.lm_head() {
        v.push(("lm_head".into(), r(x), false, true));
    }
    v
}

/// A safetensors file whose header lists `tensors` (name, dtype, shape) with contiguous
/// offsets and whose data is a hole: `set_len` makes it as large as the header says without
/// writing (or storing) the bytes, so multi-GB files cost nothing on disk.
pub fn write_sparse_weights(path: &Path, tensors: &[(String, &str, Vec<usize>)]) -> u64 {
    let mut header = serde_json::Map::new();
    let mut off = 0u64;
    for (name, dtype, shape) in tensors {
        let size = if *dtype == "F32" { 4 } else { 2 };
        let len = shape.iter().product::<usize>() as u64 * size;
        header.insert(name.clone(), serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [off, off + len]}));
        off += len;
    }
    let mut h = serde_json::to_string(&header).unwrap().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&h);
    std::fs::write(path, &bytes).unwrap();
    let total = bytes.len() as u64 + off;
    std::fs::OpenOptions::new().write(true).open(path).unwrap().set_len(total).unwrap();
    total
}

/// Model dims shaped like Llama-3-8B, for adapters of realistic (hundreds of MB) size.
pub const BIG_DIMS: LoraModelDims = LoraModelDims { num_layers: 32, hidden: 4096, q_out: 4096, kv_out: 1024, intermediate: 14336, vocab: 128256 };

/// Header entries of a rank-`r` adapter on every projection of every layer of `dims`.
pub fn all_projection_tensors(dims: &LoraModelDims, r: usize) -> Vec<(String, &'static str, Vec<usize>)> {
    let mut v = Vec::new();
    for l in 0..dims.num_layers {
        for m in LoraModule::PROJECTIONS {
            let (din, dout) = dims.module_dims(m);
            let (an, bn) = tensor_names(m, l);
            v.push((an, "F32", vec![r, din]));
            v.push((bn, "F32", vec![dout, r]));
        }
    }
    v
}
