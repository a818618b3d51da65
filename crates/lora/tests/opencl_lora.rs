//! The OpenCL LoRA kernels against the CPU reference backend (the checks are in `device_lora`).
//! They are the portable kernels in every kernel set (the DPAS shrink / expand is not written yet).

mod common;
mod device_lora;

use quiver_kernels::opencl::{testing, KernelSet};
use quiver_kernels::Device;
use std::sync::Arc;

fn devices() -> Vec<(Arc<dyn Device>, String)> {
    vec![(Arc::new(testing::device(KernelSet::Portable)), "opencl".into())]
}

#[test]
fn opencl_lora_matches_cpu_reference_on_random_batches() {
    for (dev, tag) in devices() {
        device_lora::lora_matches_cpu_reference_on_random_batches(dev, &tag);
    }
}

#[test]
fn opencl_slot_reuse_by_smaller_rank_leaks_nothing() {
    for (dev, _) in devices() {
        device_lora::slot_reuse_by_smaller_rank_leaks_nothing(dev);
    }
}

#[test]
fn opencl_shape_keyed_steps_follow_the_adapter_mix() {
    for (dev, _) in devices() {
        device_lora::shape_keyed_steps_follow_the_adapter_mix(dev);
    }
}
