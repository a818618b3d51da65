//! The CUDA LoRA kernels against the CPU reference backend (the checks are in `device_lora`).
//! Needs a GPU: ignored by default, run by `scripts/gpu-check.sh`.
#![cfg(feature = "cuda")]

mod common;
mod device_lora;

use quiver_kernels::cuda::CudaDevice;
use quiver_kernels::Device;
use quiver_lora::{LoraConfig, LoraManager, LoraModelDims, LoraModule};
use std::sync::Arc;

fn cuda() -> Arc<dyn Device> {
    Arc::new(CudaDevice::new(0).unwrap_or_else(|e| panic!("opening cuda:0: {e:#}")))
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn cuda_lora_matches_cpu_reference_on_random_batches() {
    device_lora::lora_matches_cpu_reference_on_random_batches(cuda(), "cuda");
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn cuda_slot_reuse_by_smaller_rank_leaks_nothing() {
    device_lora::slot_reuse_by_smaller_rank_leaks_nothing(cuda());
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn cuda_projections_fold_the_delta_like_the_cpu() {
    device_lora::projections_with_epilogues_match_cpu(cuda());
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn cuda_norms_compute_the_next_shrink_like_the_cpu() {
    device_lora::norms_before_projections_match_cpu(cuda());
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn cuda_graph_replay_follows_the_adapter_mix() {
    device_lora::shape_keyed_steps_follow_the_adapter_mix(cuda());
}

/// LoRA on MoE experts has no CUDA path yet (the routing stays on the GPU): a pool asked for
/// expert sites on CUDA is refused, saying so, instead of failing mid-step.
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn expert_lora_pool_on_cuda_is_refused_saying_why() {
    let moe = quiver_lora::MoeLoraDims { num_experts: 8, expert_intermediate: 64, shared_intermediate: 0, mixtral_names: false, moe_layers: u128::MAX };
    let dims = LoraModelDims { moe: Some(moe), ..device_lora::WIDE };
    let cfg = LoraConfig { max_loras_per_batch: 2, max_lora_rank: 8, target_modules: LoraModule::MOE[..3].to_vec(), ..Default::default() };
    let err = match LoraManager::new(dims, cfg, cuda()) {
        Ok(_) => panic!("expert LoRA pool allocated on CUDA"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("experts") && err.contains("CUDA"), "{err}");
    println!("expert LoRA on CUDA refused: {err}");
}
