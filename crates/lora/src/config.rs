//! PEFT `adapter_config.json` with PEFT's own matching semantics.
//!
//! Module paths are the names PEFT matches against inside `LlamaForCausalLM`:
//! `model.layers.{N}.self_attn.{q,k,v,o}_proj`, `model.layers.{N}.mlp.{gate,up,down}_proj`,
//! `model.embed_tokens`, `lm_head`. Matching follows `peft/tuners/tuners_utils.py`
//! (`check_target_module_exists`) and `peft/utils/other.py` (`get_pattern_key`):
//! - `target_modules` list: exact name or suffix `.{t}`; string: `re.fullmatch` on the path;
//!   `"all-linear"`: the seven projections (never `lm_head`); absent: PEFT's Llama default
//!   `q_proj, v_proj`.
//! - `exclude_modules`: the same matching, subtracted.
//! - `layers_to_transform`: the layer index is read with `.*\.{layers_pattern}\.(\d+)\.` (any
//!   component when no pattern); a module without a layer index (embedding, head) is then
//!   not targeted, as in PEFT.
//! - `rank_pattern` / `alpha_pattern`: the first key (in file order) for which
//!   `(.*\.)?({key})$` matches the path at its start wins; otherwise `r` / `lora_alpha`.
//! - scaling = α/r, or α/√r with `use_rslora`.

use regex::Regex;
use serde_json::Value;

use crate::error::{LoraError, Result};

/// A PEFT-targetable module of a Llama-family model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LoraModule {
    QProj,
    KProj,
    VProj,
    OProj,
    GateProj,
    UpProj,
    DownProj,
    EmbedTokens,
    LmHead,
}

impl LoraModule {
    pub const ALL: [LoraModule; 9] = [
        LoraModule::QProj,
        LoraModule::KProj,
        LoraModule::VProj,
        LoraModule::OProj,
        LoraModule::GateProj,
        LoraModule::UpProj,
        LoraModule::DownProj,
        LoraModule::EmbedTokens,
        LoraModule::LmHead,
    ];
    /// The seven per-layer projections (what `all-linear` means).
    pub const PROJECTIONS: [LoraModule; 7] = [
        LoraModule::QProj,
        LoraModule::KProj,
        LoraModule::VProj,
        LoraModule::OProj,
        LoraModule::GateProj,
        LoraModule::UpProj,
        LoraModule::DownProj,
    ];

    pub fn name(self) -> &'static str {
        match self {
            LoraModule::QProj => "q_proj",
            LoraModule::KProj => "k_proj",
            LoraModule::VProj => "v_proj",
            LoraModule::OProj => "o_proj",
            LoraModule::GateProj => "gate_proj",
            LoraModule::UpProj => "up_proj",
            LoraModule::DownProj => "down_proj",
            LoraModule::EmbedTokens => "embed_tokens",
            LoraModule::LmHead => "lm_head",
        }
    }

    /// Parses a module name as given on a CLI (`q_proj`, ..., `embed_tokens`, `lm_head`); the
    /// fused names `qkv_proj` / `gate_up_proj` expand to their parts, `all-linear` / `all`
    /// to the seven projections.
    pub fn parse_list(s: &str) -> std::result::Result<Vec<LoraModule>, String> {
        let mut out = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part {
                "all-linear" | "all" => out.extend(LoraModule::PROJECTIONS),
                "qkv_proj" => out.extend([LoraModule::QProj, LoraModule::KProj, LoraModule::VProj]),
                "gate_up_proj" => out.extend([LoraModule::GateProj, LoraModule::UpProj]),
                _ => match LoraModule::ALL.iter().find(|m| m.name() == part) {
                    Some(m) => out.push(*m),
                    None => {
                        return Err(format!(
                            "unknown LoRA target module `{part}` (valid: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, qkv_proj, gate_up_proj, embed_tokens, lm_head, all-linear)"
                        ))
                    }
                },
            }
        }
        out.sort();
        out.dedup();
        Ok(out)
    }

    pub fn is_projection(self) -> bool {
        !matches!(self, LoraModule::EmbedTokens | LoraModule::LmHead)
    }

    /// The path PEFT matches patterns against (`layer` is ignored for embed/lm_head).
    pub fn path(self, layer: usize) -> String {
        match self {
            LoraModule::QProj | LoraModule::KProj | LoraModule::VProj | LoraModule::OProj => {
                format!("model.layers.{layer}.self_attn.{}", self.name())
            }
            LoraModule::GateProj | LoraModule::UpProj | LoraModule::DownProj => {
                format!("model.layers.{layer}.mlp.{}", self.name())
            }
            LoraModule::EmbedTokens => "model.embed_tokens".to_string(),
            LoraModule::LmHead => "lm_head".to_string(),
        }
    }
}

/// `target_modules` / `exclude_modules` as PEFT interprets them.
#[derive(Clone, Debug)]
pub enum ModuleMatcher {
    /// Exact name or `.{name}` suffix.
    List(Vec<String>),
    /// `re.fullmatch` on the module path.
    Regex(Regex),
}

impl ModuleMatcher {
    pub fn matches(&self, path: &str) -> bool {
        match self {
            ModuleMatcher::List(names) => names.iter().any(|t| path == t || path.ends_with(&format!(".{t}"))),
            ModuleMatcher::Regex(re) => re.find(path).is_some_and(|m| m.start() == 0 && m.end() == path.len()),
        }
    }
}

/// A parsed, validated `adapter_config.json`.
#[derive(Clone, Debug)]
pub struct AdapterConfig {
    pub r: usize,
    pub lora_alpha: f32,
    pub use_rslora: bool,
    /// `(key, compiled (.*\.)?(key)$, rank)` in file order.
    pub rank_pattern: Vec<(String, Regex, usize)>,
    pub alpha_pattern: Vec<(String, Regex, f32)>,
    pub target_modules: ModuleMatcher,
    pub exclude_modules: Option<ModuleMatcher>,
    pub layers_to_transform: Option<Vec<usize>>,
    /// Compiled `.*\.{pattern}\.(\d+)\.` per pattern; empty = any component.
    pub layers_pattern: Vec<Regex>,
    /// Accepted: A/B keep PEFT shapes; only merging into the base would transpose.
    pub fan_in_fan_out: bool,
    pub base_model_name_or_path: Option<String>,
}

fn cfg_err(adapter: &str, field: &str, reason: impl Into<String>) -> LoraError {
    LoraError::Config { adapter: adapter.to_string(), field: field.to_string(), reason: reason.into() }
}

fn non_empty(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(Value::String(s)) => !s.is_empty(),
        Some(_) => true,
    }
}

/// What kind of JSON value `v` is. Errors describe values by kind and keys by position: the
/// file may not be an adapter config at all (a symlink to a secret), so its content is never
/// echoed.
fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

fn pattern_regex(adapter: &str, field: &str, i: usize, key: &str) -> Result<Regex> {
    Regex::new(&format!(r"^(?:.*\.)?(?:{key})$")).map_err(|_| cfg_err(adapter, field, format!("key #{} is not a valid regex", i + 1)))
}

impl AdapterConfig {
    /// Parses and validates the JSON text of `adapter_config.json` for adapter `adapter`.
    pub fn parse(adapter: &str, text: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(text).map_err(|e| LoraError::File {
            adapter: adapter.to_string(),
            file: "adapter_config.json".into(),
            reason: format!("not valid JSON (line {} column {})", e.line(), e.column()),
        })?;
        let obj = v.as_object().ok_or_else(|| cfg_err(adapter, "adapter_config.json", "expected a JSON object"))?;
        let get = |k: &str| obj.get(k).filter(|v| !v.is_null());

        if let Some(t) = get("peft_type") {
            if t.as_str() != Some("LORA") {
                return Err(cfg_err(adapter, "peft_type", format!("{} is not supported; only LORA adapters can be served", if t.is_string() { "this type" } else { kind(t) })));
            }
        }
        if get("use_dora").and_then(Value::as_bool).unwrap_or(false) {
            return Err(cfg_err(adapter, "use_dora", "DoRA renormalizes each output channel with a magnitude vector; it is not an additive LoRA delta and cannot be batched"));
        }
        if non_empty(get("modules_to_save")) {
            return Err(cfg_err(adapter, "modules_to_save", "full replacement modules are not supported; only low-rank deltas can be served"));
        }
        if non_empty(get("layer_replication")) {
            return Err(cfg_err(adapter, "layer_replication", "adapters that change the layer stack are not supported"));
        }
        if let Some(b) = get("bias") {
            if b.as_str() != Some("none") {
                return Err(cfg_err(adapter, "bias", "trained biases are not supported (bias must be \"none\")"));
            }
        }
        if get("lora_bias").and_then(Value::as_bool).unwrap_or(false) {
            return Err(cfg_err(adapter, "lora_bias", "a bias on lora_B is not supported"));
        }
        if non_empty(get("target_parameters")) {
            return Err(cfg_err(adapter, "target_parameters", "LoRA on raw parameters (MoE experts) is not supported"));
        }

        let r = match get("r") {
            None => 8,
            Some(x) => x.as_u64().filter(|&r| r > 0).ok_or_else(|| cfg_err(adapter, "r", format!("must be a positive integer, got {}", kind(x))))?
                as usize,
        };
        let lora_alpha = match get("lora_alpha") {
            None => 8.0,
            Some(x) => x.as_f64().ok_or_else(|| cfg_err(adapter, "lora_alpha", format!("must be a number, got {}", kind(x))))? as f32,
        };
        if !lora_alpha.is_finite() {
            return Err(cfg_err(adapter, "lora_alpha", "is outside the f32 range (the scaling would be infinite)"));
        }
        let use_rslora = get("use_rslora").and_then(Value::as_bool).unwrap_or(false);
        let fan_in_fan_out = get("fan_in_fan_out").and_then(Value::as_bool).unwrap_or(false);

        let mut rank_pattern = Vec::new();
        if let Some(p) = get("rank_pattern") {
            let p = p.as_object().ok_or_else(|| cfg_err(adapter, "rank_pattern", "expected an object"))?;
            for (i, (k, v)) in p.iter().enumerate() {
                let rk = v
                    .as_u64()
                    .filter(|&x| x > 0)
                    .ok_or_else(|| cfg_err(adapter, "rank_pattern", format!("the rank of key #{} must be a positive integer, got {}", i + 1, kind(v))))?;
                rank_pattern.push((k.clone(), pattern_regex(adapter, "rank_pattern", i, k)?, rk as usize));
            }
        }
        let mut alpha_pattern = Vec::new();
        if let Some(p) = get("alpha_pattern") {
            let p = p.as_object().ok_or_else(|| cfg_err(adapter, "alpha_pattern", "expected an object"))?;
            for (i, (k, v)) in p.iter().enumerate() {
                let a = v.as_f64().map(|a| a as f32).filter(|a| a.is_finite());
                let a = a.ok_or_else(|| cfg_err(adapter, "alpha_pattern", format!("the alpha of key #{} must be a number in the f32 range, got {}", i + 1, kind(v))))?;
                alpha_pattern.push((k.clone(), pattern_regex(adapter, "alpha_pattern", i, k)?, a));
            }
        }

        let matcher = |field: &str, v: &Value| -> Result<ModuleMatcher> {
            match v {
                Value::String(s) if field == "target_modules" && s == "all-linear" => Ok(ModuleMatcher::List(
                    LoraModule::PROJECTIONS.iter().map(|m| m.name().to_string()).collect(),
                )),
                Value::String(s) => Regex::new(s).map(ModuleMatcher::Regex).map_err(|_| cfg_err(adapter, field, "is not a valid regex")),
                Value::Array(a) => a
                    .iter()
                    .enumerate()
                    .map(|(i, x)| x.as_str().map(str::to_string).ok_or_else(|| cfg_err(adapter, field, format!("entry #{} must be a string, got {}", i + 1, kind(x)))))
                    .collect::<Result<Vec<_>>>()
                    .map(ModuleMatcher::List),
                other => Err(cfg_err(adapter, field, format!("expected a list or a string, got {}", kind(other)))),
            }
        };
        let target_modules = match get("target_modules") {
            // PEFT's default mapping for the Llama family.
            None => ModuleMatcher::List(vec!["q_proj".into(), "v_proj".into()]),
            Some(v) => matcher("target_modules", v)?,
        };
        let exclude_modules = get("exclude_modules").map(|v| matcher("exclude_modules", v)).transpose()?;

        let layers_to_transform = match get("layers_to_transform") {
            None => None,
            Some(Value::Number(n)) => Some(vec![n.as_u64().ok_or_else(|| cfg_err(adapter, "layers_to_transform", "is not a layer index"))? as usize]),
            Some(Value::Array(a)) => Some(
                a.iter()
                    .enumerate()
                    .map(|(i, x)| x.as_u64().map(|x| x as usize).ok_or_else(|| cfg_err(adapter, "layers_to_transform", format!("entry #{} is not a layer index", i + 1))))
                    .collect::<Result<Vec<_>>>()?,
            ),
            Some(other) => return Err(cfg_err(adapter, "layers_to_transform", format!("expected an integer or a list, got {}", kind(other)))),
        };
        let pattern_names: Vec<String> = match get("layers_pattern") {
            None => vec![],
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(a)) => a.iter().filter_map(|x| x.as_str().map(str::to_string)).collect(),
            Some(other) => return Err(cfg_err(adapter, "layers_pattern", format!("expected a string or a list, got {}", kind(other)))),
        };
        let layers_pattern = pattern_names
            .iter()
            // Grouped, so an alternation in the pattern cannot swallow the index group (PEFT's
            // unguarded `.*\.{p}\.(\d+)\.` then has no group 1; a fuzzer found the panic).
            .map(|p| Regex::new(&format!(r"^.*\.(?:{p})\.(\d+)\.")).map_err(|_| cfg_err(adapter, "layers_pattern", "is not a valid regex")))
            .collect::<Result<Vec<_>>>()?;

        Ok(AdapterConfig {
            r,
            lora_alpha,
            use_rslora,
            rank_pattern,
            alpha_pattern,
            target_modules,
            exclude_modules,
            layers_to_transform,
            layers_pattern,
            fan_in_fan_out,
            base_model_name_or_path: get("base_model_name_or_path").and_then(Value::as_str).map(str::to_string),
        })
    }

    fn layer_index(&self, path: &str) -> Option<usize> {
        if self.layers_pattern.is_empty() {
            let re = Regex::new(r"^.*\.[^.]*\.(\d+)\.").expect("static regex");
            return re.captures(path).and_then(|c| c.get(1)?.as_str().parse().ok());
        }
        self.layers_pattern.iter().find_map(|re| re.captures(path).and_then(|c| c.get(1)?.as_str().parse().ok()))
    }

    /// Whether PEFT would wrap the module at `path` with LoRA.
    pub fn targets_path(&self, path: &str) -> bool {
        if !self.target_modules.matches(path) {
            return false;
        }
        if self.exclude_modules.as_ref().is_some_and(|e| e.matches(path)) {
            return false;
        }
        if let Some(layers) = &self.layers_to_transform {
            return self.layer_index(path).is_some_and(|i| layers.contains(&i));
        }
        true
    }

    pub fn targets(&self, layer: usize, m: LoraModule) -> bool {
        self.targets_path(&m.path(layer))
    }

    /// `(rank, alpha)` of the module at `path` after `rank_pattern` / `alpha_pattern`.
    pub fn rank_alpha(&self, path: &str) -> (usize, f32) {
        let r = self.rank_pattern.iter().find(|(_, re, _)| re.is_match(path)).map_or(self.r, |p| p.2);
        let a = self.alpha_pattern.iter().find(|(_, re, _)| re.is_match(path)).map_or(self.lora_alpha, |p| p.2);
        (r, a)
    }

    /// `(rank, scaling)`: scaling is α/r, or α/√r with rsLoRA.
    pub fn rank_scaling(&self, path: &str) -> (usize, f32) {
        let (r, a) = self.rank_alpha(path);
        let s = if self.use_rslora { a / (r as f32).sqrt() } else { a / r as f32 };
        (r, s)
    }
}
