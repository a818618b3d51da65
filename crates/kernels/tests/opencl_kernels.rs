//! Every OpenCL op against the CPU device (f32) on random inputs (the checks are in
//! `device_kernels`). The GEMM runs under each kernel set of the run
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

#[test]
fn matmul_matches_cpu() {
    for set in testing::kernel_sets() {
        device_kernels::matmul_matches_cpu(&testing::device(set), &tolerances(set));
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
