//! The mixture-of-experts side of reading a PEFT adapter: module paths of experts and of the
//! shared expert, which modules a layer has (refusals name the module), and PEFT's
//! `target_parameters` LoRA on fused expert tensors, split into per-expert pairs.
//!
//! # `target_parameters` (transformers >= 5 keeps experts as 3-D parameters)
//! PEFT wraps `…mlp.experts` once per targeted parameter (`gate_up_proj` `[E, 2·inter, hidden]`,
//! `down_proj` `[E, hidden, inter]`), nesting the second wrapper around the first, so the file
//! holds `…mlp.experts.lora_A.weight` and `…mlp.experts.base_layer.lora_A.weight`. Each pair
//! is `lora_A (r·E, in)`, `lora_B (out, r·E)`; expert e's delta is `scale · B_e · A_e` with
//! `A_e = A[e·r..(e+1)·r]` and `B_e[o, k] = B[o, k·E + e]` (PEFT's `ParamWrapper`: A reshaped to
//! `(E, r, in)`, B to `(out, r, E)`). Which parameter a wrapper holds follows from the shapes
//! (`in = hidden, out = 2·inter` or `in = inter, out = hidden` can never both hold), so the
//! nesting order does not matter.

use std::collections::HashMap;

use safetensors::tensor::TensorInfo;

use crate::adapter::{shown, ModuleWeights, Planned, TensorSlot, WEIGHTS_FILE};
use crate::config::{AdapterConfig, LoraModule};
use crate::error::{LoraError, Result};
use crate::{ExpertSite, LoraModelDims};

/// The path PEFT matched a module under (`prefix` is `model.` or empty).
pub(crate) fn module_path(dims: &LoraModelDims, layer: Option<usize>, m: LoraModule, expert: usize, prefix: &str) -> String {
    let l = layer.unwrap_or(0);
    if m.is_expert() {
        m.expert_path(l, expert, dims.moe.is_some_and(|d| d.mixtral_names), prefix)
    } else {
        m.path_under(l, prefix)
    }
}

/// Why a tensor does not fit the model: a module it lacks (named by path), or a bad index.
pub(crate) enum Misfit {
    Module(String),
    Tensor(String),
}

/// Refuses modules the layer does not have: experts on a dense layer, dense MLP projections
/// on an expert layer, a shared expert the model lacks, an expert past the count.
pub(crate) fn check_structure(dims: &LoraModelDims, layer: Option<usize>, m: LoraModule, expert: usize, fused: bool) -> std::result::Result<(), Misfit> {
    let Some(l) = layer else { return Ok(()) };
    let is_moe = dims.is_moe_layer(l);
    let moe = dims.moe.unwrap_or_default();
    if (m.is_expert() || fused) && !is_moe {
        let what = if dims.moe.is_some() { format!("layer {l} of this model has a dense MLP") } else { "this model is dense".into() };
        return Err(Misfit::Module(format!("LoRA on experts, but {what}: it has no experts")));
    }
    if matches!(m, LoraModule::GateProj | LoraModule::UpProj | LoraModule::DownProj) && is_moe {
        return Err(Misfit::Module(format!("layer {l} of this model is a mixture-of-experts layer: it has no dense `{}`", m.name())));
    }
    if LoraModule::MOE[3..].contains(&m) && !(is_moe && moe.shared_intermediate > 0) {
        return Err(Misfit::Module(format!("layer {l} of this model has no shared expert")));
    }
    if m.is_expert() && !fused && expert >= moe.num_experts {
        return Err(Misfit::Tensor(format!("expert {expert} does not exist (the model has {} experts)", moe.num_experts)));
    }
    Ok(())
}

/// Pairs and checks a layer's fused `target_parameters` tensors (taken out of `found`).
pub(crate) fn plan_fused(
    name: &str,
    config: &AdapterConfig,
    dims: &LoraModelDims,
    max_rank: Option<usize>,
    layer: usize,
    prefix: &str,
    found: &mut HashMap<TensorSlot, (String, TensorInfo)>,
) -> Result<Vec<Planned>> {
    let terr = |tensor: &str, reason: String| LoraError::Tensor { adapter: name.into(), file: WEIGHTS_FILE.into(), tensor: shown(tensor), reason };
    let moe = dims.moe.unwrap_or_default();
    let (e, h, ie) = (moe.num_experts, dims.hidden, moe.expert_intermediate);
    let mut out: Vec<Planned> = Vec::new();
    for inner in [false, true] {
        let (a, b) = (found.remove(&TensorSlot::FusedA(layer, inner)), found.remove(&TensorSlot::FusedB(layer, inner)));
        let (a, b) = match (a, b) {
            (None, None) => continue,
            (Some(a), Some(b)) => (a, b),
            (Some(x), None) | (None, Some(x)) => return Err(terr(&x.0, "has no matching lora_A/lora_B partner".into())),
        };
        let (ar, ac, br, bc) = (a.1.shape[0], a.1.shape[1], b.1.shape[0], b.1.shape[1]);
        let (site, param) = match (ac, br) {
            (i, o) if i == h && o == 2 * ie => (ExpertSite::GateUp, "gate_up_proj"),
            (i, o) if i == ie && o == h => (ExpertSite::Down, "down_proj"),
            _ => return Err(terr(&a.0, format!("shapes [{ar}, {ac}] / [{br}, {bc}] fit neither fused expert parameter (gate_up_proj: lora_A [r·{e}, {h}], lora_B [{}, r·{e}]; down_proj: lora_A [r·{e}, {ie}], lora_B [{h}, r·{e}])", 2 * ie))),
        };
        let path = format!("{prefix}layers.{layer}.mlp.experts.{param}");
        if !config.targets_parameter(&path) {
            return Err(terr(&a.0, format!("parameter `{path}` is not in adapter_config.json's target_parameters")));
        }
        let (r, scaling) = config.rank_scaling(&path);
        if ar != r * e || bc != r * e {
            return Err(terr(&a.0, format!("expected lora_A [{}, {ac}] and lora_B [{br}, {}] (r={r} for `{path}` times {e} experts), got [{ar}, {ac}] / [{br}, {bc}]", r * e, r * e)));
        }
        if let Some(max) = max_rank.filter(|&max| r > max) {
            return Err(LoraError::Incompatible { adapter: name.into(), module: path, reason: format!("rank {r} exceeds max_lora_rank {max}") });
        }
        if out.iter().any(|p| p.fused == Some(site)) {
            return Err(terr(&a.0, format!("a second LoRA pair on `{path}`")));
        }
        let module = if site == ExpertSite::GateUp { LoraModule::ExpertGateProj } else { LoraModule::ExpertDownProj };
        out.push(Planned { layer: Some(layer), module, expert: 0, fused: Some(site), path, rank: r, scaling, a, b });
    }
    Ok(out)
}

/// One fused pair as `(module, expert, weights)` per expert: gate_up gives each expert its
/// gate and its up slice (the same A for both, B's rows split at the middle).
pub(crate) fn split_fused(site: ExpertSite, r: usize, scaling: f32, a: &[f32], b: &[f32], experts: usize) -> Vec<(LoraModule, usize, ModuleWeights)> {
    let re = r * experts;
    let (din, dout) = (a.len() / re, b.len() / re);
    let b_of = |e: usize, rows: std::ops::Range<usize>| -> Vec<f32> { rows.flat_map(|o| (0..r).map(move |k| b[o * re + k * experts + e])).collect() };
    let mut out = Vec::with_capacity(2 * experts);
    for e in 0..experts {
        let ae = a[e * r * din..(e + 1) * r * din].to_vec();
        let pair = |a: Vec<f32>, b: Vec<f32>| ModuleWeights { rank: r, scaling, a, b };
        match site {
            ExpertSite::GateUp => {
                let half = dout / 2;
                out.push((LoraModule::ExpertGateProj, e, pair(ae.clone(), b_of(e, 0..half))));
                out.push((LoraModule::ExpertUpProj, e, pair(ae, b_of(e, half..dout))));
            }
            ExpertSite::Down => out.push((LoraModule::ExpertDownProj, e, pair(ae, b_of(e, 0..dout)))),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Expert e's pair is A's rows e·r.. and B's columns k·E + e, as PEFT reshapes them.
    #[test]
    fn fused_pairs_split_per_expert_as_peft_reshapes_them() {
        let (r, e, din, dout) = (2, 3, 4, 6);
        let a: Vec<f32> = (0..r * e * din).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..dout * r * e).map(|i| 1000.0 + i as f32).collect();
        let s = split_fused(ExpertSite::GateUp, r, 0.5, &a, &b, e);
        assert_eq!(s.len(), 2 * e);
        // Expert 1 gives entries 2 (gate) and 3 (up).
        let (m, x, w) = &s[3];
        assert_eq!((*m, *x), (LoraModule::ExpertUpProj, 1));
        assert_eq!(w.a, a[r * din..2 * r * din]);
        // up rows are B's rows 3..6; B_1[o, k] = B[o, k·3 + 1].
        for o in 0..3 {
            for k in 0..r {
                assert_eq!(w.b[o * r + k], b[(3 + o) * r * e + k * e + 1], "o {o} k {k}");
            }
        }
    }
}
