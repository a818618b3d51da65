//! The CUDA LoRA kernels against the CPU reference backend (the checks are in `device_lora`).
//! Needs a GPU: ignored by default, run by `scripts/gpu-check.sh`.
#![cfg(feature = "cuda")]

mod common;
mod device_lora;

use quiver_kernels::cuda::CudaDevice;
use quiver_kernels::Device;
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
fn cuda_graph_replay_follows_the_adapter_mix() {
    device_lora::shape_keyed_steps_follow_the_adapter_mix(cuda());
}
