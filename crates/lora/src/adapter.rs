//! One PEFT LoRA adapter in host memory: per layer and projection `lora_A (r, in)` and
//! `lora_B (out, r)` as f32 with the module's scaling, plus optional embedding and LM-head
//! deltas. Everything is validated against the model dims at load so that slot loading and the
//! kernels never see a surprise.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;

pub use crate::adapter_files::{FileStamp, ReadLimits};
use crate::adapter_files::AdapterDir;
use crate::config::{AdapterConfig, LoraModule};
use crate::error::{LoraError, Result};
use crate::LoraModelDims;

pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
const ADDED_TOKENS_FILE: &str = "added_tokens.json";
/// A PEFT header lists two small entries per module; a few MB covers the largest models.
const MAX_HEADER_BYTES: u64 = 16 << 20;
/// Bound on any element of a module's effective weights `scale·B·A`. Its delta lands in the
/// residual stream, which the next RMSNorm squares: past √f32::MAX even a unit activation
/// overflows to Inf and the sequence's logits turn to NaN.
const MAX_EFFECTIVE_WEIGHT: f64 = 1.8446742e19;

/// One module's low-rank pair.
#[derive(Clone, Debug)]
pub struct ModuleWeights {
    pub rank: usize,
    /// α/r or α/√r, after patterns.
    pub scaling: f32,
    /// `(rank, in)` row-major (embedding: `(rank, vocab)`).
    pub a: Vec<f32>,
    /// `(out, rank)` row-major (embedding: `(hidden, rank)`).
    pub b: Vec<f32>,
}

#[derive(Clone, Debug)]
pub struct LoraAdapter {
    pub name: String,
    pub path: PathBuf,
    pub config: AdapterConfig,
    pub num_layers: usize,
    /// `layers · 7`, indexed `layer * 7 + projection`.
    modules: Vec<Option<ModuleWeights>>,
    /// Experts of the model (0 for a dense one).
    pub num_experts: usize,
    /// `layers · experts · 3`, indexed `(layer · E + e) · 3 + p` (gate, up, down).
    experts: Vec<Option<ModuleWeights>>,
    /// Qwen2-MoE's shared expert, `layers · 3`.
    shared: Vec<Option<ModuleWeights>>,
    pub embed_tokens: Option<ModuleWeights>,
    pub lm_head: Option<ModuleWeights>,
    pub stamp: Option<FileStamp>,
    /// The pools' images of this adapter (one per rank's layout), made at its first activation.
    pub(crate) image: DeviceImage,
}

/// An adapter's [`quiver_kernels::LoraImage`]s (a pool's contents for it as the device holds
/// them, in host memory the device copies from directly), made by the pool the first time the
/// adapter is activated so the next activations are copies only: one per pool layout, so each
/// rank of a tensor-parallel group keeps the image of its own cut. Clones of the adapter share
/// them; they go when the adapter's host copy goes (host-cache eviction, replacement).
#[derive(Clone, Default)]
pub struct DeviceImage(pub(crate) std::sync::Arc<std::sync::Mutex<Vec<quiver_kernels::LoraImage>>>);

impl std::fmt::Debug for DeviceImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.try_lock() {
            Ok(g) => write!(f, "{:?}", *g),
            Err(_) => write!(f, "DeviceImage(in use)"),
        }
    }
}

fn proj_index(m: LoraModule) -> usize {
    LoraModule::PROJECTIONS.iter().position(|p| *p == m).expect("a projection")
}

/// Gate, up, down: the index of an expert or shared-expert module within its three.
fn moe_index(m: LoraModule) -> usize {
    proj_index(m.dense_part()) - 4
}

/// Where a tensor name points. Expert modules carry their expert; `Fused` is PEFT's
/// `target_parameters` pair on a layer's fused experts (`…mlp.experts[.base_layer].lora_X`:
/// which parameter each of the two nested wrappers holds is read from the shapes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum TensorSlot {
    A(Option<usize>, LoraModule, usize),
    B(Option<usize>, LoraModule, usize),
    FusedA(usize, bool),
    FusedB(usize, bool),
}

impl TensorSlot {
    fn new(is_b: bool, layer: Option<usize>, m: LoraModule, e: usize) -> Self {
        if is_b { TensorSlot::B(layer, m, e) } else { TensorSlot::A(layer, m, e) }
    }
}

fn lora_ab(s: &str) -> Option<bool> {
    match s {
        "lora_A.weight" => Some(false),
        "lora_B.weight" => Some(true),
        _ => None,
    }
}

/// The modules of an MoE block under `layers.{l}.`: `mlp.experts.{e}.gate_proj`, Mixtral's
/// `block_sparse_moe.experts.{e}.w1`, `mlp.shared_expert.up_proj`, and the fused
/// `mlp.experts[.base_layer].lora_A.weight`.
fn parse_moe_tensor(layer: usize, block: &str, rest: &str) -> Option<TensorSlot> {
    if let Some(r) = rest.strip_prefix("shared_expert.") {
        let (proj, ab) = r.split_once('.')?;
        let m = LoraModule::MOE[3..].iter().copied().find(|m| m.dense_part().name() == proj)?;
        return (block == "mlp").then_some(TensorSlot::new(lora_ab(ab)?, Some(layer), m, 0));
    }
    let r = rest.strip_prefix("experts.")?;
    if let Some(is_b) = lora_ab(r) {
        return Some(if is_b { TensorSlot::FusedB(layer, false) } else { TensorSlot::FusedA(layer, false) });
    }
    if let Some(is_b) = r.strip_prefix("base_layer.").and_then(lora_ab) {
        return Some(if is_b { TensorSlot::FusedB(layer, true) } else { TensorSlot::FusedA(layer, true) });
    }
    let (e, r) = r.split_once('.')?;
    let e: usize = e.parse().ok()?;
    let (proj, ab) = r.split_once('.')?;
    let m = match (block, proj) {
        ("mlp", "gate_proj") | ("block_sparse_moe", "w1") => LoraModule::ExpertGateProj,
        ("mlp", "up_proj") | ("block_sparse_moe", "w3") => LoraModule::ExpertUpProj,
        ("mlp", "down_proj") | ("block_sparse_moe", "w2") => LoraModule::ExpertDownProj,
        _ => return None,
    };
    Some(TensorSlot::new(lora_ab(ab)?, Some(layer), m, e))
}

/// A LoRA tensor on a module Quiver knows but applies no LoRA to (the MoE router, Qwen2-MoE's
/// shared-expert gate): the module's path, for the refusal.
fn unsupported_module(name: &str) -> Option<&str> {
    let n = name.strip_prefix("base_model.model.").unwrap_or(name);
    let module = n.strip_suffix(".lora_A.weight").or_else(|| n.strip_suffix(".lora_B.weight"))?;
    [".mlp.gate", ".block_sparse_moe.gate", ".mlp.shared_expert_gate"].iter().any(|s| module.ends_with(s)).then_some(module)
}

/// The slot a tensor name points at, and whether the decoder's modules sit under `model.`
/// (`…ForCausalLM`) or at the top (a bare decoder: PEFT on an embedding model's `Qwen3Model`).
fn parse_tensor_name(name: &str) -> Option<(TensorSlot, Option<bool>)> {
    let n = name.strip_prefix("base_model.model.").unwrap_or(name);
    match n {
        "lm_head.lora_A.weight" => return Some((TensorSlot::A(None, LoraModule::LmHead, 0), None)),
        "lm_head.lora_B.weight" => return Some((TensorSlot::B(None, LoraModule::LmHead, 0), None)),
        _ => {}
    }
    let (n, under_model) = match n.strip_prefix("model.") {
        Some(rest) => (rest, true),
        None => (n, false),
    };
    match n {
        "embed_tokens.lora_embedding_A" => return Some((TensorSlot::A(None, LoraModule::EmbedTokens, 0), Some(under_model))),
        "embed_tokens.lora_embedding_B" => return Some((TensorSlot::B(None, LoraModule::EmbedTokens, 0), Some(under_model))),
        _ => {}
    }
    let rest = n.strip_prefix("layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (block, rest) = rest.split_once('.')?;
    if let Some(slot) = parse_moe_tensor(layer, block, rest) {
        return Some((slot, Some(under_model)));
    }
    let (proj, ab) = rest.split_once('.')?;
    let m = LoraModule::PROJECTIONS.iter().copied().find(|m| m.name() == proj)?;
    let expected_block = if matches!(m, LoraModule::QProj | LoraModule::KProj | LoraModule::VProj | LoraModule::OProj) {
        "self_attn"
    } else {
        "mlp"
    };
    if block != expected_block {
        return None;
    }
    match ab {
        "lora_A.weight" => Some((TensorSlot::A(Some(layer), m, 0), Some(under_model))),
        "lora_B.weight" => Some((TensorSlot::B(Some(layer), m, 0), Some(under_model))),
        _ => None,
    }
}

/// A tensor name as it may appear in an error: names are file content, so only short
/// identifier-like ones are echoed.
pub(crate) fn shown(name: &str) -> String {
    if name.len() <= 200 && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_') {
        name.to_string()
    } else {
        format!("<a {}-byte name that is not shown>", name.len())
    }
}

fn to_f32(dtype: Dtype, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        Dtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        Dtype::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        Dtype::BF16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        _ => unreachable!("dtype checked against the header"),
    }
}

/// A bound on every element of `scale·B·A`: by Cauchy-Schwarz `|(BA)_ij| <= |B_i,:|·|A_:,j|`,
/// so the largest row norm of B times the largest column norm of A. One pass over each.
fn effective_weight_bound(w: &ModuleWeights, din: usize) -> f64 {
    let r = w.rank;
    let mut col = vec![0f64; din];
    for row in w.a.chunks_exact(din) {
        for (c, &x) in col.iter_mut().zip(row) {
            *c += (x as f64) * (x as f64);
        }
    }
    let max_a = col.iter().fold(0f64, |m, &c| m.max(c)).sqrt();
    let max_b = w.b.chunks_exact(r).map(|row| row.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>()).fold(0f64, f64::max).sqrt();
    (w.scaling as f64).abs() * max_a * max_b
}

/// What the header promises for one targeted module, checked before any data is read.
pub(crate) struct Planned {
    pub layer: Option<usize>,
    pub module: LoraModule,
    /// The expert of an expert module.
    pub expert: usize,
    /// A fused `target_parameters` pair spanning every expert: its site.
    pub fused: Option<crate::ExpertSite>,
    /// The path PEFT matched it under (for messages).
    pub path: String,
    pub rank: usize,
    pub scaling: f32,
    pub a: (String, TensorInfo),
    pub b: (String, TensorInfo),
}

impl LoraAdapter {
    /// The pool layouts this adapter holds a device image for, oldest first (one per rank of a
    /// tensor-parallel group once each has activated it; none on a device without images).
    pub fn image_layouts(&self) -> Vec<u64> {
        self.image.0.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|i| i.layout).collect()
    }

    /// Loads and validates the PEFT adapter in directory `dir` for a model of `dims`, with the
    /// default limits (no sandbox, no rank bound).
    pub fn load(name: &str, dir: &Path, dims: &LoraModelDims) -> Result<Self> {
        Self::load_with(name, dir, dims, &ReadLimits::default())
    }

    /// Loads under `limits`. Files are read into owned memory with checked lengths; the
    /// safetensors header is validated against the config and the model's shapes (and the
    /// rank bound) before any tensor data is allocated or read.
    pub fn load_with(name: &str, dir: &Path, dims: &LoraModelDims, limits: &ReadLimits) -> Result<Self> {
        let d = AdapterDir::new(name, dir, limits)?;
        let text = d.read_text(CONFIG_FILE)?;
        let config = AdapterConfig::parse(name, &text)?;

        if d.exists(ADDED_TOKENS_FILE) {
            let t = d.read_text(ADDED_TOKENS_FILE)?;
            let empty = serde_json::from_str::<serde_json::Value>(&t).ok().and_then(|v| v.as_object().map(|o| o.is_empty())).unwrap_or(false);
            if !empty {
                return Err(LoraError::Config {
                    adapter: name.into(),
                    field: ADDED_TOKENS_FILE.into(),
                    reason: "adapters that add tokens to the vocabulary are not supported".into(),
                });
            }
        }

        if !d.exists(WEIGHTS_FILE) {
            if d.exists("adapter_model.bin") {
                return Err(LoraError::Config {
                    adapter: name.into(),
                    field: "adapter_model.bin".into(),
                    reason: "only pickled .bin weights found; convert the adapter to adapter_model.safetensors (pickle is not loaded for safety)".into(),
                });
            }
            return Err(d.err(WEIGHTS_FILE, "missing (expected adapter_model.safetensors)"));
        }
        let mut f = d.open(WEIGHTS_FILE, limits.max_weights_bytes)?;
        if f.len == 0 {
            return Err(d.err(WEIGHTS_FILE, "empty file"));
        }
        let invalid = |why: String| d.err(WEIGHTS_FILE, format!("not a valid safetensors file: {why}"));
        if f.len < 8 {
            return Err(invalid(format!("{} bytes, shorter than the 8-byte header length", f.len)));
        }
        let mut buf = Vec::new();
        f.read_into(&mut buf, 8, &d)?;
        let n = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
        if n > MAX_HEADER_BYTES || n > f.len - 8 {
            return Err(invalid(format!("header length {n} exceeds the file ({} bytes) or the {MAX_HEADER_BYTES}-byte limit", f.len)));
        }
        buf.clear();
        f.read_into(&mut buf, n as usize, &d)?;
        // serde's messages can quote the offending text, so only the position is reported.
        let meta: Metadata = serde_json::from_slice(&buf).map_err(|e| invalid(format!("bad header at line {} column {}", e.line(), e.column())))?;
        let data_len = meta.data_len() as u64;
        if 8 + n + data_len != f.len {
            return Err(invalid(format!("the header describes {data_len} bytes of tensor data but the file holds {}", f.len - 8 - n)));
        }

        let plan = plan_modules(name, &config, dims, limits.max_rank, &meta)?;
        let terr = |tensor: &str, reason: String| LoraError::Tensor { adapter: name.into(), file: WEIGHTS_FILE.into(), tensor: shown(tensor), reason };

        // Only now, with every shape proven to match, is the data read (at most the file).
        let mut data = Vec::new();
        f.read_into(&mut data, data_len as usize, &d)?;
        if !f.unchanged() {
            return Err(d.err(WEIGHTS_FILE, "changed on disk while it was being read; load it again once it is written"));
        }
        let tensor = |(tname, info): &(String, TensorInfo)| -> Result<Vec<f32>> {
            let v = to_f32(info.dtype, &data[info.data_offsets.0..info.data_offsets.1]);
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                return Err(terr(tname, format!("non-finite value {} at element {i}", v[i])));
            }
            Ok(v)
        };

        let mut out = LoraAdapter::empty(name, dir.to_path_buf(), config, dims);
        out.stamp = Some(f.stamp);
        for p in &plan {
            let (a, b) = (tensor(&p.a)?, tensor(&p.b)?);
            // A fused pair is E per-expert pairs (gate_up: each the gate and the up slice).
            let split = match p.fused {
                None => vec![(p.module, p.expert, ModuleWeights { rank: p.rank, scaling: p.scaling, a, b })],
                Some(site) => crate::adapter_moe::split_fused(site, p.rank, p.scaling, &a, &b, out.num_experts),
            };
            for (module, expert, w) in split {
                let path = &p.path;
                let bound = effective_weight_bound(&w, dims.module_dims(module).0);
                if !bound.is_finite() || bound > MAX_EFFECTIVE_WEIGHT {
                    return Err(terr(
                        &p.b.0,
                        format!("module `{path}`: its effective weights scale·B·A (scale {}) can reach {bound:.3e}, beyond the {MAX_EFFECTIVE_WEIGHT:.1e} f32 activations survive (the output would be Inf/NaN)", p.scaling),
                    ));
                }
                out.set(p.layer, module, expert, w);
            }
        }
        Ok(out)
    }

    /// An in-memory adapter with random weights on every layer of `modules` at rank `rank`
    /// (benchmarks: a pool full of 8B-shaped adapters without writing gigabytes of files). A is
    /// uniform with std `1/√in`, B uniform with std `b_std`, from a fixed-seed xorshift.
    pub fn synthetic(name: &str, dims: &LoraModelDims, modules: &[LoraModule], rank: usize, alpha: f32, b_std: f32, seed: u64) -> Result<Self> {
        let cfg = serde_json::json!({"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": modules.iter().map(|m| m.name()).collect::<Vec<_>>()});
        let config = AdapterConfig::parse(name, &cfg.to_string())?;
        let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut uniform = |n: usize, std: f32| -> Vec<f32> {
            let a = std * 3f32.sqrt();
            (0..n)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
                })
                .collect()
        };
        let scaling = alpha / rank as f32;
        let mut pair = |m: LoraModule| {
            let (din, dout) = dims.module_dims(m);
            ModuleWeights { rank, scaling, a: uniform(rank * din, 1.0 / (din as f32).sqrt()), b: uniform(dout * rank, b_std) }
        };
        let mut out = LoraAdapter::empty(name, PathBuf::new(), config, dims);
        let shared = dims.moe.is_some_and(|m| m.shared_intermediate > 0);
        for l in 0..dims.num_layers {
            let moe = dims.is_moe_layer(l);
            for &m in modules {
                match m {
                    LoraModule::EmbedTokens | LoraModule::LmHead => {}
                    _ if m.is_expert() => {
                        for e in 0..if moe { out.num_experts } else { 0 } {
                            out.set(Some(l), m, e, pair(m));
                        }
                    }
                    LoraModule::SharedGateProj | LoraModule::SharedUpProj | LoraModule::SharedDownProj if moe && shared => out.set(Some(l), m, 0, pair(m)),
                    LoraModule::GateProj | LoraModule::UpProj | LoraModule::DownProj if moe => {}
                    _ if m.is_projection() && !LoraModule::MOE.contains(&m) => out.set(Some(l), m, 0, pair(m)),
                    _ => {}
                }
            }
        }
        for m in [LoraModule::EmbedTokens, LoraModule::LmHead] {
            if modules.contains(&m) {
                out.set(None, m, 0, pair(m));
            }
        }
        Ok(out)
    }

    fn empty(name: &str, path: PathBuf, config: AdapterConfig, dims: &LoraModelDims) -> Self {
        let (l, e) = (dims.num_layers, dims.moe.map_or(0, |m| m.num_experts));
        let has_shared = dims.moe.is_some_and(|m| m.shared_intermediate > 0);
        LoraAdapter {
            name: name.into(),
            path,
            config,
            num_layers: l,
            modules: vec![None; l * 7],
            num_experts: e,
            experts: vec![None; l * e * 3],
            shared: vec![None; if has_shared { l * 3 } else { 0 }],
            embed_tokens: None,
            lm_head: None,
            stamp: None,
            image: DeviceImage::default(),
        }
    }

    fn set(&mut self, layer: Option<usize>, m: LoraModule, expert: usize, w: ModuleWeights) {
        let l = layer.unwrap_or(0);
        match m {
            LoraModule::EmbedTokens => self.embed_tokens = Some(w),
            LoraModule::LmHead => self.lm_head = Some(w),
            _ if m.is_expert() => self.experts[(l * self.num_experts + expert) * 3 + moe_index(m)] = Some(w),
            _ if LoraModule::MOE.contains(&m) => self.shared[l * 3 + moe_index(m)] = Some(w),
            _ => self.modules[l * 7 + proj_index(m)] = Some(w),
        }
    }

    /// Expert `e`'s projection `m` (an `Expert*` module) in `layer`, if the adapter has it.
    pub fn expert(&self, layer: usize, e: usize, m: LoraModule) -> Option<&ModuleWeights> {
        self.experts.get((layer * self.num_experts + e) * 3 + moe_index(m))?.as_ref()
    }

    /// The weights of a projection in `layer`, if the adapter has it.
    pub fn module(&self, layer: usize, m: LoraModule) -> Option<&ModuleWeights> {
        match m {
            LoraModule::EmbedTokens => self.embed_tokens.as_ref(),
            LoraModule::LmHead => self.lm_head.as_ref(),
            // Some expert's: see `expert`.
            _ if m.is_expert() => (0..self.num_experts).find_map(|e| self.expert(layer, e, m)),
            _ if LoraModule::MOE.contains(&m) => self.shared.get(layer * 3 + moe_index(m))?.as_ref(),
            _ => self.modules[layer * 7 + proj_index(m)].as_ref(),
        }
    }

    /// Every `(module, max rank)` this adapter carries.
    pub fn module_ranks(&self) -> Vec<(LoraModule, usize)> {
        let mut out: Vec<(LoraModule, usize)> = Vec::new();
        for m in LoraModule::ALL.into_iter().chain(LoraModule::MOE) {
            let r = if m.is_expert() {
                self.experts.iter().skip(moe_index(m)).step_by(3).flatten().map(|w| w.rank).max()
            } else {
                (0..self.num_layers.max(1)).filter_map(|l| self.module(l, m)).map(|w| w.rank).max()
            };
            if let Some(r) = r {
                out.push((m, r));
            }
        }
        out
    }

    pub fn max_rank(&self) -> usize {
        self.module_ranks().iter().map(|x| x.1).max().unwrap_or(0)
    }

    /// Refuses adapters the pool cannot hold: a rank above `max_rank` or a module outside the
    /// pool's configured targets.
    pub fn check_compatible(&self, max_rank: usize, pool_modules: &[LoraModule]) -> Result<()> {
        for (m, r) in self.module_ranks() {
            if !pool_modules.contains(&m) {
                return Err(LoraError::Incompatible {
                    adapter: self.name.clone(),
                    module: m.name().into(),
                    reason: format!(
                        "not among the pool's target modules [{}]",
                        pool_modules.iter().map(|m| m.name()).collect::<Vec<_>>().join(", ")
                    ),
                });
            }
            if r > max_rank {
                return Err(LoraError::Incompatible {
                    adapter: self.name.clone(),
                    module: m.name().into(),
                    reason: format!("rank {r} exceeds max_lora_rank {max_rank}"),
                });
            }
        }
        Ok(())
    }

    /// Host bytes held by the weights.
    pub fn size_bytes(&self) -> usize {
        let w = |m: &ModuleWeights| (m.a.len() + m.b.len()) * 4;
        self.modules.iter().chain(&self.experts).chain(&self.shared).flatten().map(w).sum::<usize>() + self.embed_tokens.iter().map(w).sum::<usize>() + self.lm_head.iter().map(w).sum::<usize>()
    }
}

/// Checks every tensor the header lists against the config and the model (names, layers,
/// targeting, dtype, shapes, rank bound) and pairs them per module, so that a file whose
/// header promises the wrong tensors is refused before its data is read.
fn plan_modules(name: &str, config: &AdapterConfig, dims: &LoraModelDims, max_rank: Option<usize>, meta: &Metadata) -> Result<Vec<Planned>> {
    let terr = |tensor: &str, reason: String| LoraError::Tensor { adapter: name.into(), file: WEIGHTS_FILE.into(), tensor: shown(tensor), reason };
    let mut found: HashMap<TensorSlot, (String, TensorInfo)> = HashMap::new();
    let mut names: Vec<(String, &TensorInfo)> = meta.tensors().into_iter().collect();
    // Deterministic errors: the first offending tensor in file order.
    names.sort_by_key(|(_, i)| i.data_offsets);
    // `model.` when the decoder's modules sit under it (`None` until a tensor says).
    let mut under_model: Option<bool> = None;
    for (tname, info) in names {
        let Some((slot, under)) = parse_tensor_name(&tname) else {
            if let Some(module) = unsupported_module(&tname) {
                return Err(LoraError::Incompatible { adapter: name.into(), module: shown(module), reason: "LoRA on the MoE router or on the shared expert's gate is not supported".into() });
            }
            return Err(terr(&tname, "unknown tensor name (expected PEFT LoRA names for q/k/v/o/gate/up/down_proj, experts, shared_expert, embed_tokens or lm_head)".into()));
        };
        match (under_model, under) {
            (Some(a), Some(b)) if a != b => return Err(terr(&tname, "mixes module paths under `model.` and at the top level in one adapter".into())),
            (None, Some(b)) => under_model = Some(b),
            _ => {}
        }
        let (layer, module, expert, fused) = match slot {
            TensorSlot::A(l, m, e) | TensorSlot::B(l, m, e) => (l, m, e, false),
            TensorSlot::FusedA(l, _) | TensorSlot::FusedB(l, _) => (Some(l), LoraModule::ExpertGateProj, 0, true),
        };
        if let Some(l) = layer {
            if l >= dims.num_layers {
                return Err(terr(&tname, format!("layer {l} does not exist (the model has {} layers)", dims.num_layers)));
            }
        }
        let prefix = if under.unwrap_or(true) { "model." } else { "" };
        let path = crate::adapter_moe::module_path(dims, layer, module, expert, prefix);
        crate::adapter_moe::check_structure(dims, layer, module, expert, fused).map_err(|e| match e {
            crate::adapter_moe::Misfit::Module(reason) => LoraError::Incompatible { adapter: name.into(), module: path.clone(), reason },
            crate::adapter_moe::Misfit::Tensor(reason) => terr(&tname, reason),
        })?;
        if fused {
            if config.target_parameters.is_empty() {
                return Err(terr(&tname, "a fused expert LoRA tensor, but adapter_config.json has no target_parameters".into()));
            }
        } else if !config.targets_path(&path) {
            return Err(terr(&tname, format!("module `{path}` is not targeted by adapter_config.json (target_modules / exclude_modules / layers_to_transform)")));
        }
        if info.shape.len() != 2 {
            return Err(terr(&tname, format!("expected a 2-D tensor, got {} dimensions", info.shape.len())));
        }
        if !matches!(info.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
            return Err(terr(&tname, format!("unsupported dtype {:?} (expected F32, F16 or BF16)", info.dtype)));
        }
        found.insert(slot, (tname, info.clone()));
    }
    if found.is_empty() {
        return Err(LoraError::File { adapter: name.into(), file: WEIGHTS_FILE.into(), reason: "contains no LoRA tensors".into() });
    }

    // Shape and presence checks per targeted module; the error names the PEFT tensor.
    let under: &'static str = if under_model.unwrap_or(true) { "model." } else { "" };
    let take = |found: &mut HashMap<TensorSlot, (String, TensorInfo)>, layer: Option<usize>, m: LoraModule, expert: usize| -> Result<Option<Planned>> {
        let path = crate::adapter_moe::module_path(dims, layer, m, expert, under);
        let a = found.remove(&TensorSlot::A(layer, m, expert));
        let b = found.remove(&TensorSlot::B(layer, m, expert));
        let prefix = "base_model.model.";
        let (an, bn) = match m {
            LoraModule::EmbedTokens => (format!("{prefix}{path}.lora_embedding_A"), format!("{prefix}{path}.lora_embedding_B")),
            _ => (format!("{prefix}{path}.lora_A.weight"), format!("{prefix}{path}.lora_B.weight")),
        };
        if !config.targets_path(&path) {
            return Ok(None);
        }
        let (a, b) = match (a, b) {
            (Some(a), Some(b)) => (a, b),
            (None, _) => return Err(terr(&an, format!("missing (module `{path}` is targeted by adapter_config.json)"))),
            (_, None) => return Err(terr(&bn, format!("missing (module `{path}` is targeted by adapter_config.json)"))),
        };
        let (r, scaling) = config.rank_scaling(&path);
        let (din, dout) = dims.module_dims(m);
        let (ar, ac) = (a.1.shape[0], a.1.shape[1]);
        let (br, bc) = (b.1.shape[0], b.1.shape[1]);
        if (ar, ac) != (r, din) {
            let why = if (ar, ac) == (din, r) && din != r {
                format!("shape [{ar}, {ac}] looks transposed: lora_A must be [r={r}, in={din}]")
            } else if ac == din {
                format!("rank {ar} but adapter_config.json gives r={r} for `{path}` (r / rank_pattern mismatch)")
            } else {
                format!("shape [{ar}, {ac}] does not match [r={r}, in={din}]")
            };
            return Err(terr(&a.0, why));
        }
        if (br, bc) != (dout, r) {
            let why = if (br, bc) == (r, dout) && dout != r {
                format!("shape [{br}, {bc}] looks transposed: lora_B must be [out={dout}, r={r}]")
            } else if br == dout {
                format!("rank {bc} but adapter_config.json gives r={r} for `{path}` (r / rank_pattern mismatch)")
            } else {
                format!("shape [{br}, {bc}] does not match [out={dout}, r={r}]")
            };
            return Err(terr(&b.0, why));
        }
        if let Some(max) = max_rank.filter(|&max| r > max) {
            return Err(LoraError::Incompatible { adapter: name.into(), module: m.name().into(), reason: format!("rank {r} exceeds max_lora_rank {max}") });
        }
        Ok(Some(Planned { layer, module: m, expert, fused: None, path, rank: r, scaling, a, b }))
    };

    let mut plan = Vec::new();
    let moe = dims.moe.unwrap_or_default();
    for l in 0..dims.num_layers {
        let is_moe = dims.is_moe_layer(l);
        for m in LoraModule::PROJECTIONS {
            // An expert layer's MLP is its experts (refused by name above if the file has it).
            if !(is_moe && matches!(m, LoraModule::GateProj | LoraModule::UpProj | LoraModule::DownProj)) {
                plan.extend(take(&mut found, Some(l), m, 0)?);
            }
        }
        if !is_moe {
            continue;
        }
        // transformers >= 5 PEFT: one pair per fused parameter spanning every expert, in place
        // of per-expert modules (which its target_modules may still seem to name).
        if found.keys().any(|k| matches!(k, TensorSlot::FusedA(x, _) | TensorSlot::FusedB(x, _) if *x == l)) {
            plan.extend(crate::adapter_moe::plan_fused(name, config, dims, max_rank, l, under, &mut found)?);
        } else {
            for e in 0..moe.num_experts {
                for m in &LoraModule::MOE[..3] {
                    plan.extend(take(&mut found, Some(l), *m, e)?);
                }
            }
        }
        if moe.shared_intermediate > 0 {
            for m in &LoraModule::MOE[3..] {
                plan.extend(take(&mut found, Some(l), *m, 0)?);
            }
        }
    }
    plan.extend(take(&mut found, None, LoraModule::EmbedTokens, 0)?);
    plan.extend(take(&mut found, None, LoraModule::LmHead, 0)?);
    // Anything left is an A without its B (or vice versa) for an untargeted module; the
    // targeting check above already refused those, so this is a safety net.
    if let Some((_, (tname, _))) = found.into_iter().next() {
        return Err(terr(&tname, "has no matching lora_A/lora_B partner".into()));
    }
    Ok(plan)
}
