//! Which PEFT adapters fit a model beyond what the adapter loader checks against the LoRA
//! dimensions: modules the model's layers do not have.

use crate::ModelConfig;
use quiver_lora::{LoraAdapter, LoraError, LoraModule};

/// Refuses an adapter carrying LoRA on a module this model does not have, naming it: dense MLP
/// projections (`model.layers.{l}.mlp.gate_proj`, …) of a layer whose MLP is experts, or the
/// LM head of a bare decoder (an embedding model). PEFT could not have trained those for this
/// model. (Reading the adapter against the model's LoRA dims refuses the same MLP mismatches,
/// and experts on a dense layer, first; this check also covers adapters built in memory.)
pub fn check_adapter(config: &ModelConfig, adapter: &LoraAdapter) -> Result<(), LoraError> {
    let refuse = |module: String, reason: String| Err(LoraError::Incompatible { adapter: adapter.name.clone(), module, reason });
    for l in (0..config.num_layers).filter(|&l| config.is_moe_layer(l)) {
        for m in [LoraModule::GateProj, LoraModule::UpProj, LoraModule::DownProj] {
            if adapter.module(l, m).is_some() {
                return refuse(m.path(l), format!("layer {l} of this {:?} model is a mixture-of-experts layer: it has no dense `{}`", config.arch, m.name()));
            }
        }
    }
    if !config.has_lm_head && adapter.lm_head.is_some() {
        return refuse("lm_head".into(), "this model is a bare decoder (an embedding model) without an LM head".into());
    }
    Ok(())
}
