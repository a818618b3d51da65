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

/// The CUDA device as a `Device`, and the routing read-back the expert checks compare by pair.
fn cuda_with_routing() -> (Arc<dyn Device>, Arc<CudaDevice>) {
    let d = Arc::new(CudaDevice::new(0).unwrap_or_else(|e| panic!("opening cuda:0: {e:#}")));
    (d.clone(), d)
}

/// LoRA on MoE experts: the routed positions grouped by (adapter slot, expert) on the GPU, the
/// dense shrink and expand over them, against the CPU reference on random routings and batches.
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn cuda_expert_lora_matches_cpu_reference() {
    let (dev, cuda) = cuda_with_routing();
    device_lora::experts::expert_lora_matches_cpu_reference(dev, &|r| cuda.read_routing(r), "cuda");
}

/// The same as a recorded step (a CUDA graph) replayed under other routings and adapter mixes.
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn cuda_recorded_expert_steps_follow_routing_and_adapters() {
    let (dev, cuda) = cuda_with_routing();
    device_lora::experts::recorded_expert_steps_follow_routing_and_adapters(dev, &|r| cuda.read_routing(r));
}

/// Past the grouping's bound (slots × experts counters in shared memory) the pool is refused at
/// start-up, naming the flag to lower, instead of failing mid-step.
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn expert_lora_past_the_grouping_bound_is_refused_naming_the_flag() {
    let moe = quiver_lora::MoeLoraDims { num_experts: 128, expert_intermediate: 64, shared_intermediate: 0, mixtral_names: false, moe_layers: u128::MAX };
    let dims = LoraModelDims { moe: Some(moe), ..device_lora::WIDE };
    let cfg = |slots| LoraConfig { max_loras_per_batch: slots, max_loaded_loras: slots, max_lora_rank: 4, target_modules: LoraModule::MOE[..3].to_vec(), ..Default::default() };
    let err = match LoraManager::new(dims, cfg(65), cuda()) {
        Ok(_) => panic!("65 slots x 128 experts accepted past the grouping's 8192 keys"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("experts") && err.contains("--max-loras-per-batch") && err.contains("at most 64"), "{err}");
    println!("expert LoRA past the bound refused: {err}");
    LoraManager::new(dims, cfg(64), cuda()).unwrap_or_else(|e| panic!("64 slots x 128 experts (8192 keys) refused: {e}"));
}

/// The LoRA checks again on a device that keeps room beside every weight's rows and after each
/// row of the bf16 GEMM inputs its ops write (`CudaDevice::with_rooms`, where LoRA's B and shrink
/// will go): the projections with their fused epilogues, the norms that also shrink, the long
/// prompts' LoRA GEMMs without tails (the default device adds their deltas through the tails),
/// all through the row strides.
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn cuda_lora_reads_weights_and_inputs_through_their_row_strides() {
    let roomy = || -> Arc<dyn Device> { Arc::new(CudaDevice::new(0).unwrap_or_else(|e| panic!("opening cuda:0: {e:#}")).with_rooms(24, 40).with_lora_tail(false)) };
    device_lora::lora_matches_cpu_reference_on_random_batches(roomy(), "cuda");
    device_lora::projections_with_epilogues_match_cpu(roomy());
    device_lora::norms_before_projections_match_cpu(roomy());
}

/// LoRA tails with steps of rows through them too (`QUIVER_CUDA_LORA_TAIL=rows`; long prompts
/// take the tails by default): each site's weight keeps its slots' B beside its rows, and steps
/// of several rows add their deltas in the base GEMM over the tail (t̂ from
/// the norm's shrink or the tail kernel's own). The projections' check (its long prompts around
/// a base one take the prompts' path; 12 and 160 rows the rows' path; two slots for three
/// adapters, so slot writes after the attach rewrite the tail) and the norms' check (the norm's
/// shrink feeding the tail, and a recorded step replayed under other adapter mixes) against the
/// CPU reference.
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh"]
fn cuda_lora_tails_match_cpu() {
    let tails = || -> Arc<dyn Device> { Arc::new(CudaDevice::new(0).unwrap_or_else(|e| panic!("opening cuda:0: {e:#}")).with_lora_tail_rows(true)) };
    device_lora::projections_with_epilogues_match_cpu(tails());
    device_lora::norms_before_projections_match_cpu(tails());
}
