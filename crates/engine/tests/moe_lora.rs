//! LoRA on mixture-of-experts models: adapters whose modules the model does not have are
//! refused, naming the module.

mod common;

use common::*;
use quiver_engine::testing::{temp_dir, write_random_adapter};
use quiver_engine::{Engine, EngineConfig};
use quiver_kernels::DType;
use quiver_lora::LoraModule;

#[test]
fn dense_mlp_adapter_on_an_expert_layer_is_refused_naming_the_module() {
    let lm = load(&require("ref/models/tiny-qwen3moe-dense1"), DType::F32);
    let dims = lm.model.lora_dims();
    let dir = temp_dir("moe-dense-adapter");
    // Layer 1 is dense (mlp_only_layers), layers 0 and 2 are experts: an adapter on every
    // layer's gate_proj cannot have been trained for this model.
    write_random_adapter(&dir, &dims, &[LoraModule::QProj, LoraModule::GateProj], 4, 8.0, 0.1, 1).unwrap();
    let h = Engine::start(lm, EngineConfig { kv_cache_memory: Some(16 << 20), ..Default::default() }).unwrap();
    let err = h.load_adapter_blocking("dense", &dir, false, false, None).unwrap_err().to_string();
    assert!(err.contains("model.layers.0.mlp.gate_proj") && err.contains("mixture-of-experts"), "{err}");
    h.shutdown_and_join();
    std::fs::remove_dir_all(dir).unwrap();
}
