//! The OpenCL LoRA kernels against the CPU reference backend (the checks are in `device_lora`),
//! under each kernel set of the run (`quiver_kernels::opencl::testing`): the portable shrink and
//! expand, and the DPAS ones at 16 and 8 lanes (the matrix builtin emulated on a CPU runtime).

mod common;
mod device_lora;

use quiver_kernels::opencl::testing;
use quiver_kernels::Device;
use std::sync::Arc;

fn devices() -> Vec<(Arc<dyn Device>, String)> {
    testing::kernel_sets()
        .into_iter()
        .map(|s| {
            let d = testing::device(s);
            let tag = format!("opencl {:?}", d.kernel_set());
            (Arc::new(d) as Arc<dyn Device>, tag)
        })
        .collect()
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

#[test]
fn opencl_projections_with_epilogues_match_cpu() {
    for (dev, _) in devices() {
        device_lora::projections_with_epilogues_match_cpu(dev);
    }
}
