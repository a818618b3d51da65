//! One PEFT LoRA adapter in host memory: per layer and projection `lora_A (r, in)` and
//! `lora_B (out, r)` as f32 with the module's scaling, plus optional embedding and LM-head
//! deltas. Everything is validated against the model dims at load so that slot loading and the
//! kernels never see a surprise.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use safetensors::{Dtype, SafeTensors};

use crate::config::{AdapterConfig, LoraModule};
use crate::error::{LoraError, Result};
use crate::LoraModelDims;

pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";

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

/// Size and modification time of the weights file, to detect files rewritten on disk between
/// a host-cache eviction and the reload (which would silently change a version's weights).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileStamp {
    pub len: u64,
    pub modified: Option<SystemTime>,
}

impl FileStamp {
    pub fn of(path: &Path) -> Option<FileStamp> {
        let md = std::fs::metadata(path).ok()?;
        Some(FileStamp { len: md.len(), modified: md.modified().ok() })
    }
}

#[derive(Debug)]
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

/// The slot a tensor name points at, and whether the decoder's modules sit under `model.`
/// (`…ForCausalLM`) or at the top (a bare decoder: PEFT on an embedding model's `Qwen3Model`).
fn parse_tensor_name(name: &str) -> Option<(TensorSlot, Option<bool>)> {
    let n = name.strip_prefix("base_model.model.").unwrap_or(name);
    match n {
        "lm_head.lora_A.weight" => return Some((TensorSlot::A(None, LoraModule::LmHead), None)),
        "lm_head.lora_B.weight" => return Some((TensorSlot::B(None, LoraModule::LmHead), None)),
        _ => {}
    }
    let (n, under_model) = match n.strip_prefix("model.") {
        Some(rest) => (rest, true),
        None => (n, false),
    };
    match n {
        "embed_tokens.lora_embedding_A" => return Some((TensorSlot::A(None, LoraModule::EmbedTokens), Some(under_model))),
        "embed_tokens.lora_embedding_B" => return Some((TensorSlot::B(None, LoraModule::EmbedTokens), Some(under_model))),
        _ => {}
    }
    let rest = n.strip_prefix("layers.")?;
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
        "lora_A.weight" => Some((TensorSlot::A(Some(layer), m), Some(under_model))),
        "lora_B.weight" => Some((TensorSlot::B(Some(layer), m), Some(under_model))),
        _ => None,
    }
}

fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        Dtype::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        Dtype::BF16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        _ => return None,
    })
}

impl LoraAdapter {
    /// Loads and validates the PEFT adapter in directory `dir` for a model of `dims`.
    pub fn load(name: &str, dir: &Path, dims: &LoraModelDims) -> Result<Self> {
        let file_err = |file: &str, reason: String| LoraError::File { adapter: name.to_string(), file: file.to_string(), reason };
        if !dir.is_dir() {
            return Err(file_err(&dir.display().to_string(), "not a directory (expected a PEFT adapter directory)".into()));
        }
        let cfg_path = dir.join(CONFIG_FILE);
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| file_err(&cfg_path.display().to_string(), format!("cannot read: {e}")))?;
        let config = AdapterConfig::parse(name, &text)?;

        let added = dir.join("added_tokens.json");
        if added.exists() {
            let t = std::fs::read_to_string(&added).unwrap_or_default();
            let empty = serde_json::from_str::<serde_json::Value>(&t).ok().and_then(|v| v.as_object().map(|o| o.is_empty())).unwrap_or(false);
            if !empty {
                return Err(LoraError::Config {
                    adapter: name.into(),
                    field: "added_tokens.json".into(),
                    reason: "adapters that add tokens to the vocabulary are not supported".into(),
                });
            }
        }

        let wpath = dir.join(WEIGHTS_FILE);
        if !wpath.exists() {
            if dir.join("adapter_model.bin").exists() {
                return Err(LoraError::Config {
                    adapter: name.into(),
                    field: "adapter_model.bin".into(),
                    reason: "only pickled .bin weights found; convert the adapter to adapter_model.safetensors (pickle is not loaded for safety)".into(),
                });
            }
            return Err(file_err(&wpath.display().to_string(), "missing (expected adapter_model.safetensors)".into()));
        }
        let wfile = wpath.display().to_string();
        let f = std::fs::File::open(&wpath).map_err(|e| file_err(&wfile, format!("cannot open: {e}")))?;
        let stamp = FileStamp::of(&wpath);
        if f.metadata().map(|m| m.len()).unwrap_or(0) == 0 {
            return Err(file_err(&wfile, "empty file".into()));
        }
        // SAFETY: the map is read-only and dropped before returning; a concurrent writer can
        // only corrupt the values we copy out, which the finiteness check then catches.
        let mmap = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| file_err(&wfile, format!("cannot map: {e}")))?;
        let st = SafeTensors::deserialize(&mmap).map_err(|e| file_err(&wfile, format!("not a valid safetensors file: {e}")))?;

        let terr = |tensor: &str, reason: String| LoraError::Tensor { adapter: name.into(), file: WEIGHTS_FILE.into(), tensor: tensor.into(), reason };

        let mut found: HashMap<TensorSlot, (String, Vec<f32>, usize, usize)> = HashMap::new();
        // `model.` when the decoder's modules sit under it (`None` until a tensor says).
        let mut under_model: Option<bool> = None;
        for (tname, view) in st.tensors() {
            let (slot, under) = parse_tensor_name(&tname).ok_or_else(|| terr(&tname, "unknown tensor name (expected PEFT LoRA names for q/k/v/o/gate/up/down_proj, embed_tokens or lm_head)".into()))?;
            match (under_model, under) {
                (Some(a), Some(b)) if a != b => return Err(terr(&tname, "mixes module paths under `model.` and at the top level in one adapter".into())),
                (None, Some(b)) => under_model = Some(b),
                _ => {}
            }
            let (layer, module) = match slot {
                TensorSlot::A(l, m) | TensorSlot::B(l, m) => (l, m),
            };
            if let Some(l) = layer {
                if l >= dims.num_layers {
                    return Err(terr(&tname, format!("layer {l} does not exist (the model has {} layers)", dims.num_layers)));
                }
            }
            let prefix = if under.unwrap_or(true) { "model." } else { "" };
            let path = module.path_under(layer.unwrap_or(0), prefix);
            if !config.targets_path(&path) {
                return Err(terr(&tname, format!("module `{path}` is not targeted by adapter_config.json (target_modules / exclude_modules / layers_to_transform)")));
            }
            let shape = view.shape();
            if shape.len() != 2 {
                return Err(terr(&tname, format!("expected a 2-D tensor, got shape {shape:?}")));
            }
            let data = to_f32(view.dtype(), view.data()).ok_or_else(|| terr(&tname, format!("unsupported dtype {:?} (expected F32, F16 or BF16)", view.dtype())))?;
            if data.len() != shape[0] * shape[1] {
                return Err(terr(&tname, "data length does not match its shape".into()));
            }
            if let Some(i) = data.iter().position(|x| !x.is_finite()) {
                return Err(terr(&tname, format!("non-finite value {} at element {i}", data[i])));
            }
            found.insert(slot, (tname.to_string(), data, shape[0], shape[1]));
        }
        if found.is_empty() {
            return Err(file_err(&wfile, "contains no LoRA tensors".into()));
        }

        // Shape and presence checks per targeted module; the error names the PEFT tensor.
        let prefix = if under_model.unwrap_or(true) { "model." } else { "" };
        let mut take = |layer: Option<usize>, m: LoraModule| -> Result<Option<ModuleWeights>> {
            let path = m.path_under(layer.unwrap_or(0), prefix);
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
            let (ref aname, adata, ar, ac) = a;
            let (ref bname, bdata, br, bc) = b;
            if (ar, ac) != (r, din) {
                let why = if (ar, ac) == (din, r) && din != r {
                    format!("shape [{ar}, {ac}] looks transposed: lora_A must be [r={r}, in={din}]")
                } else if ac == din {
                    format!("rank {ar} but adapter_config.json gives r={r} for `{path}` (r / rank_pattern mismatch)")
                } else {
                    format!("shape [{ar}, {ac}] does not match [r={r}, in={din}]")
                };
                return Err(terr(aname, why));
            }
            if (br, bc) != (dout, r) {
                let why = if (br, bc) == (r, dout) && dout != r {
                    format!("shape [{br}, {bc}] looks transposed: lora_B must be [out={dout}, r={r}]")
                } else if br == dout {
                    format!("rank {bc} but adapter_config.json gives r={r} for `{path}` (r / rank_pattern mismatch)")
                } else {
                    format!("shape [{br}, {bc}] does not match [out={dout}, r={r}]")
                };
                return Err(terr(bname, why));
            }
            Ok(Some(ModuleWeights { rank: r, scaling, a: adata, b: bdata }))
        };

        let mut modules = Vec::with_capacity(dims.num_layers * 7);
        for l in 0..dims.num_layers {
            for m in LoraModule::PROJECTIONS {
                modules.push(take(Some(l), m)?);
            }
        }
        let embed_tokens = take(None, LoraModule::EmbedTokens)?;
        let lm_head = take(None, LoraModule::LmHead)?;
        // Anything left is an A without its B (or vice versa) for an untargeted module; the
        // targeting check above already refused those, so this is a safety net.
        if let Some((_, (tname, ..))) = found.into_iter().next() {
            return Err(terr(&tname, "has no matching lora_A/lora_B partner".into()));
        }
        Ok(LoraAdapter { name: name.into(), path: dir.to_path_buf(), config, num_layers: dims.num_layers, modules, embed_tokens, lm_head, stamp })
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
