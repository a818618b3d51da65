//! Every OpenCL op against the CPU device (f32) on random inputs (the checks are in
//! `device_kernels`). The GEMMs (dense and the experts' grouped) run under each kernel set of the run
//! (`quiver_kernels::opencl::testing`: on Intel's CPU runtime the portable kernels and the DPAS
//! kernels at 16 and 8 lanes, the matrix builtin emulated; on PoCL the portable ones); the other
//! ops are the same portable kernels in every set and run once. `make test-opencl` runs both.

mod device_kernels;

use device_kernels::*;
use quiver_kernels::opencl::{testing, KernelSet};

/// f32 everywhere (activations, KV cache): only the order of f32 sums differs from the CPU. The
/// DPAS GEMM takes its f32 input as a bf16 hi + lo pair (about 16 mantissa bits).
fn tolerances(set: KernelSet) -> Tolerances {
    let dpas = matches!(set, KernelSet::Dpas { .. });
    Tolerances { matmul_f32: 1e-5, matmul_bf16: if dpas { 1e-4 } else { 1e-5 }, attention: 1e-5 }
}

/// The weight GEMMs under each kernel set: the dense GEMM, and the experts' grouped GEMM in a
/// whole MoE block (DPAS for bf16 experts whose input width is a whole number of 16-steps), where
/// a row routed alone must give the bits it got in the batch. One device per set for both: a
/// DPAS set takes seconds to compile on the CPU runtime.
#[test]
fn matmul_and_moe_block_match_cpu() {
    for set in testing::kernel_sets() {
        let g = testing::device(set);
        device_kernels::matmul_matches_cpu(&g, &tolerances(set));
        device_kernels::moe::moe_block_matches_cpu(&g, tolerances(set).matmul_bf16, true);
    }
}

#[test]
fn embedding_and_gather_match_cpu() {
    device_kernels::embedding_and_gather_match_cpu(&testing::device(KernelSet::Portable));
}

#[test]
fn drawn_ids_resolve_to_the_last_draws() {
    device_kernels::drawn_ids_resolve_to_the_last_draws(&testing::device(KernelSet::Portable));
}

#[test]
fn logit_edits_match_the_host_path() {
    device_kernels::logit_edits::logit_edits_match_the_host_path(&testing::device(KernelSet::Portable));
}

#[test]
fn norms_and_elementwise_match_cpu() {
    device_kernels::norms_and_elementwise_match_cpu(&testing::device(KernelSet::Portable));
}

#[test]
fn rope_matches_cpu() {
    device_kernels::rope_matches_cpu(&testing::device(KernelSet::Portable));
}

#[test]
fn paged_attention_matches_cpu() {
    device_kernels::paged_attention_matches_cpu(&testing::device(KernelSet::Portable), &tolerances(KernelSet::Portable));
}

#[test]
fn qk_norm_matches_cpu() {
    device_kernels::moe::qk_norm_matches_cpu(&testing::device(KernelSet::Portable));
}

/// Routing and grouping stay on the device; read back, they equal the CPU's exactly.
#[test]
fn moe_routing_matches_cpu() {
    let g = testing::device(KernelSet::Portable);
    device_kernels::moe::moe_routing_matches_cpu(&g, &|r| g.read_routing(r));
}

/// A buffer past the device's largest allocation is refused by `check_alloc` (which model load
/// calls with the model's largest weight), naming the limit; one within it is not.
#[test]
fn allocations_past_the_device_limit_are_refused_by_name() {
    use quiver_kernels::Device;
    let g = testing::device(KernelSet::Portable);
    let err = g.check_alloc(usize::MAX / 2).expect_err("a buffer of half the address space was accepted");
    assert!(err.contains("CL_DEVICE_MAX_MEM_ALLOC_SIZE"), "{err}");
    g.check_alloc(1 << 20).expect("a 1 MiB buffer");
}
