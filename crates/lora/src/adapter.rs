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
    pub embed_tokens: Option<ModuleWeights>,
    pub lm_head: Option<ModuleWeights>,
    pub stamp: Option<FileStamp>,
}

fn proj_index(m: LoraModule) -> usize {
    LoraModule::PROJECTIONS.iter().position(|p| *p == m).expect("a projection")
}

/// Where a tensor name points.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum TensorSlot {
    A(Option<usize>, LoraModule),
    B(Option<usize>, LoraModule),
}

fn parse_tensor_name(name: &str) -> Option<TensorSlot> {
    let n = name.strip_prefix("base_model.model.").unwrap_or(name);
    match n {
        "model.embed_tokens.lora_embedding_A" => return Some(TensorSlot::A(None, LoraModule::EmbedTokens)),
        "model.embed_tokens.lora_embedding_B" => return Some(TensorSlot::B(None, LoraModule::EmbedTokens)),
        "lm_head.lora_A.weight" => return Some(TensorSlot::A(None, LoraModule::LmHead)),
        "lm_head.lora_B.weight" => return Some(TensorSlot::B(None, LoraModule::LmHead)),
        _ => {}
    }
    let rest = n.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (block, rest) = rest.split_once('.')?;
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
        "lora_A.weight" => Some(TensorSlot::A(Some(layer), m)),
        "lora_B.weight" => Some(TensorSlot::B(Some(layer), m)),
        _ => None,
    }
}

/// A tensor name as it may appear in an error: names are file content, so only short
/// identifier-like ones are echoed.
fn shown(name: &str) -> String {
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
struct Planned {
    layer: Option<usize>,
    module: LoraModule,
    rank: usize,
    scaling: f32,
    a: (String, TensorInfo),
    b: (String, TensorInfo),
}

impl LoraAdapter {
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

        let mut modules: Vec<Option<ModuleWeights>> = vec![None; dims.num_layers * 7];
        let (mut embed_tokens, mut lm_head) = (None, None);
        for p in &plan {
            let w = ModuleWeights { rank: p.rank, scaling: p.scaling, a: tensor(&p.a)?, b: tensor(&p.b)? };
            let path = p.module.path(p.layer.unwrap_or(0));
            let bound = effective_weight_bound(&w, dims.module_dims(p.module).0);
            if !bound.is_finite() || bound > MAX_EFFECTIVE_WEIGHT {
                return Err(terr(
                    &p.b.0,
                    format!("module `{path}`: its effective weights scale·B·A (scale {}) can reach {bound:.3e}, beyond the {MAX_EFFECTIVE_WEIGHT:.1e} f32 activations survive (the output would be Inf/NaN)", p.scaling),
                ));
            }
            match (p.layer, p.module) {
                (None, LoraModule::EmbedTokens) => embed_tokens = Some(w),
                (None, _) => lm_head = Some(w),
                (Some(l), m) => modules[l * 7 + proj_index(m)] = Some(w),
            }
        }
        Ok(LoraAdapter { name: name.into(), path: dir.to_path_buf(), config, num_layers: dims.num_layers, modules, embed_tokens, lm_head, stamp: Some(f.stamp) })
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
        let mut layer_modules = Vec::with_capacity(dims.num_layers * 7);
        for _ in 0..dims.num_layers {
            for m in LoraModule::PROJECTIONS {
                layer_modules.push(modules.contains(&m).then(|| pair(m)));
            }
        }
        let embed_tokens = modules.contains(&LoraModule::EmbedTokens).then(|| pair(LoraModule::EmbedTokens));
        let lm_head = modules.contains(&LoraModule::LmHead).then(|| pair(LoraModule::LmHead));
        Ok(LoraAdapter { name: name.into(), path: PathBuf::new(), config, num_layers: dims.num_layers, modules: layer_modules, embed_tokens, lm_head, stamp: None })
    }

    /// The weights of a projection in `layer`, if the adapter has it.
    pub fn module(&self, layer: usize, m: LoraModule) -> Option<&ModuleWeights> {
        match m {
            LoraModule::EmbedTokens => self.embed_tokens.as_ref(),
            LoraModule::LmHead => self.lm_head.as_ref(),
            _ => self.modules[layer * 7 + proj_index(m)].as_ref(),
        }
    }

    /// Every `(module, max rank)` this adapter carries.
    pub fn module_ranks(&self) -> Vec<(LoraModule, usize)> {
        let mut out: Vec<(LoraModule, usize)> = Vec::new();
        for m in LoraModule::ALL {
            let r = (0..self.num_layers.max(1)).filter_map(|l| self.module(l, m)).map(|w| w.rank).max();
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
        self.modules.iter().flatten().map(w).sum::<usize>() + self.embed_tokens.iter().map(w).sum::<usize>() + self.lm_head.iter().map(w).sum::<usize>()
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
    for (tname, info) in names {
        let slot = parse_tensor_name(&tname).ok_or_else(|| terr(&tname, "unknown tensor name (expected PEFT LoRA names for q/k/v/o/gate/up/down_proj, embed_tokens or lm_head)".into()))?;
        let (layer, module) = match slot {
            TensorSlot::A(l, m) | TensorSlot::B(l, m) => (l, m),
        };
        if let Some(l) = layer {
            if l >= dims.num_layers {
                return Err(terr(&tname, format!("layer {l} does not exist (the model has {} layers)", dims.num_layers)));
            }
        }
        let path = module.path(layer.unwrap_or(0));
        if !config.targets_path(&path) {
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
    let mut take = |layer: Option<usize>, m: LoraModule| -> Result<Option<Planned>> {
        let path = m.path(layer.unwrap_or(0));
        let a = found.remove(&TensorSlot::A(layer, m));
        let b = found.remove(&TensorSlot::B(layer, m));
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
        Ok(Some(Planned { layer, module: m, rank: r, scaling, a, b }))
    };

    let mut plan = Vec::new();
    for l in 0..dims.num_layers {
        for m in LoraModule::PROJECTIONS {
            plan.extend(take(Some(l), m)?);
        }
    }
    plan.extend(take(None, LoraModule::EmbedTokens)?);
    plan.extend(take(None, LoraModule::LmHead)?);
    // Anything left is an A without its B (or vice versa) for an untargeted module; the
    // targeting check above already refused those, so this is a safety net.
    if let Some((_, (tname, _))) = found.into_iter().next() {
        return Err(terr(&tname, "has no matching lora_A/lora_B partner".into()));
    }
    Ok(plan)
}
